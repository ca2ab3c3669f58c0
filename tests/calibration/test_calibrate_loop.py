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
from autotune.backends.base import Measurement
from autotune.calibration.loop import Calibrator, load_calibration
from autotune.simulate import EFFICIENCY_KEYS, efficiency_params, simulate
from autotune.strategy import Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_expert_parallel_trials_correct_expert_parallel_candidates_only(tmp_path):
    """An EP layout is its own memory family: its measured / predicted ratio (the routing factors' bound)
    corrects the unprofiled candidates of the same EP size, not the same engine and precision without EP."""
    from autotune.memory import estimate_memory

    cfg = load_config(os.path.join(ROOT, "examples", "tiny-cpu-moe.yaml"))
    cal = Calibrator(cfg, str(tmp_path))
    pred = lambda s: estimate_memory(cfg.model, cfg.training, cfg.hardware, s).gpu["peak"]  # noqa: E731
    ep = [Strategy(engine="fsdp2", expert_parallel_size=2, micro_batch_size=m) for m in (1, 2, 4)]
    plain = [Strategy(engine="fsdp2", micro_batch_size=m) for m in (1, 2)]
    for s, f in ((ep[0], 0.94), (ep[1], 0.95), (plain[0], 1.0)):
        cal.add(s, Measurement(status="ok", peak_memory_bytes=int(pred(s) * f), tokens_per_s_per_gpu=1000.0))
    assert cal.memory_factor(ep[2]) == pytest.approx(0.945, abs=1e-3)
    assert cal.memory_factor(plain[1]) == pytest.approx(1.0, abs=1e-3)


def test_memory_is_calibrated_per_family(cfg, truth, tmp_path):
    """Measured / predicted peak of a family corrects that family's unprofiled candidates only."""
    from autotune.memory import estimate_memory

    cal = Calibrator(cfg, str(tmp_path))
    pred = lambda s: estimate_memory(cfg.model, cfg.training, cfg.hardware, s).gpu["peak"]  # noqa: E731
    z3 = [Strategy(zero_stage=3, micro_batch_size=m, checkpointing="full") for m in (1, 2, 4)]
    for s, f in zip(z3[:2], (1.10, 1.12)):
        m = measured(cfg, truth, s)
        cal.add(s, Measurement(status="ok", peak_memory_bytes=int(pred(s) * f),
                               tokens_per_s_per_gpu=m.tokens_per_s_per_gpu))
    unprofiled = z3[2]
    assert cal.memory_factor(unprofiled) == pytest.approx(1.11, abs=1e-3)
    assert cal.corrected_peak(unprofiled, pred(unprofiled)) == pytest.approx(1.11 * pred(unprofiled), rel=1e-3)
    other = Strategy(zero_stage=2, micro_batch_size=2, checkpointing="full")  # another family: untouched
    assert cal.memory_factor(other) is None and cal.corrected_peak(other, 5.0) == 5.0
    assert cal.memory_sd(unprofiled) > 0  # the two ratios differ
    # the correction is reported, and the next trial of the family records the corrected prediction
    cal.add(unprofiled, measured(cfg, truth, unprofiled))
    rep = json.loads((tmp_path / "calibration.json").read_text())
    (corr,) = rep["memory_correction"]
    assert (corr["zero_stage"], corr["precision"], corr["n"]) == (3, "bf16", 3)
    assert rep["trials"][2]["corrected_peak_bytes"] == pytest.approx(1.11 * pred(unprofiled), rel=1e-3)


def test_spread_is_recorded_and_noise_is_its_median(cfg, truth, tmp_path):
    from autotune.calibration.loop import throughput_spread

    cal = Calibrator(cfg, str(tmp_path))
    for s, times in zip(STRATEGIES[:3], ([1.0, 1.1, 0.9], [2.0, 2.0, 2.2], [1.0, 1.0, 1.0])):
        m = measured(cfg, truth, s)
        cal.add(s, Measurement(status="ok", peak_memory_bytes=m.peak_memory_bytes,
                               tokens_per_s_per_gpu=m.tokens_per_s_per_gpu, extra={"step_times_s": times}))
    spreads = [c.tokens_spread_pct for c in cal.comparisons]
    assert spreads == pytest.approx([10.0, 5.0, 0.0])
    assert cal.noise() == pytest.approx(0.05)
    assert throughput_spread({"extra": {"tokens_per_s_spread": 0.03}}) == 0.03
    assert throughput_spread(Measurement(status="ok")) is None


def test_incremental_refit_matches_the_full_fit(cfg, truth, tmp_path):
    """Each re-fit takes a few trust-region steps from the last one; after the loop its held-out
    error is as good as a from-scratch multi-start fit's."""
    cal = Calibrator(cfg, None, autosave=False)
    for s in STRATEGIES[:8]:
        cal.add(s, measured(cfg, truth, s))
    assert len(cal.refit_seconds) == 8
    incremental = held_out_error(cfg, truth, cal.current_params())
    cal.refit(full=True)
    assert incremental <= held_out_error(cfg, truth, cal.current_params()) + 0.01
