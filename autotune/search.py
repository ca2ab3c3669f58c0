"""The Optuna search: screen the space analytically, then run a multi-objective study.

Objectives: minimise peak GPU memory (GiB), maximise tokens/s per GPU. Every candidate is first
checked by the memory model; infeasible ones are recorded as PRUNED with their reason (user attr
``prune_reason``) and constraint values (``trial.set_constraint``), and never evaluated. Repeats of
an already evaluated strategy reuse its result (user attr ``duplicate_of``).
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from autotune.trial_attrs import OUTCOME_KEYS, StudyAttrs, TrialAttrs, put
from autotune.claim import (abandon, ask, claim, fail_stale, fail_status, has_result, heartbeat_around,
                            heartbeat_on, key_text)
from autotune._optuna_compat import tell
from autotune.config import Config
from autotune.memory import estimate_memory
from autotune.pareto import pareto_front
from autotune.backends.base import Backend, Measurement, fail_reason_text
from autotune.screen import Screened, predicted_front, screen, spread  # noqa: F401  (spread: public here too)
from autotune.signals import StopFlag
from autotune.simulate import simulate
from autotune.space import SearchSpace, strategy_params, trial_strategy
from autotune.spec import GIB
from autotune.storage import add_trials
from autotune.strategy import Strategy

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial, Trial, TrialState

METRIC_NAMES = ["peak_memory_gib", "tokens_per_s_per_gpu"]
DIRECTIONS = ["minimize", "maximize"]


def make_sampler(name: str, seed: int, context: Optional[dict] = None) -> Any:
    """NSGA-II by default: the space is small, discrete and categorical, the problem is bi-objective
    with constraints, and NSGA-II handles all three at a fraction of TPE's cost per trial (GP needs
    scipy and is built for continuous spaces; per-trial costs in docs/accuracy.md, "Figures moved
    from code").

    ``ehvi``: autotune.samplers.front.FrontSampler (calibrated simulator + residual GP, expected hypervolume
    improvement), built from ``context`` (cfg, space, screened, headroom, calibrator).

    ``sweep``: Optuna's BruteForceSampler, every combination of the space's knobs once (in random
    order); the study ends early once the grid is exhausted."""
    import optuna

    if name == "ehvi":
        from autotune.samplers.front import FrontSampler

        ctx = dict(context or {})
        return FrontSampler(ctx["cfg"], ctx["space"], ctx["screened"], headroom=ctx["headroom"],
                            calibrator=ctx.get("calibrator"), seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=24)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "gp":
        try:
            import scipy  # noqa: F401  (GPSampler's optimiser; not a core dependency)
        except ImportError:
            from autotune.errors import ConfigError

            raise ConfigError("sampler gp needs scipy: pip install scipy (or -e '.[profile]')",
                              path="search.sampler") from None
        return optuna.samplers.GPSampler(seed=seed)
    if name == "sweep":
        return _sweep_sampler(seed)
    return optuna.samplers.RandomSampler(seed=seed)


def _sweep_sampler(seed: int) -> Any:
    """Optuna's BruteForceSampler without its ``study.stop()`` on an exhausted grid (which ask/tell
    refuses): the trial loop ends by itself once every candidate that fits has been evaluated."""
    import optuna

    class SweepSampler(optuna.samplers.BruteForceSampler):
        def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                        values: Optional[Sequence[float]]) -> None:
            pass

    with warnings.catch_warnings():  # "experimental" since Optuna 3.1, unchanged through 5.0
        warnings.simplefilter("ignore")
        return SweepSampler(seed=seed)


@dataclass
class StudyOutcome:
    """What run_study returns: the study and the bookkeeping the outputs need."""

    study: Study
    screened: list[Screened]
    interrupted: bool = False
    evaluated: dict[tuple, int] = field(default_factory=dict)
    """strategy key -> number of the trial that evaluated it."""
    evaluations: int = 0
    """Backend evaluations made by this process."""
    confidence: Optional[str] = None
    """How sure the front is (sampler ehvi), e.g. "front stable: expected hypervolume gain ... 0.3%; 11 of
    704 feasible candidates profiled"; also the study user attr ``front_confidence``."""
    stopped_early: bool = False
    """The sampler's stopping rule ended the run before ``n_trials`` evaluations."""
    stop_reason: str = ""
    """Why the trial loop ended, one clause (``autotune worker`` and resumed runs print it)."""


MAX_ASKS_PER_EVALUATION = 20
"""Bound on Optuna trials (pruned and repeats included) per evaluation budget unit."""

STALL_ASKS = 20
"""Consecutive asks repeating an evaluated candidate after which the best-predicted candidate that fits and was
never evaluated is queued (a sampler that keeps proposing evaluated candidates of a small space would
otherwise spend MAX_ASKS_PER_EVALUATION x n_trials asks, minutes in NSGA-II, before stopping)."""


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
    join: bool = False,
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
    The in-memory study is also appended every ``FLUSH_EVERY_S`` seconds, so SIGKILL of a fast run
    loses at most that much work; SIGINT and SIGTERM lose nothing.

    ``join=True`` (``autotune worker``): create the study if it does not exist, else continue it;
    several processes (on several nodes with PostgreSQL) may run the same study at once. Write-through
    studies always use the claim protocol of ``claim.claim`` so that each candidate is evaluated once.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    screened = screen(cfg, space, headroom, params)
    # What is alive now (the screened candidates: ~10^5 objects) lives as long as the study: frozen, the
    # cyclic collector stops rescanning it in every collection the trial loop triggers (docs/accuracy.md)
    gc.freeze()
    try:
        return _study(cfg, space, backend, screened, storage=storage, study_name=study_name, n_trials=n_trials,
                      seed=seed, sampler=sampler, headroom=headroom, resume=resume, progress=progress,
                      enqueue=enqueue, seed_predicted_front=seed_predicted_front, write_through=write_through,
                      join=join)
    finally:
        gc.unfreeze()  # back to the oldest generation: garbage among them is collected as before


def _study(cfg: Config, space: SearchSpace, backend: Backend, screened: list[Screened], *, storage: Any,
           study_name: str, n_trials: int, seed: int, sampler: str, headroom: float, resume: bool,
           progress: Optional[Callable[[int, int], None]], enqueue: Optional[list[Strategy]],
           seed_predicted_front: bool, write_through: bool, join: bool) -> StudyOutcome:
    """run_study after the screen: create or load the study and run the trial loop on it."""
    import optuna

    if sampler == "auto":  # measurements cost GPU time: choose them by expected improvement
        sampler = "ehvi" if getattr(backend, "measures", False) else "nsga2"
    context = {"cfg": cfg, "space": space, "screened": screened, "headroom": headroom,
               "calibrator": getattr(backend, "calibrator", None)}
    study = optuna.create_study(
        study_name=study_name, storage=storage, directions=DIRECTIONS,
        sampler=make_sampler(sampler, seed, context), load_if_exists=resume or join,
    )
    if write_through:
        if join and StudyAttrs.of(study).num_candidates is None:
            resume = False  # the first worker of a new study initialises it
        elif join:
            resume = True
        return _run(study, study, cfg, space, backend, screened, n_trials, headroom, resume, progress, enqueue,
                    seed_predicted_front, shared=True)
    persistent = study
    study = optuna.create_study(directions=DIRECTIONS, sampler=study.sampler)
    known = [t for t in persistent.get_trials(deepcopy=False) if t.state.is_finished()] if resume else []
    study.add_trials(known)  # in memory
    flusher = _Flusher(study, persistent, flushed=len(known))
    try:
        outcome = _run(study, persistent, cfg, space, backend, screened, n_trials, headroom, resume, progress,
                       enqueue, seed_predicted_front, after_trial=flusher.flush)
    finally:
        flusher.flush(final=True)
    outcome.study = persistent
    return outcome


class _Flusher:
    """Appends the finished trials of an in-memory study to its persistent one (every FLUSH_EVERY_S,
    and at the end), so a SIGKILLed fast run loses at most the last couple of seconds of work."""

    def __init__(self, study: Study, persistent: Study, flushed: int) -> None:
        self.study, self.persistent = study, persistent
        self.flushed = flushed
        """Trials of ``study`` already in ``persistent`` (its first ones)."""
        self.last_flush = time.monotonic()

    def flush(self, final: bool = False) -> None:
        if not final and time.monotonic() - self.last_flush < FLUSH_EVERY_S:
            return
        trials = self.study.get_trials(deepcopy=False)
        batch = []
        for t in trials[self.flushed:]:
            if not t.state.is_finished():
                if final:
                    continue
                break
            batch.append(t)
        if batch:
            add_trials(self.persistent, batch)
        self.flushed += len(batch)
        self.last_flush = time.monotonic()


FLUSH_EVERY_S = 1.0
"""In-memory (fast backend) studies are appended to storage at least this often."""


def _run(study: Study, persistent: Study, cfg: Config, space: SearchSpace, backend: Backend, screened: list[Screened],
         n_trials: int, headroom: float, resume: bool, progress: Optional[Callable[[int, int], None]],
         enqueue: Optional[list[Strategy]], seed_predicted_front: bool, shared: bool = False,
         after_trial: Optional[Callable[[], None]] = None) -> StudyOutcome:
    """The trial loop on ``study``; study-level attributes go to ``persistent``.

    ``shared``: the study lives in storage that other processes may use at the same time (and a
    killed process may have left RUNNING trials behind): outcomes of other processes' trials are
    read back before every ask, stale trials are failed and re-queued through Optuna's heartbeat,
    and every evaluation is claimed first (``claim.claim``).
    """
    from optuna.trial import TrialState

    # by the Strategy: its equality is key()'s (frozen dataclass, every field compared), its hash 5x cheaper
    by_strategy = {s.strategy: s for s in screened}
    outcome = StudyOutcome(study=study, screened=screened)
    # sampler ehvi re-predicts every candidate before each trial: no front seeding, no re-seeding,
    # and its stopping rule may end the run before n_trials (autotune.samplers.front)
    chooses_front = getattr(study.sampler, "chooses_front", False)
    cache: dict[tuple, _Outcome] = {}  # strategy key -> how its first trial ended
    oom_at: dict[tuple, tuple[int, int]] = {}  # strategy-without-mbs -> (smallest OOM mbs, trial number)
    seen: set[int] = set()  # trial numbers already folded into cache (shared mode)
    heartbeat = shared and heartbeat_on(study)
    if resume:
        _sync(study, space, cfg, seen, cache, oom_at)  # the earlier trials' outcomes
    else:
        _initialise(study, persistent, cfg, space, screened, n_trials, headroom, enqueue,
                    seed_predicted_front and not chooses_front)
    fitting = {s.strategy.key(): s for s in by_strategy.values() if s.memory.fits}
    feasible = set(fitting)
    calibrator = getattr(backend, "calibrator", None)
    evaluations = asks = stalled = 0
    # ask/tell with a heartbeat storage: Optuna warns that heartbeats are meant for optimize(); here
    # the heartbeat thread is started around each evaluation (claim.heartbeat_around), as optimize does.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    outcome.stop_reason = f"the budget of {n_trials} evaluations is spent"
    with StopFlag() as flag:
        while evaluations < n_trials:
            if asks >= MAX_ASKS_PER_EVALUATION * n_trials:
                outcome.stop_reason = (f"{asks} trials asked gave only {evaluations} new evaluations (the sampler "
                                       "keeps proposing evaluated or pruned candidates)")
                break
            if flag.stop:
                outcome.interrupted = True
                outcome.stop_reason = "interrupted"
                break
            if shared:
                if heartbeat:
                    fail_stale(study)
                _sync(study, space, cfg, seen, cache, oom_at)
            if feasible <= cache.keys() and (feasible or (len(by_strategy) <= len(cache)
                                                          and all(s.key() in cache for s in by_strategy))) and not (
                    shared and study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
                # everything that fits has been evaluated (or, when nothing fits, seen). A shared study's WAITING
                # trials are asked first: a retry re-queued by another worker's heartbeat check, a seed nobody
                # asked; each resolves as a repeat of its evaluated candidate, and no trial is left waiting
                outcome.stop_reason = (f"every one of the {len(feasible)} candidates that fit has been evaluated"
                                       if feasible else "no candidate fits")
                break
            trial = None
            try:
                with flag.deferred():  # an abort while the trial is created waits until it is ours to abandon
                    trial = ask(study)
                asks += 1
                done = _one_trial(study, trial, space, cfg, backend, headroom, by_strategy, cache, oom_at, shared,
                                  heartbeat)
            except BaseException as err:  # SIGTERM, an error: the trial in flight is abandoned, then it propagates
                if trial is not None:
                    abandon(study, trial, err)
                raise
            seen.add(trial.number)
            if done is None:
                continue
            strategy, ended = done
            repeat = strategy.key() in cache  # the sampler proposed an evaluated (or pruned) candidate again
            cache.setdefault(strategy.key(), ended)
            if after_trial is not None:
                after_trial()
            stalled = stalled + 1 if repeat else 0
            if stalled >= STALL_ASKS and not chooses_front:
                _enqueue_unevaluated(study, space, cfg, fitting, feasible - cache.keys())
                stalled = 0
            if ended.measured:
                evaluations += 1
                if progress:
                    progress(evaluations, n_trials)
                if chooses_front:
                    stop, assessment = study.sampler.should_stop(study)
                    outcome.confidence = assessment.statement(study.sampler.stop_gain)
                    if stop and evaluations < n_trials:
                        outcome.stopped_early = True
                        outcome.stop_reason = f"the stopping rule ended it ({outcome.confidence})"
                        break
                elif calibrator is not None and calibrator.fitted:
                    _enqueue_recalibrated(study, space, cfg, screened, calibrator.current_params(), cache)
    if outcome.confidence is not None:
        put(persistent, front_confidence=outcome.confidence)
    outcome.evaluated = {k: o.number for k, o in cache.items()}
    outcome.evaluations = evaluations
    return outcome


def _one_trial(study: Study, trial: Trial, space: SearchSpace, cfg: Config, backend: Backend, headroom: float,
               by_strategy: dict, cache: dict, oom_at: dict, shared: bool,
               heartbeat: bool) -> Optional[tuple[Strategy, "_Outcome"]]:
    """Choose the asked trial's strategy, claim it (shared studies) and finish the trial; returns the
    strategy and how it ended. None: another worker's heartbeat check declared this trial stale (our
    heartbeat was late, e.g. on an overloaded machine) and re-queued it; its retry evaluates the
    candidate, so this result is dropped and nothing is cached. Anything else that cuts the trial
    short (SIGTERM, an error) propagates; the loop (``_run``) abandons the trial."""
    from optuna.exceptions import UpdateFinishedTrialError

    try:
        strategy = space.suggest(trial, cfg.model)
        if shared:
            put(trial, strategy_key=key_text(strategy))
            owner = claim(study, trial, strategy, space, cfg, heartbeat)
            if owner is not None:
                cache.setdefault(strategy.key(), _Outcome.of(owner))
        with heartbeat_around(trial, study, heartbeat):
            ended = _evaluate_trial(study, trial, strategy, cfg, backend, headroom, by_strategy, cache, oom_at)
    except UpdateFinishedTrialError:
        return None
    return strategy, ended


def _initialise(study: Study, persistent: Study, cfg: Config, space: SearchSpace, screened: list[Screened],
                n_trials: int, headroom: float, enqueue: Optional[list[Strategy]], seed_front: bool) -> None:
    """A new study: metric names and the attributes outputs read, then the seeds enqueued."""
    with warnings.catch_warnings():  # "experimental" since Optuna 3.2, still the API in 5.0
        warnings.simplefilter("ignore")
        persistent.set_metric_names(METRIC_NAMES)
    put(persistent, space=space.path, headroom=headroom, config=cfg.path)
    # Caller-given seeds (e.g. a nightly baseline's front) come first, then the analytic front:
    # the whole space was screened in well under a second, so the study starts from the
    # predicted-best points and explores from there.
    seeds = list(enqueue or [])
    if seed_front:
        front = [s.strategy for s in predicted_front(screened)]
        seeds += spread(front, max(1, n_trials - len(seeds)) if n_trials else len(front))
    enqueued: list[dict] = []
    for strategy in seeds[:n_trials or len(seeds)]:  # n_trials 0: a worker only initialising
        params = strategy_params(strategy, space, cfg.model)
        if study is persistent:  # in storage other workers may share: Optuna's check against every trial
            study.enqueue_trial(params, skip_if_exists=True)
        elif params not in enqueued:  # a new in-memory study holds only these: the same check, without
            enqueued.append(params)   # Optuna's np.isclose per value and trial (the knobs are discrete)
            study.enqueue_trial(params)
    # Set last: a joining worker treats a study with num_candidates as initialised.
    put(persistent, num_feasible=sum(s.memory.fits for s in screened))
    put(persistent, num_candidates=len(screened))  # last: a study that has it is initialised


def _record_oom(oom_at: dict, strategy: Strategy, number: int) -> None:
    """Remember the smallest micro-batch at which this strategy ran out of memory (trial ``number``)."""
    no_mbs = strategy.replace(micro_batch_size=0).key()
    prev = oom_at.get(no_mbs)
    if prev is None or strategy.micro_batch_size < prev[0]:
        oom_at[no_mbs] = (strategy.micro_batch_size, number)


def _note_oom(t: FrozenTrial, strategy: Strategy, oom_at: dict) -> None:
    if fail_status(t) == "oom":
        _record_oom(oom_at, strategy, t.number)


def _sync(study: Study, space: SearchSpace, cfg: Config, seen: set, cache: dict, oom_at: dict) -> None:
    """Fold outcomes that other processes wrote into the local cache (first trial per key wins)."""
    for t in study.get_trials(deepcopy=False):
        if t.number in seen or not has_result(t):
            continue
        seen.add(t.number)
        if TrialAttrs.of(t).duplicate_of is not None:
            continue
        strategy = trial_strategy(t, space, cfg)
        cache.setdefault(strategy.key(), _Outcome.of(t))
        _note_oom(t, strategy, oom_at)


def _enqueue_unevaluated(study: Study, space: SearchSpace, cfg: Config, by_key: dict, left: set) -> None:
    """Queue the never-evaluated candidate that fits with the highest predicted throughput."""
    if left:
        best = max(left, key=lambda k: (by_key[k].tokens_per_s_per_gpu, str(k)))
        study.enqueue_trial(strategy_params(by_key[best].strategy, space, cfg.model))


def _enqueue_recalibrated(study: Study, space: SearchSpace, cfg: Config, screened: list[Screened],
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
    def of(cls, trial: FrozenTrial) -> "_Outcome":
        attrs = TrialAttrs.of(trial)
        ended = {k: getattr(attrs, k) for k in OUTCOME_KEYS if getattr(attrs, k) is not None}
        return cls(trial.number, trial.state, trial.values, ended, trial.system_attrs.get("constraints:gpu_memory"))


def _evaluate_trial(study: Study, trial: Trial, strategy: Strategy, cfg: Config, backend: Backend, headroom: float,
                    by_strategy: dict, cache: dict, oom_at: dict) -> _Outcome:
    """Finish one asked trial: reuse, prune, or evaluate it; returns how it ended."""
    from optuna.trial import TrialState

    def finish(state: Any, values: Optional[list[float]] = None, measured: bool = False, **attrs: Any) -> _Outcome:
        put(trial, **attrs)
        tell(study, trial, values, state=state)
        return _Outcome(trial.number, state, values, attrs, constraint, measured)

    key = strategy.key()
    if key in cache:
        first: _Outcome = cache[key]
        constraint = first.constraint
        if constraint is not None:
            trial.set_constraint("gpu_memory", constraint)
        put(trial, duplicate_of=first.number)
        return finish(first.state, first.values, **first.attrs)  # measured=False: reused
    screened = by_strategy.get(strategy)
    mem = screened.memory if screened else estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy,
                                                           headroom=headroom)
    capacity = cfg.hardware.gpu.memory_bytes * (1 - headroom)
    constraint = (mem.total_gpu_bytes - capacity) / GIB  # peak + overhead (a screened verdict knows it)
    trial.set_constraint("gpu_memory", constraint)
    if not mem.fits:
        return finish(TrialState.PRUNED, prune_reason="; ".join(mem.reasons) or "does not fit")
    no_mbs = strategy.replace(micro_batch_size=0).key()
    if no_mbs in oom_at and strategy.micro_batch_size >= oom_at[no_mbs][0]:
        mbs, number = oom_at[no_mbs]
        return finish(TrialState.PRUNED, prune_reason=f"out of memory at micro_batch_size {mbs} (trial {number})")
    result: Measurement = backend.evaluate(strategy, trial_number=trial.number)
    put(trial, measurement=_json_safe(result.as_dict()))
    if not result.ok:
        if result.status == "oom":
            _record_oom(oom_at, strategy, trial.number)
        return finish(TrialState.FAIL, measured=True, fail_status=result.status,
                      fail_reason=fail_reason_text(result.status, result.reason))
    return finish(TrialState.COMPLETE, [result.peak_memory_bytes / GIB, result.tokens_per_s_per_gpu], measured=True)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
