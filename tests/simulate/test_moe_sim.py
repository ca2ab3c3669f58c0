"""Mixture-of-experts in the simulator (autotune.simulate_moe): active parameters and MFU on them,
the grouped GEMM's rows per expert, the expert-parallel all-to-all volume, the rules of
expert_parallel_size, and dense jobs untouched."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from autotune.config import hf_config_fields
from autotune.presets import gpu_from_name, model_from_name
from autotune.simulate import Simulator, simulate
from autotune.simulate_moe import (active_params, all_to_all_bytes, fsdp2_gathered_params, moe_flops_per_token,
                                   tokens_per_expert)
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, validation_errors

ROOT = Path(__file__).resolve().parents[2]


def _moe(name: str) -> ModelSpec:
    return ModelSpec(**hf_config_fields(str(ROOT / "tests/data/hf/moe" / f"{name}.json"), exact_check=False))


MIXTRAL, QWEN = _moe("mixtral-8x7b-v0.1"), _moe("qwen3-30b-a3b")
HW8 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8)
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64)


@pytest.mark.parametrize("model,total_b,active_b", [
    (MIXTRAL, 46.7, 12.9),  # Mixtral paper (arXiv 2401.04088 sec. 2): 47B, 13B active
    (QWEN, 30.5, 3.3),      # Qwen3 model card: 30.5B, 3.3B activated
    (_moe("deepseek-v3"), 671.0, 37.0),  # DeepSeek-V3 report sec. 1: 671B, 37B activated (+ MTP not built)
])
def test_active_parameters_are_the_published_ones(model, total_b, active_b):
    assert model.num_parameters / 1e9 == pytest.approx(total_b, rel=0.01)
    assert active_params(model) / 1e9 == pytest.approx(active_b, rel=0.02)


def test_flops_and_mfu_are_on_active_parameters():
    s = 4096
    attention = 12.0 * MIXTRAL.num_hidden_layers * MIXTRAL.hidden_size * s
    assert moe_flops_per_token(MIXTRAL, s) == 6.0 * active_params(MIXTRAL) + attention
    assert moe_flops_per_token(MIXTRAL, s) < 0.3 * MIXTRAL.flops_per_token(s)
    r = simulate(MIXTRAL, TRAIN, HW8, Strategy(engine="fsdp2", checkpointing="full"))
    peak = HW8.gpu.peak_flops("bf16")
    assert r.mfu == pytest.approx(moe_flops_per_token(MIXTRAL, s) * r.tokens_per_s_per_gpu / peak, rel=1e-12)
    llama = model_from_name("llama2-7b")  # a dense model keeps ModelSpec.flops_per_token
    d = simulate(llama, TRAIN, HW8, Strategy(zero_stage=3))
    assert d.mfu == pytest.approx(llama.flops_per_token(s) * d.tokens_per_s_per_gpu / peak, rel=1e-12)
    assert active_params(llama) == llama.num_parameters


def test_all_to_all_volume_and_rows_per_expert():
    T = 4096.0
    # tokens x top_k x hidden x bytes x (ep - 1) / ep per dispatch (and per combine)
    assert all_to_all_bytes(QWEN, T, 8, 2) == T * 8 * 2048 * 2 * 7 / 8
    assert all_to_all_bytes(QWEN, T, 1, 2) == 0.0
    assert tokens_per_expert(QWEN, T, 1) == T * 8 / 128 and tokens_per_expert(QWEN, T, 8) == T * 8 * 8 / 128
    # EP gathers each expert's rows from ep GPUs: bigger grouped-GEMM tiles, less compute time
    sim = Simulator(QWEN, TRAIN, HW8)
    compute = [sim(Strategy(engine="fsdp2", expert_parallel_size=ep)).breakdown["compute"] for ep in (1, 2, 4, 8)]
    assert compute == sorted(compute, reverse=True) and compute[0] > compute[-1]
    # FSDP2 with EP: dense parts over 8 GPUs, each GPU's 1/ep of the experts over 8 / ep GPUs
    experts = 48 * 128 * 3 * 2048 * 768  # 48 MoE blocks of 128 gated experts, d 2048, f 768
    dense = QWEN.num_parameters - experts
    got = fsdp2_gathered_params(QWEN, 8, 4) * 7 / 8
    assert got == pytest.approx(dense * 7 / 8 + experts / 4 * 1 / 2, rel=1e-12)
    assert fsdp2_gathered_params(QWEN, 8, 1) == QWEN.num_parameters


def test_ep_all_to_all_is_charged_as_exposed_communication():
    sim = Simulator(QWEN, TRAIN, HW8)
    base = Strategy(engine="fsdp2", expert_parallel_size=8)
    slow = Simulator(QWEN, TRAIN, HW8, params={"comm_eff": 0.06})
    # ten times less bandwidth: all-to-all and FSDP both grow, the compute stays
    a, b = sim(base), slow(base)
    assert b.breakdown["exposed_communication"] > 5 * a.breakdown["exposed_communication"]
    assert b.breakdown["compute"] == a.breakdown["compute"]


def test_scalar_simulate_and_simulator_agree():
    sim = Simulator(MIXTRAL, TRAIN, HW8)
    for s in (Strategy(engine="fsdp2", expert_parallel_size=ep, checkpointing=ck, micro_batch_size=mbs)
              for ep in (1, 2, 4, 8) for ck in ("none", "full", "mlp") for mbs in (1, 2)):
        assert sim(s) == simulate(MIXTRAL, TRAIN, HW8, s)
    assert sim(Strategy(zero_stage=3)) == simulate(MIXTRAL, TRAIN, HW8, Strategy(zero_stage=3))


def test_expert_parallel_rules_name_the_key():
    def errors(s, model=MIXTRAL, hw=HW8):
        return validation_errors(s, model, TRAIN, hw)

    assert errors(Strategy(engine="fsdp2", expert_parallel_size=8)) == []  # a valid layout (sized)
    for s, model, hw, words in (
        (Strategy(engine="fsdp2", expert_parallel_size=2), model_from_name("llama2-7b"), HW8, "mixture-of-experts"),
        (Strategy(engine="fsdp2", expert_parallel_size=3), QWEN, HW8, "num_experts"),   # 128 experts
        (Strategy(engine="fsdp2", expert_parallel_size=16), MIXTRAL, HW8, "num_experts"),
        (Strategy(engine="fsdp2", expert_parallel_size=16), QWEN, HW8, "data-parallel size"),  # 8 GPUs
        (Strategy(engine="fsdp2", expert_parallel_size=4, context_parallel_size=2), QWEN, HW8, "context_parallel"),
        (Strategy(engine="fsdp2", expert_parallel_size=0), QWEN, HW8, ">= 1"),
        (Strategy(engine="fsdp2", expert_parallel_size=2, checkpointing="op"), QWEN, HW8, "checkpointing op"),
        (Strategy(engine="fsdp2", sharding="hybrid", expert_parallel_size=16), QWEN,
         HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8, num_nodes=2), "gpus_per_node"),
    ):
        got = errors(s, model, hw)
        assert [k for k, _ in got] == ["expert_parallel_size"] and words in got[0][1], (s, got)
        assert "\n" not in got[0][1]
    assert Strategy(expert_parallel_size=4).expert_parallel_size == 1  # deepspeed: fixed at 1


def test_published_moe_throughput_within_bounds():
    """data/reference/moe-throughput.csv: each published run, simulated, within its row's stated
    bound of the published tokens/s per GPU (the error is reported in the .md beside it)."""
    rows = list(csv.DictReader(open(ROOT / "data/reference/moe-throughput.csv")))
    assert rows
    for row in rows:
        model = _moe(row["model_file"])
        hw = HardwareSpec(gpu=gpu_from_name(row["gpu"]), gpus_per_node=int(row["gpus_per_node"]),
                          num_nodes=int(row["num_nodes"]))
        tr = TrainingSpec(seq_len=int(row["seq_len"]), global_batch_size=int(row["global_batch_size"]))
        s = Strategy(engine="fsdp2", micro_batch_size=int(row["micro_batch_size"]),
                     checkpointing=row["checkpointing"], expert_parallel_size=int(row["expert_parallel_size"]))
        assert validation_errors(s, model, tr, hw) == []
        got = simulate(model, tr, hw, s).tokens_per_s_per_gpu
        ratio = got / float(row["published_tokens_per_s_per_gpu"])
        assert 1 / float(row["bound"]) <= ratio <= float(row["bound"]), (row["source"], ratio)
