"""MoE models whose blocks mix dense-MLP and MoE feed-forwards (``ModelSpec.dense_layers``): which block
is which and the dense block's spec, from which the memory model sizes each block as its own kind.

transformers builds each decoder layer's feed-forward by its index: DeepSeek-V2/V3
(modeling_deepseek_v2.py ``DeepseekV2DecoderLayer.__init__``: ``DeepseekV2MoE(config) if layer_idx >=
config.first_k_dense_replace else DeepseekV2MLP(config)``), Qwen2-MoE / Qwen3-MoE
(modeling_qwen2_moe.py ``Qwen2MoeDecoderLayer``: ``Qwen2MoeSparseMoeBlock`` unless ``layer_idx in
config.mlp_only_layers`` or ``(layer_idx + 1) % config.decoder_sparse_step != 0``, else ``Qwen2MoeMLP(config,
intermediate_size=config.intermediate_size)``); the dense MLP is the model's gated MLP of
``intermediate_size``, the attention and norms are the same in both kinds (docs/moe.md)."""

from __future__ import annotations

import dataclasses
import functools
from itertools import accumulate
from typing import Optional

from autotune.memory.breakdown import ActivationBreakdown
from autotune.spec import ModelSpec


@functools.lru_cache(maxsize=256)
def layer_kinds(m: ModelSpec) -> Optional[tuple[bool, ...]]:
    """Per block index, whether the block has the dense MLP; None when every block is of one kind
    (a dense model, or a MoE without dense layers: the uniform path)."""
    if not (m.is_moe and m.num_dense_layers):
        return None
    dense = set(m.dense_layers)
    return tuple(i in dense for i in range(m.num_hidden_layers))


@functools.lru_cache(maxsize=256)
def dense_block_spec(m: ModelSpec) -> ModelSpec:
    """The spec whose every block is this MoE model's dense block (same attention, norms, embeddings;
    the gated MLP of ``intermediate_size``): its per-block terms are the dense blocks'."""
    return m.replace(num_experts=0, dense_layers=())


def kind_spec(m: ModelSpec, dense: bool) -> ModelSpec:
    """The spec of one block's kind: ``dense_block_spec`` for a dense block, the model's own otherwise."""
    return dense_block_spec(m) if dense else m


@functools.lru_cache(maxsize=256)
def layer_params(m: ModelSpec) -> tuple[int, ...]:
    """Parameters of each block, by index (``ModelSpec.block_params`` of its kind)."""
    kinds = layer_kinds(m) or (False,) * m.num_hidden_layers
    moe_block, dense_block = m.block_params(), m.block_params(False)
    return tuple(dense_block if d else moe_block for d in kinds)


@functools.lru_cache(maxsize=256)
def params_after(m: ModelSpec) -> tuple[int, ...]:
    """Per block index i, the parameters of the blocks after it (L-1 down to i+1: those whose backward
    is done when block i's starts)."""
    suffix = list(accumulate(reversed(layer_params(m))))  # suffix[k-1]: the last k blocks
    L = m.num_hidden_layers
    return tuple(suffix[L - 2 - i] if i < L - 1 else 0 for i in range(L))


def blocks_within(m: ModelSpec, budget: float) -> int:
    """How many of the last blocks fit in ``budget`` parameters (the uniform walk's
    ``budget // block_params`` for blocks of several sizes)."""
    n, total = 0, 0
    for size in reversed(layer_params(m)):
        total += size
        if total > budget:
            break
        n += 1
    return n


def block_kinds(act: ActivationBreakdown, num_layers: int) -> list[ActivationBreakdown]:
    """Each block's record by index: ``act.dense`` for a dense block, ``act`` otherwise."""
    if act.dense is None:
        return [act] * num_layers
    return [act.dense if dense else act for dense in act.dense_layers]


def saved_below(act: ActivationBreakdown, checkpointed: list[int], num_layers: int) -> list[float]:
    """Per block index i, the saved activations of blocks 0..i at the forward's end (each at its kind's
    plain or checkpointed bytes)."""
    ck = set(checkpointed)
    return list(accumulate(k.per_block_checkpointed if i in ck else k.per_block_plain
                           for i, k in enumerate(block_kinds(act, num_layers))))


def mixed_breakdown(moe_act: ActivationBreakdown, dense_act: ActivationBreakdown, kinds: tuple[bool, ...],
                    checkpointed: list[int]) -> ActivationBreakdown:
    """The step's activation terms for blocks of two kinds: ``moe_act`` (the MoE blocks' terms, and every
    term outside the blocks, the same for both kinds) with the saved blocks summed block by block (each
    at its kind's plain or checkpointed bytes), the offloaded checkpoint inputs likewise, and the dense
    blocks' record attached (``dense``, ``dense_layers``) for the backward walks."""
    ck = set(checkpointed)
    blocks = 0.0
    offloaded = 0.0
    for i, dense in enumerate(kinds):
        a = dense_act if dense else moe_act
        blocks += a.per_block_checkpointed if i in ck else a.per_block_plain
        if a.offloaded and i in ck:  # offload: offloaded = n x the checkpoint's input, per_block_checkpointed 0
            offloaded += a.offloaded / a.num_checkpointed
    return dataclasses.replace(moe_act, blocks=blocks, offloaded=offloaded, dense=dense_act, dense_layers=kinds)
