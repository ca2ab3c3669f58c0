"""Several `autotune worker` processes on one shared study: each candidate evaluated once, no trial
lost, and the same front as one worker. SQLite here; PostgreSQL in test_postgres.py."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import optuna
import pytest

from autotune.storage import make_storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPACE = "zero_stage: [0, 1, 2, 3]\nmicro_batch_size: [1, 2, 4]\ncheckpointing: [none, full]\n"


def job(tmp_path) -> str:
    (tmp_path / "space.yaml").write_text(SPACE)
    text = open(os.path.join(ROOT, "examples", "llama2-7b.yaml")).read()
    path = tmp_path / "job.yaml"
    path.write_text(text.replace("space: default", "space: space.yaml").replace("trials: 200", "trials: 100"))
    return str(path)


def worker(url: str, study: str, *extra: str, env: dict | None = None, out: str = "/tmp") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autotune", "worker", "--storage", url, "--study", study,
                             "--out", out, "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, **(env or {})})


def run_workers(url: str, study: str, config: str, n: int, tmp_path, delay: str = "0.2") -> list[dict]:
    create = worker(url, study, "--config", config, "--create", "--trials", "0", out=str(tmp_path))
    assert create.wait(120) == 0, create.stderr.read()
    env = {"AUTOTUNE_SLOW_BACKEND_S": delay, "AUTOTUNE_HEARTBEAT_S": "5"}
    procs = [worker(url, study, "--trials", "100", env=env, out=str(tmp_path)) for _ in range(n)]
    summaries = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    return summaries


def check_study(url: str, study: str) -> tuple[set, int]:
    """Each candidate evaluated once, nothing left running; returns (front strategies, evaluations)."""
    st = optuna.load_study(study_name=study, storage=make_storage(url))
    trials = st.get_trials(deepcopy=False)
    states = collections.Counter(t.state.name for t in trials)
    assert states["RUNNING"] == 0 and states["WAITING"] == 0, states
    evaluated = [t for t in trials if t.state.name in ("COMPLETE", "FAIL") and "duplicate_of" not in t.user_attrs]
    keys = collections.Counter(t.user_attrs["strategy_key"] for t in evaluated)
    assert all(v == 1 for v in keys.values()), [k for k, v in keys.items() if v > 1]
    for t in trials:  # repeats reuse the first result
        if "duplicate_of" in t.user_attrs:
            first = st.trials[t.user_attrs["duplicate_of"]]
            assert first.user_attrs["strategy_key"] == t.user_attrs["strategy_key"]
            assert (t.state, t.values) == (first.state, first.values)
    assert st.user_attrs["num_feasible"] == len(evaluated)  # every candidate that fits, once
    front = {t.user_attrs["strategy_key"] for t in st.best_trials}
    return front, len(evaluated)


@pytest.mark.slow
def test_four_workers_sqlite_same_front_as_one(tmp_path):
    config = job(tmp_path)
    url4 = f"sqlite:///{tmp_path}/four.db"
    summaries = run_workers(url4, "s", config, 4, tmp_path)
    front4, n4 = check_study(url4, "s")
    assert sum(s["evaluations"] for s in summaries) == n4
    assert sum(1 for s in summaries if s["evaluations"] > 0) >= 2  # they really shared the work
    url1 = f"sqlite:///{tmp_path}/one.db"
    run_workers(url1, "s", config, 1, tmp_path, delay="0.01")
    front1, n1 = check_study(url1, "s")
    assert front4 == front1 and n4 == n1


@pytest.mark.slow
def test_a_waiting_trial_is_asked_before_the_worker_stops(tmp_path):
    """A WAITING trial left in a shared study once every candidate is evaluated (a retry another worker's
    heartbeat check re-queued on an overloaded machine, a seed nobody asked) is asked before a worker
    stops: it resolves as a repeat of its evaluated candidate, and no trial is left waiting."""
    config = job(tmp_path)
    url = f"sqlite:///{tmp_path}/w.db"
    run_workers(url, "s", config, 1, tmp_path, delay="0.01")
    st = optuna.load_study(study_name="s", storage=make_storage(url))
    done = next(t for t in st.get_trials(deepcopy=False) if t.state.name == "COMPLETE")
    st.enqueue_trial(done.params)
    w = worker(url, "s", "--trials", "100", out=str(tmp_path))
    out, err = w.communicate(timeout=300)
    assert w.returncode == 0, err[-3000:]
    check_study(url, "s")  # nothing RUNNING or WAITING, each candidate evaluated once


@pytest.mark.slow
def test_worker_joins_a_run_study_and_errors_are_one_line(tmp_path):
    config = job(tmp_path)
    url = f"sqlite:///{tmp_path}/run.db"
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", config, "--storage", url, "--name", "j",
                           "--out", str(tmp_path), "--trials", "3", "--json"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "AUTOTUNE_SLOW_BACKEND_S": "0.01"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    w = worker(url, "j", "--trials", "100", out=str(tmp_path))  # config path recorded in the study
    out, err = w.communicate(timeout=300)
    assert w.returncode == 0, err[-3000:]
    check_study(url, "j")
    for args in (["--storage", url, "--study", "nope"], ["--storage", str(tmp_path / "x.journal"), "--study", "j"],
                 ["--storage", "postgresql://nobody@127.0.0.1:1/x", "--study", "j", "--config", config]):
        p = subprocess.run([sys.executable, "-m", "autotune", "worker", *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
