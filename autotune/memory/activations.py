"""Activation memory per block and outside the blocks, per operation (Korthikanti et al. 2022,
sec. 4, adapted to the reference decoders and HF families; see the package docstring)."""

from __future__ import annotations

import functools

from autotune.memory import mla, moe
from autotune.memory.breakdown import ActivationBreakdown
from autotune.memory.common import host_pinned, pinned_bytes
from autotune.memory.expert_parallel import (ep_backward_transient, ep_forward_transient, ep_row_saved, ep_saved,
                                              step_rows)
from autotune.memory.mixed import dense_block_spec, layer_kinds, mixed_breakdown
from autotune.memory.split import NO_SPLIT, Split, loss_tile_tokens, mlp_tile_tokens, split_attention, tile_lengths
from autotune.spec import BYTES_PER_ELEMENT, ModelSpec, TrainingSpec
from autotune.strategy import Strategy


def _norm_saved(m: ModelSpec, p: int, device: str = "cuda") -> float:
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
    # native_layer_norm saves input (p h), mean and rstd; output saved by the linear (p h). mean and rstd are
    # fp32 on CUDA (layer_norm_cuda: the input's accumulate type), the parameters' dtype on the CPU
    # (layer_norm.cpp layer_norm_cpu: param_scalar_type; the engines hold the norm's weight in the model dtype)
    return 2 * p * h + (2 * p if device == "cpu" else 8)


RMS_NORM_BACKWARD_LIVE = 24.0
"""Bytes per token and unit of width that torch's RMSNorm holds at its backward's peak (PowBackward0's last
multiply, torch/csrc/autograd/FunctionsManual.cpp ``pow_backward``): its fp32 input and five fp32 h-wide
tensors (traced: test_final_norm_backward_peak_matches_an_allocation_trace)."""


def _block_norm_backward_live(m: ModelSpec, p: int) -> float:
    """Per token, a block's torch RMSNorm at its backward's peak: ``RMS_NORM_BACKWARD_LIVE``, as the final
    norm's (``final_norm_backward_live``); in fp32 one fp32 tensor fewer, the incoming gradient
    needing no fp32 copy (``ToCopyBackward0`` a no-op; allocation trace of hf-llama-long ZeRO-2 fp32
    under TiledMLP, where the final norm's trace keeps five: its gradient comes from the fp32 lm_head).
    Only the 2- and 4-norm blocks were traced (activation_breakdown applies it to those)."""
    # Gemma-2/3 (four norms): the first norm's backward, the post-feedforward norm's before the tiled MLP's,
    # holds the block output's gradient beside it and four fp32 per-token scalars (rsqrt and mean gradients)
    # (allocation traces of a Gemma-3 block under tiled MLP and full checkpointing: ZeRO-1 bf16, ZeRO-0 fp32)
    first = ((p * m.hidden_size + 16.0) if p < 4 else (8.0 * m.hidden_size + 4.0)) if m.norms_per_block == 4 else 0.0
    return (RMS_NORM_BACKWARD_LIVE - (4.0 if p == 4 else 0.0)) * m.hidden_size + first


def _sdpa_math(m: ModelSpec, device: str) -> bool:
    """sdpa with attention dropout on the CPU: PyTorch's CPU flash kernel has no dropout, so
    ``scaled_dot_product_attention`` falls back to ``_scaled_dot_product_attention_math``
    (aten/src/ATen/native/transformers/attention.cpp), in fp32 for bf16/fp16 inputs on the CPU.
    On CUDA the flash / memory-efficient kernels apply dropout from an RNG seed: nothing extra."""
    return m.attn_implementation == "sdpa" and m.attention_dropout > 0 and device == "cpu"


def _sliding_mask_built(m: ModelSpec, s: int) -> bool:
    """HF sdpa with a sliding window no longer than the sequence: transformers builds the mask
    instead of passing ``is_causal`` (masking_utils.py ``_ignore_causal_mask_sdpa``: ``if
    local_attention_size is not None and kv_length >= local_attention_size: return False``), a
    (1, 1, s, s) bool mask expanded over the batch (``sdpa_mask``)."""
    return (m.implementation == "hf" and m.attn_implementation == "sdpa" and m.sliding_window is not None
            and s >= m.sliding_window)


def _v_view_kept(m: ModelSpec, p: int, batch: int, device: str) -> bool:
    """sdpa's CPU math path saves v itself, a view of its projection's output, not a copy: in fp32 nothing
    upcasts v, and with one sequence per micro-batch ``at::matmul`` folds the batch into the heads as a view
    (torch 2.13 aten/src/ATen/native/LinearAlgebra.cpp ``matmul``), which the PV bmm saves. A repeated v
    (GQA) is a copy."""
    return _sdpa_math(m, device) and p == 4 and batch == 1 and m.num_key_value_heads == m.num_attention_heads


def _fused_output_kept(m: ModelSpec, p: int, batch: int, device: str) -> bool:
    """v's view (``_v_view_kept``) keeps a fused q/k/v projection's whole output (Phi-3 qkv_proj, GPT-NeoX
    query_key_value, GPT-2's Conv1D c_attn; measured with saved-tensor hooks: batch 1 keeps p (q + kv) bytes
    per token more than batch 2)."""
    return _v_view_kept(m, p, batch, device) and (m.fused_qkv or m.linear_addmm)


def _selective_inputs_unsaved(m: ModelSpec, p: int, batch: int, device: str) -> float:
    """Per token, under ``selective`` on sdpa's CPU math path: the storage of the core's inputs (q, k, v) that
    its checkpoint keeps (autotune.models.checkpointing.checkpoint_attention_core) and a plain core does not,
    alive beside the recomputed core (the math path saves fp32 copies of the scaled q and k, and of v but
    as ``_fused_output_kept`` says): rotated q and k (their own tensors), v's storage (a fused projection's
    whole output) unless the plain core keeps it (allocation trace of hf-gpt2 ZeRO-0 seq 512 selective
    bf16: the bf16 c_attn output beside the recomputed fp32 copies)."""
    if m.is_mla:
        return mla.inputs_unsaved(m, p, batch, device)
    if not _sdpa_math(m, device):
        return 0.0
    q, kv = m.q_size, m.kv_size
    fused = m.fused_qkv or m.linear_addmm
    own_qk = 0 if (fused and m.position_embedding != "rope") else p * (q + kv)  # else views of the fused output
    return float(own_qk + (0 if _v_view_kept(m, p, batch, device) else p * ((q + 2 * kv) if fused else kv)))


def _attention_core_saved(m: ModelSpec, p: int, s: int, mask_bytes: int, device: str = "cuda",
                          batch: int = 2) -> float:
    """Bytes per token the attention core (softmax(QK^T)V) keeps, q/k/v inputs included; ``batch``: the
    sequences of a micro-batch (only sdpa's CPU math path reads it, ``_fused_output_kept``)."""
    q, kv, a = m.q_size, m.kv_size, m.num_attention_heads
    if _sdpa_math(m, device):
        # math path (measured with saved_tensors_hooks, torch 2.13 CPU): fp32 copies of the scaled
        # q and k (k repeated for GQA), v (fp32, repeated), the fp32 softmax output, the fp32
        # dropout noise and the dropout output (each b x a x s x s); the output is not saved, the
        # contiguous copy o_proj saves is (p q); v a view of a fused projection's whole output instead
        kv_eff = q if m.num_key_value_heads < a else kv
        kept = p * (q + kv) if _fused_output_kept(m, p, batch, device) else 0
        return 4 * (q + 2 * kv_eff) + 12 * a * s + p * q + kept
    if m.attn_implementation == "sdpa":
        # flash kernels save q, k, v, out and the fp32 log-sum-exp; no s x s matrix. The CPU kernel
        # allocates out like q (aten/src/ATen/native/transformers/attention.cpp, empty_like): q made
        # by torch.cat (rotary_concat) gives a per-head contiguous out, and o_proj saves its copy
        n = p * (q + 2 * kv) + p * q + 4 * a
        if _sliding_mask_built(m, s):
            # a bool mask becomes an additive (b, 1, s, s) one in the query dtype, which the kernel
            # saves (aten/src/ATen/native/transformers/attention.cpp convert_boolean_attn_mask); with
            # a mask transformers repeats k and v for GQA instead of enable_gqa
            # (integrations/sdpa_attention.py use_gqa_in_sdpa), so the kernel saves those copies
            n += p * s + (2 * p * (q - kv) if m.num_key_value_heads < a else 0)
        return n + p * q if m.rotary_concat else n
    rep = a // m.num_key_value_heads
    kv_eff = q if rep > 1 else kv  # repeat_kv copies are what the matmuls save
    if m.attention_sinks:
        # gpt-oss eager_attention_forward: the scores and the sink column concatenated, less their row max
        # (max keeps its int64 indices), softmax in the model dtype (its output, s + 1 wide, kept; PV keeps
        # the view without the sink column); dropout 0 returns its input
        return p * q + 2 * p * kv_eff + p * a * (s + 1) + 8 * a + p * q
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


def _eager_weights_returned(m: ModelSpec, p: int, s: int) -> float:
    """Per token, the attention weights transformers' eager attention returns beside its output
    (``eager_attention_forward``: the dropout's output in the model dtype; gpt-oss's a view of its softmax
    over the scores and the sink column, s + 1 wide), which the decoder layer holds (``hidden_states, _ =
    self.self_attn(...)``) until its forward returns: through the feed-forward, beyond what a checkpointed
    core saves (allocation trace of hf-gptoss-sv FSDP2 selective fp32: the last block's experts' forward
    peak). sdpa returns none."""
    if m.attn_implementation != "eager":
        return 0.0
    return float(p * m.num_attention_heads * (s + 1 if m.attention_sinks else s))


def _attention_core_selective(m: ModelSpec, p: int) -> float:
    """Attention core under selective checkpointing: only its inputs q, k, v and its output."""
    q, kv = m.q_size, m.kv_size
    return p * (q + 2 * kv) + p * q


def _attention_sublayer_saved(m: ModelSpec, p: int, s: int, mask_bytes: int, device: str, core: str,
                              batch: int = 2) -> float:
    """Per token, what the attention module (projections, core, its residual dropout) keeps, its
    input (the norm's output, counted with the norm) excluded. ``core``: ``"full"`` or
    ``"selective"`` (core recomputed, Korthikanti et al. 2022 sec. 5); ``batch``: sequences per micro-batch."""
    if m.is_mla:  # DeepSeek-V2's latent attention (mla.py)
        return mla.attention_saved(m, p, s, device, core, batch)
    if core == "selective":
        n = _attention_core_selective(m, p)
    else:
        n = _attention_core_saved(m, p, s, mask_bytes, device, batch)
    if m.qk_norm != "none":
        # HF q_norm / k_norm (RMSNorm with the fp32 upcast, Qwen3 per head, OLMo2 over the whole
        # projection): the fp32 input, the normalised value in the model dtype (saved by the weight
        # multiply) and one fp32 rsqrt per normalised vector; the output goes to rope / attention
        # (Olmo2RMSNorm multiplies the weight in fp32: the fp32 normalised value instead)
        width = m.q_size + m.kv_size
        vectors = (m.num_attention_heads + m.num_key_value_heads) if m.qk_norm == "head" else 2
        n += (8 if m.norm == "rmsnorm_fp32" else 4 + p) * width + 4 * vectors
    if (m.fused_qkv and m.position_embedding == "rope" and (core != "selective" or m.implementation == "hf")
            and (core == "selective" or not _sdpa_math(m, device))):
        # rotary makes new q and k, v stays a view of the fused projection's output: attention (or
        # the checkpoint of HF's selective, autotune.models.checkpointing.checkpoint_attention_core, which
        # keeps its inputs) keeps that whole output (q + 2 kv) where separate projections keep v alone
        # (sdpa's CPU math path only as _fused_output_kept says, counted with the core)
        n += p * (m.q_size + m.kv_size)
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size  # its residual-branch dropout mask
    return n


def _mlp_saved_per_token(m: ModelSpec, p: int) -> float:
    """Per token, the MLP's f-wide saved tensors (a MoE block's: the router's and the routed pairs',
    ``moe.moe_saved_per_token``): ``mlp_saved_per_block`` per token."""
    return moe.moe_saved_per_token(m, p) if m.is_moe else (4 if m.gated_mlp else 2) * p * m.intermediate_size


def _mlp_sublayer_saved(m: ModelSpec, p: int, mask_bytes: int) -> float:
    """Per token, what the MLP module keeps, its input (the norm's output) excluded."""
    f = m.intermediate_size
    n = _mlp_saved_per_token(m, p)  # a MoE block: the router's and the routed pairs' saved tensors (moe.py)
    if m.implementation == "hf" and m.hidden_act == "gelu_new" and not m.is_moe:
        # transformers activations.py NewGELUActivation is a Python composite,
        # 0.5*x*(1+tanh(c*(x+0.044715*x^3))): autograd keeps x, tanh(.), 0.5*x and 1+tanh(.)
        # where F.gelu(approximate="tanh") keeps x alone: three more f-wide tensors.
        n += 3 * p * f
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size  # its residual-branch dropout mask
    return n


def _block_linears(m: ModelSpec, zero3_linear: bool = False) -> list[tuple[int, bool]]:
    """A block's linears in call order (q, k, v or the fused qkv; o; the MLP's input projection(s);
    the down projection last; a MoE block's router and shared expert, ``_moe_linears``) as (output width,
    runs ``aten.mm``): ``_attention_linears`` then ``_ffn_linears``."""
    return _attention_linears(m, zero3_linear) + _ffn_linears(m, zero3_linear)


def _mm_flags(m: ModelSpec, zero3_linear: bool) -> tuple[bool, bool]:
    """Whether the q/k/v projections and the other linears run ``aten.mm``. Biased linears run ``addmm``,
    except under ZeRO-3 (``zero3_linear``), whose memory-efficient linear computes a batched input as
    ``matmul`` plus the bias (deepspeed/runtime/zero/linear.py ``LinearFunctionForZeroStage3``), unless the
    model calls ``torch.addmm`` itself (``linear_addmm``, HF GPT-2's Conv1D)."""
    biased_mm = zero3_linear and not m.linear_addmm
    return biased_mm or not (m.bias or m.qkv_bias or m.linear_addmm), biased_mm or not (m.bias or m.linear_addmm)


def _attention_linears(m: ModelSpec, zero3_linear: bool = False) -> list[tuple[int, bool]]:
    """``_block_linears``' attention part: q, k, v or the fused qkv (Phi-3 qkv_proj, GPT-NeoX
    query_key_value), then o."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    qkv_mm, rest_mm = _mm_flags(m, zero3_linear)
    if m.fused_qkv:
        return [(q + 2 * kv, qkv_mm), (h, rest_mm)]
    return [(q, qkv_mm), (kv, qkv_mm), (kv, qkv_mm), (h, rest_mm)]


def _ffn_linears(m: ModelSpec, zero3_linear: bool = False) -> list[tuple[int, bool]]:
    """``_block_linears``' feed-forward part: the MLP's input projection(s) (Phi-3's fused gate_up_proj) and
    the down projection, or a MoE block's router and shared expert (``_moe_linears``)."""
    if m.is_moe:
        return _moe_linears(m)
    h, f = m.hidden_size, m.intermediate_size
    rest_mm = _mm_flags(m, zero3_linear)[1]
    up = ([(2 * f, rest_mm)] if m.fused_qkv else [(f, rest_mm)] * 2) if m.gated_mlp else [(f, rest_mm)]
    return up + [(h, rest_mm)]


def _moe_linears(m: ModelSpec) -> list[tuple[int, bool]]:
    """A MoE block's feed-forward linears in call order, as ``_block_linears`` lists them (measured with
    op_sac_context's policy on the benchmark's tiny families: docs/moe.md). The routed experts run
    ``aten._grouped_mm`` (integrations/moe.py ``grouped_mm_experts_forward``), no ``aten.mm``, so only the
    router and the shared expert count: the router's linear on the 2-D tokens runs ``mm``, gpt-oss's biased
    one ``addmm`` (ZeRO-3's linear too: deepspeed/runtime/zero/linear.py takes ``addmm`` for a 2-D input with a
    bias); Qwen2-MoE's bias-free shared expert (gate, up, down) runs before the router and its
    ``shared_expert_gate`` (width 1) after the routed experts (modeling_qwen2_moe.py
    ``Qwen2MoeSparseMoeBlock.forward``). DeepSeek's blocks are not described (op refused for latent attention)."""
    h, fs = m.hidden_size, m.shared_expert_intermediate_size
    router = [(m.num_experts, not m.router_bias)]
    if m.shared_expert_gate:
        return [(fs, True), (fs, True), (h, True)] + router + [(1, True)]
    return router


def _op_sac_saved(m: ModelSpec, p: int, device: str, zero3_linear: bool = False, tiles: tuple[int, ...] = ()) -> float:
    """Per token, what op-level selective checkpointing keeps of a block (``autotune.models.checkpointing
    .op_sac_context``, torchtitan's policy): the block input, the attention kernel's outputs (out
    and the fp32 log-sum-exp of sdpa's flash kernels; eager and the CPU math path are recomputed)
    and the output of every other ``aten.mm`` in the block's order (1st, 3rd, ...; ``_block_linears``:
    an ``addmm`` is recomputed and not counted). ``tiles``: TiledMLP's tile lengths of one sequence
    (``tile_lengths``; empty: untiled): its tiles run the MLP's linears one tile after the other under
    ``no_grad``, and the policy's caching mode counts and keeps their ``mm`` outputs all the same
    (torch/utils/checkpoint.py ``_CachingTorchDispatchMode`` does not read the grad mode)."""
    h, q = m.hidden_size, m.q_size
    # a MoE block: the attention's linears, then the router's and the shared expert's (``_moe_linears``)
    # the mm outputs in call order, each with its share of the tokens: the attention's over the whole
    # sequence, then the feed-forward's, once or tile by tile
    shares = [length / sum(tiles) for length in tiles] if tiles else [1.0]
    mms = [(w, 1.0) for w, is_mm in _attention_linears(m, zero3_linear) if is_mm]
    mms += [(w, share) for share in shares for w, is_mm in _ffn_linears(m, zero3_linear) if is_mm]
    n = p * h + p * sum(w * share for w, share in mms[0::2])
    if m.attn_implementation == "sdpa" and not _sdpa_math(m, device):
        n += p * q + 4 * m.num_attention_heads
    return n


def block_activation_bytes_per_token(m: ModelSpec, p: int, s: int, checkpointing: str = "none",
                                     mask_bytes: int = 1, device: str = "cuda", zero3_linear: bool = False,
                                     batch: int = 2, tiles: tuple[int, ...] = ()) -> float:
    """Bytes per token one block keeps for backward (Korthikanti et al. 2022, per operation).

    ``checkpointing``: ``full`` keeps the block input only; ``attention`` / ``mlp`` checkpoint that
    module (the sublayer inside the norms, as HF decoder layers hold it: the checkpoint's input is
    the norm output the norm count already has); ``op`` keeps what the op-level selective policy
    saves (``_op_sac_saved``); ``selective`` recomputes the attention core.
    ``mask_bytes``: bytes per element of a dropout mask (1 on CUDA: bool mask of the fused
    kernel; the model dtype's size on CPU, whose dropout multiplies by a noise tensor). ``batch``: the
    micro-batch's sequences (sdpa's CPU math path keeps more with one, ``_fused_output_kept``);
    ``tiles``: TiledMLP's tile lengths under ``op`` (``_op_sac_saved``).
    """
    h = m.hidden_size
    # Granite's residual + h * residual_multiplier and inputs_embeds * embedding_multiplier
    # (modeling_granitemoe.py GraniteMoeDecoderLayer / GraniteMoeModel.forward) keep nothing (MulBackward0
    # of a scalar); the product's gradient beside the residual's (p h) lives only through the sub-layer's
    # last op's backward (o_proj's, the experts' final gather), below the instants modelled after it
    # (the attention core's, the MoE's routing-weight multiply; measured: docs/moe.md, Granite-MoE)
    if checkpointing == "full":
        return p * h  # the block input saved by the checkpoint
    if checkpointing == "op":
        return _op_sac_saved(m, p, device, zero3_linear, tiles)
    # the two pre-norms' outputs are saved by the next linear; extra (post-)norms (Gemma2) feed the
    # residual add, which saves nothing
    n = 2 * _norm_saved(m, p, device) + (m.norms_per_block - 2) * (_norm_saved(m, p, device) - p * h)
    if m.parallel_residual and m.norm == "layernorm":
        n -= p * h  # both pre-norms save the same block input (native_layer_norm): one tensor
    if checkpointing != "attention":
        n += _attention_sublayer_saved(m, p, s, mask_bytes, device, "selective" if checkpointing == "selective" else "full",
                                       batch)
    if checkpointing != "mlp":
        n += _mlp_sublayer_saved(m, p, mask_bytes)
    return n


def _attention_backward_transient(m: ModelSpec, p: int, s: int, device: str = "cuda", mask_bytes: int = 1) -> float:
    """Gradient buffers of the attention core's backward, per token, beyond its saved tensors.

    Eager (torch's engine, the core's ops last first): PV's backward makes the probabilities' gradient
    (the model dtype) and dv beside every saved tensor and its incoming gradient; then the softmax's
    backward holds the fp32 gradient of its output (the incoming one cast up, or itself in fp32) and
    ``_softmax_backward_data``'s fp32 result once PV's saved s x s tensor (the probabilities cast to the
    model dtype, or the dropout's output and its noise) is released: the larger of the two (s x s per
    head). With gpt-oss's sinks (softmax in the model dtype) the probabilities' gradient in the model
    dtype next to an fp32 one. sdpa/flash: dq, dk, dv. sdpa's CPU math path (dropout): fp32 gradients of
    the dropout output and of the softmax (s x s per head).
    """
    if _sdpa_math(m, device):
        # the PV matmul's backward (fp32): the probabilities' gradient (s x s per head) and dv (v repeated for
        # GQA) beside the saved dropout output and the incoming fp32 gradient of the output; then the softmax
        # gradient takes the dropout output's place (allocation trace of hf-gpt2 fsdp2 seq 512 selective fp32)
        kv_eff = m.q_size if m.num_key_value_heads < m.num_attention_heads else m.kv_size
        return 4 * m.num_attention_heads * s + 4 * (m.q_size + kv_eff)
    if m.attn_implementation == "eager":
        if m.attention_sinks:
            return (4 + p) * m.num_attention_heads * s
        a = m.num_attention_heads
        saved_by_pv = (mask_bytes + p) if m.attention_dropout > 0 else (p if p < 4 else 0)
        v = m.q_size if a > m.num_key_value_heads else m.kv_size  # dv beside the saved (repeated) v
        return max(p * a * s + p * v + p * m.q_size, (8 - saved_by_pv) * a * s)  # + PV's incoming gradient
    if _sliding_mask_built(m, s) and m.num_key_value_heads < m.num_attention_heads:
        return 3 * p * m.q_size  # dk, dv of the repeated k, v (_attention_core_saved)
    return p * (m.q_size + 2 * m.kv_size)


def _math_core_forward_transient(m: ModelSpec, p: int, batch: int, s: int) -> float:
    """Per token, sdpa's CPU math path at its forward's end beyond what it saves (torch 2.13
    aten/src/ATen/native/transformers/attention.cpp ``_scaled_dot_product_attention_math``, allocation
    traces of the kernel alone, fp32 and bf16, one and two sequences): its fp32 output; in bf16 the fp32
    copies of q and k (locals until it returns), the probabilities cast back (``attn.to(origin_dtype)``, s x s
    per head) and the output cast; with several sequences a q-sized copy for the batched matmul of a q laid
    out (b, s, heads, d), which rotary's ``torch.cat`` does not leave (in bf16 also v's fp32 copy, whose
    contiguous clone is what PV saves). With grouped kv heads (transformers' ``use_gqa_in_sdpa``: no mask,
    ``enable_gqa``) the kernel repeats k and v itself (``repeat_interleave``), one q-sized fp32 tensor more at
    its peak than with as many kv heads as q heads (traces of the kernel alone, bf16 and fp32, one and two
    sequences: 4 q bytes per token). The (s, s) fp32 causal mask is per micro-batch, added by the caller,
    and so are the core's inputs, alive in the attention module's frame (``_selective_inputs_unsaved``)."""
    q, a = m.q_size, m.num_attention_heads
    gqa = m.num_key_value_heads < a
    kv_eff = q if gqa else m.kv_size
    n = 4 * q + (4 * q if batch > 1 and not m.rotary_concat else 0) + (4 * q if gqa else 0)
    if p < 4:
        n += 4 * (q + kv_eff) + (4 * kv_eff if batch > 1 else 0) + p * a * s + p * q
    return float(n)


def _released_before_core(m: ModelSpec, p: int, mask_bytes: int, device: str, tiled_mlp: bool = False) -> float:
    """Per token, what a block's backward has released of its saved tensors (beyond the MLP's
    ``mlp_saved_per_block``) when its eager attention core's backward runs: o_proj's input (the core's
    output made contiguous, transformers ``eager_attention_forward``) and, blocks run in sequence,
    everything saved after the core: the MLP's pre-norm and the post-norms (Gemma2's
    post_attention_layernorm and post_feedforward_layernorm), the residual dropout masks, the MLP's saves
    beyond its f-wide tensors (HF's composite GELU). The PV matmul's saved v and the gradient it gives
    (dv) are the same size and swap places. Read off the allocation traces of hf-gemma2 fsdp2 mbs 1 seq
    512 full bf16 and of the reference GPT-2 with attention dropout (benchmarks/peak_trace_worker.py: the
    peak at block 0's softmax backward; docs/accuracy.md); sdpa's CPU math path the same (its s x s
    instant reaches the peak: allocation trace of hf-gpt2 fsdp2 seq 512 selective fp32). sdpa's kernels
    nothing (their core's output is what o_proj reads, and their backward instant stays below the MLP's);
    latent attention on the math path all but o_proj's input, which ``mla.backward_transient`` releases."""
    if not (mla.math_kernel(m, device) if m.is_mla else m.attn_implementation == "eager" or _sdpa_math(m, device)):
        return 0.0
    n = 0 if m.is_mla else p * m.q_size
    if m.parallel_residual:  # both branches read the block input: the MLP's norm may still be ahead
        return float(n)
    h, norm = m.hidden_size, _norm_saved(m, p, device)
    n += norm + (m.norms_per_block - 2) * (norm - p * h)
    masks = mask_bytes * h if m.hidden_dropout > 0 else 0
    extra = masks if tiled_mlp else _mlp_sublayer_saved(m, p, mask_bytes) - _mlp_saved_per_token(m, p)
    return float(n + extra + masks)


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


def _dense_mlp_backward(m: ModelSpec, p: int, mask_bytes: int, tokens: float) -> tuple[float, float]:
    """A dense MLP's backward peak beyond the block's saved tensors (bytes per block), with the down
    projection's weight gradient (f x h) held through the rest of the MLP's backward (ZeRO-0's
    ``param.grad``) and released right after its AccumulateGrad (states.py ``ffn_grads_released``).

    Held: the multiply's instant (``_mlp_backward_transient``) beside it, or HF's composite GELU's
    (``_composite_gelu_backward_transient``, counted without it) when larger. Released (allocation traces
    of real CPU steps, benchmarks/peak_trace_worker.py: Llama at 4096 tokens, ZeRO-2, the 22,016-byte
    down weight gradient freed at its AccumulateGrad before the multiply that holds the peak): the down
    projection's own backward, its input gradient (f wide) beside its weight gradient while its saved
    input is still alive (the residual dropout's term as at the multiply), above the multiply when h >
    tokens; the gated multiply without the weight gradient; the composite GELU's last multiply without the
    residual dropout's mask either, which the dropout's backward released before c_proj's (GPT-2 ZeRO-0
    GA 2, ZeRO-1 GA 1 and GA 4 traces: the mask freed, then c_proj's input gradient and its consumed output
    gradient, then the GELU's two f-wide gradients at the peak). Held keeps the composite GELU's instant as
    it was measured where it is the peak: without the weight gradient (the current block's, alive as
    ``param.grad`` under ZeRO-0 GA 1) and with the mask, p f h against ``mask_bytes`` h per token, equal in
    the benchmark's GPT-2 shapes (f = tokens, CPU masks in the model dtype)."""
    f, h = m.intermediate_size, m.hidden_size
    per_token = _mlp_backward_transient(m, p, mask_bytes)
    weight = p * f * h
    gelu = _composite_gelu_backward_transient(m, p)
    held = max(per_token * tokens + weight, gelu * tokens)
    dropout = per_token - (2 if m.gated_mlp else 1) * p * f  # the residual dropout's term (0 without)
    mask = mask_bytes * h if (gelu and m.hidden_dropout > 0) else 0
    released = max(per_token * tokens, (p * f + dropout) * tokens + weight, (gelu - mask) * tokens)
    return held, released


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


def _checkpoint_frame_kept(m: ModelSpec, p: int, checkpointing: str, zero3_linear: bool = False,
                           tiled_mlp: bool = False) -> float:
    """Per token, what a ``full`` / ``op`` checkpoint keeps through its block's backward beyond the
    recomputed block's own saved tensors (the checkpoint frame lives until the block's last node ran):
    * the block input (``_CheckpointFrame.save_inputs``, torch/utils/checkpoint.py) when the first
      op copies it: RMSNorm's ``x.to(torch.float32)`` in bf16/fp16 (in fp32 a no-op, so the
      recomputed norm saves that very tensor; LayerNorm saves its input itself);
    * op-level: the cached output of the block's last kept ``aten.mm`` (the down projection, when
      it is an odd-numbered mm), which early-stopped recomputation never reaches
      (``_recomputation_hook.pack_hook`` raises ``_StopRecomputationError`` at the last saved
      tensor, its input), so ``_CachedTorchDispatchMode`` never consumes that storage entry; not
      when something after it saves a tensor (residual dropout, post-norms, a MoE block's routed experts
      after its last ``mm``, the router's or Qwen2-MoE's shared-expert gate: ``_moe_linears``), nor under
      TiledMLP (``tiled_mlp``), whose input is packed after its forward ran every tile (a custom
      Function's saved tensors are packed once it returns), so the recomputation consumes them all."""
    n = 0.0
    h = m.hidden_size
    if checkpointing in ("full", "op") and m.norm in ("rmsnorm", "rmsnorm_fp32") and p < 4:
        n += p * h
    if checkpointing == "op" and m.hidden_dropout == 0 and m.norms_per_block == 2 and not m.is_moe and not tiled_mlp:
        *before, (_, down_mm) = _block_linears(m, zero3_linear)
        n_mm_before = sum(is_mm for _, is_mm in before)
        if down_mm and n_mm_before % 2 == 0:  # the down projection is mm number n_mm_before + 1: odd, kept
            n += p * h
    return n


def _block_fixed_bytes(m: ModelSpec, s: int, checkpointing: str, device: str = "cuda", p: int = 4) -> float:
    """Per-block bytes independent of the micro-batch (eager attention's s x s mask, a checkpoint's CPU RNG state)."""
    n = 0.0
    if m.attn_implementation == "eager" and checkpointing == "none" and m.implementation != "hf":
        n += s * s  # the reference decoder's bool causal mask, per block (HF builds its masks once: nonblock)
    if checkpointing != "none" and device == "cpu":
        n += CPU_RNG_STATE_BYTES
    if m.is_moe and checkpointing in ("none", "attention", "selective"):
        n += moe.moe_fixed_bytes(m, p)  # the MoE keeps its grouped_mm offsets where its MLP is not recomputed
    return n


def _final_norm_forward_extra(m: ModelSpec, p: int, tokens: int, s: int, checkpointed: bool) -> float:
    """Bytes alive at the end of the final norm's forward beyond what it saves (activation_breakdown)."""
    n = 0.0
    if m.norm in ("rmsnorm", "rmsnorm_fp32") and p < 4:
        n += ((4 + p) * m.hidden_size + 4) * tokens
    if m.implementation == "hf":
        n += (p * m.hidden_size * tokens if p < 4 else 0.0) + (0.0 if checkpointed else 8 * s)
    return n


def _nonblock_saved_per_token(m: ModelSpec, p: int, mask_bytes: int = 1, device: str = "cuda") -> float:
    """Final norm, embedding dropout mask and the loss's fp32 log-softmax output (per token)."""
    n = _norm_saved(m, p, device) + 4 * m.vocab_size
    if m.hidden_dropout > 0:
        n += mask_bytes * m.hidden_size
    return n


def activation_breakdown(model: ModelSpec, training: TrainingSpec, strategy: Strategy,
                         device: str = "cuda") -> ActivationBreakdown:
    """Saved activations at the end of the forward pass (bytes per GPU) and the loss transients."""
    L = model.num_hidden_layers
    n_ck = min(strategy.num_checkpointed(L), L)
    st = strategy
    offload = st.activation_offload != "none" and bool(n_ck) and st.checkpointing == "full"
    split = Split(st.sequence_parallel_size, st.context_parallel_size, st.tiled_loss, st.tiled_mlp, offload,
                  offload and host_pinned(st.pin_memory, device))
    knobs = (training.seq_len, strategy.micro_batch_size, strategy.precision, n_ck, strategy.checkpointing if n_ck else "none",
             strategy.engine == "deepspeed" and strategy.zero_stage == 3,  # ZeRO-3 linears (_block_linears)
             device, split)
    act = _breakdown(model, *knobs, strategy.expert_parallel_size if model.is_moe else 1)
    kinds = layer_kinds(model)
    if kinds is None:
        return act
    # dense-MLP blocks among the MoE ones (memory/mixed.py): each block's terms from its kind
    return mixed_breakdown(act, _breakdown(dense_block_spec(model), *knobs, 1), kinds, strategy.checkpointed_blocks(L))


def sequence_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """What one sequence needs on one GPU in activations and logits at its least without splitting
    it: micro-batch 1, every block checkpointed, one block recomputed, the loss at the forward's end
    (the measure of a long sequence, autotune.space.long_sequence)."""
    s = Strategy(micro_batch_size=1, checkpointing="full", precision=training.precision)
    act = activation_breakdown(model, training, s)
    return act.blocks + act.per_block_plain + act.nonblock + act.loss_forward_transient


@functools.lru_cache(maxsize=4096, typed=True)
def _breakdown(m: ModelSpec, s_full: int, b: int, precision: str, n_ck: int, gran: str, zero3: bool,
               device: str, split: Split = NO_SPLIT, ep: int = 1) -> ActivationBreakdown:
    """``activation_breakdown`` from the knobs it reads (a screen revisits the same few: cached).
    ``s_full``: sequence length; ``b``: micro-batch; ``n_ck``: checkpointed blocks at ``gran``;
    ``split``: the long-context knobs. Per-token terms count this GPU's share of the sequence
    (s / (sp x cp) tokens); the attention core's s x s terms read the whole sequence (Ulysses:
    all s for a / sp heads, the same bytes per local token)."""
    p = BYTES_PER_ELEMENT[precision]
    mb = p if device == "cpu" else 1
    s = s_full // (split.sp * split.cp)  # this GPU's tokens of each sequence
    tokens = b * s
    L = m.num_hidden_layers
    attn_saved, attn_bwd = split_attention(m, p, split)
    # tiled MLP (TiledMLP): the MLP keeps only its input (the norm output, already counted)
    mlp_untiled = _mlp_sublayer_saved(m, p, mb) - (mb * m.hidden_size if m.hidden_dropout > 0 else 0.0)
    mlp_cut = mlp_untiled if split.tiled_mlp else 0.0
    per_plain = ((block_activation_bytes_per_token(m, p, s_full, "none", mb, device, batch=b) + attn_saved - mlp_cut)
                 * tokens + _block_fixed_bytes(m, s_full, "none", p=p))
    ck_saved = block_activation_bytes_per_token(m, p, s_full, gran, mb, device, zero3_linear=zero3, batch=b,
                                                tiles=tile_lengths(s, m.hidden_size) if split.tiled_mlp else ())
    if gran not in ("full", "op"):  # these granularities keep the attention core / MLP as plain blocks do
        ck_saved += (attn_saved if gran != "attention" else 0.0) - (mlp_cut if gran != "mlp" else 0.0)
    per_ck = ck_saved * tokens + _block_fixed_bytes(m, s_full, gran, device, p)
    # the host copy of each block's input (autotune.models.long_context ``_pack``: torch.empty(...,
    # pin_memory) on CUDA; ArcticTraining's ``arg.detach().to("cpu")``, pageable)
    offloaded = (n_ck * (pinned_bytes(ck_saved * tokens, split.pinned) + per_ck - ck_saved * tokens)
                 if split.offload else 0.0)
    if split.offload:
        per_ck = 0.0  # the checkpoint's input lives in host memory until its block's backward
    blocks = n_ck * per_ck + (L - n_ck) * per_plain
    # cos and sin (1 x s x head_dim each, gpt-oss's half as wide), kept by the rotary multiplies
    table = m.head_size // 2 if m.rotary_half_table else m.head_size
    rope = mla.rope_table_bytes(m, s, p) if m.is_mla else 2 * s * table * p if m.position_embedding == "rope" else 0
    nonblock = _nonblock_saved_per_token(m, p, mb, device) * tokens + rope
    V = m.vocab_size
    # Gemma2's final_logit_softcapping, cap * tanh(logits / cap): tanh keeps its output (model dtype)
    softcap = p * V * tokens if m.final_logit_softcapping else 0.0
    # Granite's logits / logits_scaling (modeling_granitemoe.py GraniteMoeForCausalLM.forward) keeps nothing
    # (DivBackward0 of a scalar); its copy beside the head's output (2 p V) and, in backward, the quotient's
    # gradient beside the incoming one (2 p V) stay at or below the loss's instants ((p + 8) V, 12 V)
    nonblock += softcap
    masks_later = 0.0
    if m.implementation == "hf" and m.attn_implementation == "eager" and n_ck and gran in ("full", "op", "attention", "selective"):
        # HF's 4-D additive masks (model dtype): the checkpoints keep them as inputs of the block,
        # attention module or attention function (transformers masking_utils.py eager_mask; without
        # checkpointing they die with the forward)
        nonblock += m.num_attention_masks * b * s * s * p
        masks_later = (m.num_attention_masks - 1) * b * s * s * p
    # the bool sliding-window mask: an input of a checkpointed block / attention module / attention
    # function, it lives to that checkpoint's backward; otherwise it dies with the decoder's forward
    mask_kept = n_ck and gran in ("full", "op", "attention", "selective")
    forward_mask = s * s if _sliding_mask_built(m, s) and not mask_kept else 0.0
    if m.implementation == "hf" and m.attn_implementation == "eager" and not mask_kept:
        # not kept by a checkpoint, the 4-D additive masks still live to the end of the decoder's forward (its
        # local ``causal_mask_mapping``, modeling_gpt_oss.py / modeling_gemma2.py GptOssModel / Gemma2Model.forward)
        forward_mask += m.num_attention_masks * b * s * s * p
    if _sliding_mask_built(m, s) and mask_kept:
        nonblock += s * s
    if m.implementation == "hf" and n_ck:
        # the position ids (1 x s, int64) HF hands every layer: a checkpoint keeps them as an input
        # (measured: tests/memory/test_memory_hf_blocks.py; without checkpointing they die with the forward)
        nonblock += 8 * s
    # forward end: logits (model dtype), their fp32 copy and log_softmax's output coexist
    loss_fwd = (p + 4) * V * tokens if p < 4 else 4 * V * tokens
    # backward start: nll grad + log_softmax grad (fp32) next to the saved log_softmax output,
    # then the cast to the model dtype
    loss_bwd = 8 * V * tokens
    logits_saved = 4 * V * tokens + softcap
    logits_tokens = float(tokens)
    if split.tiled_loss:
        # TiledFusedLogitsLoss runs each tile's forward and backward inside the loss's forward,
        # keeping only the input's gradient (zeros_like x, model dtype) for the backward; a tile's
        # peak is its backward's start: the saved fp32 log_softmax next to the fp32 nll and
        # log_softmax gradients (the logits and their fp32 copy are released when the tile's loss
        # function returns; the head's weight gradient comes after, smaller)
        t = loss_tile_tokens(tokens, V)
        logits_saved = p * m.hidden_size * tokens
        loss_fwd = (12 + (p if softcap else 0)) * V * t
        loss_bwd = 0.0
        logits_tokens = 0.0
    nonblock += logits_saved - (4 * V * tokens + softcap)
    mlp_saved = _mlp_saved_per_token(m, p) * tokens
    moe_fwd = moe.grouped_forward_transient(m, p, int(tokens), device=device) if m.is_moe else 0.0
    moe_re = moe.grouped_forward_transient(m, p, int(tokens), recompute=True, device=device) if m.is_moe else 0.0
    if m.is_moe:
        mlp_bwd = moe.moe_backward_transient(m, p, int(tokens))
        mlp_released = moe.moe_backward_transient(m, p, int(tokens), released=True)
    else:
        mlp_bwd, mlp_released = _dense_mlp_backward(m, p, mb, tokens)
    if ep > 1:  # expert parallelism's experts path instead of grouped_mm (no offsets; memory/expert_parallel.py)
        ep_rows = step_rows(m, int(tokens), ep)  # the blocks at the step's mean rows (expert_parallel.ep_excess)
        d = ep_saved(m, p, int(tokens), ep, ep_rows[0])
        mlp_saved, per_plain, per_ck = mlp_saved + d, per_plain + d - moe.moe_fixed_bytes(m), per_ck + (
            d - moe.moe_fixed_bytes(m) if gran in ("attention", "selective") else 0.0)
        # the shared experts' instants around EP's routed ones as around grouped_mm's (moe.moe_backward_transient):
        # EP saves grouped_mm's bytes and d, without the offsets; a rank holds E / ep experts' weight gradients
        _, grouped_saved, grouped_grads = moe.grouped_routed(m, p, int(tokens))
        mlp_bwd = moe.moe_backward_transient(m, p, int(tokens), routed=(
            ep_backward_transient(m, p, int(tokens), ep), grouped_saved + d - moe.moe_fixed_bytes(m), grouped_grads / ep))
        mlp_released = mlp_bwd  # an FSDP2 knob: the DeepSpeed walk never reads it
        blocks, moe_fwd = n_ck * per_ck + (L - n_ck) * per_plain, ep_forward_transient(m, p, int(tokens), ep)
        moe_re = moe_fwd
    core_re = 0.0
    if n_ck and _sdpa_math(m, device) and gran != "mlp":
        # the recomputed core's forward end: what the block saves after the core is not made yet (the MLP's
        # pre-norm output too under a parallel residual, whose MLP runs after the attention)
        after = _released_before_core(m, p, mb, device, split.tiled_mlp)
        if m.parallel_residual and not split.tiled_mlp:
            after += (_mlp_sublayer_saved(m, p, mb) - _mlp_saved_per_token(m, p) + _norm_saved(m, p, device)
                      - p * m.hidden_size)
        # the core's inputs the plain core does not save: alive in the attention's frame (selective: counted
        # in ``recompute``, its checkpoint keeps them)
        inputs = _selective_inputs_unsaved(m, p, b, device) if gran != "selective" else 0.0
        core_re = ((_math_core_forward_transient(m, p, b, s_full) + inputs - after) * tokens + 4 * s_full * s_full
                   - (0.0 if split.tiled_mlp else mlp_saved))
    elif n_ck and m.is_mla and mla.math_kernel(m, device) and gran != "mlp":
        # latent attention's recomputed core on the math kernel, at its softmax: what the block saves after the core
        # (o_proj's input, the post-attention norm's, the MLP's) not made yet; its inputs alive in the attention's frame
        after = mla.o_proj_input(m, p) + _released_before_core(m, p, mb, device)
        inputs = mla.inputs_unsaved(m, p, b, device) if gran != "selective" else 0.0
        core_re = (mla.core_forward_transient(m, p, s_full) + inputs - after) * tokens + 4 * s_full * s_full - mlp_saved
    torch_rms_norm = m.norm in ("rmsnorm", "rmsnorm_fp32") and m.rms_norm_kernel == "torch"
    # a block norm's backward beyond its saved tensors (an instant where the MLP's no longer dominates, below)
    block_norm = (_block_norm_backward_live(m, p) - _norm_saved(m, p, device)) * tokens if torch_rms_norm else 0.0
    if split.tiled_mlp:
        # TiledMLP's backward: the input's gradient (zeros_like x), one tile's recomputed MLP and its
        # backward, the MLP's weight gradients accumulated over the tiles (ds_grad_is_ready held)
        t = mlp_tile_tokens(b, s, m.hidden_size)
        n_weights = 3 if m.gated_mlp else 2
        mlp_bwd = (p * m.hidden_size * tokens + (mlp_untiled + max(_mlp_backward_transient(m, p, mb),
                                                                    _composite_gelu_backward_transient(m, p))) * t
                   + n_weights * p * m.intermediate_size * m.hidden_size)
        # the tiles' weight gradients are held (ds_grad_is_ready False until the last tile): none released
        mlp_released = mlp_bwd
        if m.norms_per_block == 2:
            # then the pre-MLP RMSNorm's backward, which no longer sits below an untiled MLP's: its saved
            # tensors (the MLP's input, TiledMLP's only saved one, among them) replaced by its fp32 input
            # and PowBackward0's five fp32 h-wide tensors (as the final norm's, final_norm_backward_live),
            # the MLP's weight gradients handed over unless ZeRO-0 keeps them (allocation trace of
            # hf-qwen2-long ZeRO-1, tiled loss and MLP, full: the block's backward peak)
            mlp_bwd = max(mlp_bwd, block_norm + n_weights * p * m.intermediate_size * m.hidden_size)
            mlp_released = max(mlp_released, block_norm)
        mlp_saved = 0.0
    if m.norms_per_block == 4:
        # Gemma-2/3: the post-feedforward norm's backward runs before the MLP's and releases what it saved
        # (its input, rsqrt and normalised value; its output went to the residual), handing the MLP a
        # gradient of its own (p h), alive through the down projection's backward (allocation trace of
        # hf-gemma3-long ZeRO-0 full fp32: the MLP's instant 2 f + weight stays below the norm's)
        post = (_norm_saved(m, p, device) - p * m.hidden_size) * tokens
        down = p * (m.intermediate_size + m.hidden_size) * tokens + p * m.intermediate_size * m.hidden_size
        mlp_bwd, mlp_released = max(mlp_bwd, down) - post, max(mlp_released, down) - post
        if torch_rms_norm:
            # ... every saved tensor of the block alive at the norm's backward (a checkpointed block's
            # recomputation runs inside its weight multiply's backward)
            mlp_bwd, mlp_released = max(mlp_bwd, block_norm), max(mlp_released, block_norm)
    return ActivationBreakdown(
        blocks=blocks,
        per_block_plain=per_plain,
        per_block_checkpointed=per_ck,
        num_checkpointed=n_ck,
        granularity=gran,
        nonblock=nonblock,
        logits_saved=logits_saved,
        loss_forward_transient=loss_fwd,
        loss_backward_transient=loss_bwd,
        recompute=(per_plain - per_ck + (_selective_inputs_unsaved(m, p, b, device) * tokens if gran == "selective"
                                         else 0.0)) if n_ck else 0.0,
        mlp_saved_per_block=mlp_saved,
        attention_backward_transient=(mla.backward_transient(m, p, s_full, int(tokens), device) if m.is_mla else
                                      (_attention_backward_transient(m, p, s_full, device, mb) + attn_bwd) * tokens)
        - _released_before_core(m, p, mb, device, split.tiled_mlp) * tokens,
        final_norm_saved=_norm_saved(m, p, device) * tokens,
        forward_only_masks=forward_mask,
        final_norm_forward_extra=_final_norm_forward_extra(m, p, tokens, s, bool(n_ck)),
        hidden_grad=p * m.hidden_size * tokens,
        checkpoint_frame_kept=(_checkpoint_frame_kept(m, p, gran, zero3_linear=zero3, tiled_mlp=split.tiled_mlp) * tokens
                               + (CPU_RNG_STATE_BYTES if device == "cpu" else 0.0)) if n_ck else 0.0,
        final_norm_backward_live=(RMS_NORM_BACKWARD_LIVE * m.hidden_size * tokens if torch_rms_norm
                                  else _norm_saved(m, p, device) * tokens),
        mlp_backward_transient=mlp_bwd,
        mlp_backward_released=mlp_released,
        logits_tokens=logits_tokens,
        offloaded=offloaded,
        moe_forward_transient=moe_fwd + (_eager_weights_returned(m, p, s_full) * tokens
                                         if (moe_fwd and n_ck and gran not in ("none", "mlp")) else 0.0),
        moe_recompute_transient=moe_re,
        masks_only_later=masks_later,
        core_recompute_transient=core_re,
        **(dict(ep_mean_saved=float(ep_row_saved(m, p) * ep_rows[0]),
                ep_spread=float(ep_row_saved(m, p) * (ep_rows[1] - ep_rows[0])),
                ep_blocks_hold=gran in ("attention", "selective")) if ep > 1 and m.is_moe else {}),
    )
