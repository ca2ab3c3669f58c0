"""The search's own Optuna sampler: ``front.FrontSampler`` (expected hypervolume improvement over a
residual Gaussian process on the simulator's prediction), its per-level offsets and the
unmeasured-level rule (``_levels``), and hypervolume / EHVI Monte Carlo (``_ehvi``)."""
