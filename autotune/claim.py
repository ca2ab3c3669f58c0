"""Sharing one study between processes (``autotune worker``, write-through runs): each candidate
is evaluated once, and trials lost to a killed process or an interruption are re-run.

Every trial records its strategy key (TrialAttrs.strategy_key) right after ``ask()`` and ``claim`` decides
whether it evaluates the strategy or repeats an earlier trial's; a trial cut short is recorded
as a FAIL without a result and re-queued (``abandon``), re-queued trials are asked first
(``ask``), and trials of dead processes are failed and re-queued by Optuna's heartbeat
(``fail_stale``, ``heartbeat_around``).
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from typing import TYPE_CHECKING, Any, ContextManager, Optional

from autotune._optuna_compat import heartbeat_enabled, heartbeat_thread, pop_waiting_trial, stored_trial, study_storage
from autotune.config import Config
from autotune.space import SearchSpace, trial_strategy
from autotune.strategy import Strategy
from autotune.trial_attrs import TrialAttrs, encode, put

if TYPE_CHECKING:  # optuna is imported where a study is used, not at import
    from optuna import Study
    from optuna.trial import FrozenTrial, Trial

"""User attr set right after ask(): the trial's claim on its strategy (see claim)."""
CLAIM_WAIT_S = 300.0
"""Longest wait for a lower-numbered trial to record its key (without a heartbeat to fail it)."""


def key_text(strategy: Strategy) -> str:
    """Strategy.key as the text stored in TrialAttrs.strategy_key."""
    return json.dumps(list(strategy.key()))


def has_result(t: FrozenTrial) -> bool:
    """Finished with an outcome that repeats may reuse: COMPLETE, PRUNED, or FAIL with a reason from
    the backend. A FAIL without fail_reason is a lost trial (interrupted, or its process died and
    the heartbeat failed it): it is re-run, never reused."""
    from optuna.trial import TrialState

    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return t.state == TrialState.FAIL and TrialAttrs.of(t).fail_reason is not None


def fail_status(t: FrozenTrial) -> str:
    """How a FAIL trial's evaluation ended (a backend Status other than ok), from its ``fail_status``
    attr; "" for other trials and when nothing was measured. Trials stored before that attr existed
    have the same status in their ``measurement`` attr (and so does a trial lost after its
    measurement; has_result tells whether it counts)."""
    from optuna.trial import TrialState

    if t.state != TrialState.FAIL:
        return ""
    attrs = TrialAttrs.of(t)
    return attrs.fail_status or (attrs.measurement or {}).get("status") or ""


def _unkeyed(t: FrozenTrial) -> bool:
    """A running trial that has not recorded its strategy key yet (nor is a repeat)."""
    attrs = TrialAttrs.of(t)
    return attrs.strategy_key is None and attrs.duplicate_of is None


def claim(study: Study, trial: Trial, strategy: Strategy, space: SearchSpace, cfg: Config,
          heartbeat: bool) -> Optional[FrozenTrial]:
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
        pending = [t for t in trials if t.number < me and t.state == TrialState.RUNNING and _unkeyed(t)]
        if pending and (heartbeat or time.monotonic() < deadline):
            if heartbeat:
                fail_stale(study)
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)
            continue
        owners = [t for t in trials if t.number < me and key_of(t, space, cfg) == mine and
                  (t.state == TrialState.RUNNING or has_result(t))]
        if not owners:
            return None
        owner = min(owners, key=lambda t: t.number)
        if has_result(owner):
            # a repeat of a repeat carries the first trial's number
            first = TrialAttrs.of(owner).duplicate_of
            if first is not None:
                origin = [t for t in trials if t.number == first]
                if origin and has_result(origin[0]):
                    return origin[0]
            return owner
        if heartbeat:
            fail_stale(study)
        time.sleep(delay)
        delay = min(0.5, delay * 1.5)


def key_of(t: FrozenTrial, space: SearchSpace, cfg: Config) -> Optional[str]:
    key = TrialAttrs.of(t).strategy_key
    if key is None and t.state.is_finished() and t.params:
        try:
            key = key_text(trial_strategy(t, space, cfg))
        except Exception:  # params from another space: not a claim on ours
            return None
    return key


def abandon(study: Study, trial: Trial, err: BaseException) -> None:
    """The trial in flight is cut short (SIGTERM, second Ctrl-C, an error): record it as FAIL without
    a result (so it is never reused) and, when interrupted, queue its parameters again so that a
    resumed run or another worker re-runs it."""
    from optuna.trial import TrialState

    try:
        frozen = stored_trial(study, trial)
        if frozen.state.is_finished():
            return
        put(trial, interrupted=type(err).__name__)
        study.tell(trial, state=TrialState.FAIL)
        if isinstance(err, KeyboardInterrupt) and frozen.params:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.enqueue_trial(dict(frozen.params), user_attrs=encode(TrialAttrs, retry_of=trial.number))
    except Exception:  # the storage itself is gone: a resumed run's heartbeat check recovers it
        pass


def ask(study: Study) -> Trial:
    """``study.ask()``, except that re-queued trials go first.

    Optuna pops WAITING trials oldest first, so the retry of a lost trial (the heartbeat's
    RetryHeartbeatStaleTrialCallback, or ``abandon`` after an interruption) would wait behind
    every seed enqueued at the start: a resumed run with a small budget could end with the trial
    that was in flight never re-run. A retry is claimed first (_optuna_compat.pop_waiting_trial),
    then ``ask()`` as usual.
    """
    retry = pop_waiting_trial(study, lambda t: "failed_trial" in t.system_attrs or TrialAttrs.of(t).retry_of is not None)
    return retry if retry is not None else study.ask()


def heartbeat_on(study: Study) -> bool:
    """Whether the study's storage records trial heartbeats."""
    return heartbeat_enabled(study_storage(study))


def fail_stale(study: Study) -> None:
    """Optuna's own stale-trial handling: FAIL + RetryHeartbeatStaleTrialCallback re-queues it."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)


def heartbeat_around(trial: Trial, study: Study, enabled: bool) -> ContextManager[Any]:
    """Optuna's heartbeat thread for an ask/tell trial while the block runs (study.optimize starts it
    itself), or nothing when the storage has no heartbeat."""
    return heartbeat_thread(trial, study) if enabled else contextlib.nullcontext()
