"""Multi-head latent attention in the memory model: what transformers 5's DeepSeek-V2 and V3 attention
(models/deepseek_v2/modeling_deepseek_v2.py ``DeepseekV2Attention``, deepseek_v3's ``DeepseekV3Attention``:
the same block but for its cos/sin rotary) keeps for backward and adds
during it, its rotary table and its parameters in registration order (docs/moe.md).

The block: ``q_proj`` (or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` with ``q_lora_rank``),
``kv_a_proj_with_mqa`` split into the latent (``kv_lora_rank``) and the shared rope key, the latent's
``kv_a_layernorm`` and ``kv_b_proj`` to per-head nope keys and values, the complex rotary product on the
rope parts, ``torch.cat`` of the query, the key built by ``expand_kv`` (``new_empty`` + two ``copy_``), then
sdpa with a query/key head dim (nope + rope) that differs from the value's as a rule. Checked to the byte
against transformers' saved tensors (tests/memory/test_memory_mla.py).
"""

from __future__ import annotations

from autotune.spec import ModelSpec


def qk_head_dim(m: ModelSpec) -> int:
    """Per-head query / key width (``qk_nope_head_dim + qk_rope_head_dim``)."""
    return m.qk_nope_head_dim + m.qk_rope_head_dim


def v_head_dim(m: ModelSpec) -> int:
    """Per-head value width."""
    return m.v_head_dim or m.head_size


def _norm(width: int, p: int) -> float:
    """DeepseekV2RMSNorm of ``width`` (per token): the fp32 input (4w), rsqrt (4), the cast back (p w) and
    the output the next linear saves (p w); in fp32 the cast is the product the weight multiply saves."""
    return 4 * width + 2 * p * width + 4


def math_kernel(m: ModelSpec, device: str) -> bool:
    """Whether sdpa runs ``_scaled_dot_product_attention_math``: on the CPU whenever the query/key and value
    head dims differ (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp ``check_head_dim_size_cpp``:
    the CPU flash kernel wants q, k and v of one head dim); its matmuls then run in fp32."""
    return device == "cpu" and qk_head_dim(m) != v_head_dim(m)


def _value_storage(m: ModelSpec, p: int) -> float:
    """Per token, kv_b_proj's output, which the value is a view of (p a (nope + v))."""
    return float(p * m.num_attention_heads * (m.qk_nope_head_dim + v_head_dim(m)))


def core_inputs(m: ModelSpec, p: int) -> float:
    """Per token, the storages of the attention function's inputs: the concatenated query and the built key
    (p a qk each) and the value's (``_value_storage``); what a selective checkpoint of the function keeps
    (autotune.models.checkpointing.checkpoint_attention_core)."""
    return 2 * p * m.num_attention_heads * qk_head_dim(m) + _value_storage(m, p)


def inputs_unsaved(m: ModelSpec, p: int, batch: int, device: str) -> float:
    """Per token, the storages of ``core_inputs`` a plain kernel does not save (what a selective checkpoint
    holds beside the recomputed kernel): on the CPU math kernel all but the value's when ``value_kept``
    (it saves fp32 copies, ``attention_saved``); the flash kernels save the inputs themselves."""
    if not math_kernel(m, device):
        return 0.0
    return core_inputs(m, p) - (_value_storage(m, p) if value_kept(m, p, batch, device) else 0.0)


def value_kept(m: ModelSpec, p: int, batch: int, device: str) -> bool:
    """On the CPU math kernel in fp32 with one sequence per micro-batch the value stays a view of kv_b_proj's
    output down to PV's bmm (nothing upcasts it, and ``at::matmul`` folds one sequence into the heads as a
    view), which keeps that whole output, p a (nope + v), where otherwise a contiguous fp32 copy (4 a v) is
    saved (measured: hf-deepseekv3 ZeRO-0 mlp fp32 at mbs 1 read -0.86% / -1.07% at seq 256 / 512, 4 a nope
    bytes per token and layer, while the rows with 2 sequences are exact; as activations._v_view_kept)."""
    return math_kernel(m, device) and p == 4 and batch == 1


def o_proj_input(m: ModelSpec, p: int) -> float:
    """Per token, o_proj's input: the contiguous copy of the attention's transposed output (p a v)."""
    return float(p * m.num_attention_heads * v_head_dim(m))


def core_forward_transient(m: ModelSpec, p: int, s: int) -> float:
    """Per token, the CPU math kernel's forward at its ``_safe_softmax`` beyond what it saves and its inputs: the
    scores (fp32, a s) beside the probabilities, ``isneginf``'s mask of them (a s bytes) and, in 16-bit
    training, the fp32 copies of q and k before their scaling (a qk each); the (s, s) causal mask is per call
    (allocation trace of hf-deepseekv2-sv ZeRO-2 mbs 2 seq 128 attention bf16: the peak in block 1's
    recomputation after its MLP's backward), and the attention's locals no backward saves: the projected query
    (a qk), the rotated query and key rope parts (a r + r) and, in 16-bit training, the LoRA projections'
    outputs whose fp32 copies the norms save (kv_lora_rank + r, q_lora_rank)."""
    a, r = m.num_attention_heads, m.qk_rope_head_dim
    frame = p * (a * qk_head_dim(m) + a * r + r)
    if p < 4:
        frame += p * (int(m.kv_lora_rank or 0) + r + (m.q_lora_rank or 0)) + 8 * a * qk_head_dim(m)
    return float(5 * a * s + frame)


def attention_saved(m: ModelSpec, p: int, s: int, device: str, core: str = "full", batch: int = 2) -> float:
    """Per token, what DeepseekV2Attention keeps for backward, its input (the norm output) excluded:
    * the q LoRA's RMSNorm (q_lora_rank wide); none with a plain ``q_proj`` (its output is not saved);
    * kv_a_layernorm (kv_lora_rank wide); in fp32 its input is the split view of kv_a_proj_with_mqa's
      output (``.to(torch.float32)`` a no-op), whose storage holds the rope key too (+4 r);
    * the rotary product saves only the shared freqs_cis or cos / sin table (``rope_table_bytes``, outside
      the block; DeepSeek-V3's ``apply_rotary_pos_emb`` / ``_interleave``: the multiplies by cos and sin
      save the table alone, ``rotate_half``'s neg and cat nothing);
    * the CPU math kernel (``math_kernel``): fp32 copies of the scaled q and k (a x qk each), v's fp32
      contiguous copy (a x v), the fp32 softmax output (a x s);
    * the flash kernels (same head dims, or CUDA's memory-efficient kernel): the concatenated query and
      the built key (p a qk each), the value's storage (kv_b_proj's output, p a (nope + v)), the output
      (p a v) and the fp32 log-sum-exp (4 a);
    * o_proj's input, the contiguous copy of the transposed output (p a v).
    ``core`` ``selective``: the kernel recomputed, its inputs kept by the checkpoint (``core_inputs``);
    ``batch``: sequences per micro-batch (``value_kept``)."""
    a, qk, v, r = m.num_attention_heads, qk_head_dim(m), v_head_dim(m), m.qk_rope_head_dim
    n = _norm(m.q_lora_rank, p) if m.q_lora_rank is not None else 0.0
    n += _norm(int(m.kv_lora_rank or 0), p) + (4 * r if p == 4 else 0)
    if core == "selective":
        n += core_inputs(m, p)
    elif math_kernel(m, device):
        value = _value_storage(m, p) if value_kept(m, p, batch, device) else 4 * a * v
        n += 4 * 2 * a * qk + value + 4 * a * s
    else:
        n += core_inputs(m, p) + p * a * v + 4 * a
    return n + o_proj_input(m, p)


def backward_transient(m: ModelSpec, p: int, s: int, tokens: int, device: str) -> float:
    """The attention backward's peak beyond the block's saved tensors (bytes per block; the MLP's saved
    tensors released by then), from allocation traces of DeepseekV2Attention's backward (torch 2.13 CPU):
    o_proj's weight gradient (h x a v, p) next to, on the math kernel, the larger of
    * the probabilities' backward: the fp32 output gradient (a v) and its contiguous copy, the value's
      and the probabilities' fp32 gradients (a v, a s), o_proj's saved input released (p a v);
    * the softmax backward: the probabilities' gradient and the scores' (fp32, a s each) and the value's
      gradient (fp32, a v), the output gradient released, and in 16-bit training the value's fp32 copy the
      PV matmul saved (in fp32 it saved a view of kv_b_proj's output, which the block keeps: allocation
      trace of hf-deepseekv2 ZeRO-2 seq 512 selective fp32, its peak at the last block's softmax backward);
    on the flash kernels the gradients of q, k and v (as for a dense model)."""
    a, qk, v, h = m.num_attention_heads, qk_head_dim(m), v_head_dim(m), m.hidden_size
    weight = p * h * a * v
    if math_kernel(m, device):
        per_token = max(8 * a * v + 4 * a * s, 8 * a * s + (4 * a * v if p == 4 else 0)) - o_proj_input(m, p)
    else:
        per_token = p * (2 * a * qk + a * v)
    return weight + per_token * tokens


def rope_table_bytes(m: ModelSpec, s: int, p: int = 4) -> float:
    """The rotary table every block's rotary product saves: DeepSeek-V2's complex64 freqs_cis
    (DeepseekV2RotaryEmbedding.forward: ``torch.polar``, (1, s, qk_rope_head_dim / 2)); DeepSeek-V3's cos and
    sin in the model dtype (DeepseekV3RotaryEmbedding.forward: ``cos.to(dtype=x.dtype)``, (1, s, rope dim)
    each; the multiplies by the table save it, not q or k: the table needs no gradient)."""
    return 4.0 * s * m.qk_rope_head_dim if m.mla_rotary == "complex" else 2.0 * p * s * m.qk_rope_head_dim


def parameter_shapes(m: ModelSpec) -> list[tuple[int, int]]:
    """DeepseekV2Attention's parameters in registration order, each as (first dimension, elements):
    q_proj, or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    (nn.Linear weights are out x in; no biases)."""
    d, a, qk, v = m.hidden_size, m.num_attention_heads, qk_head_dim(m), v_head_dim(m)
    kv, ql = int(m.kv_lora_rank or 0), m.q_lora_rank
    q = [(a * qk, d * a * qk)] if ql is None else [(ql, d * ql), (ql, ql), (a * qk, ql * a * qk)]
    kv_nope_v = a * (m.qk_nope_head_dim + v)
    return q + [(kv + m.qk_rope_head_dim, d * (kv + m.qk_rope_head_dim)), (kv, kv), (kv_nope_v, kv * kv_nope_v),
                (d, a * v * d)]


def parameter_order(m: ModelSpec) -> list[int]:
    """Elements of each of ``parameter_shapes``."""
    return [n for _, n in parameter_shapes(m)]
