"""The replay backend: answers from a trials.csv-shaped table, deterministic, one-line errors."""

from __future__ import annotations

import csv
import json
import dataclasses
import os

import pytest

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.backends.factory import make_backend
from autotune.backends.replay import ReplayBackend
from autotune.strategy import Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = float(1 << 30)
STRATEGY_COLUMNS = ["zero_stage", "offload_optimizer", "offload_params", "micro_batch_size", "checkpointing",
                    "checkpoint_layers", "precision", "reduce_bucket_size", "allgather_bucket_size",
                    "prefetch_bucket_size"]
COLUMNS = ["number", "state", *STRATEGY_COLUMNS, "peak_memory_gib", "tokens_per_s_per_gpu", "step_time_s", "mfu",
           "prune_reason", "fail_reason", "duplicate_of"]


def write_table(path, rows, columns=COLUMNS) -> str:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return str(path)


def row(number, state, s: Strategy, **kw):
    return {"number": number, "state": state, **{k: getattr(s, k) for k in STRATEGY_COLUMNS}, **kw}


A = Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full")
B = Strategy(zero_stage=3, micro_batch_size=8, checkpointing="selective", checkpoint_layers=16,
             offload_optimizer="cpu", reduce_bucket_size=16_777_216)
C = Strategy(zero_stage=1, micro_batch_size=16)
D = Strategy(zero_stage=0, micro_batch_size=1)


@pytest.fixture
def table(tmp_path):
    return write_table(tmp_path / "trials.csv", [
        row(0, "COMPLETE", A, peak_memory_gib=31.5, tokens_per_s_per_gpu=2900.5, step_time_s=11.3, mfu=0.52),
        row(1, "COMPLETE", B, peak_memory_gib=12.25, tokens_per_s_per_gpu=1500.0, step_time_s=21.8),
        row(2, "FAIL", C, fail_reason="oom: rank 3 in backward: OutOfMemoryError: CUDA out of memory"),
        row(3, "PRUNED", D, prune_reason="does not fit"),
        row(4, "COMPLETE", A, peak_memory_gib=99.0, tokens_per_s_per_gpu=1.0, duplicate_of=0),
        row(5, "COMPLETE", A, peak_memory_gib=40.0, tokens_per_s_per_gpu=10.0),  # a repeat: first row wins
    ])


def test_answers_from_the_table(table):
    be = ReplayBackend(table)
    a = be.evaluate(A)
    assert a.status == "ok" and a.peak_memory_bytes == int(31.5 * GIB) and a.tokens_per_s_per_gpu == 2900.5
    assert a.step_time_s == 11.3 and a.mfu == 0.52
    b = be.evaluate(B)
    assert b.ok and b.peak_memory_bytes == int(12.25 * GIB) and b.mfu is None
    c = be.evaluate(C)
    assert (c.status, c.reason) == ("oom", "rank 3 in backward: OutOfMemoryError: CUDA out of memory")
    # pruned rows were never measured; strategies differing in any column do not match
    for s in (D, A.replace(micro_batch_size=8), B.replace(checkpoint_layers=None), B.replace(reduce_bucket_size=None)):
        m = be.evaluate(s)
        assert (m.status, m.reason) == ("error", "not in replay table")
    assert be.calls == 7


def test_deterministic(table):
    answers = [ReplayBackend(table).evaluate(s).as_dict() for s in (A, B, C, D)]
    assert answers == [ReplayBackend(table).evaluate(s).as_dict() for s in (A, B, C, D)]


def test_unknown_fail_reason_is_an_error(tmp_path):
    path = write_table(tmp_path / "t.csv", [row(0, "FAIL", A, fail_reason="weird thing happened")])
    m = ReplayBackend(path).evaluate(A)
    assert (m.status, m.reason) == ("error", "weird thing happened")


def test_the_status_comes_from_the_fail_status_column(tmp_path):
    """Tables with the fail_status column: the status is that cell, whatever the reason text says; the
    reason is the text after the status (as search writes it) or all of it."""
    path = write_table(tmp_path / "t.csv", [
        row(0, "FAIL", A, fail_status="timeout", fail_reason="timeout: no step in 900 s"),
        row(1, "FAIL", B, fail_status="crash", fail_reason="oom: the text is for people"),
        row(2, "FAIL", C, fail_status="", fail_reason="oom: an empty status is an error"),
    ], columns=[*COLUMNS, "fail_status"])
    be = ReplayBackend(path)
    assert (be.evaluate(A).status, be.evaluate(A).reason) == ("timeout", "no step in 900 s")
    assert (be.evaluate(B).status, be.evaluate(B).reason) == ("crash", "oom: the text is for people")
    assert (be.evaluate(C).status, be.evaluate(C).reason) == ("error", "oom: an empty status is an error")


def test_bad_tables_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read replay table"):
        ReplayBackend(str(tmp_path / "nope.csv"))
    cols = [c for c in COLUMNS if c != "micro_batch_size"]
    path = write_table(tmp_path / "a.csv", [], columns=cols)
    with pytest.raises(ConfigError, match="lacks column.*micro_batch_size"):
        ReplayBackend(path)
    path = write_table(tmp_path / "b.csv", [row(0, "COMPLETE", A, peak_memory_gib="lots", tokens_per_s_per_gpu=1)])
    with pytest.raises(ConfigError) as err:
        ReplayBackend(path)
    assert "line 2" in str(err.value) and "\n" not in str(err.value)
    path = write_table(tmp_path / "c.csv", [row(0, "COMPLETE", A)])
    with pytest.raises(ConfigError, match="COMPLETE row without"):
        ReplayBackend(path)


def test_make_backend_replay(table):
    cfg = load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, backend="replay", replay_csv=table))
    be = make_backend("replay", cfg, "/tmp/unused")
    assert be.name == "replay" and be.evaluate(A).tokens_per_s_per_gpu == 2900.5


def test_replays_a_real_trials_csv(tmp_path):
    """A simulate study's trials.csv, replayed, gives back every completed trial exactly."""
    from autotune.output import write_outputs
    from autotune.runfiles import STRATEGY_COLUMNS as OUT_COLUMNS
    from autotune.backends.base import SimulateBackend
    from autotune.search import run_study, trial_strategy
    from autotune.space import load_space

    assert set(OUT_COLUMNS) <= {f.name for f in dataclasses.fields(Strategy)}
    cfg = load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    space = load_space(cfg.search.space, ROOT)
    out = run_study(cfg, space, SimulateBackend(cfg.model, cfg.training, cfg.hardware), storage=None,
                    study_name="s", n_trials=40, seed=0, sampler="nsga2", headroom=cfg.search.headroom)
    write_outputs(str(tmp_path), cfg, space, out.study, "simulate")
    be = ReplayBackend(str(tmp_path / "trials.csv"))
    done = [t for t in out.study.trials if t.state.name == "COMPLETE" and "duplicate_of" not in t.user_attrs]
    assert done
    for t in done:
        m = be.evaluate(trial_strategy(t, space, cfg))
        assert m.ok
        assert m.peak_memory_bytes / GIB == pytest.approx(t.values[0], rel=1e-5)
        assert m.tokens_per_s_per_gpu == pytest.approx(t.values[1], rel=1e-5)


def _tiny_job(tmp_path, rows):
    """A tiny-llama job whose replay table holds ``rows``; the table perturbs the simulator."""
    cfg = load_config(os.path.join(ROOT, "examples", "tiny-cpu.yaml"))
    table = write_table(tmp_path / "measured.csv", rows)
    return dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, backend="replay", replay_csv=table))


def test_replay_runs_the_profiling_loop(tmp_path):
    """--backend replay runs the profile backend's loop: the calibrator sees every answer (failures
    too), re-fits, writes calibration.json; an OOM at a micro-batch prunes the larger ones."""
    from autotune.search import run_study
    from autotune.simulate import simulate

    from autotune.space import load_space

    (tmp_path / "space.yaml").write_text("zero_stage: [0, 1]\nmicro_batch_size: [1, 2, 4, 8]\ncheckpointing: [none]\n")
    cfg = _tiny_job(tmp_path, [])
    space = load_space(str(tmp_path / "space.yaml"), precision=cfg.training.precision)
    rows = []
    for n, s in enumerate(space.candidates(cfg.model)):
        if s.zero_stage == 1 and s.micro_batch_size >= 2:
            rows.append(row(n, "FAIL", s, fail_reason="oom: rank 0 in forward: out of memory"))
            continue
        tps = 0.6 * simulate(cfg.model, cfg.training, cfg.hardware, s).tokens_per_s_per_gpu
        rows.append(row(n, "COMPLETE", s, peak_memory_gib=0.01 * s.micro_batch_size, tokens_per_s_per_gpu=tps))
    cfg = _tiny_job(tmp_path, rows)
    be = make_backend("replay", cfg, str(tmp_path / "run"))
    assert be.calibrator is not None
    first = [Strategy(zero_stage=1, micro_batch_size=m, precision=cfg.training.precision) for m in (2, 8)]
    out = run_study(cfg, space, be, storage=None, study_name="r", n_trials=8, seed=0, sampler="nsga2",
                    headroom=cfg.search.headroom, enqueue=first)
    trials = out.study.get_trials()
    assert out.evaluations == be.calls == len(be.calibrator.comparisons)
    statuses = [c.status for c in be.calibrator.comparisons]
    assert "oom" in statuses and "ok" in statuses and be.calibrator.fitted
    # the fit learnt that this "GPU" is 40% slower than its datasheet
    rep = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert rep["overall"]["tokens_per_s_after_fit"]["median_abs_pct"] < rep["overall"]["tokens_per_s"]["max_abs_pct"]
    pruned = [t for t in trials if "out of memory at micro_batch_size" in t.user_attrs.get("prune_reason", "")]
    assert pruned and all(t.params["micro_batch_size"] > 2 and t.params["zero_stage"] == 1 for t in pruned)
    assert any(t.params["micro_batch_size"] == 8 for t in pruned)  # asked right after the OOM at 2
    assert out.evaluations + len({t.params["micro_batch_size"] for t in pruned}) == 8  # 4 and 8 never run
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert failed and all(t.user_attrs["fail_status"] == "oom" for t in failed)
    assert all(t.user_attrs["fail_reason"] == "oom: rank 0 in forward: out of memory" for t in failed)


def test_replay_passes_the_spread_on(tmp_path):
    cols = COLUMNS + ["tokens_per_s_spread"]
    path = write_table(tmp_path / "s.csv", [row(0, "COMPLETE", A, peak_memory_gib=1.0, tokens_per_s_per_gpu=5.0,
                                                tokens_per_s_spread=0.04)], columns=cols)
    assert ReplayBackend(path).evaluate(A).extra["tokens_per_s_spread"] == 0.04
