"""``make_backend``: the profile backend a run names (heavy backends are imported only when chosen).

Kept apart from profile/backend.py, the interface every backend imports, so that the interface does
not import its implementations.
"""

from __future__ import annotations

from typing import Optional

from autotune.config import Config
from autotune.profile.backend import Backend, SimulateBackend


def make_backend(name: str, cfg: Config, run_dir: str, params: Optional[dict] = None) -> Backend:
    """The backend named ``name`` for this job (heavy backends are imported only when chosen).

    ``params``: simulator efficiency parameters from an earlier calibration (``--calibration``).
    """
    if name == "simulate":
        return SimulateBackend(cfg.model, cfg.training, cfg.hardware, params)
    from autotune.errors import ConfigError

    if name == "replay":
        if not cfg.profile.replay_csv:
            raise ConfigError("backend replay needs profile.replay_csv", path="profile.replay_csv")
        from autotune.profile.calibrate import Calibrator
        from autotune.profile.replay import ReplayBackend

        # the profiling loop's test double: the same calibrator as the deepspeed backend
        return ReplayBackend(cfg.profile.replay_csv, cfg, calibrator=Calibrator(cfg, run_dir, initial=params))
    if name in ("profile", "deepspeed"):  # deepspeed: the old name of profile (it runs both engines)
        # Imports only the launcher side here; torch and deepspeed load in the launched workers.
        from autotune.profile.calibrate import Calibrator
        from autotune.profile.deepspeed_backend import DeepSpeedBackend, default_memory_limit

        calibrator = Calibrator(cfg, run_dir, initial=params)
        return DeepSpeedBackend(cfg, run_dir, memory_limit_bytes=default_memory_limit(), params=params,
                                calibrator=calibrator)
    raise ConfigError(f"unknown backend {name!r}; expected simulate, profile (alias deepspeed) or replay", path="profile.backend")
