"""The calibration loop: out-of-sample errors, re-fitting on measured trials, calibration.json reuse.

The "measurements" are produced by the simulator itself with efficiency parameters different from
the preset's (a GPU that behaves unlike its datasheet), so the truth is known and the loop must
move its predictions towards it.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.profile.backend import Measurement
from autotune.profile.calibrate import Calibrator, load_calibration
from autotune.simulate import EFFICIENCY_KEYS, efficiency_params, simulate
from autotune.strategy import Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cfg():
    return load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))


@pytest.fixture(scope="module")
def truth(cfg):
    p = efficiency_params(cfg.hardware.gpu)[0]
    p.update(gemm_eff=p["gemm_eff"] * 0.7, attn_eff=p["attn_eff"] * 0.6, layer_overhead_s=p["layer_overhead_s"] * 3)
    return p


STRATEGIES = [Strategy(zero_stage=z, micro_batch_size=m, checkpointing=c)
              for z, m, c in [(1, 1, "full"), (2, 2, "full"), (3, 4, "selective"), (3, 1, "none"), (2, 8, "full"),
                              (1, 2, "selective"), (3, 8, "full"), (2, 1, "none"),
                              # held out:
                              (3, 2, "full"), (1, 4, "full"), (2, 4, "selective"), (3, 1, "full")]]


def measured(cfg, truth, s: Strategy) -> Measurement:
    sim = simulate(cfg.model, cfg.training, cfg.hardware, s, truth)
    return Measurement(status="ok", peak_memory_bytes=10 << 30, tokens_per_s_per_gpu=sim.tokens_per_s_per_gpu,
                       step_time_s=sim.step_time_s)


def held_out_error(cfg, truth, params) -> float:
    errs = [abs(simulate(cfg.model, cfg.training, cfg.hardware, s, params).tokens_per_s_per_gpu
                / simulate(cfg.model, cfg.training, cfg.hardware, s, truth).tokens_per_s_per_gpu - 1)
            for s in STRATEGIES[8:]]
    return statistics.median(errs)


def test_refit_moves_predictions_towards_measurements(cfg, truth, tmp_path):
    cal = Calibrator(cfg, str(tmp_path))
    before = held_out_error(cfg, truth, cal.current_params())
    assert before > 0.15  # the preset really is off for this "GPU"
    for s in STRATEGIES[:8]:
        cal.add(s, measured(cfg, truth, s))
    assert cal.fitted
    after = held_out_error(cfg, truth, cal.current_params())
    assert after < before / 3, (before, after)
    rep = cal.report()
    # errors are recorded out-of-sample: the first trial was predicted with the initial parameters
    first = rep["trials"][0]
    pred0 = simulate(cfg.model, cfg.training, cfg.hardware, STRATEGIES[0], cal.initial).tokens_per_s_per_gpu
    assert first["predicted_tokens_per_s_per_gpu"] == pytest.approx(pred0)
    assert first["tokens_error_pct"] == pytest.approx(100 * (pred0 / first["measured_tokens_per_s_per_gpu"] - 1),
                                                      abs=1e-3)
    assert rep["overall"]["tokens_per_s"]["n"] == 8
    assert rep["overall"]["tokens_per_s_after_fit"]["median_abs_pct"] < rep["overall"]["tokens_per_s"]["median_abs_pct"]


def test_failed_trials_are_reported_not_fitted(cfg, truth, tmp_path):
    cal = Calibrator(cfg, str(tmp_path))
    cal.add(STRATEGIES[0], Measurement(status="oom", reason="rank 0 in backward: OutOfMemoryError"))
    assert not cal.fitted and cal.current_params() == efficiency_params(cfg.hardware.gpu)[0]
    cal.add(STRATEGIES[1], measured(cfg, truth, STRATEGIES[1]))
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert data["num_measured"] == 1 and [t["status"] for t in data["trials"]] == ["oom", "ok"]
    assert data["trials"][0]["tokens_error_pct"] is None


def test_saved_calibration_is_reused(cfg, truth, tmp_path):
    cal = Calibrator(cfg, str(tmp_path / "run1"))
    for s in STRATEGIES[:8]:
        cal.add(s, measured(cfg, truth, s))
    params = load_calibration(str(tmp_path / "run1"), gpu_name=cfg.hardware.gpu.name)
    assert set(params) == set(EFFICIENCY_KEYS)
    assert params == pytest.approx(cal.current_params())
    # a later run on the same hardware starts from the fitted parameters
    again = Calibrator(cfg, str(tmp_path / "run2"), initial=params)
    assert held_out_error(cfg, truth, again.current_params()) < held_out_error(
        cfg, truth, efficiency_params(cfg.hardware.gpu)[0]) / 3


def test_load_calibration_errors(tmp_path, cfg, truth):
    with pytest.raises(ConfigError, match="no calibration.json"):
        load_calibration(str(tmp_path))
    bad = tmp_path / "calibration.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_calibration(str(tmp_path))
    bad.write_text(json.dumps({"gpu": "a100-80gb", "params": {"gemm_eff": -1}}))
    with pytest.raises(ConfigError, match="no valid params"):
        load_calibration(str(tmp_path))
    cal = Calibrator(cfg, str(tmp_path))
    cal.add(STRATEGIES[0], measured(cfg, truth, STRATEGIES[0]))
    with pytest.raises(ConfigError) as err:
        load_calibration(str(tmp_path), gpu_name="h100-80gb")
    assert "\n" not in str(err.value) and "fitted on" in str(err.value)
