"""Every use of Optuna's private API, in one place.

Written against Optuna 5.0. Each function names the private attribute or module it relies on;
tests/search/test_optuna_compat.py exercises exactly the behaviour relied on here, so an Optuna upgrade
that changes it fails there, not in a run.

- ``study._storage``, ``study._study_id``, ``trial._trial_id``: the storage handle and ids behind
  a Study / Trial / FrozenTrial (no public accessor).
- ``pop_waiting_trial``: a re-implementation of ``Study._pop_waiting_trial_id`` (WAITING ->
  RUNNING in storage, atomic; then ``study._thread_local.cached_all_trials`` reset) that lets
  the caller choose which waiting trial to claim.
- ``optuna.storages._heartbeat``: ``is_heartbeat_enabled`` and ``get_heartbeat_thread``, which
  ``study.optimize`` uses and ask/tell loops must start themselves.
- ``optuna.storages.journal._file.BaseJournalFileLock`` and JournalFileBackend's ``_lock`` /
  ``_file_path`` / ``_log_number_offset``: for the journal backend without per-append fsync and
  with batched appends (autotune.storage).
- ``optuna._hypervolume.compute_hypervolume``: the hypervolume the ehvi sampler measures fronts with.
- ``optuna.study._tell._tell_with_warning``: what ``Study.tell`` runs before deep-copying the
  finished trial it returns (``tell``, for loops that do not read that copy).
- ``JournalStorage._backend``: the log backend a journal storage writes through (``journal_backend``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from optuna.storages.journal._file import BaseJournalFileLock  # noqa: F401  (re-exported: autotune.storage)

if TYPE_CHECKING:
    from optuna import Study
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial, Trial, TrialState


def study_storage(study: Study) -> BaseStorage:
    """The storage a study reads and writes (``Study._storage``)."""
    return study._storage


def trial_id(trial: Trial) -> int:
    """The storage id of a Trial or FrozenTrial (``_trial_id``; ``number`` is per study, not per storage)."""
    return trial._trial_id


def stored_trial(study: Study, trial: Trial) -> FrozenTrial:
    """The trial as the storage holds it now (a FrozenTrial), bypassing the study's trial cache."""
    return study._storage.get_trial(trial._trial_id)


def pop_waiting_trial(study: Study, accept: Callable[[FrozenTrial], bool]) -> Optional[Trial]:
    """Claim the oldest WAITING trial for which ``accept(frozen_trial)`` holds, the way
    ``Study._pop_waiting_trial_id`` claims any waiting trial: WAITING -> RUNNING in storage (atomic;
    a trial another process claimed first is skipped), then the study's trial cache is dropped.
    Returns the claimed ``optuna.Trial``, or None when no waiting trial is accepted."""
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage
    for t in storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,)):
        if not accept(t):
            continue
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                study._thread_local.cached_all_trials = None
                return optuna.Trial(study, t._trial_id)
        except UpdateFinishedTrialError:
            continue
    return None


def heartbeat_enabled(storage: BaseStorage) -> bool:
    """Whether ``storage`` records trial heartbeats (an RDB storage opened with heartbeat_interval)."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(storage)


@contextlib.contextmanager
def heartbeat_thread(trial: Trial, study: Study) -> Iterator[None]:
    """Record ``trial``'s heartbeat in the background while the block runs (what ``study.optimize``
    does around each trial; an ask/tell loop has to do it itself)."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    with get_heartbeat_thread(trial._trial_id, study._storage):
        yield


def tell(study: Study, trial: Trial, values: Optional[Sequence[float]] = None,
         state: Optional[TrialState] = None) -> None:
    """``study.tell(trial, values, state=state)`` without its return value, a deep copy of the
    finished trial (user attributes included) that costs more than the tell itself in memory."""
    from optuna.study._tell import _tell_with_warning

    _tell_with_warning(study=study, trial=trial, value_or_values=values, state=state, skip_if_finished=False)


def journal_backend(storage: BaseStorage) -> Optional[Any]:
    """The log backend of a JournalStorage (``_backend``); None for any other storage."""
    from optuna.storages.journal import JournalStorage

    return storage._backend if isinstance(storage, JournalStorage) else None


def journal_file_path(backend: Any) -> str:
    """The file a JournalFileBackend appends to (``_file_path``)."""
    return backend._file_path


def journal_lock(backend: Any) -> Any:
    """The lock object a JournalFileBackend was built with (``_lock``)."""
    return backend._lock


def journal_offsets(backend: Any) -> dict[int, int]:
    """A JournalFileBackend's log number -> byte offset of that log's line, as far as it has read
    (``_log_number_offset``; ``read_logs`` seeks with it and fills it in as it reads)."""
    return backend._log_number_offset


def compute_hypervolume(points: Any, reference: Any, assume_pareto: bool = False) -> float:
    """Hypervolume of minimised ``points`` (n x d array) against ``reference`` (Optuna's own)."""
    from optuna._hypervolume import compute_hypervolume as optuna_hypervolume

    return float(optuna_hypervolume(points, reference, assume_pareto=assume_pareto))
