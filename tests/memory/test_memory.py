"""Analytical memory model: published numbers, DeepSpeed's own estimator, invariants (fast, pure)."""


import pytest

from autotune.memory import GPU_COMPONENTS, PREDICTION_MARGIN, MemoryEstimate, estimate_memory, model_states_bytes, zero_model_states
from autotune.spec import GIB
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import HardwareSpec, NVMeSpec, TrainingSpec
from autotune.strategy import Strategy

LLAMA7 = model_from_name("llama2-7b")
A100 = gpu_from_name("a100-80gb")
HW8 = HardwareSpec(gpu=A100, gpus_per_node=8)
HW1 = HardwareSpec(gpu=A100, gpus_per_node=1)
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64, precision="bf16")
GB = 1e9  # the seed and the ZeRO paper use 1 GB = 1e9 bytes


def test_seed_llama2_7b_table():
    """Seed: params 14 GB, grads 14 GB, optimizer 84 GB (fp16 mixed precision, no ZeRO, Psi ~ 7B)."""
    train = TrainingSpec(seq_len=4096, global_batch_size=8, precision="fp16")
    s = Strategy(zero_stage=0, micro_batch_size=1, precision="fp16")
    ms = model_states_bytes(LLAMA7, train, HW8, s)
    # with the exact count 6.74B the seed's rounded 7B numbers are 3.7% high
    assert ms["parameters"] / GB == pytest.approx(14, rel=0.04)
    assert ms["gradients"] / GB == pytest.approx(14, rel=0.04)
    assert ms["optimizer_states"] / GB == pytest.approx(84, rel=0.04)
    nominal = zero_model_states(7e9, 8, 0, "fp16")
    assert (nominal["parameters"], nominal["gradients"], nominal["optimizer_states"]) == (14 * GB, 14 * GB, 84 * GB)
    est = estimate_memory(LLAMA7, train, HW8, s)
    assert est.gpu["parameters"] == ms["parameters"]
    assert est.gpu["optimizer_states"] == ms["optimizer_states"]  # 12 B/param: fp32 master + 2 moments
    assert not est.fits
    assert any("GiB" in r for r in est.reasons)


@pytest.mark.parametrize("stage,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1(stage, expected_gb):
    """ZeRO paper Figure 1: Psi = 7.5B, N_d = 64, K = 12."""
    ms = zero_model_states(7.5e9, 64, stage, "fp16")
    assert round(ms["total"] / GB, 1) == expected_gb


@pytest.mark.parametrize("gpus,nodes", [(8, 1), (4, 2), (1, 1)])
def test_matches_deepspeed_zero2_estimator(gpus, nodes):
    z = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    psi = 2_851_598_336  # t5-3b, DeepSpeed's documented example (8 GPUs)
    _, gpu = z.estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=False)
    ms = zero_model_states(psi, gpus * nodes, 2, "fp16")
    assert ms["deepspeed"] == pytest.approx(gpu, abs=8)
    _, gpu_off = z.estimate_zero2_model_states_mem_needs(psi, gpus, nodes, cpu_offload=True)
    assert zero_model_states(psi, gpus * nodes, 2, "fp16", offload_optimizer=True)["deepspeed"] == gpu_off


def test_matches_deepspeed_zero3_estimator():
    z = pytest.importorskip("deepspeed.runtime.zero.stage3")
    psi, largest = 2_851_598_336, 32_899_072
    _, gpu, largest_mem = z.estimate_zero3_model_states_mem_needs(psi, largest, 8, 1, cpu_offload=False,
                                                                  cpu_offload_params=False)
    ms = zero_model_states(psi, 8, 3, "fp16")
    assert ms["deepspeed"] + largest_mem == pytest.approx(gpu, abs=8)


def test_estimate_covers_deepspeed_model_states():
    """The optimizer-step phase holds at least what DeepSpeed's estimator counts for ZeRO-2/3."""
    for stage in (2, 3):
        s = Strategy(zero_stage=stage, micro_batch_size=1)
        est = estimate_memory(LLAMA7, TRAIN, HW8, s)
        ds = zero_model_states(LLAMA7.num_parameters, 8, stage, "bf16")["deepspeed"]
        assert ds <= est.phases["optimizer"] <= ds * 1.25


def test_activation_breakdown_is_a_frozen_record_with_a_docstring_per_field():
    import ast
    import dataclasses
    import inspect

    from autotune.memory import ActivationBreakdown, activation_breakdown

    body = ast.parse(inspect.getsource(ActivationBreakdown)).body[0].body
    undocumented = [node.target.id for node, after in zip(body, body[1:] + [None]) if isinstance(node, ast.AnnAssign)
                    and not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant))]
    assert undocumented == []
    act = activation_breakdown(LLAMA7, TRAIN, Strategy(micro_batch_size=2, checkpointing="full"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        act.blocks = 0.0  # type: ignore[misc]
    assert act.num_checkpointed == LLAMA7.num_hidden_layers and act.granularity == "full"
    assert act.blocks == act.num_checkpointed * act.per_block_checkpointed


def test_activation_breakdown_cache_follows_every_knob_it_reads():
    """The cached core (_breakdown) sees only what activation_breakdown hands it: an equal model
    built anew hits the same entry, and each knob the terms read moves them."""
    from autotune.memory import activation_breakdown

    base = Strategy(micro_batch_size=2, checkpointing="full", checkpoint_layers=8, zero_stage=2)
    act = activation_breakdown(LLAMA7, TRAIN, base)
    assert activation_breakdown(model_from_name("llama2-7b"), TRAIN, base) is act
    moved = [base.replace(micro_batch_size=1), base.replace(precision="fp32"), base.replace(checkpoint_layers=4),
             base.replace(checkpointing="selective"), base.replace(checkpointing="none")]
    for s in moved:
        assert activation_breakdown(LLAMA7, TRAIN, s) != act, s
    assert activation_breakdown(LLAMA7, TrainingSpec(seq_len=2048, global_batch_size=64, precision="bf16"), base) != act
    assert activation_breakdown(LLAMA7, TRAIN, base, device="cpu") != act
    # ZeRO-3's linears change what op-level checkpointing keeps of a biased model (_block_linears)
    gpt2 = model_from_name("gpt2")
    op = Strategy(micro_batch_size=1, checkpointing="op", zero_stage=2)
    assert (activation_breakdown(gpt2, TRAIN, op).per_block_checkpointed
            != activation_breakdown(gpt2, TRAIN, op.replace(zero_stage=3)).per_block_checkpointed)


def test_breakdown_sums_to_peak_and_is_jsonable():
    import json

    for s in [Strategy(zero_stage=z, micro_batch_size=2, checkpointing=c) for z in range(4) for c in ("none", "full")]:
        est = estimate_memory(LLAMA7, TRAIN, HW8, s)
        assert isinstance(est, MemoryEstimate)
        assert set(est.gpu) == set(GPU_COMPONENTS) | {"peak"}
        assert sum(est.gpu[k] for k in GPU_COMPONENTS if k != "overhead") == est.gpu["peak"]
        assert est.gpu["peak"] == max(est.phases.values())
        assert est.peak_phase in ("forward", "backward", "optimizer")
        assert est.gpu["overhead"] == (int(HW8.cuda_context_gib * GIB + HW8.allocator_slack * est.gpu["peak"])
                                       + int(PREDICTION_MARGIN * est.gpu["peak"]))
        assert all(v >= 0 for v in est.gpu.values())
        json.dumps(est.as_dict())


def test_zero_stages_reduce_memory():
    peaks = [estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=z, micro_batch_size=1,
                                                          checkpointing="full")).gpu["peak"] for z in range(4)]
    # DeepSpeed 0.19's stage 1 uses the same partitioned contiguous gradient path as stage 2
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3]


def test_checkpoint_layers_monotone():
    for gran in ("selective", "full"):
        prev = None
        for n in range(0, LLAMA7.num_hidden_layers + 1):
            s = Strategy(zero_stage=3, micro_batch_size=4, checkpointing=gran, checkpoint_layers=n)
            peak = estimate_memory(LLAMA7, TRAIN, HW8, s).gpu["peak"]
            if prev is not None:
                assert peak <= prev, (gran, n)
            prev = peak
    none = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=3, micro_batch_size=4)).gpu["peak"]
    sel = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=3, micro_batch_size=4, checkpointing="selective")).gpu["peak"]
    full = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=3, micro_batch_size=4, checkpointing="full")).gpu["peak"]
    assert none > sel > full


def test_micro_batch_and_sequence_increase_memory():
    s1 = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=3, micro_batch_size=1)).gpu["activations"]
    s2 = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=3, micro_batch_size=2)).gpu["activations"]
    assert s2 > 1.9 * s1


def test_eager_attention_costs_s2():
    eager = LLAMA7.replace(attn_implementation="eager")
    s = Strategy(zero_stage=3, micro_batch_size=1)
    assert estimate_memory(eager, TRAIN, HW8, s).gpu["peak"] > estimate_memory(LLAMA7, TRAIN, HW8, s).gpu["peak"] + 10 * GIB


def test_fits_and_reasons():
    small = estimate_memory(model_from_name("gpt2"), TrainingSpec(seq_len=1024, global_batch_size=8), HW8,
                            Strategy(zero_stage=0, micro_batch_size=1))
    assert small.fits and small.reasons == []
    big = estimate_memory(model_from_name("llama2-70b"), TRAIN, HW1, Strategy(zero_stage=0, micro_batch_size=1))
    assert not big.fits and big.reasons
    assert any("optimizer states" in r and "GiB" in r for r in big.reasons)
    # headroom tightens the verdict
    s = Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full")
    est = estimate_memory(LLAMA7, TRAIN, HW8, s)
    frac = (est.gpu["peak"] + est.gpu["overhead"]) / A100.memory_bytes
    assert est.fits
    assert not estimate_memory(LLAMA7, TRAIN, HW8, s, headroom=1 - frac * 0.99).fits
    # strategy validation errors are reasons too
    bad = estimate_memory(LLAMA7, TRAIN, HW8, Strategy(zero_stage=2, offload_params="cpu"))
    assert not bad.fits and any("zero_stage 3" in r for r in bad.reasons)


def test_offload_moves_states_to_cpu():
    base = Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full")
    on_gpu = estimate_memory(LLAMA7, TRAIN, HW8, base)
    off = estimate_memory(LLAMA7, TRAIN, HW8, base.replace(offload_optimizer="cpu"))
    both = estimate_memory(LLAMA7, TRAIN, HW8, base.replace(offload_optimizer="cpu", offload_params="cpu"))
    assert on_gpu.cpu_bytes_per_node == 0
    assert off.gpu["optimizer_states"] == 0 and off.gpu["peak"] < on_gpu.gpu["peak"]
    # fp32 master + 2 moments + fp32 grads of all 8 partitions live in this node's RAM
    assert off.cpu_bytes_per_node >= 16 * LLAMA7.num_parameters
    assert both.gpu["peak"] < off.gpu["peak"] and both.cpu_bytes_per_node > off.cpu_bytes_per_node
    tiny_ram = HardwareSpec(gpu=A100, gpus_per_node=8, cpu_memory_gib=64)
    est = estimate_memory(LLAMA7, TRAIN, tiny_ram, base.replace(offload_optimizer="cpu"))
    assert not est.fits and any("host RAM" in r for r in est.reasons)
    nv = HardwareSpec(gpu=A100, gpus_per_node=8, nvme=NVMeSpec(capacity_gib=50))
    est = estimate_memory(LLAMA7, TRAIN, nv, base.replace(offload_optimizer="nvme"))
    assert est.nvme_bytes_per_node > 0 and not est.fits and any("NVMe" in r for r in est.reasons)




def test_hf_gelu_new_composite_keeps_three_more_tensors():
    """HF GPT-2's NewGELUActivation is a Python composite (found by tracing, benchmarks/trace_vs_analytic.py):
    an hf-implementation model keeps 3 more intermediate-size tensors per token per block."""
    from autotune.memory import block_activation_bytes_per_token
    from autotune.presets import model_from_name

    ref = model_from_name("gpt2")
    hf = ref.replace(implementation="hf")
    p, s = 2, 1024
    extra = block_activation_bytes_per_token(hf, p, s) - block_activation_bytes_per_token(ref, p, s)
    assert extra == 3 * p * ref.intermediate_size
    # only the composite activation differs; full checkpointing keeps the block input either way
    assert block_activation_bytes_per_token(hf, p, s, "full") == block_activation_bytes_per_token(ref, p, s, "full")
    llama = model_from_name("llama2-7b")
    assert block_activation_bytes_per_token(llama.replace(implementation="hf"), p, s) == \
        block_activation_bytes_per_token(llama, p, s)


# ---------------------------------------------------------------- issue 11: what a user's job hits

from autotune.memory.states import _model_states  # noqa: E402

SMALL = model_from_name("tiny-llama").replace(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                              num_key_value_heads=8, intermediate_size=688, vocab_size=4096)


def _peak(model, stage, ga, dp=1, loop="keep_outputs", precision="bf16", ckpt="none", **kw):
    train = TrainingSpec(seq_len=256, global_batch_size=2 * dp * ga, precision=precision)
    hw = HardwareSpec(gpu=A100, gpus_per_node=dp)
    s = Strategy(zero_stage=stage, micro_batch_size=2, checkpointing=ckpt, precision=precision, **kw)
    return estimate_memory(model, train, hw, s, device="cpu", loop=loop)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_kept_outputs_hold_the_logits_everywhere(precision):
    """The usual loop keeps outputs.logits (model dtype) through backward, the step and the next forward."""
    p = 2 if precision == "bf16" else 4
    logits = p * SMALL.vocab_size * 2 * 256
    for stage in (0, 1, 2, 3):
        keep, drop = _peak(SMALL, stage, 1, precision=precision), _peak(SMALL, stage, 1, precision=precision,
                                                                        loop="drop_outputs")
        assert keep.gpu["peak"] - drop.gpu["peak"] == logits
        assert all(keep.phases[k] - drop.phases[k] == logits for k in drop.phases)
    with pytest.raises(ValueError, match="loop must be one of"):
        _peak(SMALL, 0, 1, loop="other")


@pytest.mark.parametrize("stage,dp,copies", [(0, 1, 1.0), (0, 2, 1.0), (1, 1, 3.0), (1, 2, 3.0), (2, 1, 1.0),
                                             (2, 2, 0.5), (3, 1, 0.0), (3, 2, 0.0)])
def test_gradient_accumulation_carry(stage, dp, copies):
    """Gradients that live across micro-steps (model dtype): ZeRO-0 param.grad, ZeRO-1 unreduced
    gradients, ZeRO-2 the accumulated partition, ZeRO-3 nothing (in-place partition buffer)."""
    carry = 2 * SMALL.num_parameters * copies
    if stage == 2:  # the partition holds the parameters overlapping it whole (grads_in_partition)
        from autotune.memory.states import grad_partition_elements

        carry = 2 * grad_partition_elements(SMALL, dp)
    ga1, ga2, ga4 = (_peak(SMALL, stage, g, dp) for g in (1, 2, 4))
    assert ga2.phases["forward"] - ga1.phases["forward"] == pytest.approx(carry, abs=8)
    assert ga4.gpu["peak"] == ga2.gpu["peak"] and ga2.gpu["peak"] >= ga1.gpu["peak"]
    # engine.step() after a non-boundary micro-step is entered holding the carry (ZeRO-1's ipg buckets
    # too); the boundary step's own instants are those of GA 1
    kept = 2 * SMALL.vocab_size * 2 * 256  # the usual loop's outputs.logits
    entry = ga1.gpu["parameters"] + ga1.gpu["optimizer_states"] + kept + (carry if stage != 1 else
                                                              2 * SMALL.num_parameters + 2 * 2 * SMALL.num_parameters)
    assert ga2.phases["optimizer"] == pytest.approx(max(ga1.phases["optimizer"], entry), abs=8)
    assert ga4.phases["optimizer"] == ga2.phases["optimizer"]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero12_reduce_at_the_end_of_backward(precision):
    """One bucket (the whole model), 2 ranks, small activations: the peak is the reduce that ends a
    backward, two ipg buffers plus the bucket's flat all-reduced copy (allreduce_bucket), freed before
    copy_grads_in_partition allocates the partition. ZeRO-2 adds the partition carried from earlier
    micro-steps; ZeRO-1's carried full-size gradients were moved into the buckets by their hooks at
    the boundary (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads), so they never
    sit next to the buckets and the flat copy."""
    from autotune.memory.states import grad_partition_elements

    p = 2 if precision == "bf16" else 4
    psi = SMALL.num_parameters
    part = grad_partition_elements(SMALL, 2)  # Psi/2 plus a straddling parameter's other side

    def est(stage, ga):
        train = TrainingSpec(seq_len=64, global_batch_size=2 * ga, precision=precision)
        return estimate_memory(SMALL, train, HardwareSpec(gpu=A100, gpus_per_node=2),
                               Strategy(zero_stage=stage, micro_batch_size=1, checkpointing="full",
                                        precision=precision), device="cpu")

    def states(e):
        return e.gpu["parameters"] + e.gpu["optimizer_states"] + e.gpu["logits"]

    z2, z2_ga4 = est(2, 1), est(2, 4)
    assert z2.gpu["buffers"] == 3 * p * psi and z2.gpu["gradients"] == 0 and z2.gpu["activations"] == 0
    assert z2.gpu["peak"] == states(z2) + 3 * p * psi
    assert z2_ga4.gpu["peak"] - z2.gpu["peak"] == p * part and z2_ga4.gpu["gradients"] == p * part
    z1, z1_ga4 = est(1, 1), est(1, 4)
    assert z1.gpu["peak"] == z2.gpu["peak"]  # GA 1: the same path
    # later micro-steps: the carried gradients with the two buckets, plus the block's backward;
    # never the carried gradients next to the flat copy (+ p psi)
    assert states(z1) + 3 * p * psi < z1_ga4.gpu["peak"] < states(z1) + 3 * p * psi + p * part


def test_zero3_optimizer_offload_puts_gradient_partitions_on_the_host():
    """DeepSpeed stage3.py: self.device = cpu with offload_optimizer; grad_partitions_flat_buffer there."""
    m = model_from_name("llama2-70b")
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1, cpu_memory_gib=2048,
                      nvme=NVMeSpec(capacity_gib=3500))
    train = TrainingSpec(seq_len=4096, global_batch_size=8)
    psi = m.num_parameters
    est = estimate_memory(m, train, hw, Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full",
                                                 offload_optimizer="cpu", offload_params="cpu", pin_memory=False))
    assert est.gpu["gradients"] == 0 and est.gpu["optimizer_states"] == 0 and est.fits
    assert est.gpu["parameters"] < 1 * GIB  # only persistent small params stay on the GPU
    assert est.cpu_bytes_per_node == pytest.approx((4 + 8 + 4 + 2 + 2) * psi, rel=1e-6)
    st = _model_states(m, train, hw, Strategy(zero_stage=3, micro_batch_size=1, offload_optimizer="cpu",
                                              pin_memory=False))  # pageable (pinned: test_pinned_host.py)
    assert st.grad_buffer == 0 and st.cpu == pytest.approx((4 + 8 + 4 + 2) * psi, rel=1e-6)


@pytest.mark.parametrize("opt", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("par", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_memory_figure_is_ever_negative(stage, opt, par):
    if stage < 3 and par != "none":
        return
    hw = HardwareSpec(gpu=A100, gpus_per_node=8, nvme=NVMeSpec(capacity_gib=3500))
    for model in (SMALL, LLAMA7, model_from_name("llama2-70b")):
        est = estimate_memory(model, TRAIN, hw, Strategy(zero_stage=stage, micro_batch_size=1,
                                                         offload_optimizer=opt, offload_params=par))
        assert min(est.gpu.values()) >= 0 and min(est.phases.values()) >= 0
        assert est.cpu_bytes_per_node >= 0 and est.nvme_bytes_per_node >= 0
        if "nvme" in (opt, par) and stage == 3:
            assert est.nvme_bytes_per_node > 0


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_offload_gpu_model_states_reproduce_deepspeed_estimators(gpus):
    """estimate_zero2/3_model_states_mem_needs: the figures they cover are the partitioned model
    states on the GPU (their largest-layer term is a working-set heuristic) and a host lower bound."""
    z2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    z3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    m = LLAMA7
    psi = m.num_parameters
    hw = HardwareSpec(gpu=A100, gpus_per_node=gpus)
    train = TrainingSpec(seq_len=4096, global_batch_size=gpus, precision="fp16")
    # ZeRO-2 + optimizer offload: 2 B/param on the GPU (the fp16 params), host >= 16 B/param
    cpu, gpu = z2.estimate_zero2_model_states_mem_needs(psi, gpus, 1, cpu_offload=True)
    st = _model_states(m, train, hw, Strategy(zero_stage=2, micro_batch_size=1, precision="fp16",
                                              offload_optimizer="cpu"))
    assert st.params + st.optimizer + st.grads + st.grad_buffer == gpu
    assert st.cpu * gpus >= cpu / 1.5  # DeepSpeed's figure carries a 1.5x buffer factor
    # ZeRO-2 without offload: 2 + 18/N (16-bit params; 16-bit grads, fp32 grads, master, moments / N)
    cpu, gpu = z2.estimate_zero2_model_states_mem_needs(psi, gpus, 1, cpu_offload=False)
    st = _model_states(m, train, hw, Strategy(zero_stage=2, micro_batch_size=1, precision="fp16"))
    part = -(-psi // gpus)
    # (its 16-bit gradient partition is Psi/N; the real one holds a straddling parameter whole)
    assert 2 * part <= st.grads < 2 * part + 2 * m.vocab_size * m.hidden_size
    assert st.params + st.optimizer + 2 * part + 4 * part == pytest.approx(gpu, abs=8 * gpus)
    # ZeRO-3 + optimizer offload: 2/N on the GPU beyond the largest layer; + param offload: nothing
    largest = m.intermediate_size * m.hidden_size
    for off_par, frac in ((False, 2), (True, 0)):
        cpu, gpu, largest_mem = z3.estimate_zero3_model_states_mem_needs(psi, largest, gpus, 1, cpu_offload=True,
                                                                         cpu_offload_params=off_par)
        st = _model_states(m, train, hw, Strategy(zero_stage=3, micro_batch_size=1, precision="fp16",
                                                  offload_optimizer="cpu",
                                                  offload_params="cpu" if off_par else "none"))
        persist = st.params - (0 if off_par else 2 * part)
        assert st.params - persist + st.optimizer + st.grad_buffer == pytest.approx(gpu - largest_mem, abs=8)
        assert st.cpu * gpus >= cpu / 1.5


def test_zero1_two_micro_steps_split_the_carry():
    """ZeRO-1, GA 2: the carry micro-step is the boundary one, whose hooks move each hooked parameter's
    carried gradient into the reduce bucket (estimate.split_carry). At a late backward peak (a core
    recomputed after its block's MLP backward: small vocabulary, attention dropout on the CPU's math
    path) GA 2 holds the carry of the parameters not hooked yet; GA 4's middle micro-step holds it all."""
    from autotune.memory.estimate import split_relief

    assert split_relief(0.0, 5.0, 6.0) == 0.0  # no split: nothing released
    assert split_relief(10.0, 3.0, 4.0) == 3.0  # early: the hooked carry is gone
    assert split_relief(10.0, 7.0, 8.0) == 2.0  # late: the first micro-step's own gradients (8) dominate
    assert split_relief(10.0, 6.0, 11.0) == 0.0
    m = SMALL.replace(vocab_size=64, attention_dropout=0.1)
    ga1, ga2, ga4 = (_peak(m, 1, g, precision="fp32", ckpt="selective").gpu["peak"] for g in (1, 2, 4))
    hooked = m.vocab_size * m.hidden_size + m.norm_params() + m.params_after_attention_core()
    assert ga4 - ga1 == 4 * m.num_parameters
    assert ga2 - ga1 == 4 * (m.num_parameters - hooked)
    # ZeRO-0 and ZeRO-2 carry the same in every later micro-step
    for stage in (0, 2):
        assert _peak(m, stage, 2, precision="fp32", ckpt="selective").gpu["peak"] == \
            _peak(m, stage, 4, precision="fp32", ckpt="selective").gpu["peak"]
