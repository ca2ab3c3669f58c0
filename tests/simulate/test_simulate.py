"""Shape tests of the throughput simulator: the orderings the Pareto front depends on."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from autotune.presets import gpu_from_name, model_from_name
from autotune.simulate import EFFICIENCY_KEYS, SimResult, default_efficiency, simulate
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy

LLAMA = model_from_name("llama2-7b")


def _hw(gpu="a100-80gb", nodes=1, **gpu_overrides):
    return HardwareSpec(gpu=gpu_from_name(gpu, **gpu_overrides), gpus_per_node=8, num_nodes=nodes)


def _run(strategy, gpu="a100-80gb", nodes=1, seq_len=4096, gbs=None, model=LLAMA, **gpu_overrides):
    hw = _hw(gpu, nodes, **gpu_overrides)
    gbs = gbs or 64 * hw.num_gpus
    return simulate(model, TrainingSpec(seq_len=seq_len, global_batch_size=gbs), hw, strategy)


def test_result_fields_and_breakdown_sum():
    r = _run(Strategy(zero_stage=3, micro_batch_size=2, checkpointing="full"))
    assert isinstance(r, SimResult)
    assert set(r.breakdown) == {"compute", "recompute", "exposed_communication", "offload", "optimizer", "overhead"}
    assert math.isclose(sum(r.breakdown.values()), r.step_time_s, rel_tol=1e-9)
    assert all(v >= 0 for v in r.breakdown.values())
    hw = _hw()
    tokens = 64 * hw.num_gpus * 4096 / hw.num_gpus
    assert math.isclose(r.tokens_per_s_per_gpu, tokens / r.step_time_s, rel_tol=1e-9)
    # MFU follows llm-foundry's definition from the same tokens/s
    assert math.isclose(r.mfu, LLAMA.flops_per_token(4096) * r.tokens_per_s_per_gpu / 312e12, rel_tol=1e-9)
    assert 0.2 < r.mfu < 0.75
    d = r.as_dict()
    assert d["step_time_s"] == r.step_time_s and d["breakdown"] == r.breakdown and "calibrated" in d


def test_throughput_rises_with_micro_batch_and_saturates():
    tps = [_run(Strategy(zero_stage=3, micro_batch_size=b, checkpointing="full"), gbs=512).tokens_per_s_per_gpu
           for b in (1, 2, 4, 8, 16, 32, 64)]
    assert all(b > a for a, b in zip(tps, tps[1:])), tps
    gains = [b / a - 1 for a, b in zip(tps, tps[1:])]
    assert gains[0] > gains[-1]  # diminishing returns
    assert gains[-1] < 0.02  # saturated at large micro-batch
    assert tps[-1] / tps[0] > 1.03  # but micro-batch 1 is visibly worse


def test_full_checkpointing_costs_about_a_third_of_fwd_bwd():
    base = _run(Strategy(zero_stage=2, micro_batch_size=4))
    full = _run(Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full"))
    assert base.breakdown["recompute"] == 0.0
    ratio = full.breakdown["recompute"] / full.breakdown["compute"]
    assert 0.25 < ratio < 0.36, ratio  # one extra forward of the blocks (head/loss excluded)
    assert full.step_time_s > 1.2 * base.step_time_s
    half = _run(Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full", checkpoint_layers=16))
    assert math.isclose(half.breakdown["recompute"], full.breakdown["recompute"] / 2, rel_tol=1e-9)
    sel = _run(Strategy(zero_stage=2, micro_batch_size=4, checkpointing="selective"))
    assert 0 < sel.breakdown["recompute"] < 0.5 * full.breakdown["recompute"]


def test_zero3_slower_than_zero2_at_small_micro_batch_on_slow_interconnect():
    kw = dict(gpu="a100-80gb", nodes=4, inter_node_bandwidth_gbps=3.0)  # ~25 Gb/s Ethernet per GPU
    z2 = _run(Strategy(zero_stage=2, micro_batch_size=1, checkpointing="full"), **kw)
    z3 = _run(Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full"), **kw)
    assert z3.tokens_per_s_per_gpu < 0.9 * z2.tokens_per_s_per_gpu
    assert z3.breakdown["exposed_communication"] > z2.breakdown["exposed_communication"]
    # with a big micro-batch and NVLink inside one node the gap almost closes
    z2b = _run(Strategy(zero_stage=2, micro_batch_size=16, checkpointing="full"))
    z3b = _run(Strategy(zero_stage=3, micro_batch_size=16, checkpointing="full"))
    assert z3b.tokens_per_s_per_gpu > 0.95 * z2b.tokens_per_s_per_gpu


def test_communication_grows_with_slower_links_and_gradient_accumulation_for_zero3():
    s = Strategy(zero_stage=3, micro_batch_size=1)
    fast = _run(s, nodes=2)
    slow = _run(s, nodes=2, inter_node_bandwidth_gbps=2.0)
    assert slow.breakdown["exposed_communication"] > fast.breakdown["exposed_communication"]
    small_gas = _run(s, nodes=2, inter_node_bandwidth_gbps=2.0, gbs=16)
    big_gas = _run(s, nodes=2, inter_node_bandwidth_gbps=2.0, gbs=64)
    # ZeRO-3 gathers parameters every micro-batch: 4x the micro-batches ~ 4x the exposed traffic
    assert big_gas.breakdown["exposed_communication"] > 3.5 * small_gas.breakdown["exposed_communication"]


def test_cpu_offload_much_slower_unless_compute_hides_it():
    small = dict(gbs=8, seq_len=2048)  # one micro-batch per step: CPU Adam dominates
    gpu = _run(Strategy(zero_stage=2, micro_batch_size=1), **small)
    cpu = _run(Strategy(zero_stage=2, micro_batch_size=1, offload_optimizer="cpu"), **small)
    assert cpu.tokens_per_s_per_gpu < 0.5 * gpu.tokens_per_s_per_gpu
    assert cpu.breakdown["offload"] > cpu.breakdown["compute"]
    big = dict(gbs=8 * 256, seq_len=4096)  # long steps amortise the per-step CPU work
    gpu_b = _run(Strategy(zero_stage=2, micro_batch_size=8, checkpointing="full"), **big)
    cpu_b = _run(Strategy(zero_stage=2, micro_batch_size=8, checkpointing="full", offload_optimizer="cpu"), **big)
    assert cpu_b.tokens_per_s_per_gpu > 0.85 * gpu_b.tokens_per_s_per_gpu
    # parameter offload adds PCIe traffic every micro-batch on top
    opt3 = _run(Strategy(zero_stage=3, micro_batch_size=1, offload_optimizer="cpu"), **small)
    both = _run(Strategy(zero_stage=3, micro_batch_size=1, offload_optimizer="cpu", offload_params="cpu"), **small)
    assert both.breakdown["offload"] > opt3.breakdown["offload"]
    assert both.step_time_s > opt3.step_time_s


def test_nvme_offload_slower_than_cpu_offload():
    from autotune.spec import NVMeSpec

    hw = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8, nvme=NVMeSpec(capacity_gib=2000))
    tr = TrainingSpec(seq_len=2048, global_batch_size=8)
    cpu = simulate(LLAMA, tr, hw, Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"))
    nvme = simulate(LLAMA, tr, hw, Strategy(zero_stage=3, offload_optimizer="nvme", offload_params="nvme"))
    assert nvme.step_time_s > cpu.step_time_s


@pytest.mark.parametrize("gpu", ["v100-32gb", "h200-141gb", "l40s", "rtx4090"])
def test_uncalibrated_gpus_get_datasheet_defaults(gpu):
    spec = gpu_from_name(gpu)
    assert not spec.efficiency
    prec = "fp16" if gpu.startswith("v100") else "bf16"
    r = simulate(LLAMA, TrainingSpec(seq_len=2048, global_batch_size=64, precision=prec),
                 HardwareSpec(gpu=spec, gpus_per_node=8), Strategy(zero_stage=2, micro_batch_size=8, precision=prec))
    assert r.calibrated is False
    assert 0.15 < r.mfu < 0.7, r.mfu
    p = default_efficiency(spec)
    assert set(EFFICIENCY_KEYS) <= set(p)


def test_calibrated_presets_are_marked_and_params_override():
    spec = gpu_from_name("a100-80gb")
    s = Strategy(zero_stage=2, micro_batch_size=4)
    r = _run(s)
    assert r.calibrated is bool(spec.efficiency)
    slower = simulate(LLAMA, TrainingSpec(seq_len=4096, global_batch_size=512), _hw(), s,
                      params={"gemm_eff": 0.3})
    assert slower.tokens_per_s_per_gpu < 0.7 * r.tokens_per_s_per_gpu


def test_faster_gpu_is_faster_and_h200_not_slower_than_h100():
    s = Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full")
    a100 = _run(s, gpu="a100-80gb")
    h100 = _run(s, gpu="h100-80gb")
    assert h100.tokens_per_s_per_gpu > 1.5 * a100.tokens_per_s_per_gpu
    v100 = simulate(LLAMA, TrainingSpec(seq_len=4096, global_batch_size=512, precision="fp16"), _hw("v100-32gb"),
                    s.replace(precision="fp16"))
    assert v100.tokens_per_s_per_gpu < a100.tokens_per_s_per_gpu


def test_import_is_light():
    code = ("import sys, autotune.simulate; "
            "bad = [m for m in ('torch', 'deepspeed', 'scipy') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
