"""Storage: SQLite shared by several processes hands each enqueued trial to exactly one of them."""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import optuna

from autotune.storage import make_storage

POP = """
import json, sys, warnings
import optuna
warnings.simplefilter("ignore")
optuna.logging.set_verbosity(optuna.logging.ERROR)
from autotune.storage import make_storage
study = optuna.load_study(study_name="p", storage=make_storage(sys.argv[1], heartbeat=True))
got = []
for _ in range(int(sys.argv[2])):
    trial = study.ask()
    got.append(trial.number)
    study.tell(trial, [0.0])
print(json.dumps(got))
"""


def test_concurrent_ask_never_pops_one_waiting_trial_twice(tmp_path):
    # Without BEGIN IMMEDIATE (storage._serialize_sqlite) two processes both move the same WAITING
    # trial to RUNNING: every one of 6 runs of this exact setup produced duplicates (and a tell on an
    # already finished trial). Here each of 4 processes asks 10 of the 40 enqueued trials.
    url = f"sqlite:///{tmp_path}/p.db"
    study = optuna.create_study(study_name="p", storage=make_storage(url), directions=["minimize"])
    for i in range(40):
        study.enqueue_trial({"x": float(i)})
    procs = [subprocess.Popen([sys.executable, "-c", POP, url, "10"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    numbers = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        numbers += json.loads(out.strip().splitlines()[-1])
    twice = [n for n, c in collections.Counter(numbers).items() if c > 1]
    assert not twice, f"trials handed to two processes: {twice}"
    assert sorted(numbers) == list(range(40))
    states = collections.Counter(t.state.name for t in study.get_trials(deepcopy=False))
    assert states == {"COMPLETE": 40}, states
