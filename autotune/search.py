"""The Optuna search: screen the space analytically, then run a multi-objective study.

Objectives: minimise peak GPU memory (GiB), maximise tokens/s per GPU. Every candidate is first
checked by the memory model; infeasible ones are recorded as PRUNED with their reason (user attr
``prune_reason``) and constraint values (``trial.set_constraint``), and never evaluated. Repeats of
an already evaluated strategy reuse its result (user attr ``duplicate_of``).
"""

from __future__ import annotations

import math
import signal
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from autotune.config import Config
from autotune.memory import MemoryEstimate, estimate_memory
from autotune.pareto import pareto_front
from autotune.profile.backend import Backend, Measurement
from autotune.simulate import simulate
from autotune.space import SearchSpace, strategy_params
from autotune.storage import make_storage  # noqa: F401  (re-exported for callers of search)
from autotune.strategy import Strategy

GIB = float(1 << 30)
METRIC_NAMES = ["peak_memory_gib", "tokens_per_s_per_gpu"]
DIRECTIONS = ["minimize", "maximize"]


@dataclass(frozen=True)
class Screened:
    """One candidate as the analytic models see it."""

    strategy: Strategy
    memory: MemoryEstimate
    tokens_per_s_per_gpu: float = 0.0
    """Simulated throughput (0 when infeasible: not simulated)."""


def screen(cfg: Config, space: SearchSpace, headroom: float, params: Optional[dict] = None) -> list[Screened]:
    """Every candidate of the space through the memory model, and the feasible ones through the
    simulator (with efficiency ``params`` when given, e.g. from a calibration).

    With ``search.fidelity: traced`` every candidate's activations come from a FakeTensorMode trace
    of the real model (autotune.trace; one trace per micro-batch x checkpointing pair, reused across
    ZeRO stages and offload); with ``search.trace_near_limit`` only those within that fraction of
    the usable memory are traced.
    """
    traced = _tracer(cfg, headroom)
    capacity = cfg.hardware.gpu.memory_bytes * (1 - headroom)
    near = cfg.search.trace_near_limit * capacity
    out = []
    for strategy in space.candidates(cfg.model):
        mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy, headroom=headroom)
        if traced and (cfg.search.fidelity == "traced" or
                       abs(mem.gpu["peak"] + mem.gpu["overhead"] - capacity) <= near):
            mem = traced(strategy)
        tps = simulate(cfg.model, cfg.training, cfg.hardware, strategy, params).tokens_per_s_per_gpu if mem.fits else 0.0
        out.append(Screened(strategy, mem, tps))
    return out


def _tracer(cfg: Config, headroom: float) -> Optional[Callable[[Strategy], MemoryEstimate]]:
    """A function tracing one strategy (with a shared cache), or None when tracing is off."""
    if cfg.search.fidelity != "traced" and cfg.search.trace_near_limit <= 0:
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        from autotune.errors import ConfigError

        raise ConfigError("traced memory needs torch: pip install torch==2.13.0 -e '.[profile]'",
                          path="search.fidelity") from None
    from autotune.trace import TraceCache, traced_estimate

    cache = TraceCache()
    return lambda strategy: traced_estimate(cfg, strategy, cache, headroom=headroom)[0]


def predicted_front(screened: list[Screened]) -> list[Screened]:
    feasible = [s for s in screened if s.memory.fits]
    idx = pareto_front([(s.memory.gpu["peak"], s.tokens_per_s_per_gpu) for s in feasible])
    return [feasible[i] for i in idx]


def make_sampler(name: str, seed: int) -> Any:
    """NSGA-II by default: the space is small, discrete and categorical, the problem is bi-objective
    with constraints, and NSGA-II handles all three at ~0.4 ms/trial (TPE ~5 ms, GP needs scipy and is
    built for continuous spaces); see ../shared/NOTES-cpu.md for the timings."""
    import optuna

    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=24)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


@dataclass
class StudyOutcome:
    """What run_study returns: the study and the bookkeeping the outputs need."""

    study: Any
    screened: list[Screened]
    interrupted: bool = False
    evaluated: dict[tuple, int] = field(default_factory=dict)
    """strategy key -> number of the trial that evaluated it."""


class _StopFlag:
    """First SIGINT: finish the current trial, then stop. Second SIGINT: stop now."""

    def __init__(self) -> None:
        self.stop = False
        self._old: Any = None

    def __enter__(self) -> "_StopFlag":
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True
        print("\nautotune: stopping after the current trial (Ctrl-C again to abort it)", file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def trial_strategy(trial: Any, space: SearchSpace, cfg: Config) -> Strategy:
    """The strategy a finished trial evaluated (rebuilt from its params)."""
    import optuna

    return space.suggest(optuna.trial.FixedTrial(trial.params), cfg.model)


MAX_ASKS_PER_EVALUATION = 20
"""Bound on Optuna trials (pruned and repeats included) per evaluation budget unit."""


def run_study(
    cfg: Config,
    space: SearchSpace,
    backend: Backend,
    *,
    storage: Any,
    study_name: str,
    n_trials: int,
    seed: int,
    sampler: str,
    headroom: float,
    resume: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
    enqueue: Optional[list[Strategy]] = None,
    seed_predicted_front: bool = True,
    params: Optional[dict] = None,
    write_through: bool = True,
) -> StudyOutcome:
    """Run (or continue) the study until ``n_trials`` candidates have been evaluated by the backend.

    Pruned candidates (memory model) and repeats are cheap and do not count against ``n_trials``;
    at most ``MAX_ASKS_PER_EVALUATION * n_trials`` Optuna trials are asked, and the study stops early
    once every candidate that fits has been evaluated. ``params`` are simulator efficiency parameters
    (from ``--calibration``); a backend with a ``calibrator`` re-fits them as measurements arrive,
    and the re-predicted front's unevaluated points are enqueued.

    ``write_through=False`` (fast backends: simulate, replay) runs the study in memory and appends
    the finished trials to ``storage`` at the end, also on interruption or error: one journal line
    per trial instead of ~12, which keeps a 200-evaluation simulate run within seconds. Slow
    backends write every step through, so a killed run loses at most the trial in flight.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    screened = screen(cfg, space, headroom, params)
    study = optuna.create_study(
        study_name=study_name, storage=storage, directions=DIRECTIONS,
        sampler=make_sampler(sampler, seed), load_if_exists=resume,
    )
    if write_through:
        return _run(study, study, cfg, space, backend, screened, n_trials, headroom, resume, progress, enqueue,
                    seed_predicted_front)
    persistent = study
    study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(sampler, seed))
    known = persistent.get_trials(deepcopy=False) if resume else []
    study.add_trials([t for t in known if t.state.is_finished()])
    try:
        outcome = _run(study, persistent, cfg, space, backend, screened, n_trials, headroom, resume, progress,
                       enqueue, seed_predicted_front)
    finally:
        persistent.add_trials([t for t in study.get_trials(deepcopy=False)[len(known):] if t.state.is_finished()])
    outcome.study = persistent
    return outcome


def _run(study: Any, persistent: Any, cfg: Config, space: SearchSpace, backend: Backend, screened: list[Screened],
         n_trials: int, headroom: float, resume: bool, progress: Optional[Callable[[int, int], None]],
         enqueue: Optional[list[Strategy]], seed_predicted_front: bool) -> StudyOutcome:
    """The trial loop on ``study``; study-level attributes go to ``persistent``."""
    from optuna.trial import TrialState

    by_key = {s.strategy.key(): s for s in screened}
    outcome = StudyOutcome(study=study, screened=screened)
    cache: dict[tuple, _Outcome] = {}  # strategy key -> how its first trial ended
    oom_at: dict[tuple, tuple[int, int]] = {}  # strategy-without-mbs -> (smallest OOM mbs, trial number)
    if resume:
        for t in study.get_trials(deepcopy=False):
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                cache.setdefault(trial_strategy(t, space, cfg).key(), _Outcome.of(t))
    else:
        with warnings.catch_warnings():  # "experimental" since Optuna 3.2, still the API in 5.0
            warnings.simplefilter("ignore")
            persistent.set_metric_names(METRIC_NAMES)
        persistent.set_user_attr("space", space.path)
        persistent.set_user_attr("headroom", headroom)
        persistent.set_user_attr("num_candidates", len(screened))
        persistent.set_user_attr("num_feasible", sum(s.memory.fits for s in screened))
        # Caller-given seeds (e.g. a nightly baseline's front) come first, then the analytic front:
        # the whole space was screened in well under a second, so the study starts from the
        # predicted-best points and explores from there.
        seeds = list(enqueue or [])
        if seed_predicted_front:
            seeds += [s.strategy for s in predicted_front(screened)]
        for strategy in seeds[:n_trials]:
            study.enqueue_trial(strategy_params(strategy, space, cfg.model), skip_if_exists=True)
    feasible = {k for k, s in by_key.items() if s.memory.fits}
    calibrator = getattr(backend, "calibrator", None)
    evaluations = asks = 0
    with _StopFlag() as flag:
        while evaluations < n_trials and asks < MAX_ASKS_PER_EVALUATION * n_trials:
            if flag.stop:
                outcome.interrupted = True
                break
            if feasible <= cache.keys() and (feasible or by_key.keys() <= cache.keys()):
                break  # everything that fits has been evaluated (or, when nothing fits, seen)
            trial = study.ask()
            asks += 1
            strategy = space.suggest(trial, cfg.model)
            ended = _evaluate_trial(study, trial, strategy, cfg, backend, headroom, by_key, cache, oom_at)
            cache.setdefault(strategy.key(), ended)
            if ended.measured:
                evaluations += 1
                if progress:
                    progress(evaluations, n_trials)
                if calibrator is not None and calibrator.fitted:
                    _enqueue_recalibrated(study, space, cfg, screened, calibrator.current_params(), cache)
    outcome.evaluated = {k: o.number for k, o in cache.items()}
    return outcome


def _enqueue_recalibrated(study: Any, space: SearchSpace, cfg: Config, screened: list[Screened],
                          params: dict, cache: dict) -> None:
    """Re-predict the feasible candidates with re-fitted simulator parameters and enqueue the
    predicted-front points that have not been evaluated yet (so the front improves as it runs)."""
    feasible = [s for s in screened if s.memory.fits]
    tps = [simulate(cfg.model, cfg.training, cfg.hardware, s.strategy, params).tokens_per_s_per_gpu
           for s in feasible]
    for i in pareto_front([(s.memory.gpu["peak"], t) for s, t in zip(feasible, tps)]):
        strategy = feasible[i].strategy
        if strategy.key() not in cache:
            study.enqueue_trial(strategy_params(strategy, space, cfg.model), skip_if_exists=True)


@dataclass(frozen=True)
class _Outcome:
    """How a strategy's first trial ended; repeats of the strategy end the same way."""

    number: int
    state: Any  # optuna TrialState
    values: Optional[list[float]] = None
    attrs: dict[str, Any] = field(default_factory=dict)
    constraint: Optional[float] = None
    measured: bool = False
    """Whether the backend was called (repeats and pruned candidates are not)."""

    @classmethod
    def of(cls, trial: Any) -> "_Outcome":
        return cls(trial.number, trial.state, trial.values,
                   {k: v for k, v in trial.user_attrs.items() if k in ("prune_reason", "fail_reason")},
                   trial.system_attrs.get("constraints:gpu_memory"))


def _evaluate_trial(study: Any, trial: Any, strategy: Strategy, cfg: Config, backend: Backend, headroom: float,
                    by_key: dict, cache: dict, oom_at: dict) -> _Outcome:
    """Finish one asked trial: reuse, prune, or evaluate it; returns how it ended."""
    from optuna.trial import TrialState

    def finish(state: Any, values: Optional[list[float]] = None, measured: bool = False, **attrs: Any) -> _Outcome:
        for name, value in attrs.items():
            trial.set_user_attr(name, value)
        study.tell(trial, values, state=state)
        return _Outcome(trial.number, state, values, attrs, constraint, measured)

    key = strategy.key()
    if key in cache:
        first: _Outcome = cache[key]
        constraint = first.constraint
        if constraint is not None:
            trial.set_constraint("gpu_memory", constraint)
        trial.set_user_attr("duplicate_of", first.number)
        return finish(first.state, first.values, **first.attrs)  # measured=False: reused
    screened = by_key.get(key)
    mem = screened.memory if screened else estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy,
                                                           headroom=headroom)
    capacity = cfg.hardware.gpu.memory_bytes * (1 - headroom)
    constraint = (mem.gpu["peak"] + mem.gpu["overhead"] - capacity) / GIB
    trial.set_constraint("gpu_memory", constraint)
    if not mem.fits:
        return finish(TrialState.PRUNED, prune_reason="; ".join(mem.reasons) or "does not fit")
    no_mbs = strategy.replace(micro_batch_size=0).key()
    if no_mbs in oom_at and strategy.micro_batch_size >= oom_at[no_mbs][0]:
        mbs, number = oom_at[no_mbs]
        return finish(TrialState.PRUNED, prune_reason=f"out of memory at micro_batch_size {mbs} (trial {number})")
    result: Measurement = backend.evaluate(strategy, trial_number=trial.number)
    trial.set_user_attr("measurement", _json_safe(result.as_dict()))
    if not result.ok:
        if result.status == "oom":
            prev = oom_at.get(no_mbs)
            if prev is None or strategy.micro_batch_size < prev[0]:
                oom_at[no_mbs] = (strategy.micro_batch_size, trial.number)
        return finish(TrialState.FAIL, measured=True, fail_reason=f"{result.status}: {result.reason}".rstrip(": "))
    return finish(TrialState.COMPLETE, [result.peak_memory_bytes / GIB, result.tokens_per_s_per_gpu], measured=True)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
