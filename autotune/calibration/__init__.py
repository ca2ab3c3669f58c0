"""Correcting the simulator with measurements: fitting its per-GPU efficiency parameters to measured
runs (``fit``: the published llm-foundry table, or any MeasuredRun list), and the loop that compares
every profiled trial with its prediction and re-fits from the run's own trials (``loop``)."""
