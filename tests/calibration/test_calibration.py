"""Calibration: fitting recovers known parameters from synthetic runs; CV runs on real rows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autotune.calibration.fit import MeasuredRun, cross_validate, fit_efficiency, load_llmfoundry_csv, mpt_model, predict
from autotune.presets import gpu_from_name, model_from_name
from autotune.simulate import EFFICIENCY_KEYS, default_efficiency, simulate
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy

CSV = Path(__file__).resolve().parents[2] / "data" / "reference" / "llmfoundry-calibration.csv"


def _synthetic_runs(params: dict) -> list[MeasuredRun]:
    """A varied design (model size, seq len, micro-batch, nodes, ZeRO stage, checkpointing) on one GPU."""
    gpu = gpu_from_name("a100-80gb", efficiency=None)
    runs = []
    designs = [
        ("mpt-125m", 12, 768, 12, 2048, 1, 16, 2, 3, "none"),
        ("mpt-125m", 12, 768, 12, 512, 1, 64, 1, 3, "none"),
        ("mpt-350m", 24, 1024, 16, 8192, 1, 2, 4, 3, "none"),
        ("mpt-1b", 24, 2048, 16, 2048, 1, 8, 2, 3, "none"),
        ("mpt-1b", 24, 2048, 16, 32768, 1, 1, 2, 3, "full"),
        ("mpt-1b", 24, 2048, 16, 2048, 4, 8, 1, 2, "none"),
        ("mpt-3b", 32, 2560, 20, 2048, 8, 4, 1, 3, "none"),
        ("mpt-3b", 32, 2560, 20, 16384, 1, 1, 4, 3, "full"),
        ("mpt-7b", 32, 4096, 32, 2048, 1, 1, 8, 3, "full"),
        ("mpt-7b", 32, 4096, 32, 2048, 16, 8, 1, 3, "full"),
        ("mpt-7b", 32, 4096, 32, 4096, 2, 4, 2, 3, "full"),
        ("mpt-13b", 40, 5120, 40, 2048, 8, 4, 1, 3, "full"),
        ("mpt-13b", 40, 5120, 40, 512, 1, 32, 4, 3, "full"),
        ("mpt-30b", 48, 7168, 56, 2048, 16, 2, 1, 3, "full"),
        ("mpt-30b", 48, 7168, 56, 8192, 1, 1, 8, 3, "full"),
    ]
    for name, L, d, h, S, nodes, mbs, ga, z, ck in designs:
        model = mpt_model(name, L, d, h, 4 * d, 50368, S)
        hw = HardwareSpec(gpu=gpu, gpus_per_node=8, num_nodes=nodes)
        tr = TrainingSpec(seq_len=S, global_batch_size=mbs * ga * hw.num_gpus)
        st = Strategy(zero_stage=z, micro_batch_size=mbs, checkpointing=ck)
        tps = simulate(model, tr, hw, st, params).tokens_per_s_per_gpu
        runs.append(MeasuredRun(model, tr, hw, st, tps, name))
    return runs


def test_fit_recovers_known_parameters_from_synthetic_runs():
    gpu = gpu_from_name("a100-80gb", efficiency=None)
    truth = default_efficiency(gpu)
    truth.update(gemm_eff=0.62, attn_eff=0.22, hbm_eff=0.5, comm_eff=0.45)
    runs = _synthetic_runs(truth)
    fitted = fit_efficiency(runs)  # starts from (and is weakly pulled to) the datasheet defaults
    assert set(EFFICIENCY_KEYS) <= set(fitted)
    # the strongly identified parameters come back; the prior starts visibly elsewhere
    start = default_efficiency(gpu)
    assert abs(start["gemm_eff"] / truth["gemm_eff"] - 1) > 0.15
    assert fitted["gemm_eff"] == pytest.approx(truth["gemm_eff"], rel=0.05)
    assert fitted["attn_eff"] == pytest.approx(truth["attn_eff"], rel=0.1)
    # and the fitted parameters reproduce every synthetic throughput
    for r in runs:
        assert predict(r, fitted) == pytest.approx(r.tokens_per_s_per_gpu, rel=0.02)


def test_fit_rejects_mixed_gpus_and_empty_input():
    runs = _synthetic_runs(default_efficiency(gpu_from_name("a100-80gb")))[:2]
    other = runs[0].hardware.__class__(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8)
    mixed = runs + [MeasuredRun(runs[0].model, runs[0].training, other, runs[0].strategy, 1000.0)]
    with pytest.raises(ValueError):
        fit_efficiency(mixed)
    with pytest.raises(ValueError):
        fit_efficiency([])


def test_mpt_model_matches_published_parameter_formula():
    # L*(12d^2 + 13d) + 2d + V*d + S*d (reference/README.md)
    L, d, V, S = 24, 2048, 50368, 2048
    m = mpt_model("mpt-1b", L, d, 16, 4 * d, V, S)
    assert m.num_parameters == L * (12 * d * d + 13 * d) + 2 * d + V * d + S * d


def test_loader_maps_rows_and_excludes_fp8():
    excluded: list = []
    runs = load_llmfoundry_csv(CSV, excluded=excluded)
    assert len(runs) + len(excluded) == 105
    assert all("fp8" in why for _, why in excluded) and len(excluded) == 3
    stages = {r.strategy.zero_stage for r in runs}
    assert stages == {2, 3}
    assert {r.hardware.gpu.name for r in runs} == {"a100-40gb", "a100-80gb", "h100-80gb"}
    for r in runs:
        assert r.hardware.num_gpus * r.strategy.micro_batch_size <= r.training.global_batch_size
        assert r.strategy.checkpointing in ("none", "full")


def test_cross_validation_runs_on_a_subset_and_returns_finite_errors():
    runs = [r for r in load_llmfoundry_csv(CSV) if r.hardware.gpu.name == "h100-80gb"][:15]
    res = cross_validate(runs, k=3, seed=0)
    assert res["overall"]["n"] == 15 and len(res["rows"]) == 15
    assert math.isfinite(res["overall"]["median"]) and math.isfinite(res["overall"]["p90"])
    assert res["overall"]["median"] <= res["overall"]["p90"] <= res["overall"]["max"]
    assert set(res["per_gpu"]) == {"h100-80gb"}
    # out-of-fold predictions are real predictions, not the measured values echoed back
    assert any(abs(e) > 1e-4 for *_, e in res["rows"])


def test_llama_preset_unchanged_by_calibration_module():
    # importing calibration must not alter the presets it reads
    assert model_from_name("llama2-7b").num_parameters == 6_738_415_616
