"""No level is trusted unmeasured (issue 22): each level of each categorical knob has its own offset in
the ehvi sampler's residual model (autotune.samplers._levels), and the stopping rule does not call a front
stable while a level that could reach it was never measured."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

from autotune.samplers import _levels
from autotune.samplers.front import gp_posterior
from autotune.strategy import Strategy, knob_choices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_the_level_prior_is_what_the_measured_tables_show():
    """LEVEL_PRIOR_SD is benchmarks/level_prior.py's figure over data/measured (docs/search.md)."""
    from level_prior import level_errors, prior_sd

    errors = level_errors()
    assert {k for _, k, _ in errors} >= {"zero_stage", "precision", "checkpointing", "engine"}
    assert _levels.LEVEL_PRIOR_SD == pytest.approx(prior_sd(errors), abs=0.005)


def test_levels_are_every_value_of_every_categorical_knob_that_varies():
    # the knobs come from Strategy's Literal fields, so a knob added later gets levels without a list here
    assert set(_levels.CATEGORICAL_KNOBS) == {f.name for f in dataclasses.fields(Strategy)
                                              if f.metadata["search_order"] is not None and knob_choices(f.name)}
    strategies = [Strategy(zero_stage=z, precision=p, micro_batch_size=m) for z in (0, 3) for p in ("bf16", "fp32")
                  for m in (1, 2)] + [Strategy(engine="fsdp2", reshard_after_forward=False)]
    levels, g = _levels.level_matrix(strategies)
    assert ("precision", "fp32") in levels and ("engine", "fsdp2") in levels and ("zero_stage", 3) in levels
    assert not any(k == "checkpointing" for k, _ in levels)  # one value only: no offset
    # the ZeRO stage does not apply to fsdp2 (fixed at 3 there): the FSDP2 candidate has no ZeRO-3 level
    assert g[-1, levels.index(("zero_stage", 3))] == 0 and g[-1, levels.index(("engine", "fsdp2"))] == 1
    assert g[:-1].sum(1).tolist() == [3.0] * 8  # engine, ZeRO stage, precision


def test_a_level_without_data_keeps_its_prior_variance():
    """Residuals of bf16 say nothing about fp32's offset: its predictive variance stays above the prior's."""
    x = np.array([[0.0], [0.5], [1.0], [0.0]])  # the last one: fp32, same features as the first
    g = np.array([[1.0, 0.0]] * 3 + [[0.0, 1.0]])  # levels bf16 / fp32
    y = np.array([0.02, -0.01, 0.0])
    sd = _levels.LEVEL_PRIOR_SD
    _, var, _ = gp_posterior(x[:3], y, x, g=g[:3], gs=g, level_sd=sd)
    assert var[3] > sd * sd and var[0] < 0.5 * sd * sd
    _, flat, _ = gp_posterior(x[:3], y, x)  # the features alone: fp32 looks as known as bf16
    assert flat[3] == pytest.approx(flat[0], rel=0.01)


@pytest.fixture(scope="module")
def misstated(tmp_path_factory):
    """tiny-llama-1rank measured on the CPU, with a job file that says fp32 is 2x slower than bf16
    (measured, it is several times faster): the simulator is wrong for the level precision=fp32."""
    from level_tables import level_tables

    (label, folder), = level_tables(os.path.join(ROOT, "data", "measured", "tiny-llama-1rank"), "level-precision",
                                    str(tmp_path_factory.mktemp("levels")))
    return folder


def test_a_mispredicted_level_is_measured_and_never_called_stable_unmeasured(misstated):
    from search_cost import load_measured

    from autotune.pareto import hypervolume
    from autotune.calibration.loop import Calibrator
    from autotune.backends.replay import ReplayBackend
    from autotune.search import run_study, trial_strategy

    cfg, space, table, rows = load_measured(misstated)
    assert cfg.hardware.gpu.peak_tflops_fp32 == cfg.hardware.gpu.peak_tflops_bf16 / 2
    out = run_study(cfg, space, ReplayBackend(table, cfg, calibrator=Calibrator(cfg, None, autosave=False)),
                    storage=None, study_name="m", n_trials=len(rows), seed=0, sampler="ehvi",
                    headroom=cfg.search.headroom, seed_predicted_front=False)
    done = [trial_strategy(t, space, cfg) for t in out.study.get_trials()
            if t.state.name in ("COMPLETE", "FAIL") and "duplicate_of" not in t.user_attrs]
    history = out.study.sampler.history
    assert out.stopped_early and len(history) == len(done)
    assert any(s.precision == "fp32" for s in done), "fp32 never measured"
    first = next(k for k, s in enumerate(done) if s.precision == "fp32")
    for a in history[:first]:  # before fp32 was measured: never stable, and fp32 named
        assert "precision=fp32" in a.unmeasured and not a.stable(out.study.sampler.stop_gain)
        said = a.statement(out.study.sampler.stop_gain)
        assert said.startswith("front not stable: ") and "precision=fp32" in said.split("never measured")[0]
    # the whole true front is fp32 here; where it stops, the front holds 95% of the true hypervolume
    ref = (cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom) / 2**30, 0.0)
    got = [(t.values[0], t.values[1]) for t in out.study.get_trials() if t.state.name == "COMPLETE"]
    assert hypervolume(got, ref) >= 0.95 * hypervolume([(m, t) for _, m, t, _ in rows], ref)
    assert out.confidence.startswith("front stable")
