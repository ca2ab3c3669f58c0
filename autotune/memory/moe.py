"""Mixture-of-experts blocks in the memory model: what transformers 5's sparse MoE block keeps for
backward and adds during it, the expert tensors' sizes for the model states, and which MoE layouts
the model sizes (docs/moe.md).

Sized: the routed-expert blocks of transformers' Mixtral (``MixtralSparseMoeBlock``) and Qwen3-MoE
(``Qwen3MoeSparseMoeBlock``) in every layer, run by the default experts implementation
``grouped_mm`` (modeling_utils.py ``get_correct_experts_implementation``: ``"grouped_mm" if
requested_experts is None``; integrations/moe.py ``grouped_mm_experts_forward``). That path sorts
the S = tokens x top-k (token, expert) pairs by expert and runs one grouped GEMM over all of them:
every buffer is S rows, whatever the split among experts, so the bytes do not depend on the
routing (no load imbalance in them; ``expert_imbalance`` is where it would enter).
"""

from __future__ import annotations

from typing import Optional

from autotune.spec import ModelSpec

def expert_cap(m: ModelSpec) -> float:
    """The most the busiest expert can take over the mean: every token (top-k picks distinct experts), experts / top-k."""
    return m.num_experts / max(1, m.num_experts_per_tok)


def expert_imbalance(m: ModelSpec) -> float:
    """The busiest expert's tokens over the mean: the stated ``moe_load_imbalance``, else ``expert_cap``: a
    router that sees text sends some block's every token of a rank to one expert (measured on every family
    of benchmarks/trained_routing.py, at init and trained: at init the deep blocks' inputs are nearly one
    vector: benchmarks/trained_routing.py --alignment). transformers' default ``grouped_mm``
    path, the one sized for ZeRO and plain FSDP2, has no per-expert buffer: every tensor is tokens x top-k
    rows, so its bytes are exact for any routing and the factor multiplies nothing; a per-expert layout
    (expert parallelism's chunks and tokens per EP rank) takes its worst expert as this factor x the mean."""
    return m.moe_load_imbalance or expert_cap(m)


def worst_expert_tokens(m: ModelSpec, tokens: int, imbalance: Optional[float] = None) -> int:
    """Routed tokens of the busiest expert: ``imbalance`` (default ``expert_imbalance``) x the mean, at
    most every token (top-k picks distinct experts: an expert sees a token once)."""
    mean = tokens * m.num_experts_per_tok / max(1, m.num_experts)
    return int(min(tokens, -(-(imbalance or expert_imbalance(m)) * mean // 1)))


def least_expert_tokens(m: ModelSpec, tokens: int) -> int:
    """Routed tokens of the least-loaded expert from ``tokens`` of one rank: the stated ``moe_min_load`` x
    the mean, rounded down; 0 where none is stated (an expert may receive nothing)."""
    return int((m.moe_min_load or 0.0) * tokens * m.num_experts_per_tok / max(1, m.num_experts))


def expert_width(m: ModelSpec) -> int:
    """One routed expert's (gated) MLP width."""
    return m.moe_intermediate_size or m.intermediate_size


def _routing_weight_bytes(m: ModelSpec, p: int) -> int:
    """Bytes of one routing weight: Mixtral's router returns the fp32 top-k probabilities
    (modeling_mixtral.py ``MixtralTopKRouter``: softmax of ``router_logits.float()``); Qwen3-MoE's
    and Qwen2-MoE's (qk-norm per head / the gated shared expert) cast them back (modeling_qwen3_moe.py,
    modeling_qwen2_moe.py ``router_top_value.to(router_logits.dtype)``)."""
    return p if m.router_weights_cast else 4


SIZED_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "qwen2_moe", "deepseek_v3", "olmoe", "granitemoe", "gpt_oss",
                  "phimoe")
"""The HF model_type values whose MoE block this module sizes (the blocks of other MoE families differ;
docs/moe.md)."""


def not_sized(m: ModelSpec, model_type: Optional[str]) -> Optional[str]:
    """Why the memory model does not size this MoE model of HF ``model_type`` (None: it does): the
    routed MoE block of Mixtral / Qwen3-MoE in every layer (no shared expert, no biases, RMSNorm, no MLA);
    DeepSeek-V2's and V3's, with their ungated shared experts and latent attention (autotune/memory/mla.py;
    V3's sigmoid router and cos/sin rotary: ``router_sigmoid``, ``mla_rotary``);
    Qwen2-MoE's, with its sigmoid-gated shared expert and qkv biases; OLMoE's, Qwen3-MoE's router on
    q/k norms over the whole projections; Granite-MoE's, its softmax over the top-k logits and its
    multipliers (embedding, residual, logits), with attention dropout (the dense models' sdpa / eager
    dropout terms, memory/activations.py); phimoe's, its sparsemixer router (top-2 only) and input jitter on
    biased attention, LayerNorms with bias and a biased head."""
    if not (m.is_moe or m.is_mla):
        return None
    if m.implementation != "hf" or model_type not in SIZED_FAMILIES:
        return f"{', '.join(SIZED_FAMILIES)} only, not model_type {model_type or 'unknown'}"
    deepseek, qwen2 = model_type in ("deepseek_v2", "deepseek_v3"), model_type == "qwen2_moe"
    oss = model_type == "gpt_oss"  # biased linears and experts, eager attention with sinks, sliding layers
    granite = model_type == "granitemoe"
    phi = model_type == "phimoe"  # biased q/k/v/o, LayerNorm with bias, the sparsemixer router
    why = [name for name, bad in (
        ("shared experts", (m.shared_expert_intermediate_size and not (deepseek or qwen2))
         or m.shared_expert_gate != qwen2),
        ("multi-head latent attention", m.is_mla != deepseek),
        ("eager attention", deepseek and m.attn_implementation != "sdpa"),
        ("router / expert biases", (m.router_bias or m.expert_bias) and not oss),
        ("biased linears", (m.bias or m.qkv_bias) and not (oss or phi or (qwen2 and not m.bias))),
        ("LayerNorm", m.norm not in (("rmsnorm", "rmsnorm_fp32") if oss else ("layernorm",) if phi else ("rmsnorm",))),
        ("the sparsemixer router", m.router_sparsemixer != phi),
        ("a top-k other than the sparsemixer's 2", phi and m.num_experts_per_tok != 2),
        ("input jitter", m.input_jitter_draws and not phi),
        ("attention sinks", m.attention_sinks != oss),
        ("sinks under sdpa (transformers runs gpt-oss's attention eager)", oss and m.attn_implementation != "eager"),
        ("sliding layers", m.sliding_window_layers is not None and not oss),
        ("dropout", m.hidden_dropout or (m.attention_dropout and not (granite or phi))),
        ("an ungated expert", not m.gated_mlp),
    ) if bad]
    return ("their routed blocks without " + ", ".join(why)) if why else None


def router_saved_per_token(m: ModelSpec, p: int = 4) -> float:
    """Bytes per token the router keeps: the fp32 softmax output (E; ``softmax(router_logits.float())``
    / ``softmax(..., dtype=torch.float)``), topk's int64 indices (k), and the top-k renormalisation
    ``router_top_value /= router_top_value.sum(...)``: the fp32 sum (1) and quotient (k) (DivBackward).
    Qwen3-MoE's ``norm_topk_prob: false`` skips the last (4 + 4k bytes fewer: a bound).
    DeepSeek-V2 (``router_fp32``; modeling_deepseek_v2.py ``DeepseekV2TopkRouter.forward``): the fp32
    copy of the input in 16-bit training (4h), the softmax (E), topk's indices (k), no renormalisation;
    group-limited: the bool mask of ``masked_fill`` (E; the group max / topk nodes die in the forward).
    DeepSeek-V3 (``router_sigmoid``): the fp32 input copy (4h, 16-bit), the sigmoid output (E), the int64
    index of ``scores.gather`` (k) and, with ``norm_topk_prob``, the in-place division's fp32 quotient (k)
    and denominator (1); the corrected scores, the group top-k and the masked_fill of the choice die in
    the forward (only the indices leave them), ``* routed_scaling_factor`` saves no tensor.
    Granite-MoE (``router_topk_softmax``; modeling_granitemoe.py ``GraniteMoeTopKRouter.forward``): topk's
    int64 indices (k) and the fp32 softmax over the k top logits (k); the logits' fp32 copy (``.float()``,
    whose backward keeps nothing) and the weights cast back (``type_as``; the experts save their gathered
    copy, ``pair_saved``) are not kept.
    phimoe (``router_sparsemixer``; modeling_phimoe.py ``sparsemixer``, training): per round (two), the bool mask of
    ``masked_fill`` (E), the softmax of the masked logits (E, model dtype; saved by softmax and by
    ``PhimoeMultiplier``), its gather at the sampled expert (1, kept by ``PhimoeMultiplier`` as ``multiplier``)
    and the sample's int64 index (saved by the gather, ``PhimoeMultiplier`` and the first round's
    ``torch.scatter``); the Gumbel noise and the max that samples die in the forward.
    Measured to the byte by the block check (hf_config.check_block_bytes)."""
    e, k = m.num_experts, m.num_experts_per_tok
    if m.router_sparsemixer:
        return 2 * ((1 + p) * e + p + 8)
    if m.router_topk_softmax:  # topk's indices, the k-wide softmax (fp32 on Granite's fp32 logits, else the model dtype)
        return 8 * k + (4 if m.router_logits_fp32 else p) * k
    if m.router_sigmoid:  # DeepSeek-V3 (modeling_deepseek_v3.py DeepseekV3TopkRouter.forward): see below
        return (4 * m.hidden_size if p < 4 else 0) + 4 * e + 8 * k + (4 + 4 * k if m.router_norm_topk else 0)
    if not m.router_norm_topk:  # Qwen2-MoE's norm_topk_prob: false (modeling_qwen2_moe.py Qwen2MoeTopKRouter)
        return 4 * e + 8 * k
    if m.router_fp32:
        return (4 * m.hidden_size if p < 4 else 0) + 4 * e + 8 * k + (e if m.router_group_limited else 0)
    return 4 * e + 8 * k + 4 + 4 * k


def pair_saved(m: ModelSpec, p: int) -> float:
    """Bytes per (token, expert) pair the grouped path keeps (integrations/moe.py
    ``grouped_mm_experts_forward``): three int64 index vectors (``perm`` from torch.sort, ``perm //
    num_top_k`` for the gather, ``inv_perm``), the gathered input (h), the grouped up projection's
    output (2f: silu's input and ``up`` are views of it), silu's output and the gated product (f each,
    saved by the multiply and the down grouped_mm), the down output (h) and the routing weight,
    both saved by ``proj_out * sample_weights_g``."""
    h, f = m.hidden_size, expert_width(m)
    # gpt-oss's clamped SwiGLU keeps the clamped gate, sigmoid(alpha * gate), their product, up + 1 and the
    # gated product (5 f) beside the up projection's output (2 f, saved by the clamps): 3 f more; biased
    # experts gather their biases by the sorted expert ids, a fourth int64 index (integrations/moe.py
    # ``gate_up_proj_bias[expert_ids_g]``)
    gate = 7 * f if m.expert_clamped_swiglu else 4 * f
    return 24 + (8 if m.expert_bias else 0) + p * (2 * h + gate) + _routing_weight_bytes(m, p)


def moe_saved_per_token(m: ModelSpec, p: int) -> float:
    """Bytes per token one MoE block's feed-forward keeps, its input (the norm output) excluded:
    the router's and the routed pairs'."""
    # DeepSeek-V2's shared experts: one gated MLP on the block input (DeepseekV2MLP: gate, up, silu, product)
    shared = 4 * p * m.shared_expert_intermediate_size
    if m.shared_expert_gate:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x) keeps both factors
        shared += p + p * m.hidden_size
    # phimoe's input jitter (PhimoeSparseMoeBlock / PhimoeTopKRouter.forward ``hidden_states *= torch.empty_like(
    # hidden_states).uniform_(...)``): each in-place multiply keeps its draw (h); the jittered norm output is the
    # tensor the router and the experts' gather read, counted with the norm
    jitter = m.input_jitter_draws * p * m.hidden_size
    return router_saved_per_token(m, p) + m.num_experts_per_tok * pair_saved(m, p) + shared + jitter


def moe_fixed_bytes(m: ModelSpec, p: int = 4) -> float:
    """Per block, not per token: the int32 cumulative tokens per expert (``offsets``, E) grouped_mm saves;
    DeepSeek-V2's router linear its fp32 copy of a 16-bit weight (``self.weight.type(torch.float32)``, E x h)."""
    return 4.0 * m.num_experts + (4.0 * m.num_experts * m.hidden_size if m.router_fp32 and p < 4 else 0.0)


def grouped_routed(m: ModelSpec, p: int, tokens: int, released: bool = False) -> tuple[float, float, float]:
    """grouped_mm's routed path in one block (``moe_backward_transient``): its backward peak beyond the
    block's saved tensors (the instants below), the bytes it saves (the pairs and the offsets) and its
    experts' weight gradients still held after it (every expert's gate_up and down, model dtype).
    ``released``: each weight gradient leaves autograd right after its AccumulateGrad (states.py
    ``ffn_grads_released``): the gated multiply's and the up grouped_mm's instants without the down one's,
    and the down grouped_mm's own instant (its input gradient, S x f, beside its weight gradient, its saved
    input and output gradient not yet released: above the multiply's when E h f > S (f - h)); none held."""
    h, f, e, k = m.hidden_size, expert_width(m), m.num_experts, m.num_experts_per_tok
    w = _routing_weight_bytes(m, p)
    q = max(p, w)
    pairs = k * tokens
    down = p * e * h * f  # every expert's down weight gradient
    held = 0 if released else down
    weights = ((3 * q + p) * h if q > p else 3 * q * h + w) * pairs - 8 * pairs
    gate = 2 * p * f * pairs + held - (p * h + 8) * pairs
    gate_up = 2 * p * e * h * f + held - 2 * p * f * pairs - 8 * pairs
    saved = (k * pair_saved(m, p)) * tokens + moe_fixed_bytes(m, p)
    if released:
        down_mm = p * f * pairs + down - 8 * pairs
        return max(weights, gate, gate_up, down_mm), saved, 0.0
    return max(weights, gate, gate_up), saved, 3 * p * e * h * f


def saved_after_routed(m: ModelSpec, p: int, tokens: int) -> float:
    """What a MoE block saves after its routed experts (bytes per block): DeepSeek-V2/V3's shared experts run
    after them (modeling_deepseek_v2.py ``DeepseekV2Moe.forward``: their four f-wide tensors); Qwen2-MoE's
    shared expert runs first, its gate's sigmoid after (p per token, modeling_qwen2_moe.py
    ``Qwen2MoeSparseMoeBlock.forward``); nothing without shared experts."""
    return float(p * tokens if m.shared_expert_gate else 4 * p * m.shared_expert_intermediate_size * tokens)


def forward_locals(m: ModelSpec, p: int, tokens: int) -> float:
    """What the decoder layer holds in Python locals while its experts run, not saved by autograd (bytes per
    block): the router's logits (tokens x E, fp32 for an fp32 router; the ``_`` of ``_, weights, indices =
    self.gate(h)`` in every family's MoE forward) and, in 16-bit under an upcasting RMSNorm, the residual
    stream (tokens x h: the post-attention norm saved its fp32 copy, the layer keeps ``residual`` for the
    second add)."""
    router = (4 if (m.router_fp32 or m.router_logits_fp32) else p) * m.num_experts * tokens
    residual = p * m.hidden_size * tokens if (p < 4 and m.norm in ("rmsnorm", "rmsnorm_fp32")) else 0
    return float(router + residual)


def grouped_forward_transient(m: ModelSpec, p: int, tokens: int, recompute: bool = False,
                              device: str = "cuda") -> float:
    """grouped_mm's forward peak beyond the block's saved tensors (bytes per block; integrations/moe.py
    ``grouped_mm_experts_forward``, allocation traces of gpt-oss's and OLMoE's steps, torch 2.13 CPU), S =
    tokens x top-k pairs, the largest of three instants, each net of what the block saves after it:
    * the gated product (``_apply_gate`` returning): biased experts' gathered gate_up biases (S x 2f, bound to
      ``selected_biases`` until the down projection's gather replaces them), gpt-oss's clamped up half (f, a
      local of ``_apply_gate``); the down output (h, saved by the weighting) and ``inv_perm`` (8 S) not made;
    * the down projection's gathered biases (S x h) beside the gate_up ones, the same two not made;
    * the restored order: the weighted output and its ``weighted_out[inv_perm]`` copy (S x h each) beside the
      down biases (S x h, to the function's return), every routed tensor made;
    and each net of the shared experts' saved tensors made after the routed ones (``saved_after_routed``), with
    the layer's ``forward_locals`` and the function's ``histc_input`` (the sorted expert ids as float32 on the
    CPU, int32 on CUDA: 4 S) and ``tokens_per_expert`` (4 E) alive throughout. ``recompute``: a checkpointed block's recomputation, which
    torch stops once every saved tensor is made again (torch/utils/checkpoint.py early stop): after the
    weighting multiply, before the order is restored, with the backward's gradient of the combine alive (the
    sum's view backward made it contiguous, S x h, before IndexBackward0 unpacked ``inv_perm``).
    The weighted output, its reordered copy and that gradient are in q = max(p, the routing weight's bytes)
    (Mixtral's fp32 weights promote them: fp32 in 16-bit training); on the CPU the weighting multiply also
    casts the down output to q first, a temporary (TensorIterator's CPU path casts inputs to the common
    dtype, aten/src/ATen/TensorIterator.cpp ``compute_types``; CUDA kernels cast as they load)."""
    h, f, pairs = m.hidden_size, expert_width(m), m.num_experts_per_tok * tokens
    q = max(p, _routing_weight_bytes(m, p))
    cast = q if (q > p and device == "cpu") else 0
    bias = 2 * f if m.expert_bias else 0
    later = saved_after_routed(m, p, tokens)
    after = (p * h + 8) * pairs + later
    gated = (bias + (f if m.expert_clamped_swiglu else 0)) * p * pairs - after
    down_bias = ((bias + h) * p * pairs - after) if m.expert_bias else 0
    down = h if m.expert_bias else 0  # the down projection's gathered biases, to the function's return
    # the forward: the product beside its reordered copy (or, a moment before, the cast input); the
    # recomputation stops after the product
    weighted = (q + cast if recompute else max(2 * q, q + cast)) * h * pairs
    restored = weighted + down * p * pairs - later
    gradient = q * h * pairs if recompute else 0.0
    histc = 4 * pairs + 4 * m.num_experts  # locals to the function's return
    return float(max(gated, down_bias, restored) + forward_locals(m, p, tokens) + histc + gradient)


def moe_backward_transient(m: ModelSpec, p: int, tokens: int, routed: Optional[tuple[float, float, float]] = None,
                           released: bool = False) -> float:
    """The MoE feed-forward's backward peak beyond the block's saved tensors (bytes per block), the
    largest of three instants of grouped_mm_experts_forward's backward (S = tokens x top-k pairs; w the
    routing weight's bytes, q = max(p, w) the dtype of ``proj_out * sample_weights_g``), each net of
    what the backward has released by then (``inv_perm``, 8 S, after the final gather's backward):
    * the routing-weight multiply: the gathered output's gradient (``index_put`` zeros, S x h in q)
      and the product's two gradients (S x h in q each), cast back to the model dtype when q > p
      (Mixtral bf16), else with the weights' summed gradient (S);
    * the gated multiply: the down grouped_mm's input gradient (S x f), which replaces its saved
      input, and the two factor gradients (S x f each), next to the down weight's gradient for every
      expert (E x h x f) and the routing weights' gradient, the multiply's saved down output and
      weights released (S x h + S w);
    * the up grouped_mm: the gate_up weight's gradient (E x 2f x h) beside the down one's, the product,
      silu output and up projection (4 f per pair) released, the concatenated gradient (2f) and the
      input gradient (h, replacing the released weighted gradient) alive.
    From allocation traces of one block's backward (torch 2.13 CPU profiler, docs/moe.md).
    ``routed``: another routed path's (peak, saved bytes, expert weight-gradient bytes) in place of
    grouped_mm's (``grouped_routed``; expert parallelism's, memory/expert_parallel.py), the shared
    experts' instants composed with it the same way (they run beside the routed path, whichever runs it).
    ``released``: each weight gradient leaves autograd right after its AccumulateGrad (states.py
    ``ffn_grads_released``; ``grouped_routed``): no instant holds one made by an earlier node."""
    h = m.hidden_size
    routed = routed or grouped_routed(m, p, tokens, released)
    fs = m.shared_expert_intermediate_size
    if not fs:
        return float(routed[0])
    if m.shared_expert_gate:
        return _qwen2_backward(m, p, tokens, *routed, released=released)
    # DeepSeek-V2's shared experts run their backward first (computed last): a dense gated MLP's peak (two
    # f-wide factor gradients, its down weight gradient); then the routed instants with its saved tensors
    # released, its three weight gradients and its input gradient (h, awaiting the routed one) alive
    # (allocation traces of DeepseekV2Moe's backward, torch 2.13 CPU, docs/moe.md). Released: the multiply
    # without the down weight gradient, or the down projection's own instant (its input gradient beside its
    # weight gradient), and the routed instants without the three
    if released:
        shared = max(2 * p * fs * tokens, p * fs * tokens + p * fs * h)
        return float(max(shared, routed[0] - (4 * p * fs - p * h) * tokens))
    shared = 2 * p * fs * tokens + p * fs * h
    return float(max(shared, routed[0] - (4 * p * fs - p * h) * tokens + 3 * p * fs * h))


def _qwen2_backward(m: ModelSpec, p: int, tokens: int, routed: float, routed_saved: float, expert_grads: float,
                    released: bool = False) -> float:
    """Qwen2MoeSparseMoeBlock's backward peak beyond the saved set (bytes per block), from allocation traces
    (torch 2.13 CPU; the block alone, whose harness adds one h-wide copy of the output gradient that the
    benchmark's real steps do not have): the gate multiply (both factor gradients, h wide, and the broadcast
    product before its sum); the routed instants (``routed``) with the shared output's gradient, the gate
    linear's input and weight gradients alive and the multiply's saved shared output and sigmoid released;
    then, the routed pairs, router and gate released and every weight gradient and the block input's summed
    gradient kept, the shared expert's dense backward (it ran first in the forward). ``routed_saved``:
    the routed path's saved bytes (pairs and per-block buffers), ``expert_grads``: its experts' weight
    gradients on this rank. ``released`` (states.py ``ffn_grads_released``): the gate linear's and the router's
    weight gradients (1 x h, E x h) and the experts' (``expert_grads`` 0) gone once made; the shared expert's
    multiply without its down weight gradient, or its down projection's own instant (input gradient beside
    weight gradient, its output gradient not yet released)."""
    h, e, fs, t = m.hidden_size, m.num_experts, m.shared_expert_intermediate_size, tokens
    weights = 0 if released else p * h  # the gate linear's weight gradient
    mul = (2 * p * h + p) * t
    before = (p * h - p) * t + weights
    base = (2 * p * h - router_saved_per_token(m, p) - p - p * h) * t - routed_saved + expert_grads + (
        0 if released else p * (e * h + h))
    if released:
        shared = base + max((2 * p * fs - p * h) * t, p * fs * t + p * fs * h)
    else:
        shared = base + p * fs * h + (2 * p * fs - p * h) * t
    return float(max(mul, routed + before, shared))


def down_weight_elements(m: ModelSpec) -> int:
    """Elements of the feed-forward's down projection weight: every expert's (``experts.down_proj``,
    E x h x f) for a MoE, the dense f x h otherwise."""
    return m.num_experts * m.hidden_size * expert_width(m) if m.is_moe else m.hidden_size * m.intermediate_size


def expert_weight_elements(m: ModelSpec) -> tuple[int, int]:
    """Elements of the experts' two 3-D weights, gate_up_proj (E x 2f x h) and down_proj (E x h x f)."""
    h, f, e = m.hidden_size, expert_width(m), m.num_experts
    return e * 2 * f * h, e * h * f


def leaf_hook_elements(m: ModelSpec, reduce_bucket_size: int, clone: bool) -> int:
    """Gradient elements a ZeRO-3 leaf MoE block (``ModelSpec.zero3_leaf_block``) holds at most in its backward
    hook (deepspeed stage3.py ``reduce_leaf_module_grads``): every parameter's gradient is alive when it fires;
    then, in ``parameters()`` order, each is bucketed (``reduce_independent_p_g_buckets_and_remove_grads``): the
    bucket is reduce-scattered first when it would overflow, freeing what it held, and a gradient that fits is
    copied into the bucket's buffer and freed (``__add_grad_to_ipg_bucket``), a larger one kept until the next
    reduce. ``clone``: gloo's reduce-scatter copies its input (states.py ``reduce_clone``). The bucket's content
    from before the hook (the block above's last, small gradients) is not counted: it is reduced while the
    first, larger, expert gradient waits."""
    held = sum(ffn_parameter_order(m))
    peak, bucket, kept = held, 0, 0
    for n in ffn_parameter_order(m):
        if bucket and bucket + n > reduce_bucket_size:
            peak = max(peak, held + (bucket if clone else 0))
            held, bucket, kept = held - kept, 0, 0
        if bucket + n <= reduce_bucket_size:
            held -= n
        else:
            kept += n
        bucket += n
    return peak


def largest_ffn_parameter(m: ModelSpec) -> int:
    """Elements of a block's largest feed-forward parameter: a MoE's (``ffn_parameter_order``; its dense-MLP
    blocks' too, memory/mixed.py), a dense MLP's weight (Phi-3's fused gate_up: 2 f x h)."""
    dense = (2 if (m.fused_qkv and m.gated_mlp) else 1) * m.hidden_size * m.intermediate_size
    if not m.is_moe:
        return dense
    return max(*ffn_parameter_order(m), dense if m.num_dense_layers else 0)


def ffn_weight_elements(m: ModelSpec) -> int:
    """Weights of one block's feed-forward (the router and all experts for a MoE)."""
    if m.is_moe:
        shared = 3 * m.hidden_size * m.shared_expert_intermediate_size + (m.hidden_size if m.shared_expert_gate else 0)
        return m.num_experts * m.hidden_size + 3 * m.num_experts * m.hidden_size * expert_width(m) + shared
    return (3 if m.gated_mlp else 2) * m.hidden_size * m.intermediate_size


def ffn_parameter_modules(m: ModelSpec) -> list[list[tuple[int, int]]]:
    """A MoE block's feed-forward parameters in ``parameters()`` order, each as (first dimension,
    elements), grouped by the module that holds them (what ZeRO-3 gathers together): Mixtral registers the
    router before the experts (``MixtralSparseMoeBlock.__init__``: ``self.gate``, ``self.experts``), Qwen3-MoE
    after them (``Qwen3MoeSparseMoeBlock``: ``self.experts``, ``self.gate``), DeepSeek-V2 too and its shared
    experts last (``DeepseekV2Moe``: experts, gate, shared_experts' gate, up, down); Qwen2-MoE's router first,
    its shared expert and its gate last (``Qwen2MoeSparseMoeBlock``); the experts' 3-D ``gate_up_proj``
    (E x 2f x h) then ``down_proj`` (E x h x f), one module; the router E x h; Qwen2-MoE's shared_expert_gate
    1 x h; gpt-oss's router and expert biases. A ZeRO-3 leaf block (``ModelSpec.zero3_leaf_block``) is one
    module."""
    h, f, e, fs = m.hidden_size, expert_width(m), m.num_experts, m.shared_expert_intermediate_size
    # gpt-oss (GptOssExperts, GptOssTopKRouter): each projection followed by its bias, the router's bias after
    # its weight (E first, as ``gate_up_proj`` of E x h x 2f is)
    experts = [[(e, e * 2 * f * h)] + ([(e, e * 2 * f)] if m.expert_bias else []) + [(e, e * h * f)] + (
        [(e, e * h)] if m.expert_bias else [])]
    shared = ([[(fs, fs * h)], [(fs, fs * h)], [(h, fs * h)]] if fs else []) + ([[(1, h)]] if m.shared_expert_gate
                                                                              else [])
    router = [[(e, e * h)] + ([(e, e)] if m.router_bias else [])]
    out = (experts + router if m.router_after_experts else router + experts) + shared
    return [[t for mod in out for t in mod]] if m.zero3_leaf_block else out


def ffn_parameter_shapes(m: ModelSpec) -> list[tuple[int, int]]:
    """``ffn_parameter_modules``' tensors, in order."""
    return [t for mod in ffn_parameter_modules(m) for t in mod]


def ffn_parameter_order(m: ModelSpec) -> list[int]:
    """Elements of each of ``ffn_parameter_shapes``."""
    return [n for _, n in ffn_parameter_shapes(m)]
