"""The long-context knobs' pieces of the activation terms (pure math): how a step's sequences lie
over a GPU (``Split``: the Ulysses / context-parallel degrees, tiling, activation offload), the tile
sizes of DeepSpeed's TiledFusedLogitsLoss and TiledMLP, and what splitting the sequence adds to the
attention core. autotune.memory.activations applies them."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Split:
    """How one step's sequences are laid over a GPU (the long-context knobs ``_breakdown`` reads)."""

    sp: int = 1
    """Ulysses degree: each GPU holds s / sp tokens, and inside attention all s for a / sp heads."""
    cp: int = 1
    """Context-parallel degree: each GPU holds s / cp tokens, its key/value chunks passed round a ring."""
    tiled_loss: bool = False
    tiled_mlp: bool = False
    offload: bool = False
    """Fully checkpointed blocks' inputs in host memory."""
    pinned: bool = False
    """With ``offload``: each host copy pinned (CUDA, ``pin_memory``), a power-of-two block of torch's
    caching host allocator (``common.pinned_bytes``)."""


NO_SPLIT = Split()

LOSS_TILE_BYTES = 2**30
"""Bytes of fp32 logits per tile of the tiled loss: ArcticTraining's sft_trainer slices the logits
in 1 GiB pieces (``slice_size_in_gb = 1``; shards = ceil(tokens x vocab x 4 / 1 GiB))."""


def loss_tiles(tokens: int, vocab: int) -> int:
    """Tiles of TiledFusedLogitsLoss: ceil(tokens x vocab x 4 / LOSS_TILE_BYTES), at least 1 (what
    autotune.models.long_context runs and the memory model and simulator size)."""
    return max(1, -(-tokens * vocab * 4 // LOSS_TILE_BYTES))


def loss_tile_tokens(tokens: int, vocab: int) -> int:
    """Tokens per tile of TiledFusedLogitsLoss (torch.chunk of the flattened tokens into
    ``loss_tiles`` shards: the first, largest chunk)."""
    return -(-tokens // loss_tiles(tokens, vocab))


def mlp_tiles(seq: int, hidden: int) -> int:
    """Tiles of TiledMLP per sequence: ceil(seqlen / hidden), at least 1 (its docstring's
    ``num_shards = math.ceil(seqlen / hidden)``, deepspeed/runtime/sequence_parallel/ulysses_sp.py)."""
    return max(1, -(-seq // hidden))


def tile_lengths(s_local: int, hidden: int) -> tuple[int, ...]:
    """TiledMLP's tiles of one sequence of ``s_local`` tokens: torch.chunk into ``mlp_tiles`` shards gives
    chunks of ceil(s / n) tokens and a shorter last one (fewer chunks when the last would be empty)."""
    c = -(-s_local // mlp_tiles(s_local, hidden))
    return (c,) * (s_local // c) + ((s_local % c,) if s_local % c else ()) if c else ()


def mlp_tile_tokens(b: int, s_local: int, hidden: int) -> int:
    """Tokens per tile of TiledMLP: torch.chunk's largest chunk of each sequence (``tile_lengths``), over
    the micro-batch."""
    return b * max(tile_lengths(s_local, hidden), default=0)


def split_attention(m: ModelSpec, p: int, split: Split) -> tuple[float, float]:
    """Per local token, what splitting the sequence adds to the attention core: (saved, backward
    transient).
    * Ulysses: the kernel's k and v hold max(1, sp / kv heads) x the local kv width (kv heads
      repeated when the degree exceeds them, ``kv_replication_factor``), so do dk and dv; each of
      dq, dk, dv then leaves through a contiguous copy and the all-to-all's output, one after the
      other (``_combine_local_sequences``'s three exchanges, ulysses_sp.py): two copies of the
      widest. The kernel's output goes back through an all-to-all and a re-layout
      (``_partition_global_sequence``'s ``output.reshape(...)`` after the ``ws sl_l bs em_l ->
      sl_l bs ws em_l`` rearrange: a copy), which o_proj saves next to the kernel's saved output:
      one more q-wide tensor where the plain path's o_proj input is a view of that output (where it
      is already a copy, ``rotary_concat``, nothing more), released by o_proj's backward before
      the core's backward runs.
    * Ring attention: fp32 accumulators of dq, dk, dv next to one step's gradients, and the k/v
      chunk and its fp32 dk/dv travelling round the ring (torch/distributed/tensor/experimental/
      _context_parallel/_attention.py ``_templated_ring_attention_backward``, convert_to_f32)."""
    q, kv = m.q_size, m.kv_size
    if split.sp > 1:
        repeat = max(1, split.sp // m.num_key_value_heads)
        extra_kv = 2 * p * kv * (repeat - 1)
        o_proj_input = 0 if m.rotary_concat else p * q
        # o_proj's backward, before the core's, releases that copy: not alive at the core's backward
        return float(extra_kv + o_proj_input), float(extra_kv + 2 * p * max(q, kv * repeat) - o_proj_input)
    if split.cp > 1:
        return 0.0, float(4 * (q + 2 * kv) + 2 * p * kv + 8 * kv)
    return 0.0, 0.0
