"""The Optuna search: screen the space analytically, then run a multi-objective study.

Objectives: minimise peak GPU memory (GiB), maximise tokens/s per GPU. Every candidate is first
checked by the memory model; infeasible ones are recorded as PRUNED with their reason (user attr
``prune_reason``) and constraint values (``trial.set_constraint``), and never evaluated. Repeats of
an already evaluated strategy reuse its result (user attr ``duplicate_of``).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
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


def spread(points: list, k: int) -> list:
    """At most ``k`` of ``points`` (a front, memory ascending), evenly spaced and always including
    both ends: a budget smaller than the predicted front still covers low memory and top speed."""
    if k >= len(points):
        return list(points)
    if k == 1:
        return [points[-1]]
    return [points[round(i * (len(points) - 1) / (k - 1))] for i in range(k)]


def make_sampler(name: str, seed: int, context: Optional[dict] = None) -> Any:
    """NSGA-II by default: the space is small, discrete and categorical, the problem is bi-objective
    with constraints, and NSGA-II handles all three at ~0.4 ms/trial (TPE ~5 ms, GP needs scipy and is
    built for continuous spaces; per-trial costs measured with Optuna 5.0 on a 2-core machine).

    ``ehvi``: autotune.sampler.FrontSampler (calibrated simulator + residual GP, expected hypervolume
    improvement), built from ``context`` (cfg, space, screened, headroom, calibrator)."""
    import optuna

    if name == "ehvi":
        from autotune.sampler import FrontSampler

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
    return optuna.samplers.RandomSampler(seed=seed)


@dataclass
class StudyOutcome:
    """What run_study returns: the study and the bookkeeping the outputs need."""

    study: Any
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (or a second SIGINT) while a trial runs: abort it, persist the study, exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopFlag:
    """First SIGINT: finish the current trial, then stop. Second SIGINT or SIGTERM: stop now
    (raise Terminated; the trial in flight is recorded as interrupted and re-queued, the study is
    persisted, the backend's launch is killed by its own cleanup)."""

    def __init__(self) -> None:
        self.stop = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop or signum == signal.SIGTERM:
            raise Terminated(signum)
        self.stop = True
        print("\nautotune: stopping after the current trial (Ctrl-C again to abort it)", file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


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
    studies always use the claim protocol of ``_claim`` so that each candidate is evaluated once.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    screened = screen(cfg, space, headroom, params)
    if sampler == "auto":  # measurements cost GPU time: choose them by expected improvement
        sampler = "ehvi" if getattr(backend, "name", "") in ("deepspeed", "replay") else "nsga2"
    context = {"cfg": cfg, "space": space, "screened": screened, "headroom": headroom,
               "calibrator": getattr(backend, "calibrator", None)}
    study = optuna.create_study(
        study_name=study_name, storage=storage, directions=DIRECTIONS,
        sampler=make_sampler(sampler, seed, context), load_if_exists=resume or join,
    )
    if write_through:
        if join and "num_candidates" not in study.user_attrs:
            resume = False  # the first worker of a new study initialises it
        elif join:
            resume = True
        return _run(study, study, cfg, space, backend, screened, n_trials, headroom, resume, progress, enqueue,
                    seed_predicted_front, shared=True)
    persistent = study
    study = optuna.create_study(directions=DIRECTIONS, sampler=study.sampler)
    known = [t for t in persistent.get_trials(deepcopy=False) if t.state.is_finished()] if resume else []
    study.add_trials(known)
    flushed = len(known)
    last_flush = time.monotonic()

    def flush(final: bool = False) -> None:
        """Append the finished in-memory trials to ``persistent`` (every FLUSH_EVERY_S, and at the end),
        so a SIGKILLed fast run loses at most the last couple of seconds of work."""
        nonlocal flushed, last_flush
        if not final and time.monotonic() - last_flush < FLUSH_EVERY_S:
            return
        trials = study.get_trials(deepcopy=False)
        batch = []
        for t in trials[flushed:]:
            if not t.state.is_finished():
                if final:
                    continue
                break
            batch.append(t)
        if batch:
            persistent.add_trials(batch)
        flushed += len(batch)
        last_flush = time.monotonic()

    try:
        outcome = _run(study, persistent, cfg, space, backend, screened, n_trials, headroom, resume, progress,
                       enqueue, seed_predicted_front, after_trial=flush)
    finally:
        flush(final=True)
    outcome.study = persistent
    return outcome


FLUSH_EVERY_S = 1.0
"""In-memory (fast backend) studies are appended to storage at least this often."""


def _run(study: Any, persistent: Any, cfg: Config, space: SearchSpace, backend: Backend, screened: list[Screened],
         n_trials: int, headroom: float, resume: bool, progress: Optional[Callable[[int, int], None]],
         enqueue: Optional[list[Strategy]], seed_predicted_front: bool, shared: bool = False,
         after_trial: Optional[Callable[[], None]] = None) -> StudyOutcome:
    """The trial loop on ``study``; study-level attributes go to ``persistent``.

    ``shared``: the study lives in storage that other processes may use at the same time (and a
    killed process may have left RUNNING trials behind): outcomes of other processes' trials are
    read back before every ask, stale trials are failed and re-queued through Optuna's heartbeat,
    and every evaluation is claimed first (``_claim``).
    """
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    by_key = {s.strategy.key(): s for s in screened}
    outcome = StudyOutcome(study=study, screened=screened)
    # sampler ehvi re-predicts every candidate before each trial: no front seeding, no re-seeding,
    # and its stopping rule may end the run before n_trials (autotune.sampler)
    chooses_front = getattr(study.sampler, "chooses_front", False)
    cache: dict[tuple, _Outcome] = {}  # strategy key -> how its first trial ended
    oom_at: dict[tuple, tuple[int, int]] = {}  # strategy-without-mbs -> (smallest OOM mbs, trial number)
    seen: set[int] = set()  # trial numbers already folded into cache (shared mode)
    heartbeat = shared and _heartbeat_enabled(study)
    if resume:
        _sync(study, space, cfg, seen, cache, oom_at)  # the earlier trials' outcomes
    else:
        with warnings.catch_warnings():  # "experimental" since Optuna 3.2, still the API in 5.0
            warnings.simplefilter("ignore")
            persistent.set_metric_names(METRIC_NAMES)
        persistent.set_user_attr("space", space.path)
        persistent.set_user_attr("headroom", headroom)
        persistent.set_user_attr("config", cfg.path)
        # Caller-given seeds (e.g. a nightly baseline's front) come first, then the analytic front:
        # the whole space was screened in well under a second, so the study starts from the
        # predicted-best points and explores from there.
        seeds = list(enqueue or [])
        if seed_predicted_front and not chooses_front:
            front = [s.strategy for s in predicted_front(screened)]
            seeds += spread(front, max(1, n_trials - len(seeds)) if n_trials else len(front))
        for strategy in seeds[:n_trials or len(seeds)]:  # n_trials 0: a worker only initialising
            study.enqueue_trial(strategy_params(strategy, space, cfg.model), skip_if_exists=True)
        # Set last: a joining worker treats a study with num_candidates as initialised.
        persistent.set_user_attr("num_feasible", sum(s.memory.fits for s in screened))
        persistent.set_user_attr("num_candidates", len(screened))
    feasible = {k for k, s in by_key.items() if s.memory.fits}
    calibrator = getattr(backend, "calibrator", None)
    evaluations = asks = 0
    # ask/tell with a heartbeat storage: Optuna warns that heartbeats are meant for optimize(); here
    # the heartbeat thread is started around each evaluation (_heartbeat_thread), as optimize does.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    with _StopFlag() as flag:
        while evaluations < n_trials and asks < MAX_ASKS_PER_EVALUATION * n_trials:
            if flag.stop:
                outcome.interrupted = True
                break
            if shared:
                if heartbeat:
                    _fail_stale(study)
                _sync(study, space, cfg, seen, cache, oom_at)
            if feasible <= cache.keys() and (feasible or by_key.keys() <= cache.keys()):
                break  # everything that fits has been evaluated (or, when nothing fits, seen)
            trial = _ask(study)
            asks += 1
            try:
                strategy = space.suggest(trial, cfg.model)
                if shared:
                    trial.set_user_attr(KEY_ATTR, key_text(strategy))
                    owner = _claim(study, trial, strategy, space, cfg, heartbeat)
                    if owner is not None:
                        cache.setdefault(strategy.key(), _Outcome.of(owner))
                with _heartbeat_thread(trial, study, heartbeat):
                    ended = _evaluate_trial(study, trial, strategy, cfg, backend, headroom, by_key, cache, oom_at)
            except UpdateFinishedTrialError:
                # Another worker's heartbeat check declared this trial stale (our heartbeat was late,
                # e.g. on an overloaded machine) and re-queued it: its retry evaluates the candidate,
                # so this result is dropped and nothing is cached for the strategy.
                seen.add(trial.number)
                continue
            except BaseException as err:
                _abandon(study, trial, err)
                raise
            cache.setdefault(strategy.key(), ended)
            seen.add(trial.number)
            if after_trial is not None:
                after_trial()
            if ended.measured:
                evaluations += 1
                if progress:
                    progress(evaluations, n_trials)
                if chooses_front:
                    stop, assessment = study.sampler.should_stop(study)
                    outcome.confidence = assessment.statement(study.sampler.stop_gain)
                    if stop and evaluations < n_trials:
                        outcome.stopped_early = True
                        break
                elif calibrator is not None and calibrator.fitted:
                    _enqueue_recalibrated(study, space, cfg, screened, calibrator.current_params(), cache)
    if outcome.confidence is not None:
        persistent.set_user_attr("front_confidence", outcome.confidence)
    outcome.evaluated = {k: o.number for k, o in cache.items()}
    outcome.evaluations = evaluations
    return outcome


KEY_ATTR = "strategy_key"
"""User attr set right after ask(): the trial's claim on its strategy (see _claim)."""
CLAIM_WAIT_S = 300.0
"""Longest wait for a lower-numbered trial to record its key (without a heartbeat to fail it)."""


def key_text(strategy: Strategy) -> str:
    return json.dumps(list(strategy.key()))


def _has_result(t: Any) -> bool:
    """Finished with an outcome that repeats may reuse: COMPLETE, PRUNED, or FAIL with a reason from
    the backend. A FAIL without fail_reason is a lost trial (interrupted, or its process died and
    the heartbeat failed it): it is re-run, never reused."""
    from optuna.trial import TrialState

    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return t.state == TrialState.FAIL and "fail_reason" in t.user_attrs


def _record_oom(oom_at: dict, strategy: Strategy, number: int) -> None:
    """Remember the smallest micro-batch at which this strategy ran out of memory (trial ``number``)."""
    no_mbs = strategy.replace(micro_batch_size=0).key()
    prev = oom_at.get(no_mbs)
    if prev is None or strategy.micro_batch_size < prev[0]:
        oom_at[no_mbs] = (strategy.micro_batch_size, number)


def _note_oom(t: Any, strategy: Strategy, oom_at: dict) -> None:
    if t.user_attrs.get("fail_reason", "").startswith("oom"):
        _record_oom(oom_at, strategy, t.number)


def _sync(study: Any, space: SearchSpace, cfg: Config, seen: set, cache: dict, oom_at: dict) -> None:
    """Fold outcomes that other processes wrote into the local cache (first trial per key wins)."""
    for t in study.get_trials(deepcopy=False):
        if t.number in seen or not _has_result(t):
            continue
        seen.add(t.number)
        if "duplicate_of" in t.user_attrs:
            continue
        strategy = trial_strategy(t, space, cfg)
        cache.setdefault(strategy.key(), _Outcome.of(t))
        _note_oom(t, strategy, oom_at)


def _claim(study: Any, trial: Any, strategy: Strategy, space: SearchSpace, cfg: Config,
           heartbeat: bool) -> Optional[Any]:
    """Decide whether this trial evaluates its strategy or repeats an earlier trial's.

    The protocol (race-free because the storage assigns trial numbers atomically): every trial
    records its strategy key right after ask(). A trial first waits until every lower-numbered
    RUNNING trial has recorded its key. The owner of a key is the lowest-numbered trial with that
    key that is running or has a result (lost trials, FAIL without a reason, do not count). If the
    owner is this trial, it evaluates; otherwise it waits for the owner to finish and returns the
    owner's FrozenTrial (a lost owner hands the key on: the claim is re-decided).
    """
    from optuna.trial import TrialState

    me = trial.number
    mine = key_text(strategy)
    deadline = time.monotonic() + CLAIM_WAIT_S
    delay = 0.02
    while True:
        trials = study.get_trials(deepcopy=False)
        pending = [t for t in trials if t.number < me and t.state == TrialState.RUNNING and KEY_ATTR not in
                   t.user_attrs and "duplicate_of" not in t.user_attrs]
        if pending and (heartbeat or time.monotonic() < deadline):
            if heartbeat:
                _fail_stale(study)
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)
            continue
        owners = [t for t in trials if t.number < me and _key_of(t, space, cfg) == mine and
                  (t.state == TrialState.RUNNING or _has_result(t))]
        if not owners:
            return None
        owner = min(owners, key=lambda t: t.number)
        if _has_result(owner):
            # a repeat of a repeat carries the first trial's number
            first = owner.user_attrs.get("duplicate_of")
            if first is not None:
                origin = [t for t in trials if t.number == first]
                if origin and _has_result(origin[0]):
                    return origin[0]
            return owner
        if heartbeat:
            _fail_stale(study)
        time.sleep(delay)
        delay = min(0.5, delay * 1.5)


def _key_of(t: Any, space: SearchSpace, cfg: Config) -> Optional[str]:
    key = t.user_attrs.get(KEY_ATTR)
    if key is None and t.state.is_finished() and t.params:
        try:
            key = key_text(trial_strategy(t, space, cfg))
        except Exception:  # params from another space: not a claim on ours
            return None
    return key


def _abandon(study: Any, trial: Any, err: BaseException) -> None:
    """The trial in flight is cut short (SIGTERM, second Ctrl-C, an error): record it as FAIL without
    a result (so it is never reused) and, when interrupted, queue its parameters again so that a
    resumed run or another worker re-runs it."""
    from optuna.trial import TrialState

    try:
        frozen = study._storage.get_trial(trial._trial_id)
        if frozen.state.is_finished():
            return
        trial.set_user_attr("interrupted", type(err).__name__)
        study.tell(trial, state=TrialState.FAIL)
        if isinstance(err, KeyboardInterrupt) and frozen.params:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.enqueue_trial(dict(frozen.params), user_attrs={"retry_of": trial.number})
    except Exception:  # the storage itself is gone: a resumed run's heartbeat check recovers it
        pass


def _ask(study: Any) -> Any:
    """``study.ask()``, except that re-queued trials go first.

    Optuna pops WAITING trials oldest first, so the retry of a lost trial (the heartbeat's
    RetryHeartbeatStaleTrialCallback, or ``_abandon`` after an interruption) would wait behind
    every seed enqueued at the start: a resumed run with a small budget could end with the trial
    that was in flight never re-run. This claims a retry the way ``Study._pop_waiting_trial_id``
    claims any waiting trial (WAITING -> RUNNING in storage, atomic) and falls back to ``ask()``.
    """
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage
    for t in storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,)):
        if "failed_trial" not in t.system_attrs and "retry_of" not in t.user_attrs:
            continue
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                study._thread_local.cached_all_trials = None
                return optuna.Trial(study, t._trial_id)
        except UpdateFinishedTrialError:
            continue
    return study.ask()


def _heartbeat_enabled(study: Any) -> bool:
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(study._storage)


def _fail_stale(study: Any) -> None:
    """Optuna's own stale-trial handling: FAIL + RetryHeartbeatStaleTrialCallback re-queues it."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)


class _heartbeat_thread:
    """Optuna's heartbeat thread for an ask/tell trial (study.optimize starts it itself)."""

    def __init__(self, trial: Any, study: Any, enabled: bool) -> None:
        self._thread = None
        if enabled:
            from optuna.storages._heartbeat import get_heartbeat_thread

            self._thread = get_heartbeat_thread(trial._trial_id, study._storage)

    def __enter__(self) -> None:
        if self._thread is not None:
            self._thread.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._thread.__exit__(*exc)


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
            _record_oom(oom_at, strategy, trial.number)
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
