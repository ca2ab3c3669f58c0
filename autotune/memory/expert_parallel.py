"""Expert parallelism (``expert_parallel_size`` > 1, fsdp2 only) in the memory model: what the layout
of ``autotune.models.fsdp2.apply`` changes in one block (docs/moe.md, "Expert parallelism").

The layout is torchtitan's (torchtitan/distributed/parallel_dims.py ``_build_mesh_with_ep``,
models/llama4/infra/parallelize.py ``apply_fsdp``): each block's routed experts are their own
``fully_shard`` unit holding E / ep experts, sharded over the n / ep ranks of ``dp_shard_mod_ep``;
the rest of the block (attention, norms, router) is a unit sharded over all n ranks. The experts run
``autotune.models.expert_parallel.expert_parallel``'s forward: rows sorted by expert, sent to their
experts' rank by ``all_to_all_single`` (dispatch), one gated MLP per (source rank, local expert)
chunk of the R rows this rank receives, sent back (combine), weighted and summed per token.

Pure arithmetic. Load imbalance enters twice, as stated factors: R, the busiest rank's received rows,
is ``rank_imbalance`` x the mean (tokens x top-k: each rank sends as many rows as it receives on
average), at most every row that can reach it; a chunk (one source rank's rows for one expert) is at
most the busiest expert's tokens, ``moe.worst_expert_tokens`` (``moe_load_imbalance`` x the mean).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

from autotune.memory.moe import (_routing_weight_bytes, expert_imbalance, expert_width,
                                 least_expert_tokens, pair_saved, saved_after_routed, worst_expert_tokens)
from autotune.spec import ModelSpec


def block_expert_elements(m: ModelSpec) -> int:
    """Routed-expert weights of one block, all E experts (``gate_up_proj`` E x 2f x h, ``down_proj`` E x h x f)."""
    return 3 * m.num_experts * m.hidden_size * expert_width(m)


COLLAPSE_QUANTILE = 0.99
"""The probability with which ``collapsed_rank_imbalance`` covers every MoE block of a step (docs/moe.md, Load
imbalance)."""


@functools.lru_cache(maxsize=None)
def _collapsed_picks(experts: int, k: int, ep: int, blocks: int) -> int:
    """The most of a block's k picks one rank's E / ep experts hold, for ``blocks`` blocks that each pick k
    distinct experts at random, at COLLAPSE_QUANTILE: the smallest m with P(every rank holds <= m)^blocks >=
    the quantile, P from the count of k-subsets with at most m on each rank ([x^k] (sum_{i<=m} C(E/ep, i)
    x^i)^ep over C(E, k))."""
    local = experts // ep
    top = min(k, local)
    for most in range(1, top):
        row = [math.comb(local, i) for i in range(most + 1)]
        ways = [1]
        for _ in range(ep):
            ways = [sum(ways[a] * row[n - a] for a in range(max(0, n - most), min(n, len(ways) - 1) + 1))
                    for n in range(min(k, len(ways) - 1 + most) + 1)]
        if len(ways) > k and (ways[k] / math.comb(experts, k)) ** blocks >= COLLAPSE_QUANTILE:
            return most
    return top


def collapsed_rank_imbalance(m: ModelSpec, ep: int) -> float:
    """The busiest EP rank's received rows over the mean when every token of a block picks the same top-k
    experts (a collapsed router: what routers at init do in the deeper blocks, whose inputs are nearly one
    vector; benchmarks/trained_routing.py): a rank holding j of the k picks receives every token of the ep
    ranks j times, ep x j / k x the mean, with j the most one rank holds over the step's MoE blocks
    (``_collapsed_picks``); with one expert per rank, ep / top-k (every token of its expert)."""
    k = max(1, m.num_experts_per_tok)
    return ep * _collapsed_picks(m.num_experts, k, ep, max(1, m.num_moe_layers)) / k


def rank_imbalance(m: ModelSpec, ep: int) -> float:
    """The busiest EP rank's received rows over the mean: the stated ``ep_rank_imbalance``, else the collapsed
    router's (``collapsed_rank_imbalance``), at most the busiest expert's factor (``moe.expert_imbalance``: a
    rank's E / ep experts average it out; with one expert per rank, that expert's)."""
    return m.ep_rank_imbalance or min(collapsed_rank_imbalance(m, ep), expert_imbalance(m))


@functools.lru_cache(maxsize=None)
def _collapsed_step_picks(experts: int, k: int, ep: int, blocks: int) -> int:
    """The most picks one rank's E / ep experts hold summed over ``blocks`` blocks that each pick k distinct
    experts at random, at COLLAPSE_QUANTILE over every rank (a union bound: the smallest t with ep x P(a rank
    holds more than t) <= 1 - the quantile); a block's count on one rank is hypergeometric, the blocks'
    independent (their sum's distribution by convolution)."""
    local = experts // ep
    one = [math.comb(local, i) * math.comb(experts - local, k - i) / math.comb(experts, k)
           for i in range(min(k, local) + 1)]
    total = [1.0]
    for _ in range(blocks):
        total = [sum(total[t - i] * p for i, p in enumerate(one) if 0 <= t - i < len(total))
                 for t in range(len(total) + len(one) - 1)]
    above = 0.0
    for t in range(len(total) - 1, -1, -1):  # above = P(sum > t)
        if ep * (above + total[t]) > 1 - COLLAPSE_QUANTILE:
            return t
        above += total[t]
    return 0


def collapsed_step_imbalance(m: ModelSpec, ep: int) -> float:
    """The busiest EP rank's received rows summed over a micro-step's MoE blocks over the mean when every token
    of each block picks that block's same top-k experts, the blocks' picks independent (a collapsed router,
    ``collapsed_rank_imbalance``): ep x t / (blocks x top-k), t the most picks one rank holds over the blocks
    (``_collapsed_step_picks``); at least 1."""
    k, blocks = max(1, m.num_experts_per_tok), max(1, m.num_moe_layers)
    return max(1.0, ep * _collapsed_step_picks(m.num_experts, k, ep, blocks) / (blocks * k))


def step_imbalance(m: ModelSpec, ep: int) -> float:
    """The busiest EP rank's received rows summed over a micro-step's MoE blocks over the mean (MoE blocks x
    tokens x top-k): the stated ``ep_step_imbalance``; else, where the rank's factor is stated, that factor (a
    measured router's blocks need not pick independently), and otherwise the collapsed router's
    (``collapsed_step_imbalance``); at most the rank's busiest dispatch (``rank_imbalance``: a rank's mean over
    the blocks is at most its busiest block's)."""
    rank = rank_imbalance(m, ep)
    if m.ep_step_imbalance:
        return min(m.ep_step_imbalance, rank)
    return rank if m.ep_rank_imbalance else min(collapsed_step_imbalance(m, ep), rank)


def received_rows(m: ModelSpec, tokens: int, ep: int, imbalance: Optional[float] = None) -> int:
    """Rows the busiest EP rank receives by the dispatch (``all_to_all_single`` of the sorted rows,
    expert_parallel.py ``forward``): ``imbalance`` (default ``rank_imbalance``) x the mean tokens x top-k,
    at most every token of the ep ranks once per local expert it can pick (top-k picks distinct experts)."""
    local = m.num_experts // ep
    cap = ep * tokens * min(m.num_experts_per_tok, local)
    return int(min(cap, -(-(imbalance or rank_imbalance(m, ep)) * tokens * m.num_experts_per_tok // 1)))


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


def ep_row_saved(m: ModelSpec, p: int) -> int:
    """What a block keeps per received row (``ep_saved``): the dispatched input (h), the gate_up output (2f),
    silu's output and the product (f each)."""
    return p * (m.hidden_size + 4 * expert_width(m))


def ep_saved(m: ModelSpec, p: int, tokens: int, ep: int, rows: Optional[int] = None) -> float:
    """What the routed experts keep per block under EP minus what the grouped_mm path keeps (its
    ``tokens`` x top-k x ``pair_saved``; the router's are the same; the grouped offsets, which EP does
    not keep, are ``moe_fixed_bytes(m)`` at its default p, apart). S = tokens x top-k sent rows, R received
    (``rows``, default ``received_rows``):
    * per sent row: ``order`` (argsort, int64, saved by the weights' index), ``order // k`` twice (int64,
      saved by the input's index and by ``index_add``), the combined row (h, saved by ``back *
      weights``), its routing weight cast to the row's dtype (p: ``.to(back.dtype)``) and the weighted
      row (h, saved by ``index_add``: its source, torch's derivatives.yaml ``index_add``);
    * per received row: the dispatched input (h, saved by each chunk's ``F.linear`` as a view), the
      gate_up output (2f: silu's input and ``up`` are views), silu's output and the product (f each);
    the down outputs and their ``torch.cat`` are not saved (CatBackward keeps sizes), nor are the
    all-to-all buffers (torch/distributed/nn/functional.py ``_AlltoAllSingle`` saves split sizes)."""
    h = m.hidden_size
    sent, rows = tokens * m.num_experts_per_tok, received_rows(m, tokens, ep) if rows is None else rows
    return float(sent * (24 + 2 * p * h + p) + rows * ep_row_saved(m, p) - sent * pair_saved(m, p))


def step_rows(m: ModelSpec, tokens: int, ep: int) -> tuple[int, int]:
    """A block's received rows at the step's mean (``step_imbalance``: what every block's saved tensors are
    sized with) and at the busiest dispatch (``rank_imbalance``: the block being run or recomputed, whose
    saved tensors above the mean ``ep_excess`` adds)."""
    return received_rows(m, tokens, ep, step_imbalance(m, ep)), received_rows(m, tokens, ep)


def ep_excess(spread: Any, mean: Any, moe_blocks: Any, held: Any) -> Any:
    """What an instant holding ``held`` blocks' received rows (the block being run counted where its saved
    tensors exist) keeps beyond ``held`` blocks at the step's mean: the rank's rows over the held blocks are at
    most ``held`` busiest dispatches and at most every MoE block's at the mean (``moe_blocks`` x the mean), so
    ``min(held x spread, (moe_blocks - held) x mean)``, with ``mean`` the saved bytes of a block's rows at
    ``step_rows``' mean and ``spread`` those of the busiest's rows above it (``ep_row_saved``); scalars or numpy
    arrays alike; 0 where the step factor is the dispatch's (no spread)."""
    a, b = held * spread, (moe_blocks - held) * mean
    return a - (a - b) * (a > b)


def ep_forward_transient(m: ModelSpec, p: int, tokens: int, ep: int) -> float:
    """The experts' forward peak beyond the block's saved tensors under EP (bytes per block), at the
    combine's ``index_add`` (expert_parallel.py ``forward``): the chunks' down outputs (``outs``, R x h)
    and their ``torch.cat`` (R x h), both alive until the forward returns, ``zeros_like`` of the tokens
    (tokens x h) and index_add's output (tokens x h), the int64 counts and received counts (E each);
    net of what the block saves after it (DeepSeek-V2/V3's shared experts run after the routed ones,
    modeling_deepseek_v2.py ``DeepseekV2Moe.forward``: their four f-wide tensors; Qwen2-MoE's shared
    expert runs first, its gate's sigmoid after: p per token, modeling_qwen2_moe.py
    ``Qwen2MoeSparseMoeBlock.forward``). From allocation traces of a checkpointed block's recomputation
    (benchmarks/peak_trace_worker.py, docs/moe.md). Given the measured splits (``chunk_rows``), the
    busiest dispatch's rows."""
    splits = chunk_rows(m, tokens, ep)
    h, rows = m.hidden_size, max(map(sum, splits)) if splits else received_rows(m, tokens, ep)
    return float(2 * p * h * rows + 2 * p * h * tokens + 16 * m.num_experts - saved_after_routed(m, p, tokens))


class MeasuredRouting(NamedTuple):
    """The stated routing factors (the ModelSpec fields of the same names, docs/moe.md "Load imbalance") a
    measured expert-parallel routing gives: what a job that measured its routing states."""

    moe_load_imbalance: float
    """The largest chunk (one source rank's rows for one expert) over its mean (tokens x top-k / experts)."""
    moe_min_load: float
    """The smallest chunk over the same mean."""
    ep_rank_imbalance: float
    """A rank's busiest dispatch (its received rows) over the mean (tokens x top-k)."""
    ep_step_imbalance: float
    """A rank's received rows summed over a micro-step's MoE blocks (their forward dispatches, the first of the
    step's: a recomputation dispatches them again) over MoE blocks x the mean."""

    LOWER = ("moe_min_load",)
    """The factors that bound from below (a routing beyond them is smaller); the others bound from above."""

    def beyond(self, sized: "MeasuredRouting") -> list[str]:
        """The factors of this routing beyond ``sized`` (what a layout is sized with): an upper factor above it,
        a lower one (LOWER) below it."""
        return [k for k, v in self._asdict().items()
                if (v < getattr(sized, k) if k in self.LOWER else v > getattr(sized, k))]

    def describe(self) -> str:
        """The factors in words, as the estimate's routed-loads line and a run's routing line print them."""
        return (f"busiest expert {self.moe_load_imbalance:g} x the mean, least {self.moe_min_load:g} x, "
                f"busiest EP rank {self.ep_rank_imbalance:g} x, over a step {self.ep_step_imbalance:g} x")

    def statement(self, indent: str = "  ") -> list[str]:
        """The factors as a job file states them: ``model:`` and one ``key: value`` line each under it, to paste."""
        return ["model:", *(f"{indent}{k}: {v:g}" for k, v in self._asdict().items())]


STATED_LOAD_KEYS: tuple[str, ...] = MeasuredRouting._fields
"""The model fields a job states its routing with (ModelSpec; docs/moe.md, Load imbalance)."""


def sized_routing(m: ModelSpec, ep: int) -> MeasuredRouting:
    """The factors the model sizes an expert-parallel layout of ``ep`` ranks with: the stated ones, else
    autotune's defaults (``moe.expert_imbalance``, ``moe_min_load`` or 0, ``rank_imbalance``,
    ``step_imbalance``)."""
    return MeasuredRouting(expert_imbalance(m), m.moe_min_load or 0.0, rank_imbalance(m, ep), step_imbalance(m, ep))


def measured_routing(m: ModelSpec, sent: int, steps: Sequence[Sequence[Sequence[int]]]) -> Optional[MeasuredRouting]:
    """The factors of a measured routing: ``sent`` the rows each rank sends per dispatch (tokens x top-k),
    ``steps`` every rank's measured micro-steps, each the splits of its dispatches in forward order (the rows
    received per (source rank, local expert), autotune.models.expert_parallel ``forward``'s counts exchange).
    The upper factors are rounded up and the least load down (4 decimals), so a job that states them is
    sized at or above the routing measured; None when nothing was dispatched."""
    chunks = [n for st in steps for dispatch in st for n in dispatch]
    moe_blocks = m.num_moe_layers
    if not chunks or sent <= 0 or moe_blocks <= 0:
        return None
    up = lambda x: math.ceil(x * 1e4 - 1e-6) / 1e4  # noqa: E731  (1e-6: a float's last bit is no imbalance)
    return MeasuredRouting(
        moe_load_imbalance=up(max(chunks) * m.num_experts / sent),
        moe_min_load=math.floor(min(chunks) * m.num_experts / sent * 1e4 + 1e-6) / 1e4,
        ep_rank_imbalance=up(max(sum(d) for st in steps for d in st) / sent),
        ep_step_imbalance=up(max(sum(map(sum, st[:moe_blocks])) / len(st[:moe_blocks]) for st in steps if st) / sent))


def chunk_rows(m: ModelSpec, tokens: int, ep: int) -> tuple[tuple[int, ...], ...] | None:
    """The rows of each (source rank, local expert) chunk a rank receives, in the order backward runs
    them (the last created first), one tuple per dispatch; None: the routing is unknown, and
    ``ep_backward_transient`` bounds every split of ``received_rows``. The analytical model never
    knows the routing (memory_vs_deepspeed.py fills this in with a measured step's splits)."""
    return None


def _chunk_instants(m: ModelSpec, p: int, ep: int, sent: int, rows: int, n: int, before: int, later: bool) -> float:
    """The largest instant of one chunk's backward (``n`` rows, ``before`` rows of the chunks run before
    it, whose four saved f-wide rows are gone; ``later``: not the first chunk run, so the received rows'
    gradient buffer and both weight buffers exist), beyond the block's saved tensors, the combine's
    saves released. Always live: the cat's gradient (the combine all-to-all backward's R x h output)
    and that all-to-all's S x h input (gloo's work holds it; the allocation trace frees it from
    another thread during the second chunk). In order (torch 2.13, derivatives.yaml mm / select /
    slice, FunctionsManual.cpp ``select_backward``, input_buffer.cpp ``accumulate``):
    * down's weight gradient (h f) and input gradient (n f), then SelectBackward0's zeros (El h f,
      the first chunk's kept as the down buffer, a later one's added into it and freed);
    * the gated product's backward (its saved product released by down's backward): two n x f
      gradients next to down's input gradient;
    * gate_up's weight gradient (2 f h) and input gradient (n h), the chunk's saves released, then
      SelectBackward0's zeros (2 El h f; the first kept as the gate_up buffer);
    * SliceBackward0's zeros (R x h; the first kept as the received rows' gradient buffer) beside the
      chunk's input gradient."""
    h, f, local = m.hidden_size, expert_width(m), m.num_experts // ep
    w = p * local * h * f  # one local-experts weight of h x f (down; gate_up is two)
    live = p * h * rows + p * h * sent - (2 * sent * p * h + sent * p) - 4 * p * f * before
    buffers = p * h * rows + 3 * w if later else 0
    down = live + buffers + p * h * f + p * f * n + w
    product = live + (buffers if later else w) + 2 * p * f * n
    gate_up = live + (buffers if later else w) + p * h * n + 2 * p * f * h + 2 * w - 4 * p * f * n
    slice_ = live + (buffers if later else 3 * w) + p * h * n + p * h * rows - 4 * p * f * n
    return float(max(down, product, gate_up, slice_))


def _chunk_loop(m: ModelSpec, p: int, ep: int, sent: int, chunks: tuple[int, ...]) -> float:
    """The chunk loop's peak for one dispatch's chunks (rows each, in backward order)."""
    rows, before, out = sum(chunks), 0, 0.0
    for j, n in enumerate(chunks):
        out = max(out, _chunk_instants(m, p, ep, sent, rows, n, before, j > 0))
        before += n
    return out


def ep_backward_transient(m: ModelSpec, p: int, tokens: int, ep: int) -> float:
    """The experts' backward peak beyond the block's saved tensors under EP (bytes per block), the
    largest of these instants of expert_parallel.py ``forward``'s backward (S sent rows, R received):
    * the combine's multiply (MulBackward0): ``index_add``'s source gradient (index_select, S x h,
      its saved source released), the combined rows' gradient and the weights' product before its
      sum (S x h each);
    * the combine's all-to-all backward (``_AlltoAllSingle.backward``: an R x h output), the
      multiply's saved rows and weights and the index_add's source released;
    * the chunk loop (``_chunk_instants``), chunk by chunk from the last created (torch 2.13's engine
      runs a higher sequence number first). Each instant is affine in a chunk's rows n and the rows
      run before it (n <= T = min(R, the busiest expert's tokens, moe.worst_expert_tokens); n + before <= R), so with
      the routing unknown (``chunk_rows`` None) the vertices bound every split: with every chunk at least
      S = the least-loaded expert's tokens (``moe.least_expert_tokens``, 0 unless stated), the first
      chunk with S or T rows, a later one at (S, S), (T, S), (S, R - S) or (T, R - T); given the measured
      splits, their exact loop."""
    h = m.hidden_size
    sent, rows = tokens * m.num_experts_per_tok, received_rows(m, tokens, ep)
    released = 2 * sent * p * h + sent * p  # the weighted rows, the combine multiply's saved rows and weights
    w = _routing_weight_bytes(m, p)
    combine = 2 * p * h * sent + max(w, 4) * sent
    exchange = p * h * rows + p * h * sent - released
    splits = chunk_rows(m, tokens, ep)
    if splits is None:
        top = min(rows, worst_expert_tokens(m, tokens))  # a chunk: one source rank's rows for one expert
        low = min(top, least_expert_tokens(m, tokens), rows // 2)
        loop = max(_chunk_instants(m, p, ep, sent, rows, n, b, later) for n, b, later in (
            (low, 0, False), (top, 0, False), (low, low, True), (top, low, True), (low, rows - low, True),
            (top, rows - top, True)))
    else:
        loop = max(_chunk_loop(m, p, ep, sent, tuple(c)) for c in splits)
    return float(max(combine, exchange, loop))
