"""``make_backend``: the profile backend a run names, and ``backend_class``: its class, whose attributes
say what it can do (heavy backends are imported only when chosen).

This module is the one place that knows the backends' names; everything else reads the class
attributes of autotune.backends.base.Backend. Kept apart from backends/base.py, the interface
every backend imports, so that the interface does not import its implementations.
"""

from __future__ import annotations

import importlib
from typing import Optional

from autotune.config import Config, check_backend
from autotune.backends.base import Backend, SimulateBackend

BACKEND_CLASSES: dict[str, str] = {
    "simulate": "autotune.backends.base:SimulateBackend",
    "replay": "autotune.backends.replay:ReplayBackend",
    "profile": "autotune.backends.profiled:DeepSpeedBackend",
    "script": "autotune.backends.script:ScriptBackend",
}
"""Backend name (config.BACKENDS) -> ``module:class``; the modules import no torch (the profile
backend's workers do, in their own processes)."""


def backend_class(name: str, path: str = "profile.backend") -> type[Backend]:
    """The class of the backend named ``name`` (ConfigError at ``path`` for another name)."""
    check_backend(name, path)
    module, _, cls = BACKEND_CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, cfg: Config, run_dir: str, params: Optional[dict] = None) -> Backend:
    """The backend named ``name`` for this job.

    ``params``: simulator efficiency parameters from an earlier calibration (``--calibration``).
    """
    cls = backend_class(name)
    if cls is SimulateBackend:
        return SimulateBackend(cfg.model, cfg.training, cfg.hardware, params)
    from autotune.errors import ConfigError
    from autotune.calibration.loop import Calibrator

    if name == "replay":
        if not cfg.profile.replay_csv:
            raise ConfigError("backend replay needs profile.replay_csv", path="profile.replay_csv")
        # the profiling loop's test double: the same calibrator as the profile backend
        return cls(cfg.profile.replay_csv, cfg, calibrator=Calibrator(cfg, run_dir, initial=params))
    if name == "script" and not cfg.profile.command:
        raise ConfigError("backend script needs profile.command, the training command to run", path="profile.command")
    # Imports only the launcher side here; torch and deepspeed load in the launched workers.
    from autotune.backends.profiled import default_memory_limit

    return cls(cfg, run_dir, memory_limit_bytes=default_memory_limit(), params=params,
               calibrator=Calibrator(cfg, run_dir, initial=params))
