"""A model's parameters by the module that holds them, in ``model.parameters()`` order: the one definition
ZeRO-1/2's partitions (states.py), ZeRO-3's persistence and gathering (states.py, zero3_fetch.py) and FSDP2's
units (fsdp2.py) read."""

from __future__ import annotations

import functools
from typing import NamedTuple

from autotune.memory import mla, moe
from autotune.memory.mixed import layer_kinds
from autotune.spec import ModelSpec


def parameter_order(m: ModelSpec) -> list[int]:
    """Elements of each parameter tensor in ``model.parameters()`` order (``parameter_shapes``)."""
    return [n for _, n in parameter_shapes(m)]


@functools.lru_cache(maxsize=256)
def parameter_shapes(m: ModelSpec) -> tuple[tuple[int, int], ...]:
    """Each parameter tensor as (first dimension, elements) in ``model.parameters()`` order, the
    order ZeRO-1/2 flatten and partition them in (stage_1_and_2.py: ``bit16_groups`` from the param group, no
    round_robin_gradients): ``parameter_modules``' tensors. The first dimension is what FSDP2 shards
    (nn.Linear weights are out x in, GPT-2's Conv1D in x out). Elements sum to num_parameters."""
    return tuple(t for mod in parameter_modules(m) for t in mod)


Module = tuple[tuple[int, int], ...]
"""One module's own parameters, each as (first dimension, elements)."""


class Parts(NamedTuple):
    """A model's modules by role: ``parameter_modules`` arranges them in ``parameters()`` order,
    memory/zero3_fetch.py in the order a step runs them."""

    embed: list[Module]        # the token embedding, then GPT-2's learned positions
    norm: list[Module]         # one norm module
    norms: list[Module]        # a block's norms
    qk_norm: list[Module]      # q / k norms (Qwen3, OLMoE)
    attention: list[Module]    # q, k, v (or fused; gpt-oss's sinks first; MLA's projections and norms)
    o: list[Module]            # the output projection (MLA: in ``attention``)
    dense_mlp: list[Module]    # a dense block's MLP linears
    moe_ffn: list[Module]      # a MoE block's feed-forward modules (moe.ffn_parameter_modules)
    head: list[Module]         # the output head's own parameters (none when tied, but its bias)


@functools.lru_cache(maxsize=256)
def parts(m: ModelSpec) -> Parts:
    d, f, q, kv = m.hidden_size, m.intermediate_size, m.q_size, m.kv_size
    qkv_b, out_b = m.bias or m.qkv_bias, m.bias

    def lin(n_in: int, n_out: int, bias: bool) -> list[Module]:
        return [((n_in if m.linear_addmm else n_out, n_in * n_out),) + (((n_out, n_out),) if bias else ())]

    norm: list[Module] = [((d, d), (d, d)) if (m.norm == "layernorm" and m.bias) else ((d, d),)]
    qk_norm: list[Module] = {"head": [((m.head_size, m.head_size),)] * 2, "full": [((q, q),), ((kv, kv),)]}.get(
        m.qk_norm, [])
    if m.fused_qkv or m.linear_addmm:  # GPT-2's Conv1D c_attn is fused too
        qkv = lin(d, q + 2 * kv, qkv_b)
    else:
        qkv = lin(d, q, qkv_b) + lin(d, kv, qkv_b) + lin(d, kv, qkv_b)
    o = lin(q, d, out_b)
    if m.attention_sinks:  # GptOssAttention's own parameter comes before its submodules' in parameters()
        qkv = [((m.num_attention_heads, m.num_attention_heads),)] + qkv
    if m.is_mla:  # DeepSeek-V2's q / latent kv projections, their norms, o_proj (mla.py)
        qkv, o = [(t,) for t in mla.parameter_shapes(m)], []
    if m.gated_mlp:
        mlp_in = lin(d, 2 * f, out_b) if m.fused_qkv else lin(d, f, out_b) + lin(d, f, out_b)
    else:
        mlp_in = lin(d, f, out_b)
    embed = (m.vocab_size, m.vocab_size * d)
    learned = m.position_embedding == "learned"
    positions = [((m.max_position_embeddings, m.max_position_embeddings * d),)] if learned else []
    # modeling_phimoe.py PhimoeForCausalLM: lm_head = nn.Linear(..., bias=lm_head_bias)
    head = (() if m.tie_word_embeddings else (embed,)) + (((m.vocab_size, m.vocab_size),) if m.lm_head_bias else ())
    return Parts([(embed,)] + positions, norm, norm * m.norms_per_block, qk_norm, qkv, o, mlp_in + lin(f, d, out_b),
                  [tuple(mod) for mod in moe.ffn_parameter_modules(m)] if m.is_moe else [], [head] if head else [])


@functools.lru_cache(maxsize=256)
def parameter_modules(m: ModelSpec) -> tuple[Module, ...]:
    """``model.parameters()`` grouped by the module holding them (a linear's weight and bias, a norm's, a MoE
    block's experts; ``moe.ffn_parameter_modules``), in order: autotune's reference decoders
    (autotune/models/reference.py ``Block``: norm, q, k, v, o, norm, gate, up, down) and the HF classes
    (modeling_llama.py and kin: attention, MLP, then the norms; modeling_phi3.py: o_proj before the fused
    qkv_proj, fused gate_up_proj; modeling_gpt2.py: ln_1, fused c_attn, c_proj, ln_2, c_fc, c_proj;
    modeling_gpt_neox.py: both norms, then query_key_value, dense, dense_h_to_4h, dense_4h_to_h). A tied head
    holds no parameter of its own (its bias, if any, is its module)."""
    pt = parts(m)
    norm, norms, qkv, o, qk_norm = pt.norm, pt.norms, pt.attention, pt.o, pt.qk_norm

    def block(mlp: list[Module]) -> list[Module]:
        if m.implementation == "reference":
            return norm + qkv + o + norm + mlp + qk_norm
        if m.linear_addmm or m.parallel_residual:  # GPT-2: ln_1 attn ln_2 mlp; GPT-NeoX: norms first
            return (norms + qkv + o + mlp) if m.parallel_residual else (norm + qkv + o + norm + mlp)
        if m.fused_qkv:  # Phi-3: o_proj is registered before qkv_proj
            return o + qkv + mlp + norms
        if m.norms_before_mlp:  # modeling_granitemoe.py GraniteMoeDecoderLayer: the norms before block_sparse_moe
            return qkv + o + qk_norm + norms + mlp
        return qkv + o + qk_norm + mlp + norms

    out = list(pt.embed)
    for dense in layer_kinds(m) or (not m.is_moe,) * m.num_hidden_layers:
        out += block(pt.dense_mlp if dense else pt.moe_ffn)
    return tuple(out + norm + pt.head)
