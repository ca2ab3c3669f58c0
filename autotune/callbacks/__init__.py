"""Autotune callbacks for the user's own training script (the ``script`` backend): ``hf``
(a transformers TrainerCallback) and ``lightning`` (a Lightning Callback), both on ``_meter``'s
StepMeter. Docstring only: importing this package imports no torch, transformers or lightning."""
