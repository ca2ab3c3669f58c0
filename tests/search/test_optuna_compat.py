"""The Optuna behaviour autotune._optuna_compat relies on (private attributes and modules).

Each test exercises one promise of the compat module against the installed Optuna, so an upgrade
that moves or changes a private API fails here, with the name of what changed.
"""

import time
import warnings

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from autotune import _optuna_compat as compat
from autotune.storage import UnsyncedJournalFileBackend, make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _sqlite(tmp_path, **kwargs):
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", **kwargs)


def test_storage_and_trial_ids(tmp_path):
    storage = _sqlite(tmp_path)
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    trial.suggest_int("x", 0, 3)
    held = compat.study_storage(study)  # Optuna wraps an RDB storage in its _CachedStorage
    assert held.get_study_id_from_name(study.study_name) == storage.get_study_id_from_name(study.study_name)
    assert held.get_trial(compat.trial_id(trial)).number == trial.number
    frozen = compat.stored_trial(study, trial)
    assert frozen.number == trial.number and frozen.state == TrialState.RUNNING
    assert compat.trial_id(frozen) == compat.trial_id(trial)
    study.tell(trial, 1.0)
    assert compat.stored_trial(study, trial).state == TrialState.COMPLETE  # not the study's stale cache


def test_pop_waiting_trial_claims_the_accepted_one_atomically(tmp_path):
    study = optuna.create_study(storage=_sqlite(tmp_path))
    study.enqueue_trial({"x": 1})
    study.enqueue_trial({"x": 2}, user_attrs={"retry_of": 0})
    study.get_trials()  # fill the study's trial cache: the claim must invalidate it
    got = compat.pop_waiting_trial(study, lambda t: "retry_of" in t.user_attrs)
    assert got is not None and got.params == {} and got.suggest_int("x", 0, 3) == 2
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {0: TrialState.WAITING, 1: TrialState.RUNNING}
    assert compat.pop_waiting_trial(study, lambda t: "retry_of" in t.user_attrs) is None
    nxt = study.ask()  # Optuna's own pop still takes the remaining waiting trial
    assert nxt.number == 0 and nxt.suggest_int("x", 0, 3) == 1


def test_pop_waiting_trial_skips_a_trial_claimed_elsewhere(tmp_path):
    storage = _sqlite(tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    study.enqueue_trial({"x": 1}, user_attrs={"retry_of": 0})
    other = optuna.load_study(study_name="s", storage=storage)
    assert compat.pop_waiting_trial(other, lambda t: True) is not None
    assert compat.pop_waiting_trial(study, lambda t: True) is None


def test_heartbeat_enabled_only_with_an_interval(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        beating = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'a.db'}", heartbeat_interval=1)
    assert compat.heartbeat_enabled(beating)
    assert compat.heartbeat_enabled(compat.study_storage(optuna.create_study(storage=beating)))
    assert not compat.heartbeat_enabled(_sqlite(tmp_path))
    assert not compat.heartbeat_enabled(make_storage(str(tmp_path / "j.journal")))


def test_heartbeat_thread_keeps_a_trial_alive(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'a.db'}", heartbeat_interval=1,
                                             grace_period=2)
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    with compat.heartbeat_thread(trial, study):
        time.sleep(3.5)  # beyond the grace period: only the heartbeat keeps it RUNNING
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optuna.storages.fail_stale_trials(study)
        assert compat.stored_trial(study, trial).state == TrialState.RUNNING
    time.sleep(3.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    assert compat.stored_trial(study, trial).state == TrialState.FAIL


def test_journal_backend_internals_and_file_format(tmp_path):
    path = str(tmp_path / "study.journal")
    backend = UnsyncedJournalFileBackend(path)
    assert compat.journal_file_path(backend) == path
    assert isinstance(compat.journal_lock(backend), compat.BaseJournalFileLock)
    study = optuna.create_study(storage=JournalStorage(backend), study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    plain = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(path)))
    assert [t.params for t in plain.get_trials()] == [t.params for t in study.get_trials()]


@pytest.mark.parametrize("name", ["_storage", "_study_id", "_thread_local"])
def test_study_private_attributes_exist(tmp_path, name):
    study = optuna.create_study(storage=_sqlite(tmp_path))
    assert hasattr(study, name)
    if name == "_thread_local":
        assert hasattr(study._thread_local, "cached_all_trials")


def test_hypervolume_of_a_staircase():
    import numpy as np

    pts = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [2.5, 2.5]])  # the last one is dominated
    # area below (4, 4) not dominated by the points: 3x1 + 2x1 + 1x1 = 6
    assert compat.compute_hypervolume(pts, np.array([4.0, 4.0])) == pytest.approx(6.0)
    assert compat.compute_hypervolume(pts[:3], np.array([4.0, 4.0]), assume_pareto=True) == pytest.approx(6.0)
