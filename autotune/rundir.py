"""A run directory (runs/<name>/): creation rules, run.json metadata, and executing the study.

Re-running with an existing name never overwrites it: it is an error unless ``--resume`` is given,
which continues the same study (same storage, same study name).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from autotune.config import Config
from autotune.errors import ConfigError

RUN_FILE = "run.json"
JOURNAL = "study.journal"
SQLITE = "study.db"


@dataclass
class Run:
    """An opened run directory and the choices that drive its study."""

    cfg: Config
    run_dir: str
    name: str
    storage_url: str
    backend: str
    seed: int
    trials: int
    resume: bool
    calibration: Optional[str] = None
    """A run directory (or calibration.json) whose fitted simulator parameters to start from."""
    interrupted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    snapshot: Optional[int] = None
    """Trial number whose profiling workers save a CUDA memory snapshot (``--snapshot``)."""

    @property
    def storage_path(self) -> Optional[str]:
        return None if "://" in self.storage_url else self.storage_url

    def execute(self, progress: bool = True, enqueue: Optional[list] = None) -> dict[str, Any]:
        """Run (or continue) the study, then write every output; returns front.json's object."""
        from autotune.output import write_outputs
        from autotune.profile.backend import make_backend
        from autotune.search import run_study
        from autotune.space import space_for

        space = space_for(self.cfg)
        params = None
        if self.calibration:
            from autotune.profile.calibrate import load_calibration

            params = load_calibration(self.calibration, self.cfg.hardware.gpu.name)
        backend = make_backend(self.backend, self.cfg, self.run_dir, params)
        if self.snapshot is not None:
            if hasattr(backend, "snapshot_trial"):
                backend.snapshot_trial = self.snapshot
            else:
                print(f"autotune: --snapshot is ignored by backend {self.backend} (it runs no worker; "
                      "use --backend deepspeed)", file=sys.stderr)
        backend = slowed(backend)
        from autotune.storage import make_storage

        fast = is_fast(self.backend)
        storage = make_storage(self.storage_url, heartbeat=not fast)
        if self.resume and not fast:
            wait_for_stale_trials(storage, self.name)
        bar = _Progress(self.trials) if progress else None
        start = time.perf_counter()
        outcome = run_study(
            self.cfg, space, backend, storage=storage, study_name=self.name,
            n_trials=self.trials, seed=self.seed, sampler=self.cfg.search.sampler,
            headroom=self.cfg.search.headroom, resume=self.resume, progress=bar.update if bar else None,
            enqueue=enqueue, params=params, write_through=not fast,
        )
        if bar:
            bar.close()
        self.interrupted = outcome.interrupted
        feasible = sum(s.memory.fits for s in outcome.screened)
        extra = {
            "candidates screened by the memory model": f"{len(outcome.screened)} ({feasible} fit)",
            "distinct candidates evaluated or pruned": len(outcome.evaluated),
            "study": f"{self.name} in {self.storage_url}",
            "search wall time": f"{time.perf_counter() - start:.2f} s",
        }
        return write_outputs(self.run_dir, self.cfg, space, outcome.study, self.backend, extra)


SLOW_ENV = "AUTOTUNE_SLOW_BACKEND_S"
"""Fault-injection hook for tests and benchmarks/reliability.py: every evaluation sleeps this long
first, and the backend counts as slow (write-through storage, heartbeat)."""


def is_fast(backend: str) -> bool:
    """simulate and replay answer in microseconds: their study runs in memory (see run_study)."""
    return backend in ("simulate", "replay") and not os.environ.get(SLOW_ENV)


class _Slowed:
    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name = inner.name
        self.calibrator = getattr(inner, "calibrator", None)

    def evaluate(self, strategy: Any, trial_number: Optional[int] = None) -> Any:
        time.sleep(self.delay_s)
        return self.inner.evaluate(strategy, trial_number=trial_number)


def slowed(backend: Any) -> Any:
    raw = os.environ.get(SLOW_ENV)
    return _Slowed(backend, float(raw)) if raw else backend


def default_storage(run_dir: str, backend: str) -> str:
    """A journal file for fast backends (~3 ms/trial, see storage.py), SQLite for slow ones: every
    profiled trial is written through, and Optuna's heartbeat (RDB storages only in Optuna 5) lets
    --resume find and re-run the trial a killed run had in flight."""
    return os.path.join(run_dir, JOURNAL) if is_fast(backend) else "sqlite:///" + os.path.abspath(
        os.path.join(run_dir, SQLITE))


def wait_for_stale_trials(storage: Any, study_name: str) -> None:
    """--resume of a killed run: wait (at most the heartbeat grace period) until its RUNNING trials
    have gone stale, so that they are failed and re-queued before the study continues."""
    import optuna
    from optuna.trial import TrialState

    from autotune.storage import has_heartbeat

    if not has_heartbeat(storage):
        return
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return
    grace = storage.get_heartbeat_interval() * 4
    deadline = time.monotonic() + grace
    told = False
    while time.monotonic() < deadline:
        running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if not running:
            return
        if not told:
            print(f"autotune: waiting up to {grace} s for the heartbeat of running trial(s) "
                  f"{', '.join(map(str, running))} to go stale (re-queued if their process is gone)", file=sys.stderr)
            told = True
        from autotune.search import _fail_stale

        _fail_stale(study)
        time.sleep(0.5)


def default_name(config_path: str) -> str:
    stem = os.path.splitext(os.path.basename(config_path))[0]
    return f"{stem}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def open_run(cfg: Config, *, out: str, name: Optional[str], resume: bool, storage: Optional[str],
             backend: Optional[str], seed: Optional[int], trials: Optional[int],
             calibration: Optional[str] = None, snapshot: Optional[int] = None) -> Run:
    """Create a new run directory, or reopen one for --resume; refuses to overwrite."""
    if resume and not name:
        raise ConfigError("--resume needs --name of the run to continue", path="--resume")
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials must be >= 1, but got {trials}", path="--trials")
    name = name or default_name(cfg.path)
    if not name or "/" in name or name in (".", ".."):
        raise ConfigError(f"--name must be a plain folder name, but got {name!r}", path="--name")
    run_dir = os.path.join(out, name)
    meta_path = os.path.join(run_dir, RUN_FILE)
    meta: dict[str, Any] = {}
    if resume:
        if not os.path.isfile(meta_path):
            raise ConfigError(f"no run to resume at {run_dir} (missing {RUN_FILE})", path="--name")
        with open(meta_path) as fh:
            meta = json.load(fh)
        storage = storage or meta["storage"]
        backend = backend or meta.get("backend")
        seed = meta.get("seed", 0) if seed is None else seed
    elif os.path.exists(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"{run_dir} already exists; pass --resume to continue it or choose another --name",
                          path="--name")
    os.makedirs(run_dir, exist_ok=True)
    run = Run(
        cfg=cfg, run_dir=run_dir, name=name,
        storage_url=storage or default_storage(run_dir, backend or cfg.profile.backend),
        backend=backend or cfg.profile.backend,
        seed=cfg.search.seed if seed is None else seed,
        trials=trials or cfg.search.trials, resume=resume, meta=meta,
        calibration=calibration or meta.get("calibration"), snapshot=snapshot,
    )
    meta.update(name=name, config=os.path.abspath(cfg.path), storage=run.storage_url, backend=run.backend,
                calibration=run.calibration and os.path.abspath(run.calibration),
                seed=run.seed, space=cfg.search.space, created=meta.get("created") or
                datetime.now(timezone.utc).isoformat(timespec="seconds"))
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=2)
    return run


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.enabled = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        if self.enabled:
            width = 30
            filled = int(width * done / max(total, 1))
            sys.stderr.write(f"\rtrials [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
