"""The simulator's long-context terms (issue 24): the sequence split, Ulysses all-to-alls, the
context-parallel exchange, tiled MLP / loss and activation offload."""

from __future__ import annotations

import math

import pytest

from autotune.presets import gpu_from_name, model_from_name
from autotune.simulate import Simulator, _exposed_communication, efficiency_params, simulate
from autotune.simulate_comm import _link_bandwidth
from autotune.memory.split import loss_tile_tokens, mlp_tile_tokens
from autotune.simulate_long import (LongTerms, long_context_terms, offload_exposed, ring_bytes,
                                    ulysses_bytes_per_layer, uses_long_context)
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy, validate

LLAMA3 = model_from_name("llama3-8b")  # 32 heads, 8 kv heads of 128, d 4096, f 14336, V 128256
H100 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8)
Z3 = Strategy(zero_stage=3, checkpointing="full")
FSDP = Strategy(engine="fsdp2", checkpointing="full")


def _tr(seq_len=32768, gbs=8):
    return TrainingSpec(seq_len=seq_len, global_batch_size=gbs)


def _terms(strategy, seq_len=32768, hardware=H100, params=None):
    sim = Simulator(LLAMA3, _tr(seq_len), hardware, params)
    rates, mb = sim.micro_batch(strategy)
    T = strategy.micro_batch_size * seq_len / (strategy.sequence_parallel_size * strategy.context_parallel_size)
    return sim, rates, mb, long_context_terms(LLAMA3, hardware, strategy, rates, sim.p, mb, seq_len, T,
                                              mb.fwd, mb.bwd + strategy.num_checkpointed(32) * mb.fwd_block)


def test_defaults_skip_the_long_context_terms():
    assert not uses_long_context(Strategy())
    for change in ({"sequence_parallel_size": 2}, {"tiled_loss": True}, {"tiled_mlp": True},
                   {"checkpointing": "full", "activation_offload": "cpu"}):
        assert uses_long_context(Strategy(**change)), change
    assert uses_long_context(Strategy(engine="fsdp2", context_parallel_size=2))


@pytest.mark.parametrize("sp", [2, 4, 8, 16])
def test_ulysses_all_to_all_volume_per_layer(sp):
    b, S = 2, 65536
    local = b * S // sp  # tokens of each sequence on one GPU
    kv_heads = 8 if sp <= 8 else sp  # fewer kv heads than sp: repeated up to sp (kv_replication_factor)
    q = local * 32 * 128  # q in, the output back: a x head_dim per token
    kv = local * kv_heads * 128
    expected = (sp - 1) / sp * (q + kv + kv + q) * 2  # bf16, 1/sp of each tensor stays
    assert math.isclose(ulysses_bytes_per_layer(LLAMA3, b, S, sp, 2), expected, rel_tol=1e-12)
    assert ulysses_bytes_per_layer(LLAMA3, b, S, 1, 2) == 0.0


def test_ulysses_communication_is_the_all_to_alls_of_forward_backward_and_recomputation():
    for ckpt, repeats in (("full", 32), ("selective", 32), ("op", 0), ("none", 0)):
        s = Strategy(zero_stage=3, checkpointing=ckpt, sequence_parallel_size=8)
        sim, rates, mb, t = _terms(s)
        bw = _link_bandwidth(H100, sim.p, crosses_nodes=False)
        one = ulysses_bytes_per_layer(LLAMA3, 1, 32768, 8, 2) / bw + 4 * 7 * sim.p["coll_latency_s"]
        assert math.isclose(t.communication, (2 * 32 + repeats) * one, rel_tol=1e-12), ckpt
        assert t.compute == t.recompute == t.offload == t.fwd_shift == 0.0
    # the step charges it once per micro-batch: exposed communication = ZeRO-3's + gas x all-to-alls
    s = Z3.replace(sequence_parallel_size=8)
    r = simulate(LLAMA3, _tr(), H100, s)
    gas = 8  # 8 sequences, one batch rank (8 GPUs / sp 8), micro-batch 1
    sim, rates, mb, t = _terms(s)
    # ZeRO-3's collectives over all 8 GPUs, every micro-batch, in the same compute windows
    zero = _exposed_communication(LLAMA3, H100, s, rates, sim.p, gas, mb.fwd, mb.bwd + 32 * mb.fwd_block,
                                  float(LLAMA3.num_parameters), sim.buckets(s))
    assert math.isclose(r.breakdown["exposed_communication"], zero + gas * t.communication, rel_tol=1e-12)


def test_sequence_split_divides_the_per_sequence_flops():
    sim = Simulator(LLAMA3, _tr(), H100)
    _, one = sim.micro_batch(Z3)
    for s in (Z3.replace(sequence_parallel_size=4), FSDP.replace(context_parallel_size=4)):
        _, split = sim.micro_batch(s)
        # attention core: this GPU's heads (Ulysses) or q chunks (ring) against the whole sequence
        assert math.isclose(split.attn_fwd_block * 4, one.attn_fwd_block, rel_tol=1e-12)
        assert split.gemm_fwd_block * 4 > one.gemm_fwd_block  # GEMMs at M = seq/4: a little less efficient
    # tokens per GPU per step: the global batch's tokens over all GPUs, whatever the split
    for s in (Z3, Z3.replace(sequence_parallel_size=8), FSDP.replace(context_parallel_size=2)):
        r = simulate(LLAMA3, _tr(), H100, s)
        assert math.isclose(r.tokens_per_s_per_gpu * r.step_time_s, 8 * 32768 / 8, rel_tol=1e-12)


def test_attention_flops_quadratic_and_causal_in_the_sequence():
    p = {"attn_s_half": 0.0}
    s = Strategy()
    a = Simulator(LLAMA3, _tr(16384), H100, p).micro_batch(s.replace(micro_batch_size=2))[1]
    b = Simulator(LLAMA3, _tr(32768), H100, p).micro_batch(s)[1]
    # the same tokens per micro-batch: attention per token doubles, so per sequence it quadruples
    assert math.isclose(b.attn_fwd_block / a.attn_fwd_block, 2.0, rel_tol=1e-12)
    assert math.isclose(b.gemm_fwd_block, a.gemm_fwd_block, rel_tol=1e-12)
    rates = Simulator(LLAMA3, _tr(32768), H100, p).micro_batch(s)[0]
    attn_eff = efficiency_params(H100.gpu, p)[0]["attn_eff"]
    causal = 32768 * 32768 * 4 * LLAMA3.q_size / 2  # QK^T and PV, half masked
    assert math.isclose(b.attn_fwd_block, causal / (rates.peak * attn_eff), rel_tol=1e-12)


def test_ring_exchange_volume_and_overlap():
    kv, dkv = ring_bytes(LLAMA3, 1, 65536, 4, 2)
    assert kv == 65536 / 4 * 2 * 8 * 128 * 2  # local k and v, bf16
    assert dkv == kv * 2  # dk, dv accumulated in fp32
    s = FSDP.replace(context_parallel_size=4)
    sim, rates, mb, t = _terms(s, 65536)
    bw = _link_bandwidth(H100, sim.p, crosses_nodes=False)
    gather = 3 * kv / bw  # cp-1 chunks in
    # a slow link exposes nearly all of it: forward, recomputation and backward gathers plus the dk/dv hops
    slow = HardwareSpec(gpu=gpu_from_name("h100-80gb", intra_node_bandwidth_gbps=0.5), gpus_per_node=8)
    _, _, _, ts = _terms(s, 65536, slow)
    bw_s = _link_bandwidth(slow, sim.p, crosses_nodes=False)
    floor = 32 * 3 * (3 * kv / bw_s) + 32 * 4 * dkv / bw_s  # 3 gathers (fwd, recompute, bwd), 4 hops
    assert floor * 0.95 < ts.communication < floor * 1.05
    # the exchange grows with S, the attention that hides it with S^2 / cp: hidden better at long sequences
    ratio = []
    for S in (16384, 65536, 262144):
        r = simulate(LLAMA3, _tr(S), H100, s)
        base = simulate(LLAMA3, _tr(S), H100, FSDP.replace(context_parallel_size=1)).breakdown
        ratio.append((r.breakdown["exposed_communication"] - base["exposed_communication"]) / r.step_time_s)
    assert ratio[0] > ratio[1] > ratio[2] > 0
    nothing_hidden = 32 * 3 * gather + 32 * 4 * dkv / bw
    assert t.communication < 0.8 * nothing_hidden  # fast NVLink: partly hidden under the attention steps


def test_tiled_mlp_adds_one_mlp_forward_per_block():
    p = {"gemm_m_half": 0.0}  # no tile-size effect: exactly one more MLP forward per block
    base = simulate(LLAMA3, _tr(), H100, Z3, p)
    tiled = simulate(LLAMA3, _tr(), H100, Z3.replace(tiled_mlp=True), p)
    mb = Simulator(LLAMA3, _tr(), H100, p).micro_batch(Z3)[1]
    assert math.isclose(tiled.breakdown["recompute"] - base.breakdown["recompute"], 32 * mb.mlp_module,  # gas 1
                        rel_tol=1e-9)
    assert tiled.breakdown["compute"] == base.breakdown["compute"]
    # tiles of hidden_size tokens: smaller GEMMs cost a little more with the default efficiency
    assert mlp_tile_tokens(1, 32768, 4096) == 4096 and mlp_tile_tokens(2, 3000, 4096) == 6000
    d, plain = simulate(LLAMA3, _tr(), H100, Z3.replace(tiled_mlp=True)), simulate(LLAMA3, _tr(), H100, Z3)
    assert d.breakdown["compute"] > plain.breakdown["compute"]
    mlp = Simulator(LLAMA3, _tr(), H100).micro_batch(Z3)[1].mlp_module
    # + the tiles' slowdown (M 4096 instead of 32768: ~3%) on the MLP GEMMs' forward, backward and repeat
    assert 32 * mlp < d.step_time_s - plain.step_time_s < 1.15 * 32 * mlp


def test_tiled_loss_costs_only_its_tiles_gemm_efficiency():
    one_gpu = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1)
    tr = TrainingSpec(seq_len=32768, global_batch_size=1)
    # 1 GiB of fp32 logits per tile: 32768 x 128256 x 4 B = 15.7 GiB -> 16 tiles of 2048 tokens
    assert loss_tile_tokens(32768, 128256) == 2048
    p = {"gemm_m_half": 0.0}
    untiled = simulate(LLAMA3, tr, one_gpu, Z3, p)
    assert simulate(LLAMA3, tr, one_gpu, Z3.replace(tiled_loss=True), p).step_time_s == untiled.step_time_s
    slower = simulate(LLAMA3, tr, one_gpu, Z3.replace(tiled_loss=True)).step_time_s
    assert 1.0 < slower / simulate(LLAMA3, tr, one_gpu, Z3).step_time_s < 1.01
    _, _, mb, t = _terms(Z3.replace(tiled_loss=True))
    assert t.fwd_shift > 2 * mb.head_gemm  # the head's backward runs inside the forward


def test_activation_offload_pcie_traffic():
    s = Z3.replace(activation_offload="cpu")
    _, _, mb, t = _terms(s)
    one = 32768 * 4096 * 2 / 50e9  # one block input, bf16, over the H100's PCIe figure
    # the copies run on the compute stream: every byte each way is on the critical path
    assert t.offload == pytest.approx(2 * 32 * one, rel=1e-12)
    r = simulate(LLAMA3, _tr(), H100, s)
    assert r.breakdown["offload"] == pytest.approx(t.offload, rel=1e-12)  # gas 1
    assert r.step_time_s == pytest.approx(simulate(LLAMA3, _tr(), H100, Z3).step_time_s + t.offload, rel=1e-12)
    # on a side stream they would hide under the forward / backward as far as PCIe allows
    fwd, bwd = mb.fwd, mb.bwd + 32 * mb.fwd_block
    overlap = efficiency_params(H100.gpu)[0]["overlap"]
    fast = offload_exposed(32768 * 4096 * 2, 32, 50e9, fwd, bwd, overlap, side_stream=True)
    assert one < fast < t.offload
    slow = offload_exposed(32768 * 4096 * 2, 32, 0.5e9, fwd, bwd, overlap, side_stream=True)
    full = 2 * 32 * 32768 * 4096 * 2 / 0.5e9
    assert slow == pytest.approx(full - overlap * (fwd + bwd), rel=1e-9)  # PCIe-bound: what the windows hide


def test_scalar_and_simulator_agree_with_every_knob():
    tr = _tr(65536, 16)
    strategies = [Z3, FSDP, Z3.replace(sequence_parallel_size=8), Z3.replace(sequence_parallel_size=2),
                  Z3.replace(tiled_loss=True), Z3.replace(tiled_mlp=True), Z3.replace(activation_offload="cpu"),
                  FSDP.replace(context_parallel_size=4), FSDP.replace(context_parallel_size=2, tiled_mlp=True),
                  Z3.replace(sequence_parallel_size=4, tiled_loss=True, tiled_mlp=True, activation_offload="cpu",
                             micro_batch_size=2),
                  FSDP.replace(context_parallel_size=8, tiled_loss=True, activation_offload="cpu"), Z3, FSDP]
    sim = Simulator(LLAMA3, tr, H100)
    seen = set()
    for s in strategies:
        assert validate(s, LLAMA3, tr, H100) == [], s
        r = sim(s)
        assert r == simulate(LLAMA3, tr, H100, s), s.describe(32)
        assert math.isclose(sum(r.breakdown.values()), r.step_time_s, rel_tol=1e-12)
        assert all(v >= 0 for v in r.breakdown.values())
        seen.add(r.step_time_s)
    assert len(seen) == len(strategies) - 2  # every knob moves the step (the last two repeat the first)
    assert isinstance(_terms(Z3.replace(tiled_mlp=True))[3], LongTerms)
