"""autotune.storage.add_trials: a journal's trials written with one append, the same lines as one
append per trial; compat.tell stores what study.tell stores."""

import json

import optuna
import pytest
from optuna.trial import TrialState

from autotune import _optuna_compat as compat
from autotune.storage import UnsyncedJournalFileBackend, add_trials, make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def finished_trials(n=30, seed=0):
    study = optuna.create_study(directions=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=seed))
    for k in range(n):
        t = study.ask()
        x = t.suggest_categorical("x", [1, 2, 4, 8])
        t.suggest_int("y", 0, 5)
        t.set_user_attr("measurement", {"k": k, "nested": {"a": [1.5, None]}})
        if k % 3 == 0:
            study.tell(t, state=TrialState.PRUNED)
        else:
            study.tell(t, [float(x), float(k)])
    return study.get_trials(deepcopy=False)


def lines(path):
    out = []
    with open(path) as fh:
        for line in fh:
            d = json.loads(line)
            for k in ("worker_id",):
                d.pop(k, None)
            out.append(d)
    return out


def count_writes(monkeypatch):
    calls = []
    original = UnsyncedJournalFileBackend._write

    def counting(self, data):
        calls.append(data.count(b"\n"))
        return original(self, data)

    monkeypatch.setattr(UnsyncedJournalFileBackend, "_write", counting)
    return calls


def test_batched_add_trials_writes_the_same_lines_once(tmp_path, monkeypatch):
    trials = finished_trials()
    one = optuna.create_study(study_name="s", storage=make_storage(str(tmp_path / "one.journal")),
                              directions=["minimize", "maximize"])
    one.add_trials(trials)  # Optuna's own: one append per trial
    calls = count_writes(monkeypatch)
    batched = optuna.create_study(study_name="s", storage=make_storage(str(tmp_path / "batch.journal")),
                                  directions=["minimize", "maximize"])
    calls.clear()
    add_trials(batched, trials)
    assert calls == [len(trials)]  # one write holding every trial's line
    assert lines(tmp_path / "one.journal") == lines(tmp_path / "batch.journal")
    # the study that wrote them and a fresh reader of the file hold the same trials
    fresh = optuna.load_study(study_name="s", storage=make_storage(str(tmp_path / "batch.journal")))
    for study in (batched, fresh):
        got = study.get_trials(deepcopy=False)
        assert [(t.number, t.state, t.values, t.params, t.user_attrs) for t in got] == \
               [(t.number, t.state, t.values, t.params, t.user_attrs) for t in trials]
    # later writes go after the batch and are read back
    t = batched.ask()
    t.suggest_categorical("x", [1, 2, 4, 8])
    batched.tell(t, [1.0, 2.0])
    fresh = optuna.load_study(study_name="s", storage=make_storage(str(tmp_path / "batch.journal")))
    assert len(fresh.get_trials(deepcopy=False)) == len(trials) + 1 == len(batched.get_trials(deepcopy=False))


def test_reads_inside_a_batch_see_its_trials_and_an_error_still_writes(tmp_path):
    path = str(tmp_path / "s.journal")
    study = optuna.create_study(study_name="s", storage=make_storage(path), directions=["minimize", "maximize"])
    backend = compat.journal_backend(compat.study_storage(study))
    trials = finished_trials(6)
    with pytest.raises(RuntimeError):
        with backend.batched():
            study.add_trials(trials[:3])
            assert len(study.get_trials(deepcopy=False)) == 3  # visible before the write
            study.add_trials(trials[3:])
            raise RuntimeError("interrupted")
    fresh = optuna.load_study(study_name="s", storage=make_storage(path))
    assert [t.number for t in fresh.get_trials(deepcopy=False)] == list(range(6))


def test_batch_after_another_writers_lines(tmp_path):
    """Lines another storage appended before the batch come first, and both readers agree."""
    path = str(tmp_path / "s.journal")
    a = optuna.create_study(study_name="s", storage=make_storage(path), directions=["minimize", "maximize"])
    b = optuna.load_study(study_name="s", storage=make_storage(path))
    trials = finished_trials(8)
    b.add_trials(trials[:4])  # a has not read these yet
    add_trials(a, trials[4:])
    for study in (a, b, optuna.load_study(study_name="s", storage=make_storage(path))):
        got = study.get_trials(deepcopy=False)
        assert [t.number for t in got] == list(range(8))
        assert [t.values for t in got] == [t.values for t in trials]


def test_add_trials_on_other_storages_is_study_add_trials():
    study = optuna.create_study(directions=["minimize", "maximize"])  # in memory
    trials = finished_trials(5)
    add_trials(study, trials)
    assert [t.values for t in study.get_trials(deepcopy=False)] == [t.values for t in trials]


def test_compat_tell_stores_what_study_tell_stores():
    done = []
    for tell in (lambda s, t, v, st: s.tell(t, v, state=st), compat.tell):
        study = optuna.create_study(directions=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=3))
        for k in range(4):
            t = study.ask()
            t.suggest_int("x", 0, 9)
            state = TrialState.PRUNED if k == 1 else (TrialState.FAIL if k == 2 else TrialState.COMPLETE)
            values = [1.0, float(k)] if state == TrialState.COMPLETE else None
            tell(study, t, values, state)
        done.append([(t.state, t.values, t.params) for t in study.get_trials(deepcopy=False)])
    assert done[0] == done[1]
    study = optuna.create_study()
    t = study.ask()
    compat.tell(study, t, 1.0)
    with pytest.raises(ValueError, match="Cannot tell a COMPLETE trial"):  # as study.tell refuses it
        compat.tell(study, t, 2.0)
