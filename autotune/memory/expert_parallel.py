"""Expert parallelism (``expert_parallel_size`` > 1, fsdp2 only) in the memory model: what the layout
of ``autotune.models.fsdp2.apply`` changes in one block (docs/moe.md, "Expert parallelism").

The layout is torchtitan's (torchtitan/distributed/parallel_dims.py ``_build_mesh_with_ep``,
models/llama4/infra/parallelize.py ``apply_fsdp``): each block's routed experts are their own
``fully_shard`` unit holding E / ep experts, sharded over the n / ep ranks of ``dp_shard_mod_ep``;
the rest of the block (attention, norms, router) is a unit sharded over all n ranks. The experts run
``autotune.models.expert_parallel.expert_parallel``'s forward: rows sorted by expert, sent to their
experts' rank by ``all_to_all_single`` (dispatch), one gated MLP per (source rank, local expert)
chunk of the R rows this rank receives, sent back (combine), weighted and summed per token.

Pure arithmetic. ``received_rows`` is where load imbalance enters: R is the busiest rank's rows,
``MOE_LOAD_IMBALANCE`` x the mean (tokens x top-k: each rank sends as many rows as it receives on
average), at most every row that can reach it.
"""

from __future__ import annotations

from typing import NamedTuple

from autotune.memory.moe import MOE_LOAD_IMBALANCE, _routing_weight_bytes, expert_width, pair_saved
from autotune.spec import ModelSpec


def block_expert_elements(m: ModelSpec) -> int:
    """Routed-expert weights of one block, all E experts (``gate_up_proj`` E x 2f x h, ``down_proj`` E x h x f)."""
    return 3 * m.num_experts * m.hidden_size * expert_width(m)


def received_rows(m: ModelSpec, tokens: int, ep: int, imbalance: float = MOE_LOAD_IMBALANCE) -> int:
    """Rows the busiest EP rank receives by the dispatch (``all_to_all_single`` of the sorted rows,
    expert_parallel.py ``forward``): ``imbalance`` x the mean tokens x top-k, at most every token of
    the ep ranks once per local expert it can pick (top-k picks distinct experts)."""
    local = m.num_experts // ep
    cap = ep * tokens * min(m.num_experts_per_tok, local)
    return int(min(cap, -(-imbalance * tokens * m.num_experts_per_tok // 1)))


class EpUnits(NamedTuple):
    """One block's two FSDP2 units with expert parallelism (elements, per GPU)."""

    dense: int
    """The block's unit without its experts: attention, norms, router (sharded over the n ranks)."""
    local: int
    """The experts unit: E / ep experts (sharded over the n / ep ranks of dp_shard_mod_ep)."""
    mod_ep: int
    """Ranks the experts unit is sharded over (n / ep)."""


def ep_units(m: ModelSpec, n: int, ep: int) -> EpUnits:
    """The block's units (``_shard_experts``: fully_shard on the experts first, then on the block,
    which leaves them out; torch/distributed/fsdp/_fully_shard/_fully_shard.py: a module's
    parameters already managed by a nested fully_shard are not the outer unit's)."""
    experts = block_expert_elements(m)
    return EpUnits(dense=m.block_params() - experts, local=experts // ep, mod_ep=max(1, n // ep))


def ep_saved(m: ModelSpec, p: int, tokens: int, ep: int) -> float:
    """What the routed experts keep per block under EP minus what the grouped_mm path keeps (its
    ``tokens`` x top-k x ``pair_saved``; the router's are the same; the grouped offsets, which EP does
    not keep, are ``moe_fixed_bytes(m)`` at its default p, apart). S = tokens x top-k sent rows, R received:
    * per sent row: ``order`` (argsort, int64, saved by the weights' index), ``order // k`` twice (int64,
      saved by the input's index and by ``index_add``), the combined row (h, saved by ``back *
      weights``), its routing weight cast to the row's dtype (p: ``.to(back.dtype)``) and the weighted
      row (h, saved by ``index_add``: its source, torch's derivatives.yaml ``index_add``);
    * per received row: the dispatched input (h, saved by each chunk's ``F.linear`` as a view), the
      gate_up output (2f: silu's input and ``up`` are views), silu's output and the product (f each);
    the down outputs and their ``torch.cat`` are not saved (CatBackward keeps sizes), nor are the
    all-to-all buffers (torch/distributed/nn/functional.py ``_AlltoAllSingle`` saves split sizes)."""
    h, f = m.hidden_size, expert_width(m)
    sent, rows = tokens * m.num_experts_per_tok, received_rows(m, tokens, ep)
    return float(sent * (24 + 2 * p * h + p) + rows * p * (h + 4 * f) - sent * pair_saved(m, p))


def ep_backward_transient(m: ModelSpec, p: int, tokens: int, ep: int) -> float:
    """The experts' backward peak beyond the block's saved tensors under EP (bytes per block), the
    largest of these instants of expert_parallel.py ``forward``'s backward (S sent rows, R received,
    El = E / ep local experts, c the E chunks of (source rank, local expert), last created first):
    * the combine's multiply (MulBackward0): ``index_add``'s source gradient (index_select, S x h,
      its saved source released), the combined rows' gradient and the weights' product before its
      sum (S x h each);
    * the combine's all-to-all backward (``_AlltoAllSingle.backward``: an R x h output), the
      multiply's saved rows and weights and the index_add's source released;
    * the gate_up weight gradient of the second chunk processed: each chunk's weight is ``W[e]``
      (SelectBackward0: zeros of the whole E_l-expert tensor, torch/csrc/autograd/FunctionsManual.cpp
      ``select_backward``), summed in autograd's input buffer (input_buffer.cpp ``accumulate``: the
      first kept, later ones added): the down (El h f) and gate_up (2 El h f) buffers, the new gate_up
      zeros (2 El h f), the mm's 2f x h weight gradient, next to the cat's gradient (R x h, its views
      alive until every chunk's down backward) and the received rows' gradient buffer (SliceBackward0:
      zeros of R x h per chunk, the first kept); the chunks' released saves are not subtracted (their
      sizes depend on the routing) and a chunk's input gradient (n x h) is at most its released 4f
      per row (h <= 4f), so this bounds every later chunk too;
    * the second chunk's slice backward: a third R x h (its zeros) beside the two, the weights' buffers.
    From torch 2.13's autograd engine order (a higher sequence number first: chunk by chunk)."""
    h, f = m.hidden_size, expert_width(m)
    local = m.num_experts // ep
    sent, rows = tokens * m.num_experts_per_tok, received_rows(m, tokens, ep)
    released = 2 * sent * p * h + sent * p  # the weighted rows, the combine multiply's saved rows and weights
    w = _routing_weight_bytes(m, p)
    combine = 2 * p * h * sent + max(w, 4) * sent
    exchange = p * h * rows + p * h * sent - released
    spare = max(0, rows * (h - 4 * f)) * p  # a chunk's input gradient beyond its released saves (none if h <= 4f)
    weights = p * (5 * local * h * f + 2 * f * h) + 2 * p * h * rows - released + spare
    second_slice = p * 3 * local * h * f + 3 * p * h * rows - released + spare
    return float(max(combine, exchange, weights, second_slice))

