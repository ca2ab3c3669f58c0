"""Analytical per-GPU memory model of one DeepSpeed training step (pure arithmetic, no torch).

``estimate_memory(model, training, hardware, strategy)`` returns a :class:`MemoryEstimate`: a
named per-GPU breakdown (bytes), the predicted ``torch.cuda.max_memory_allocated`` of a
steady-state step (``gpu["peak"]``), the phase where that peak falls, host RAM / NVMe needs of
offload, and a fits / does-not-fit verdict with reasons.

What is modelled, and where it comes from
-----------------------------------------
Model states follow what DeepSpeed 0.19 really allocates (engine.py ``_do_optimizer_sanity_check``
and ``_configure_optimizer``, zero/stage_1_and_2.py, zero/stage3.py, fp16/*.py), checked against
allocation traces of real steps (torch.profiler, see benchmarks/memory_vs_deepspeed.py):

* ZeRO-0, fp32: plain optimizer: 4 B params + 4 B grads + 8 B Adam moments per parameter.
* ZeRO-0, bf16/fp16: ``FP16_Optimizer`` (``FP16_UnfusedOptimizer`` for a client torch optimizer;
  same bytes): 16-bit params and grads, fp32 master weights, fp32 moments; at the step the
  16-bit grads are flattened into an fp32 copy. Backward ends with ``allreduce_bucket``, which
  flattens the gradients (one bucket, at most the whole model) even on one rank.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): full 16-bit (or fp32) params, fp32 master + moments
  partitioned by the data-parallel size N (a separate fp32 master copy even in fp32 training),
  two ``reduce_bucket_size`` gradient buffers (``overlap_comm`` double buffering) during backward,
  the gradient partition (``grads_in_partition``, model dtype, Psi/N), and at the step a
  flattened copy of that partition plus its fp32 conversion. Stage 1 in DeepSpeed 0.19 uses the
  same contiguous partitioned gradient path as stage 2 (same bytes).
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): 16-bit param partitions (Psi/N) plus persistent
  small params (numel <= param_persistence_threshold, kept whole), fetched (all-gathered) params
  of the blocks in flight, the fp16/bf16 gradient partition buffer, reduce buckets, fp32 master +
  moments partitions; at the step the fp32 gradient of the sub group.
* Offload (``_model_states``), as DeepSpeed 0.19 places it: ZeRO-1/2 ``offload_optimizer`` (cpu
  or nvme: stages 1/2 have no NVMe swapper) moves master weights, moments and the fp32 gradient
  partition to pinned host RAM, with a largest-parameter staging buffer on each side; ZeRO-3
  ``offload_optimizer`` also moves the 16-bit gradient partitions to the host (stage3.py
  ``self.device``), nvme swaps master/moments/fp32 gradients to NVMe through pinned swap buffers;
  ``offload_param`` moves the 16-bit partitions to the host (cpu) or NVMe through pinned buffers,
  and the GPU keeps the fetched working set. No figure is ever negative.
* Gradient accumulation (``_accumulation_carry``): what lives across micro-steps, per optimizer
  wrapper, with the DeepSpeed lines it comes from.
* The training loop: ``loop="keep_outputs"`` (default) keeps ``outputs.logits`` alive through
  backward, the step and the next forward, as the usual ``outputs = engine(**batch)`` loop does.

Activations follow Korthikanti et al. 2022 (Reducing Activation Recomputation in Large
Transformer Models, sec. 4) per operation, adapted to the reference decoders of
``autotune.profile.models`` (which mirror HF Llama / GPT-2): RMSNorm with the fp32 upcast
(4 + 2p bytes per element), LayerNorm (2p + fp32 mean/rstd), q/k/v sized by GQA, sdpa (flash:
output + fp32 log-sum-exp, no s^2) vs eager (fp32 softmax + probabilities), SwiGLU (4 tensors
of width f) vs GELU (2), dropout masks (1 byte) where the spec has dropout, per-block
checkpointing (full: block input only; selective: attention core recomputed), and the logits:
the fp32 upcast and log-softmax of the loss, which dominate small models with large
vocabularies.

The peak is the maximum over three phases: forward end (all saved activations plus the loss
transients), backward (start: logits gradient; then per block, saved activations still alive
plus gradients/buckets produced so far plus the recomputation of a checkpointed block), and the
optimizer step (states plus the step's gradient copies).

Validation: ``benchmarks/memory_vs_deepspeed.py`` runs real DeepSpeed 0.19 steps on the CPU
accelerator (1 and 2 gloo ranks, ZeRO 0-3, checkpointing none/selective/full, bf16/fp32, sdpa
and eager, Llama- and GPT-2-style) and compares ``peak`` (``device="cpu"``) with the peak tensor
bytes of torch.profiler's allocation events. Surprises found on the way, all reflected above:
ZeRO-0 flattens every gradient for the all-reduce even on one rank; stage 1 allocates exactly
like stage 2; ZeRO-1/2 keep a separate fp32 master copy even in fp32 training and allocate their
reduce buckets only at the first gradient hook; ZeRO-3 keeps gathered params alive across forward
and backward (reuse distance 1e9) and allocates its gradient partition once at init.

Not modelled: tensor/pipeline/sequence parallelism, MoE, pinned-memory fragmentation, the
caching allocator's block rounding beyond ``hardware.allocator_slack``, NCCL internals (part of
``cuda_context_gib``), attention dropout under sdpa on CPU (PyTorch's CPU flash kernel has no
dropout, it falls back to the math kernel with s^2 buffers; on GPU dropout is free), the host
copy of the model each rank builds before ``deepspeed.initialize`` (use zero.Init for big models).
Also found on allocation traces and modelled: ZeRO-1/2 with several ranks flatten each bucket
again to all-reduce it (``allreduce_bucket``), which makes the end of backward the peak under full
checkpointing; tied embeddings keep the LM head's weight gradient alive through every block's
backward (one AccumulateGrad for both uses); a block's MLP backward (input gradient of the down
projection, a gated MLP's factor gradients, the down projection's weight gradient) tops the
recomputed block's activations. Earlier CPU "retention" of gloo buckets and a ZeRO-3 2-rank gap of
~5% were not memory at all: c10's CPU tally ignored frees on gloo's threads (see
``autotune.profile.worker._track_all_threads``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, data_parallel_size, default_buckets, gradient_accumulation_steps, validate

_DS_SUB_GROUP = 1_000_000_000
"""ZeRO-3 sub_group_size autotune writes (elements)."""
_DS_MAX_LIVE = 1_000_000_000
"""stage3_max_live_parameters / stage3_max_reuse_distance autotune writes (elements)."""

GPU_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead")

GIB = 1 << 30

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_DS_ALLREDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``allreduce_bucket_size`` (elements), used by ZeRO-0 gradient all-reduce."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one training step (bytes), where its peak falls, and the verdict."""

    gpu: dict[str, int]
    """GPU_COMPONENTS plus ``peak`` (predicted max_memory_allocated, overhead excluded)."""
    peak_phase: str
    """``forward`` | ``backward`` | ``optimizer``."""
    cpu_bytes_per_node: int
    """Host RAM that offload (and its pinned buffers) needs per node."""
    nvme_bytes_per_node: int
    """NVMe bytes that ZeRO-Infinity offload needs per node."""
    fits: bool
    """Whether peak + overhead fits the GPU (minus headroom) and host RAM / NVMe suffice."""
    reasons: list[str] = field(default_factory=list)
    """Why it does not fit, in words."""
    phases: dict[str, int] = field(default_factory=dict)
    """Predicted allocated bytes at the peak of each phase (forward/backward/optimizer)."""
    activation_peak: int = 0
    """Largest activations + logits at any point of the step (the peak's own may be smaller when
    the step's peak falls where model states dominate, e.g. the optimizer step)."""

    @property
    def total_gpu_bytes(self) -> int:
        """Peak plus overhead: what must fit in the GPU."""
        return self.gpu["peak"] + self.gpu["overhead"]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_gpu_bytes"] = self.total_gpu_bytes
        return d


PREDICTION_MARGIN = 0.01
"""The memory model's worst measured under-prediction of a job's peak, rounded up, as a fraction of
the peak: ``python benchmarks/memory_vs_deepspeed.py --json out.json`` (102 configs, the max over
measured optimizer steps and ranks; worst -0.73%, see the README's Accuracy section).
``estimate_memory`` adds this fraction of the predicted peak to ``gpu["overhead"]``, so ``fits`` and
the recommended point keep that much headroom beyond ``search.headroom``."""


def overhead_bytes(hardware: HardwareSpec, peak_allocated: float) -> int:
    """Memory outside the allocator's live tensors: the CUDA context plus the caching allocator's
    fragmentation, a fraction of the allocated peak (hardware.cuda_context_gib, allocator_slack)."""
    return int(hardware.cuda_context_gib * GIB + hardware.allocator_slack * peak_allocated)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _partition(n: int, dp: int) -> int:
    """Elements of one data-parallel partition (DeepSpeed pads to equal partitions)."""
    return -(-n // dp)


# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------

def _norm_saved(m: ModelSpec, p: int) -> float:
    """Bytes per token one norm keeps for backward, its output (saved by the next linear) included."""
    h = m.hidden_size
    if m.norm == "rmsnorm_fp32":
        # HF GemmaRMSNorm / Olmo2RMSNorm: x.float() (4h), rsqrt (4), the fp32 normalised value
        # saved by the fp32 weight multiply (4h), the output cast to the model dtype (p h). OLMo2's
        # post-norms save the same: their output feeds the residual, the linears save the block input.
        return 8 * h + p * h + 4
    if m.norm == "rmsnorm":
        # HF LlamaRMSNorm: x.float() (4h), rsqrt (4), h.to(dtype) (p h), weight * h (p h)
        return 4 * h + 2 * p * h + 4
    # native_layer_norm saves input (p h), mean and rstd (fp32); output saved by the linear (p h)
    return 2 * p * h + 8


def _sdpa_math(m: ModelSpec, device: str) -> bool:
    """sdpa with attention dropout on the CPU: PyTorch's CPU flash kernel has no dropout, so
    ``scaled_dot_product_attention`` falls back to ``_scaled_dot_product_attention_math``
    (aten/src/ATen/native/transformers/attention.cpp), in fp32 for bf16/fp16 inputs on the CPU.
    On CUDA the flash / memory-efficient kernels apply dropout from an RNG seed: nothing extra."""
    return m.attn_implementation == "sdpa" and m.attention_dropout > 0 and device == "cpu"


def _attention_core_saved(m: ModelSpec, p: int, s: int, mask_bytes: int, device: str = "cuda") -> float:
    """Bytes per token the attention core (softmax(QK^T)V) keeps, q/k/v inputs included."""
    q, kv, a = m.q_size, m.kv_size, m.num_attention_heads
    if _sdpa_math(m, device):
        # math path (measured with saved_tensors_hooks, torch 2.13 CPU): fp32 copies of the scaled
        # q and k (k repeated for GQA), v (fp32, repeated), the fp32 softmax output, the fp32
        # dropout noise and the dropout output (each b x a x s x s); the output is not saved, the
        # contiguous copy o_proj saves is (p q)
        kv_eff = q if m.num_key_value_heads < a else kv
        return 4 * (q + 2 * kv_eff) + 12 * a * s + p * q
    if m.attn_implementation == "sdpa":
        # flash kernels save q, k, v, out and the fp32 log-sum-exp; no s x s matrix. The CPU kernel
        # allocates out like q (aten/src/ATen/native/transformers/attention.cpp, empty_like): q made
        # by torch.cat (rotary_concat) gives a per-head contiguous out, and o_proj saves its copy
        n = p * (q + 2 * kv) + p * q + 4 * a
        return n + p * q if m.rotary_concat else n
    rep = a // m.num_key_value_heads
    kv_eff = q if rep > 1 else kv  # repeat_kv copies are what the matmuls save
    n = p * q + 2 * p * kv_eff  # q, k (QK^T), v (PV)
    n += 4 * a * s  # fp32 softmax output (saved by softmax backward)
    if m.attn_logit_softcapping:
        n += p * a * s  # tanh output of the score softcapping (transformers modeling_gemma2.py)
    if m.attention_dropout > 0:
        n += (mask_bytes + p) * a * s  # dropout mask and dropout output (saved by PV)
    elif p < 4:
        n += p * a * s  # probabilities cast back to the model dtype (saved by PV)
    n += p * q  # output (b,a,s,hd) transposed back: contiguous copy saved by o_proj
    return n


def _attention_core_selective(m: ModelSpec, p: int) -> float:
    """Attention core under selective checkpointing: only its inputs q, k, v and its output."""
    q, kv = m.q_size, m.kv_size
    return p * (q + 2 * kv) + p * q


def _attention_sublayer_saved(m: ModelSpec, p: int, s: int, mask_bytes: int, device: str, core: str) -> float:
    """Per token, what the attention module (projections, core, its residual dropout) keeps, its
    input (the norm's output, counted with the norm) excluded. ``core``: ``"full"`` or
    ``"selective"`` (core recomputed, Korthikanti et al. 2022 sec. 5)."""
    if core == "selective":
        n = _attention_core_selective(m, p)
    else:
        n = _attention_core_saved(m, p, s, mask_bytes, device)
    if m.qk_norm != "none":
        # HF q_norm / k_norm (RMSNorm with the fp32 upcast, Qwen3 per head, OLMo2 over the whole
        # projection): the fp32 input, the normalised value in the model dtype (saved by the weight
        # multiply) and one fp32 rsqrt per normalised vector; the output goes to rope / attention
        # (Olmo2RMSNorm multiplies the weight in fp32: the fp32 normalised value instead)
        width = m.q_size + m.kv_size
        vectors = (m.num_attention_heads + m.num_key_value_heads) if m.qk_norm == "head" else 2
        n += (8 if m.norm == "rmsnorm_fp32" else 4 + p) * width + 4 * vectors
    if m.fused_qkv and m.position_embedding == "rope" and core != "selective":
        # rotary makes new q and k, v stays a view of the fused projection's output: attention
        # keeps that whole output (q + 2 kv) where separate projections keep v alone
        n += p * (m.q_size + m.kv_size)
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size  # its residual-branch dropout mask
    return n


def _mlp_sublayer_saved(m: ModelSpec, p: int, mask_bytes: int) -> float:
    """Per token, what the MLP module keeps, its input (the norm's output) excluded."""
    f = m.intermediate_size
    n = (4 if m.gated_mlp else 2) * p * f
    if m.implementation == "hf" and m.hidden_act == "gelu_new":
        # transformers activations.py NewGELUActivation is a Python composite,
        # 0.5*x*(1+tanh(c*(x+0.044715*x^3))): autograd keeps x, tanh(.), 0.5*x and 1+tanh(.)
        # where F.gelu(approximate="tanh") keeps x alone: three more f-wide tensors.
        n += 3 * p * f
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size  # its residual-branch dropout mask
    return n


def _op_sac_saved(m: ModelSpec, p: int, s: int, device: str, zero3_linear: bool = False) -> float:
    """Per token, what op-level selective checkpointing keeps of a block (``autotune.checkpointing
    .op_sac_context``, torchtitan's policy): the block input, the attention kernel's outputs (out
    and the fp32 log-sum-exp of sdpa's flash kernels; eager and the CPU math path are recomputed)
    and the output of every other ``aten.mm`` in the block's order (1st, 3rd, ...). Biased linears
    run ``addmm``, which is recomputed and not counted, except under ZeRO-3 (``zero3_linear``):
    DeepSpeed's memory-efficient linear computes a batched input as ``matmul`` plus the bias
    (deepspeed/runtime/zero/linear.py ``LinearFunctionForZeroStage3``), unless the model calls
    ``torch.addmm`` itself (``linear_addmm``, HF GPT-2's Conv1D)."""
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
    biased_mm = zero3_linear and not m.linear_addmm
    qkv_mm = biased_mm or not (m.bias or m.qkv_bias or m.linear_addmm)
    rest_mm = biased_mm or not (m.bias or m.linear_addmm)
    if m.fused_qkv:  # Phi-3 qkv_proj / gate_up_proj, GPT-NeoX query_key_value
        linears = [(q + 2 * kv, qkv_mm), (h, rest_mm)]
        linears += [(2 * f, rest_mm)] if m.gated_mlp else [(f, rest_mm)]
    else:
        linears = [(q, qkv_mm), (kv, qkv_mm), (kv, qkv_mm), (h, rest_mm)]
        linears += [(f, rest_mm), (f, rest_mm)] if m.gated_mlp else [(f, rest_mm)]
    linears.append((h, rest_mm))
    mm_widths = [width for width, is_mm in linears if is_mm]
    n = p * h + p * sum(mm_widths[0::2])
    if m.attn_implementation == "sdpa" and not _sdpa_math(m, device):
        n += p * q + 4 * m.num_attention_heads
    return n


def block_activation_bytes_per_token(m: ModelSpec, p: int, s: int, checkpointing: str = "none",
                                     mask_bytes: int = 1, device: str = "cuda", zero3_linear: bool = False) -> float:
    """Bytes per token one block keeps for backward (Korthikanti et al. 2022, per operation).

    ``checkpointing``: ``full`` keeps the block input only; ``attention`` / ``mlp`` checkpoint that
    module (the sublayer inside the norms, as HF decoder layers hold it: the checkpoint's input is
    the norm output the norm count already has); ``op`` keeps what the op-level selective policy
    saves (``_op_sac_saved``); ``selective`` recomputes the attention core.
    ``mask_bytes``: bytes per element of a dropout mask (1 on CUDA: bool mask of the fused
    kernel; the model dtype's size on CPU, whose dropout multiplies by a noise tensor).
    """
    h = m.hidden_size
    if checkpointing == "full":
        return p * h  # the block input saved by the checkpoint
    if checkpointing == "op":
        return _op_sac_saved(m, p, s, device, zero3_linear)
    # the two pre-norms' outputs are saved by the next linear; extra (post-)norms (Gemma2) feed the
    # residual add, which saves nothing
    n = 2 * _norm_saved(m, p) + (m.norms_per_block - 2) * (_norm_saved(m, p) - p * h)
    if m.parallel_residual and m.norm == "layernorm":
        n -= p * h  # both pre-norms save the same block input (native_layer_norm): one tensor
    if checkpointing != "attention":
        n += _attention_sublayer_saved(m, p, s, mask_bytes, device, "selective" if checkpointing == "selective" else "full")
    if checkpointing != "mlp":
        n += _mlp_sublayer_saved(m, p, mask_bytes)
    return n


def _attention_backward_transient(m: ModelSpec, p: int, s: int, device: str = "cuda") -> float:
    """Gradient buffers of the attention core's backward, per token, beyond its saved tensors.

    Eager: the probabilities' gradient in the model dtype next to the fp32 gradient of the
    softmax (s x s per head). sdpa/flash: dq, dk, dv. sdpa's CPU math path (dropout): fp32
    gradients of the dropout output and of the softmax (s x s per head).
    """
    if _sdpa_math(m, device):
        # the softmax gradient next to the dropout output's gradient (fp32, s x s per head), after
        # the PV matmul's backward released the saved dropout output (fp32, s x s per head)
        return 4 * m.num_attention_heads * s
    if m.attn_implementation == "eager":
        return (4 + p) * m.num_attention_heads * s
    return p * (m.q_size + 2 * m.kv_size)


def _mlp_backward_transient(m: ModelSpec, p: int, mask_bytes: int) -> float:
    """Per token, what the MLP's backward adds next to the block's saved tensors (its peak).

    Measured on allocation traces of real CPU steps (benchmarks/memory_vs_deepspeed.py, and a
    SwiGLU MLP alone under non-reentrant checkpointing): the down projection's input gradient
    (f wide). A gated MLP's multiply backward then adds the gradients of both factors while that
    input gradient is alive, but the product (the down projection's saved input) was released
    after the down projection's backward: +2 f-wide net. With residual dropout, the dropout
    backward's output (h) while the dropout mask itself has been released. The down projection's
    weight gradient (f x h, not per token) is added by the caller.
    """
    n = (2 if m.gated_mlp else 1) * p * m.intermediate_size
    if m.hidden_dropout > 0:
        n += p * m.hidden_size - mask_bytes * m.hidden_size
    return n


def _composite_gelu_backward_transient(m: ModelSpec, p: int) -> float:
    """Per token, the peak of HF's composite GELU backward (NewGELUActivation, 0.5*x*(1+tanh(.))).

    Its last multiply's backward makes the gradients of both factors (f wide each) while the
    incoming gradient is alive, after the down projection's backward released the activation's
    output (its saved input): +2 f-wide net, without the down projection's weight gradient
    (already accumulated). Measured on allocation traces of transformers' GPT2MLP (torch 2.13
    CPU): +2.25 f above the forward end, against +1.5 f for F.gelu(approximate="tanh").
    """
    if m.implementation == "hf" and m.hidden_act == "gelu_new" and not m.gated_mlp:
        return 2 * p * m.intermediate_size
    return 0.0


CPU_RNG_STATE_BYTES = 5056
"""``torch.get_rng_state()`` (the CPU mt19937 generator's state), which a non-reentrant checkpoint
keeps per checkpointed region to replay dropout (torch/utils/checkpoint.py ``preserve_rng_state``);
host memory on GPUs, where the device generator's state is a few bytes."""


def _block_fixed_bytes(m: ModelSpec, s: int, checkpointing: str, device: str = "cuda") -> float:
    """Per-block bytes independent of the micro-batch (eager attention's s x s causal mask; the RNG
    state a checkpointed region keeps, on the CPU)."""
    n = 0.0
    if m.attn_implementation == "eager" and checkpointing == "none":
        n += s * s
    if checkpointing != "none" and device == "cpu":
        n += CPU_RNG_STATE_BYTES
    return n


def _nonblock_saved_per_token(m: ModelSpec, p: int, mask_bytes: int = 1) -> float:
    """Final norm, embedding dropout mask and the loss's fp32 log-softmax output (per token)."""
    n = _norm_saved(m, p) + 4 * m.vocab_size
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size
    return n


def activation_breakdown(model: ModelSpec, training: TrainingSpec, strategy: Strategy,
                         device: str = "cuda") -> dict[str, float]:
    """Saved activations at the end of the forward pass (bytes per GPU) and the loss transients."""
    m, s, b = model, training.seq_len, strategy.micro_batch_size
    p = _DTYPE_BYTES[strategy.precision]
    mb = p if device == "cpu" else 1
    tokens = b * s
    L = m.num_hidden_layers
    n_ck = min(strategy.num_checkpointed(L), L)
    gran = strategy.checkpointing if n_ck else "none"
    per_plain = block_activation_bytes_per_token(m, p, s, "none", mb, device) * tokens + _block_fixed_bytes(m, s, "none")
    per_ck = (block_activation_bytes_per_token(m, p, s, gran, mb, device, zero3_linear=strategy.zero_stage == 3) * tokens
              + _block_fixed_bytes(m, s, gran, device))
    blocks = n_ck * per_ck + (L - n_ck) * per_plain
    rope = 2 * s * m.head_size * p if m.position_embedding == "rope" else 0
    nonblock = _nonblock_saved_per_token(m, p, mb) * tokens + rope
    V = m.vocab_size
    # Gemma2's final_logit_softcapping, cap * tanh(logits / cap): tanh keeps its output (model dtype)
    softcap = p * V * tokens if m.final_logit_softcapping else 0.0
    nonblock += softcap
    if m.implementation == "hf" and m.attn_implementation == "eager" and n_ck and gran in ("full", "op", "attention"):
        # HF's 4-D additive masks (model dtype): the checkpoints keep them as inputs of the block /
        # attention module
        # (transformers masking_utils.py eager_mask; without checkpointing they die with the forward)
        nonblock += m.num_attention_masks * b * s * s * p
    # forward end: logits (model dtype), their fp32 copy and log_softmax's output coexist
    loss_fwd = (p + 4) * V * tokens if p < 4 else 4 * V * tokens
    # backward start: nll grad + log_softmax grad (fp32) next to the saved log_softmax output,
    # then the cast to the model dtype
    loss_bwd = 8 * V * tokens
    return {
        "blocks": blocks,
        "per_block_plain": per_plain,
        "per_block_checkpointed": per_ck,
        "num_checkpointed": n_ck,
        "granularity": gran,
        "nonblock": nonblock,
        "logits_saved": 4 * V * tokens + softcap,
        "loss_forward_transient": loss_fwd,
        "loss_backward_transient": loss_bwd,
        "recompute": (per_plain - per_ck) if n_ck else 0.0,
        "mlp_saved_per_block": (4 if m.gated_mlp else 2) * p * m.intermediate_size * tokens,
        "attention_backward_transient": _attention_backward_transient(m, p, s, device) * tokens,
        "final_norm_saved": _norm_saved(m, p) * tokens,
        "hidden_grad": p * m.hidden_size * tokens,
        "mlp_backward_transient": max(_mlp_backward_transient(m, p, mb) * tokens + p * m.intermediate_size * m.hidden_size,
                                      _composite_gelu_backward_transient(m, p) * tokens),
    }


# ---------------------------------------------------------------------------------------------
# model states
# ---------------------------------------------------------------------------------------------

def _largest_param(m: ModelSpec) -> int:
    """Elements of the largest single parameter tensor."""
    d = m.hidden_size
    return max(m.vocab_size * d, d * m.intermediate_size, d * m.q_size,
               m.max_position_embeddings * d if m.position_embedding == "learned" else 0)


@functools.lru_cache(maxsize=4096)
def _persistent_params(m: ModelSpec, threshold: int) -> int:
    """ZeRO-3 params with numel <= threshold stay whole on every rank (norm weights, biases...)."""
    d = m.hidden_size
    sizes: list[int] = []
    norm = [d] * (2 if (m.norm == "layernorm" and m.bias) else 1)
    block = norm * m.norms_per_block
    if m.qk_norm == "head":
        block += [m.head_size] * 2
    elif m.qk_norm == "full":
        block += [m.q_size, m.kv_size]
    if m.bias:
        block += [m.q_size, m.kv_size, m.kv_size, d] + [m.intermediate_size] * (2 if m.gated_mlp else 1) + [d]
    for t in (d * m.q_size, d * m.kv_size, d * m.kv_size, m.q_size * d):
        block.append(t)
    f = m.intermediate_size
    block += [d * f] * (3 if m.gated_mlp else 2)
    sizes += block * m.num_hidden_layers
    sizes += norm + [m.vocab_size * d]
    if m.position_embedding == "learned":
        sizes.append(m.max_position_embeddings * d)
    if not m.tie_word_embeddings:
        sizes.append(m.vocab_size * d)
    return sum(n for n in sizes if n <= threshold)


@dataclass
class _States:
    params: float = 0.0
    grads: float = 0.0            # gradients held at the end of backward (model dtype)
    optimizer: float = 0.0        # fp32 master + moments on the GPU
    buffers_bwd: float = 0.0      # DeepSpeed buffers alive from the first gradient on (buckets, live params)
    buffers_bwd_end: float = 0.0  # extra buffers at the end of backward (ZeRO-0 all-reduce flatten)
    buffers_step: float = 0.0     # extra buffers at the optimizer step
    buffers_fwd: float = 0.0      # extra buffers during forward (ZeRO-3 fetched params)
    grad_per_block: float = 0.0   # gradient bytes that accumulate per block during backward
    grad_buffer: float = 0.0      # gradient storage allocated once and resident (ZeRO-3 partition)
    resident_buffers: float = 0.0  # other always-allocated buffers (ZeRO-3 reduce bucket)
    partition_after: float = 0.0  # ZeRO-1/2: grads (elements) after which the partition buffer exists
    reduce_flat: float = 0.0      # ZeRO-1/2, several ranks: flat copy of a bucket while it is all-reduced
    cpu: float = 0.0              # host bytes per GPU (offload)
    nvme: float = 0.0             # NVMe bytes per GPU


def _model_states(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy,
                  device: str = "cuda") -> _States:
    psi = m.num_parameters
    dp = data_parallel_size(hardware)
    p = _DTYPE_BYTES[s.precision]
    k_opt = 8 if training.optimizer in ("adam", "adamw") else 4  # moments (sgd: momentum)
    out = _States()
    buckets = default_buckets(m, s)
    if s.zero_stage == 0:
        out.params = p * psi
        out.grads = p * psi
        master = 4 * psi if p < 4 else 0
        out.optimizer = (k_opt * psi) + master
        bucket = min(_DS_ALLREDUCE_BUCKET, psi)
        out.buffers_bwd_end = p * bucket  # allreduce_bucket flattens the grads (even on one rank)
        out.buffers_step = 4 * psi if p < 4 else 0  # flattened fp32 grads
        out.grad_per_block = p * m.block_params()
        return out
    part = _partition(psi, dp)
    off_opt = s.offload_optimizer != "none"
    if s.zero_stage in (1, 2):
        out.params = p * psi
        bucket = min(buckets["reduce_bucket_size"], psi)
        out.grads = p * part  # grads_in_partition (allocated when the first bucket is reduced)
        out.partition_after = bucket
        if off_opt:
            # ZeRO-Offload (stage_1_and_2.py: any offload_optimizer device, nvme included, sets
            # cpu_offload; stages 1/2 have no NVMe swapper): fp32 master, moments and the fp32
            # gradient partition live in host RAM; reduced gradients go straight from the reduce
            # buckets to the host through temp_grad_buffer_for_gpu_offload (GPU) and
            # temp_grad_buffer_for_cpu_offload (host, pinned), both of the largest parameter in
            # the model dtype, so the GPU holds no gradient partition. With gradient accumulation
            # the partition accumulates on the host (accumulated_grads_in_cpu, model dtype).
            out.optimizer = 0
            out.grads = 0
            out.resident_buffers = p * _largest_param(m)
            out.buffers_bwd = 2 * p * bucket
            out.buffers_step = 0
            gas = gradient_accumulation_steps(s, training, hardware)
            # + param_buffer_of_bit16_for_cpu_offload_groups: a pinned model-dtype copy of the
            # partition the updated master weights are cast into (stage_1_and_2.py, __init__)
            host = (4 + k_opt + 4 + p) * part + p * _largest_param(m) + (p * part if gas > 1 else 0)
        else:
            out.optimizer = (4 + k_opt) * part
            out.buffers_bwd = 2 * p * bucket  # ipg double buffer (overlap_comm)
            fp32_grad = 4 * part if p < 4 else 0
            out.buffers_step = p * part + max(p * bucket, fp32_grad)
            host = 0
        if dp > 1:
            # each bucket reduce goes through allreduce_and_scatter -> allreduce_bucket, which
            # flattens the bucket's gradients (zero/stage_1_and_2.py allreduce_bucket: self.flatten)
            out.reduce_flat = p * bucket
        out.grad_per_block = 0
    else:  # stage 3
        host = 0.0
        thr = buckets["param_persistence_threshold"]
        persist = _persistent_params(m, thr)
        rb = buckets["reduce_bucket_size"]
        prefetch = buckets["prefetch_bucket_size"]
        # Fetched (all-gathered) params stay alive while their reuse distance is below
        # stage3_max_reuse_distance and their count below stage3_max_live_parameters (autotune
        # writes 1e9 for both, like HF's "auto"): up to 1e9 params stay gathered through forward
        # and backward. With one rank the gathered tensor is the partition itself.
        off_par = s.offload_params != "none"
        # ... except when the partitions live on the host (offload_param): then every block is
        # fetched to the GPU, one rank or many
        # (on DeepSpeed's CPU accelerator "fetching" a host partition to the device is no copy)
        fetch_copies = dp > 1 or (off_par and device != "cpu")
        live = p * min(psi - persist, _DS_MAX_LIVE + prefetch) if fetch_copies else 0.0
        out.params = (0 if off_par else p * part) + p * persist
        # the reduce bucket (ipg buffer) is allocated at init on the GPU (stage3.py
        # _setup_for_real_optimizer: "bucket.buffer = torch.empty(self.reduce_bucket_size, ...)")
        out.resident_buffers = p * min(rb, psi)
        out.grads = 0
        out.buffers_fwd = live
        out.buffers_bwd = live
        if off_opt:
            # stage3.py: self.device = "cpu" when the optimizer is offloaded, and the gradient
            # partitions (grad_partitions_flat_buffer, gradient_accumulation_dtype = model dtype)
            # are allocated there, pinned: no gradient partition and no optimizer state on the GPU
            out.grad_buffer = 0
            out.optimizer = 0
            out.buffers_step = 0
            if s.offload_optimizer == "cpu":
                host += (4 + k_opt + 4) * part + p * part  # master, moments, fp32 grads; grad partitions
            else:
                # ZeRO-Infinity: master, moments and fp32 gradients swap to NVMe; the host keeps the
                # pinned gradient partitions and buffer_count (4) pinned fp32 swap buffers of one
                # sub group (autotune writes sub_group_size 1e9)
                out.nvme += (4 + k_opt + 4) * part
                host += p * part + 4 * 4 * min(_DS_SUB_GROUP, part)
        else:
            # the 16-bit gradient partition is allocated once, at init, on the GPU (stage3.py
            # grad_partitions_flat_buffer on self.device)
            out.grad_buffer = p * part
            out.optimizer = (4 + k_opt) * part
            out.buffers_step = (4 * part if p < 4 else 0) + p * part
        if s.offload_params == "cpu":
            host += p * part  # the 16-bit parameter partitions, pinned
        elif s.offload_params == "nvme":
            # partitions swap to NVMe through buffer_count (5) x buffer_size (1e8) pinned buffers
            # (autotune's offload_param config; AsyncPartitionedParameterSwapper)
            out.nvme += p * part
            host += 5 * 100_000_000 * p
    out.cpu = host
    return out


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------

Loop = Literal["keep_outputs", "drop_outputs"]
LOOPS: tuple[str, ...] = ("keep_outputs", "drop_outputs")


def _accumulation_carry(m: ModelSpec, hardware: HardwareSpec, s: Strategy, gas: int) -> tuple[float, bool]:
    """Bytes that live across the micro-steps of one optimizer step (gradient accumulation > 1),
    and whether a later micro-step's backward still grows gradients block by block.

    * ZeRO-0 (plain optimizer, FP16_Optimizer / FP16_UnfusedOptimizer): ``param.grad`` keeps
      the whole model's gradients (model dtype) from the first micro-step on; later micro-steps
      add into them in place, the all-reduce runs only at the boundary (engine.py
      ``allreduce_gradients``: "Communicate only at gradient accumulation boundaries").
    * ZeRO-1 (``partition_gradients`` False): nothing is reduced before the boundary
      (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``: ``if self.partition_gradients
      or self.is_gradient_accumulation_boundary()``), so the epilogue's ``all_grad_tensors``
      (``independent_gradient_partition_epilogue``, ``get_all_grad_tensors``) keeps full-size
      gradients, and the ipg double buffer (two reduce buckets, model dtype) they were gathered
      in stays referenced; measured on allocation traces (benchmarks/memory_vs_deepspeed.py, 1 and
      2 ranks): the gradients plus the two buckets, where the boundary micro-step reuses the
      buckets rather than adding new ones.
    * ZeRO-2: each micro-step reduces into ``grads_in_partition``; the epilogue keeps that
      partition in ``all_grad_tensors`` and the next micro-step allocates a new one to add into
      it (stage_1_and_2.py ``copy_grads_in_partition`` / ``accumulated_grad.add_``): one
      partition (Psi/N, model dtype) lives across micro-steps.
    * ZeRO-3: the gradient partition buffer allocated at init accumulates in place
      (stage3.py ``partition_grads``: ``grad_buffer.add_``): nothing extra.
    With optimizer offload the accumulated gradients live in host RAM (not modelled on the GPU).
    FP16 with loss scaling (ZeRO-0 fp16: ``FP16_Optimizer``) carries like ZeRO-0 bf16.
    ``BF16_Optimizer`` (fp32 gradient accumulation buffers) is picked only for ZeRO-1 with
    ``data_types.grad_accum_dtype: fp32`` or with pipeline parallelism (engine.py
    ``_do_optimizer_sanity_check``), and ``contiguous_gradients`` is always on in the configs
    autotune writes (strategy.py ``to_deepspeed_config``): neither is modelled.
    """
    if gas <= 1 or s.offload_optimizer != "none":
        return 0.0, True
    p = _DTYPE_BYTES[s.precision]
    psi = m.num_parameters
    part = _partition(psi, data_parallel_size(hardware))
    if s.zero_stage == 0:
        return float(p * psi), False
    if s.zero_stage == 1:
        bucket = min(default_buckets(m, s)["reduce_bucket_size"], psi)
        return float(p * psi + 2 * p * bucket), True
    if s.zero_stage == 2:
        return float(p * part), True
    return 0.0, True


def estimate_memory(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategy: Strategy,
                    *, headroom: float = 0.0, device: str = "cuda", loop: Loop = "keep_outputs") -> MemoryEstimate:
    """Predict per-GPU peak memory of a steady-state step, host/NVMe needs and the verdict.

    ``device="cpu"`` predicts the same step on DeepSpeed's CPU accelerator (the benchmark's
    ground truth): dropout masks in the model dtype instead of 1-byte bool, and sdpa with
    attention dropout on PyTorch's math kernel.

    ``loop``: ``keep_outputs`` (default, the larger) is the loop people write,
    ``outputs = engine(**batch); engine.backward(outputs.loss); engine.step()``: ``outputs`` holds
    the logits (model dtype) through backward, the step and the next forward, until the name is
    rebound; ``drop_outputs`` keeps only the loss (the logits die inside the forward).
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    m, s = model, strategy
    p = _DTYPE_BYTES[s.precision]
    st = _model_states(m, training, hardware, s, device)
    act = activation_breakdown(m, training, s, device)
    L = m.num_hidden_layers
    tokens = training.seq_len * s.micro_batch_size
    saved_blocks, nonblock, logits_saved = act["blocks"], act["nonblock"], act["logits_saved"]
    other_saved = nonblock - logits_saved  # final norm, masks, rope tables
    # the logits the user's ``outputs`` keeps (lm_head output, model dtype; fp32 training: the
    # very tensor the loss reads): alive everywhere in the steady state, the previous micro-step's
    # through the next forward until ``outputs`` is rebound
    kept = p * m.vocab_size * tokens if loop == "keep_outputs" else 0.0
    gas = gradient_accumulation_steps(s, training, hardware)
    carry, grow = _accumulation_carry(m, hardware, s, gas)
    # ZeRO-1: part of the carry is the ipg double buffer (2 reduce buckets) filled in the earlier
    # micro-steps; where the boundary micro-step's own buckets are counted, they are those buffers
    carry_ipg = st.buffers_bwd if (carry and s.zero_stage == 1) else 0.0

    fixed = st.params + st.optimizer + st.grad_buffer + st.resident_buffers
    cands: list[tuple[str, float, float, float, float, float]] = []  # phase, total, grads, act, logits, buffers

    # a tied head's gradient waits in autograd's input buffer of the shared weight until the
    # embedding's backward (one AccumulateGrad for both uses): outside param.grad until then
    pending_head = p * m.vocab_size * m.hidden_size if m.tie_word_embeddings else 0.0

    def add(phase: str, grads: float = 0.0, activations: float = 0.0, logits: float = 0.0,
            buffers: float = 0.0, pending: float = 0.0) -> None:
        logits += kept
        if phase != "optimizer":
            # later micro-steps: accumulated gradients (ZeRO-0 adds into them in place, but not
            # what autograd still holds, ``pending``)
            grads = grads + carry - min(carry_ipg, buffers) if grow else max(grads - pending, carry) + pending
        cands.append((phase, fixed + grads + activations + logits + buffers, grads, activations, logits, buffers))

    # forward end: everything saved plus the loss transient (logits, their fp32 copy, log_softmax)
    add("forward", activations=saved_blocks + other_saved, logits=logits_saved + act["loss_forward_transient"],
        buffers=st.buffers_fwd)
    # backward start: the logits gradient (fp32 nll grad + log_softmax grad next to its saved output);
    # DeepSpeed's gradient buffers appear with the first parameter gradient, right after
    add("backward", activations=saved_blocks + other_saved, logits=logits_saved + act["loss_backward_transient"],
        buffers=st.buffers_fwd)
    head = m.vocab_size * m.hidden_size
    # lm_head backward: its weight gradient is computed next to the logits gradient (model dtype)
    add("backward", grads=p * head, activations=saved_blocks + other_saved, logits=p * m.vocab_size * tokens,
        buffers=st.buffers_fwd, pending=pending_head)
    # its gradient hook: ZeRO-1/2 allocate the reduce buckets (the logits gradient is gone)
    add("backward", grads=p * head, activations=saved_blocks + other_saved, buffers=st.buffers_bwd,
        pending=pending_head)
    # the head's weight gradient stays alive through the blocks: ZeRO-0 keeps every gradient; with
    # tied embeddings autograd holds it in the shared weight's input buffer until the embedding's
    # own backward has added its part (one AccumulateGrad for both uses), so no hook fires before
    head_grad = p * head if (s.zero_stage == 0 or m.tie_word_embeddings) else 0.0
    # through the blocks (last to first): saved activations shrink while gradients accumulate;
    # a checkpointed block is recomputed (its full activations) before its backward
    n_ck = int(act["num_checkpointed"])
    bucket = st.partition_after or 0
    per_plain, per_ck = act["per_block_plain"], act["per_block_checkpointed"]
    attn_delta = act["attention_backward_transient"] - act["mlp_saved_per_block"]
    block_params = m.block_params()
    # the state at block i is linear in i within a run of same-kind blocks, so only the ends of
    # each run (and both sides of the point where ZeRO-1/2's gradient partition appears) matter
    points = {L - 1, n_ck, n_ck - 1, 0}
    reduces: dict[int, bool] = {}  # block -> whether the gradient partition exists at its bucket reduce
    if bucket and block_params:
        k = int(max(0.0, bucket - head) // block_params)  # blocks done before the partition exists
        k2 = int(max(0.0, 2 * bucket - head) // block_params)  # ... before the second reduce
        points.update({L - 1 - k, L - 2 - k, L - 2 - k2})
        if st.reduce_flat:
            reduces = {L - 2 - k2: True, L - 2 - k: False}
    # during the blocks' backward the final norm's saved tensors are already released, and the
    # gradient of the hidden states (one h-wide tensor per token) flows from block to block
    block_other = other_saved - act["final_norm_saved"] + act["hidden_grad"]
    mlp_bwd = act["mlp_backward_transient"]
    for i in sorted((i for i in points if 0 <= i < L), reverse=True):
        ck = i < n_ck
        done = L - 1 - i  # blocks whose backward is complete
        remaining = min(i + 1, n_ck) * per_ck + max(0, i + 1 - n_ck) * per_plain
        g_before = head_grad + done * st.grad_per_block  # without ZeRO-1/2's gradient partition
        g = g_before + (st.grads if bucket and head + done * block_params > bucket else 0.0)
        # a checkpointed block is recomputed in full; what its checkpoint saved (the block input,
        # or selective's kept tensors) is part of the recomputed set, not a second copy
        a = remaining + (per_plain - per_ck if ck else 0.0) + block_other
        # a checkpointed attention module is recomputed only after the MLP's backward
        a_mlp = a - (per_plain - per_ck) if (ck and act["granularity"] == "attention") else a
        add("backward", grads=g, activations=a_mlp + mlp_bwd, buffers=st.buffers_bwd, pending=pending_head)
        if attn_delta > 0:  # its attention backward: MLP tensors freed, the core's gradients appear
            add("backward", grads=g, activations=a + attn_delta, buffers=st.buffers_bwd, pending=pending_head)
        if i in reduces:  # a bucket is all-reduced during this block's backward
            add("backward", grads=g if reduces[i] else g_before, activations=a,
                buffers=st.buffers_bwd + st.reduce_flat, pending=pending_head)
    # backward end: all gradients, ZeRO-0's flat all-reduce bucket
    add("backward", grads=st.grads, buffers=st.buffers_bwd + st.buffers_bwd_end)
    if st.reduce_flat:  # the last bucket's reduce; the partition exists if an earlier reduce made it
        add("backward", grads=st.grads if m.num_parameters > bucket else 0.0,
            buffers=st.buffers_bwd + st.reduce_flat)
    # optimizer step
    add("optimizer", grads=st.grads, buffers=st.buffers_step)

    phases: dict[str, int] = {}
    best = cands[0]
    for c in cands:
        if c[1] > phases.get(c[0], -1):
            phases[c[0]] = int(c[1])
        if c[1] > best[1]:
            best = c
    peak_phase = best[0]
    gpu = {"parameters": int(st.params), "gradients": int(st.grad_buffer + best[2]),
           "optimizer_states": int(st.optimizer), "activations": int(best[3]), "logits": int(best[4]),
           "buffers": int(st.resident_buffers + best[5])}
    peak = sum(gpu.values())
    # + the measured worst-case under-prediction of the model (PREDICTION_MARGIN)
    gpu["overhead"] = overhead_bytes(hardware, peak) + int(PREDICTION_MARGIN * peak)
    gpu = {k: gpu[k] for k in GPU_COMPONENTS} | {"peak": int(peak)}

    gpn = hardware.gpus_per_node
    cpu = int(st.cpu * gpn)
    nvme = int(st.nvme * gpn)
    reasons = list(validate(s, m, training, hardware))
    avail = hardware.gpu.memory_bytes * (1.0 - headroom)
    total = gpu["peak"] + gpu["overhead"]
    if total > avail:
        biggest = max(GPU_COMPONENTS[:-1], key=lambda k: gpu[k])
        reasons.append(
            f"peak {_gib(total)} (incl. {_gib(gpu['overhead'])} overhead) > {_gib(avail)} free on "
            f"{hardware.gpu.name}; largest part: {biggest.replace('_', ' ')} {_gib(gpu[biggest])}"
        )
        if gpu[biggest] > avail:
            reasons.append(f"{biggest.replace('_', ' ')} {_gib(gpu[biggest])} > {_gib(avail)} free")
    cpu_avail = hardware.cpu_memory_gib * GIB
    if cpu > cpu_avail:
        reasons.append(f"offload needs {_gib(cpu)} host RAM per node > {_gib(cpu_avail)} available")
    if nvme:
        cap = hardware.nvme.capacity_gib * GIB if hardware.nvme else 0
        if nvme > cap:
            reasons.append(f"offload needs {_gib(nvme)} NVMe per node > {_gib(cap)} available")
    return MemoryEstimate(gpu=gpu, peak_phase=peak_phase, cpu_bytes_per_node=cpu, nvme_bytes_per_node=nvme,
                          fits=not reasons, reasons=reasons, phases=phases,
                          activation_peak=int(max(c[3] + c[4] for c in cands)))


def zero_model_states(num_parameters: float, dp: int, stage: int, precision: str = "fp16", *,
                      offload_optimizer: bool = False) -> dict[str, float]:
    """Model states per GPU by the ZeRO paper's rule, plus DeepSpeed's estimator's count.

    ``parameters``/``gradients``/``optimizer_states``/``total``: Rajbhandari et al. 2020
    (Figure 1): 2 + 2 + K bytes per parameter (K = 12: fp32 master + two moments; 8 in pure
    fp32 training with 4-byte params and grads), partitioned by stage (1: optimizer, 2: +grads,
    3: +params). ``deepspeed``: what ``estimate_zero2/3_model_states_mem_needs`` counts on the
    GPU (2 + 18/N for ZeRO-2, the extra 4 bytes being the fp32 gradient partition; 18/N for
    ZeRO-3 without its largest-layer term; with optimizer offload only the 16-bit params).
    """
    psi, n = float(num_parameters), dp
    p = _DTYPE_BYTES[precision]
    k = 12 if p < 4 else 8
    params = p * psi / (n if stage >= 3 else 1)
    grads = p * psi / (n if stage >= 2 else 1)
    opt = k * psi / (n if stage >= 1 else 1)
    if offload_optimizer:
        ds = params
    else:
        if stage == 2:
            ds = params + (p + 4 + k) * psi / n
        elif stage == 3:  # DeepSpeed counts 18 B/param/N here (16-bit params + grads + K + 2)
            ds = (2 * p + k + 2) * psi / n
        else:
            ds = params + grads + opt
    return {"parameters": params, "gradients": grads, "optimizer_states": opt, "total": params + grads + opt,
            "deepspeed": ds}


def model_states_bytes(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                       strategy: Strategy) -> dict[str, int]:
    """:func:`zero_model_states` for a model / strategy (ints, bytes per GPU)."""
    ms = zero_model_states(model.num_parameters, data_parallel_size(hardware), strategy.zero_stage,
                           strategy.precision, offload_optimizer=strategy.offload_optimizer != "none")
    return {k: int(v) for k, v in ms.items()}
