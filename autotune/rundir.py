"""A run directory (runs/<name>/): creation rules, run.json metadata, and executing the study.

Re-running with an existing name never overwrites it: it is an error unless ``--resume`` is given,
which continues the same study (same storage, same study name).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

from autotune.config import Config
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

    from autotune.space import SearchSpace

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
    """The run's budget: backend evaluations in its study, all processes together (run.json keeps it;
    a resumed run evaluates what is left of it)."""
    resume: bool
    calibration: Optional[str] = None
    """A run directory (or calibration.json) whose fitted simulator parameters to start from."""
    interrupted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    snapshot: Optional[int] = None
    """Trial number whose profiling workers save a CUDA memory snapshot (``--snapshot``)."""
    created: bool = False
    """Whether open_run made the run directory (a refused new run removes it again, see discard)."""
    space: Optional[SearchSpace] = None
    """The job's search space (space_for) as open_run checked and recorded it; None: read it again."""

    @property
    def storage_path(self) -> Optional[str]:
        return None if "://" in self.storage_url else self.storage_url

    def discard(self) -> bool:
        """Remove a run this process created whose study never recorded a trial (it was refused
        before starting), so that the same command works once the input is fixed. Returns whether
        it was removed; a run with any trial in its storage is always kept."""
        if not self.created or self.resume or _count_trials(self.storage_url, self.name):
            return False
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return True

    def execute(self, progress: bool = True, enqueue: Optional[list] = None) -> dict[str, Any]:
        """Run (or continue) the study, then write every output; returns front.json's object."""
        from autotune.output import write_outputs
        from autotune.backends.factory import make_backend
        from autotune.search import run_study
        from autotune.space import space_for

        space = self.space if self.space is not None else space_for(self.cfg)
        params = None
        if self.calibration:
            from autotune.calibration.loop import load_calibration

            params = load_calibration(self.calibration, self.cfg.hardware.gpu.name)
        backend = make_backend(self.backend, self.cfg, self.run_dir, params)
        if self.snapshot is not None:
            if hasattr(backend, "snapshot_trial"):
                backend.snapshot_trial = self.snapshot
            else:
                print(f"autotune: --snapshot is ignored by backend {self.backend} (it runs no worker; "
                      "use --backend profile)", file=sys.stderr)
        backend = slowed(backend)
        fast = is_fast(self.backend)
        storage = open_storage(self.storage_url, heartbeat=not fast)
        if self.resume and not fast:
            wait_for_stale_trials(storage, self.name)
        n_trials = self.trials
        if self.resume:
            done = evaluations_done(self.storage_url, self.name)
            n_trials = max(0, self.trials - done)
            print(f"autotune: resuming {self.name}: {done} of its {self.trials} evaluations done, {n_trials} to go"
                  + ("" if n_trials else " (pass --trials N to raise the budget to N)"), file=sys.stderr)
        bar = None
        if progress:
            backend = bar = ProgressBackend(backend, n_trials, self.cfg.model.num_hidden_layers, slow=not fast)
        start = time.perf_counter()
        try:
            outcome = run_study(
                self.cfg, space, backend, storage=storage, study_name=self.name,
                n_trials=n_trials, seed=self.seed, sampler=self.cfg.search.sampler,
                headroom=self.cfg.search.headroom, resume=self.resume,
                enqueue=enqueue, params=params, write_through=not fast,
            )
        finally:
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
        confidence = None
        if outcome.confidence:  # sampler ehvi: how sure the front is (autotune.samplers.front.Assessment)
            confidence = outcome.confidence + (" (stopped early)" if outcome.stopped_early else "")
            extra["front confidence"] = confidence
        return write_outputs(self.run_dir, self.cfg, space, outcome.study, self.backend, extra, confidence)


SLOW_ENV = "AUTOTUNE_SLOW_BACKEND_S"
"""Fault-injection hook for tests and benchmarks/reliability.py: every evaluation sleeps this long
first, and the backend counts as slow (write-through storage, heartbeat)."""


def is_fast(backend: str) -> bool:
    """Whether the backend named ``backend`` answers in microseconds (Backend.in_memory_study): its
    study runs in memory (see run_study)."""
    from autotune.backends.factory import backend_class

    return backend_class(backend).in_memory_study and not os.environ.get(SLOW_ENV)


class _Slowed:
    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str) -> Any:  # name, capabilities, calibrator of the wrapped backend
        return getattr(self.inner, name)

    def evaluate(self, strategy: Any, trial_number: Optional[int] = None) -> Any:
        time.sleep(self.delay_s)
        return self.inner.evaluate(strategy, trial_number=trial_number)


def slowed(backend: Any) -> Any:
    raw = os.environ.get(SLOW_ENV)
    return _Slowed(backend, float(raw)) if raw else backend


def default_storage(run_dir: str, backend: str) -> str:
    """A journal file for fast backends (cheaper per trial, see storage.py), SQLite for slow ones: every
    profiled trial is written through, and Optuna's heartbeat (RDB storages only in Optuna 5) lets
    --resume find and re-run the trial a killed run had in flight."""
    return os.path.join(run_dir, JOURNAL) if is_fast(backend) else "sqlite:///" + os.path.abspath(
        os.path.join(run_dir, SQLITE))


def wait_for_stale_trials(storage: BaseStorage, study_name: str) -> None:
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
        from autotune.claim import fail_stale

        fail_stale(study)
        time.sleep(0.5)


def open_storage(url: str, heartbeat: bool = False) -> Any:
    """make_storage, with a storage that cannot be opened (a missing folder, a refused connection)
    turned into a one-line error naming --storage."""
    from autotune.storage import make_storage

    try:
        return make_storage(url, heartbeat=heartbeat)
    except ConfigError:
        raise
    except Exception as err:  # sqlalchemy / psycopg2 / OSError: the URL names the problem, not our code
        text = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"cannot open storage {url!r}: {text}", path="--storage") from None


def _count_trials(url: str, study_name: str) -> int:
    """Trials recorded in the storage under ``study_name``: 0 when the storage cannot be opened or
    holds no such study (nothing can have been recorded); a storage that opens but cannot be read
    counts as holding trials, so that discard never deletes work it could not see."""
    if "://" not in url and not os.path.exists(url):
        return 0
    import optuna

    try:
        storage = open_storage(url)
    except ConfigError:
        return 0
    try:
        return len(optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False))
    except KeyError:  # no such study
        return 0
    except Exception:
        return 1


def default_name(config_path: str) -> str:
    stem = os.path.splitext(os.path.basename(config_path))[0]
    return f"{stem}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def _make_out(out: str) -> None:
    """Create the parent folder ``--out`` (and its parents); one line naming it when that fails."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out!r} is a file, not a folder for run directories", path="--out")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".autotune-write-check-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as err:
        raise ConfigError(f"cannot create run directories in {out!r} ({err.strerror or type(err).__name__})",
                          path="--out") from None


def _make_unique_dir(out: str, name: str) -> str:
    """Create ``out/name`` atomically, or ``out/name-2``, ``-3``... when taken (two runs of one
    config within a second, possibly in parallel); returns the name that was created."""
    for k in range(1, 10_000):
        candidate = name if k == 1 else f"{name}-{k}"
        try:
            os.mkdir(os.path.join(out, candidate))
            return candidate
        except FileExistsError:
            continue
    raise ConfigError(f"no free run name like {name!r} in {out}", path="--name")


RESUMABLE_KEYS = ("search.trials",)
"""Job keys a resumed run may change (the budget, also given by ``--trials``); any other change
would mix two jobs in one study, so ``--resume`` refuses it."""


def job_record(cfg: Config, space: Optional[SearchSpace] = None) -> dict[str, Any]:
    """What a study's results depend on, flattened to ``section.key`` -> JSON value: the job file's
    model, training, hardware, search and profile sections as loaded (an ``hf_config`` contributes the
    model fields it gives) and the search space's values (``space.<knob>``). Stored in run.json;
    ``--resume`` compares it with the job it is given. ``space``: the job's space_for, when already read."""
    import dataclasses

    from autotune.space import space_for

    sections = {name: getattr(cfg, name) for name in ("model", "training", "hardware", "search", "profile")}
    sections["space"] = dict((space if space is not None else space_for(cfg)).values)
    sections["model_factory"] = cfg.model_factory
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = json.loads(json.dumps(value, default=str))

    walk("", sections)
    return {k: v for k, v in flat.items() if k not in RESUMABLE_KEYS}


def _field_defaults(cfg: Config) -> dict[str, Any]:
    """``section.key`` -> the JSON of that field's default, for the job sections' own fields that have
    one: a key a run.json of an earlier release lacks was added since, and at its default it changes
    nothing."""
    import dataclasses

    out: dict[str, Any] = {}
    for name in ("model", "training", "hardware", "search", "profile"):
        section = getattr(cfg, name)
        for f in dataclasses.fields(section) if dataclasses.is_dataclass(section) else ():
            if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
                out[f"{name}.{f.name}"] = json.loads(json.dumps(f.default, default=str))
    return out


def _check_same_job(cfg: Config, meta: dict[str, Any], run_dir: str, space: SearchSpace) -> None:
    """--resume: refuse a job that differs from the one the run started with, naming the keys (a key
    the run's record lacks, added to autotune since, counts as its default)."""
    before = meta.get("job")
    if before is None:  # a run.json written before jobs were recorded: nothing to compare
        return
    now = job_record(cfg, space)
    defaults = _field_defaults(cfg)
    before = {**{k: v for k, v in defaults.items() if k in now and k not in before}, **before}
    changed = [k for k in sorted(before.keys() | now.keys()) if before.get(k) != now.get(k)]
    if not changed:
        return
    shown = ", ".join(f"{k} {json.dumps(before.get(k))} -> {json.dumps(now.get(k))}" for k in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    raise ConfigError(f"the job differs from the one {run_dir} started with: {shown}{more}; resume with that job, "
                      "or start a new run (--trials alone may change on resume)", path="--resume")


def evaluations_done(storage_url: str, study_name: str) -> int:
    """Backend evaluations a study holds (every process's): trials with a result of their own, neither
    pruned nor a repeat of an earlier trial (autotune.claim.has_result)."""
    import optuna
    from optuna.trial import TrialState

    from autotune.claim import has_result
    from autotune.trial_attrs import TrialAttrs

    try:
        study = optuna.load_study(study_name=study_name, storage=open_storage(storage_url))
    except KeyError:
        return 0
    return sum(1 for t in study.get_trials(deepcopy=False)
               if has_result(t) and t.state != TrialState.PRUNED and TrialAttrs.of(t).duplicate_of is None)


def open_run(cfg: Config, *, out: str, name: Optional[str], resume: bool, storage: Optional[str],
             backend: Optional[str], seed: Optional[int], trials: Optional[int],
             calibration: Optional[str] = None, snapshot: Optional[int] = None) -> Run:
    """Create a new run directory, or reopen one for --resume; refuses to overwrite."""
    if resume and not name:
        raise ConfigError("--resume needs --name of the run to continue", path="--resume")
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials must be >= 1, but got {trials}", path="--trials")
    if name is not None and (not name or "/" in name or name in (".", "..")):
        raise ConfigError(f"--name must be a plain folder name, but got {name!r}", path="--name")
    space = _check_before_creating(cfg, backend or cfg.profile.backend)
    _make_out(out)
    created = False
    if name is None:
        name, created = _make_unique_dir(out, default_name(cfg.path)), True
    run_dir = os.path.join(out, name)
    meta_path = os.path.join(run_dir, RUN_FILE)
    meta: dict[str, Any] = {}
    if resume:
        if not os.path.isfile(meta_path):
            raise ConfigError(f"no run to resume at {run_dir} (missing {RUN_FILE})", path="--name")
        with open(meta_path) as fh:
            meta = json.load(fh)
        _check_same_job(cfg, meta, run_dir, space)
        storage = storage or meta["storage"]
        backend = backend or meta.get("backend")
        seed = meta.get("seed", 0) if seed is None else seed
        trials = trials or meta.get("trials")
    elif os.path.exists(run_dir) and os.listdir(run_dir):
        raise ConfigError(f"{run_dir} already exists; pass --resume to continue it or choose another --name",
                          path="--name")
    if not created and not os.path.isdir(run_dir):
        os.makedirs(run_dir)
        created = True
    run = Run(
        cfg=cfg, run_dir=run_dir, name=name,
        storage_url=storage or default_storage(run_dir, backend or cfg.profile.backend),
        backend=backend or cfg.profile.backend,
        seed=cfg.search.seed if seed is None else seed,
        trials=trials or cfg.search.trials, resume=resume, meta=meta,
        calibration=calibration or meta.get("calibration"), snapshot=snapshot, created=created, space=space,
    )
    meta.update(name=name, config=os.path.abspath(cfg.path), storage=run.storage_url, backend=run.backend,
                calibration=run.calibration and os.path.abspath(run.calibration),
                seed=run.seed, trials=run.trials, space=cfg.search.space, job=job_record(cfg, space),
                created=meta.get("created") or
                datetime.now(timezone.utc).isoformat(timespec="seconds"))
    with open(meta_path, "w") as fh:
        json.dump(meta, fh, indent=2)
    return run


def _check_before_creating(cfg: Config, backend: str) -> SearchSpace:
    """Refuse what would fail as soon as the study starts, before anything is written; returns the job's
    search space (space_for)."""
    from autotune.backends.factory import backend_class
    from autotune.space import space_for

    space = space_for(cfg)  # a bad search space is refused here
    cls = backend_class(backend, "--backend")
    if backend == "replay" and not cfg.profile.replay_csv:
        raise ConfigError("backend replay needs profile.replay_csv", path="profile.replay_csv")
    if cls.launches_workers:
        _check_profiling_installed(cfg, space.values["engine"])
    if cls.builds_model:
        _check_profiled_model_builds(cfg)
    return space


def _check_profiled_model_builds(cfg: Config) -> None:
    """A job without model.hf_config or model.python is profiled on the reference decoder, which
    refuses a spec it does not build (models.sources.reference_unbuilt: qk_norm, a MoE, ...): refuse
    before starting instead of failing every trial with that line."""
    from autotune.models.sources import reference_unbuilt

    unbuilt = [] if (cfg.model_factory or cfg.hf_config) else reference_unbuilt(cfg.model)
    if unbuilt:
        raise ConfigError(f"the reference decoder a profiled run trains does not build {', '.join(unbuilt)} of "
                          f"model {cfg.model.name!r}: give model.hf_config (its config.json) or model.python to "
                          f"profile it, or run --backend simulate", file=cfg.path, path="model")


def _check_profiling_installed(cfg: Config, engines: tuple[str, ...]) -> None:
    """A profiled run needs torch (and DeepSpeed for its DeepSpeed candidates, transformers for an
    ``hf_config`` model) in this interpreter, which the launched workers run: refuse before starting
    instead of failing every trial with the ImportError in its log."""
    import importlib.util

    needed = ["torch"] + (["deepspeed"] if "deepspeed" in engines else [])
    needed += ["transformers"] if cfg.hf_config else []
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        extras = "profile,hf" if "transformers" in missing else "profile"
        raise ConfigError(f"backend profile needs {' and '.join(missing)}, not installed in {sys.executable}: "
                          f"install the extra, pip install 'autotune[{extras}]'", path="--backend")


class ProgressBackend:
    """Wraps a backend to show progress on stderr: trial k of N, the strategy, how the last one
    ended, elapsed time and ETA (tqdm). On a terminal it is one live bar; otherwise (a nightly log)
    slow backends print one line per evaluation and fast ones print nothing."""

    def __init__(self, inner: Any, total: int, num_layers: int, slow: bool) -> None:
        from tqdm import tqdm

        self.inner, self.total, self.num_layers, self.slow = inner, total, num_layers, slow
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="trial", file=sys.stderr, dynamic_ncols=True, disable=not self.tty,
                        bar_format="{desc} |{bar}| {n}/{total} [{elapsed}<{remaining}] {postfix}")
        self.done = 0
        self.start = time.monotonic()

    def __getattr__(self, name: str) -> Any:  # name, calibrator, ... of the wrapped backend
        return getattr(self.inner, name)

    def evaluate(self, strategy: Any, trial_number: Optional[int] = None) -> Any:
        text = strategy.describe(self.num_layers)
        k = self.done + 1
        self.bar.set_description(f"trial {k} of {self.total}", refresh=False)
        self.bar.set_postfix_str(f"{text}: running")
        t0 = time.monotonic()
        result = self.inner.evaluate(strategy, trial_number=trial_number)
        self.done = k
        status = result.status if result.ok else f"{result.status} ({(result.reason or '')[:80]})"
        self.bar.set_postfix_str(f"last: {status}", refresh=False)
        self.bar.update(1)
        if self.slow and not self.tty:
            elapsed = time.monotonic() - self.start
            eta = elapsed / k * (self.total - k)
            print(f"trial {k} of {self.total} (study trial {trial_number}): {text}: {status} in "
                  f"{time.monotonic() - t0:.0f} s; elapsed {elapsed:.0f} s, ETA {eta:.0f} s", file=sys.stderr, flush=True)
        return result

    def close(self) -> None:
        self.bar.close()
