"""The pieces both engines' step walks share: the blocks' backward activations, the candidate
instants of a step, and the verdict built from the largest of them."""

from __future__ import annotations

from itertools import accumulate
from typing import Iterable, Literal, NamedTuple, Optional

from autotune.memory.activations import ActivationBreakdown
from autotune.memory.expert_parallel import ep_excess
from autotune.memory.mixed import block_kinds, saved_below
from autotune.memory.common import GPU_COMPONENTS, MemoryEstimate, PREDICTION_MARGIN, _gib, overhead_bytes
from autotune.reason import Reason
from autotune.spec import GIB, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, validate

Loop = Literal["keep_outputs", "drop_outputs"]
LOOPS: tuple[str, ...] = ("keep_outputs", "drop_outputs")


class BlockPoint(NamedTuple):
    """Activations alive during one block's backward (bytes per GPU)."""

    block: int
    """Block index (the backward runs from L-1 down to 0)."""
    done: int
    """Blocks whose backward is complete."""
    saved: float
    """Saved activations still alive, the block's recomputation included, no transient; with expert
    parallelism the held blocks' received rows at the largest they can be (``ep_excess_at``)."""
    mlp: float
    """During the block's MLP backward (its transients included)."""
    attention: Optional[float]
    """During its attention backward (None without an attention backward transient)."""
    frame: float = 0.0
    """Part of ``saved`` its checkpoint frame keeps beyond the recomputed set (released with the block)."""
    act: Optional[ActivationBreakdown] = None
    """The block's own kind of terms (dense-MLP blocks among MoE ones: ``ActivationBreakdown.dense``);
    None: the step's record."""
    recompute: Optional[float] = None
    """At its recomputation's MoE forward peak or attention core's forward end (``_recompute``; before the
    backward starts, or under attention / selective before the core's; None: not recomputed, or never above
    ``mlp``)."""


def backward_blocks(act: ActivationBreakdown, strategy: Strategy, num_layers: int, other_saved: float,
                    extra_points: Iterable[int] = (), released: bool = False) -> list[BlockPoint]:
    """The blocks' backward, last to first: what is saved shrinks as blocks finish; a checkpointed
    block is recomputed in full before its backward (what its checkpoint saved, the block input or
    selective's kept tensors, is part of the recomputed set, not a second copy).

    Only the instants that can hold the peak are returned: the state is linear in the block index
    within a run of same-kind blocks, so with the first n blocks checkpointed the ends of both runs
    suffice (plus ``extra_points``); with every k-th block checkpointed every block is visited.
    ``released``: the MLP's instant at ``mlp_backward_released`` (memory/states.py ``ffn_grads_released``)."""
    L = num_layers
    if act.dense is not None:
        return _mixed_blocks(act, strategy, L, other_saved, released)
    n_ck = act.num_checkpointed
    per_plain, per_ck = act.per_block_plain, act.per_block_checkpointed
    every = strategy.checkpoint_every if n_ck else None
    if every is None:
        points = {L - 1, n_ck, n_ck - 1, 0, *extra_points}
        is_ck, count_ck = (lambda i: i < n_ck), (lambda i: min(i + 1, n_ck))
    else:
        points = set(range(L))
        is_ck, count_ck = (lambda i: (i + 1) % every == 0), (lambda i: (i + 1) // every)
    attn_delta = act.attention_backward_transient - act.mlp_saved_per_block
    # during the blocks' backward the final norm's saved tensors are already released, and the
    # gradient of the hidden states (one h-wide tensor per token) flows from block to block
    block_other = other_saved - act.final_norm_saved + act.hidden_grad
    mlp_bwd = act.mlp_backward_released if released else act.mlp_backward_transient
    held_below, moe_blocks = ep_held(act, strategy, L)
    out = []
    for i in sorted((i for i in points if 0 <= i < L), reverse=True):
        ck = is_ck(i)
        remaining = count_ck(i) * per_ck + (i + 1 - count_ck(i)) * per_plain
        frame = act.checkpoint_frame_kept if ck else 0.0
        a = remaining + (act.recompute if ck else 0.0) + block_other + frame - (act.masks_only_later if i == 0 else 0.0)
        # expert parallelism: the blocks below holding received rows, without and with this block's (ep_excess)
        without, with_ = ep_excess_at(act, held_below, moe_blocks, i)
        # a checkpointed attention module / core is recomputed only after the MLP's backward
        late = ck and act.recomputed_after_mlp
        a_mlp = a - act.recompute if late else a
        # its attention backward: the MLP's saved tensors released, the attention's transient and (the engines)
        # the MLP's weight gradients alive: an instant of its own whenever that transient exists
        out.append(BlockPoint(i, L - 1 - i, a + max(without, with_), a_mlp + mlp_bwd + with_,
                              a + attn_delta + without if (act.attention_backward_transient > 0 or late) else None,
                              frame, act, _recompute(act, ck, a + with_)))
    return out


def ep_held(act: ActivationBreakdown, strategy: Strategy, L: int) -> tuple[list[int], int]:
    """Expert parallelism: per block index i, the MoE blocks below it (0..i-1) holding their received rows
    (plain ones; checkpointed ones where ``ep_blocks_hold``), and how many MoE blocks the step has
    (``expert_parallel.ep_excess``)."""
    if not act.ep_spread:
        return [0] * (L + 1), L
    ck = set(strategy.checkpointed_blocks(L))
    kinds = block_kinds(act, L)
    return (list(accumulate((k is act and (act.ep_blocks_hold or i not in ck) for i, k in enumerate(kinds)),
                            initial=0)), sum(k is act for k in kinds))


def ep_excess_held(act: ActivationBreakdown, held: int, moe_blocks: int) -> float:
    """``expert_parallel.ep_excess`` of ``held`` blocks' received rows (0 without expert parallelism)."""
    return ep_excess(act.ep_spread, act.ep_mean_saved, moe_blocks, held) if act.ep_spread else 0.0


def ep_excess_at(act: ActivationBreakdown, held_below: list[int], moe_blocks: int, i: int) -> tuple[float, float]:
    """``ep_excess_held`` at block i's instants without and with its own received rows (a MoE block's, once
    run or recomputed)."""
    own = act.dense is None or not act.dense_layers[i]
    return ep_excess_held(act, held_below[i], moe_blocks), ep_excess_held(act, held_below[i] + own, moe_blocks)


def last_forward_relief(m: ModelSpec, k: ActivationBreakdown) -> float:
    """What the last checkpointed block's backward instant (``BlockPoint.saved``: its recomputed set, every
    block's saved tensors, the gradient flowing back) holds beyond the same block's attention core in the
    forward, an instant of both walks: the MLP's saved tensors (made after the core) and the hidden states'
    gradient, less the core's forward transient: eager attention's score chain, estimated as its backward's
    transient (not itemized: -0.60% on hf-gptoss-sv ZeRO-1 GA 2 attention fp32, whose sinks' cat and max sit
    beside it), sdpa's recomputed core end (``core_recompute_transient``, the CPU math kernel; none for the
    fused kernels). It holds the step's peak where the forward holds more gradients than the backward's
    instants (estimate.split_carry), and the forward phase's own figure everywhere (docs/accuracy.md)."""
    core = (k.attention_backward_transient if m.attn_implementation == "eager"
            else max(0.0, k.core_recompute_transient))
    return k.mlp_saved_per_block + k.hidden_grad - core


def _mixed_blocks(act: ActivationBreakdown, strategy: Strategy, L: int, other_saved: float,
                  released: bool = False) -> list[BlockPoint]:
    """``backward_blocks`` for blocks of two kinds (memory/mixed.py): every block visited, each with its
    kind's saved bytes, recomputation, frame and transients; what is still saved below it summed block
    by block."""
    kinds = block_kinds(act, L)
    ck = set(strategy.checkpointed_blocks(L))
    below = saved_below(act, strategy.checkpointed_blocks(L), L)
    block_other = other_saved - act.final_norm_saved + act.hidden_grad
    held_below, moe_blocks = ep_held(act, strategy, L)
    out = []
    for i in range(L - 1, -1, -1):
        k, is_ck = kinds[i], i in ck
        frame = k.checkpoint_frame_kept if is_ck else 0.0
        recompute = k.recompute if is_ck else 0.0
        a = below[i] + recompute + block_other + frame - (act.masks_only_later if i == 0 else 0.0)
        without, with_ = ep_excess_at(act, held_below, moe_blocks, i)
        late = is_ck and act.recomputed_after_mlp
        a_mlp = a - recompute if late else a
        attn_delta = k.attention_backward_transient - k.mlp_saved_per_block
        mlp_bwd = k.mlp_backward_released if released else k.mlp_backward_transient
        out.append(BlockPoint(i, L - 1 - i, a + max(without, with_), a_mlp + mlp_bwd + with_,
                              a + attn_delta + without if (k.attention_backward_transient > 0 or late) else None,
                              frame, k, _recompute(k, is_ck, a + with_)))
    return out


def _recompute(k: ActivationBreakdown, checkpointed: bool, a: float) -> Optional[float]:
    """A checkpointed block's recomputation instant (``BlockPoint.recompute``): the recomputed set ``a`` (the
    block's saved tensors, all made by then but what runs after the experts or the attention core, which
    the transients net out) plus the larger of ``moe_recompute_transient`` (its MoE forward's peak) and
    ``core_recompute_transient`` (its attention core's forward end), the core's alone where the MoE's is
    none: it may be negative (the MLP's saved tensors, in ``a``, released before a late recomputation) and
    still above the block's other instants."""
    moe = k.moe_recompute_transient if k.moe_recomputed else 0.0
    top = max(moe, k.core_recompute_transient) if moe else k.core_recompute_transient
    return a + top if (checkpointed and top) else None


class Candidate(NamedTuple):
    """One instant of the step that may hold the peak: what is allocated then (bytes per GPU)."""

    phase: str
    """forward, backward or optimizer."""
    total: float
    grads: float
    activations: float
    logits: float
    buffers: float


def phase_peaks(cands: list[Candidate]) -> tuple[dict[str, int], Candidate]:
    """The peak of each phase, and the candidate holding the step's peak (the first on a tie)."""
    phases: dict[str, int] = {}
    best = cands[0]
    for c in cands:
        if c.total > phases.get(c.phase, -1):
            phases[c.phase] = int(c.total)
        if c.total > best.total:
            best = c
    return phases, best


def _reasons(reasons: list[str], gpu: dict[str, int], cpu: int, nvme: int, hardware: HardwareSpec,
             headroom: float, why_gpu: Optional[str] = None) -> list[str]:
    """The strategy's rule violations plus every limit it exceeds (GPU, host RAM, NVMe), each a Reason;
    ``why_gpu``: what the GPU limit's reason adds when it is exceeded."""
    avail = hardware.gpu.memory_bytes * (1.0 - headroom)
    total = gpu["peak"] + gpu["overhead"]
    if total > avail:
        biggest = max(GPU_COMPONENTS[:-1], key=lambda k: gpu[k])
        reasons.append(Reason(
            f"peak {_gib(total)} (incl. {_gib(gpu['overhead'])} overhead) > {_gib(avail)} free on "
            f"{hardware.gpu.name}; largest part: {biggest.replace('_', ' ')} {_gib(gpu[biggest])}", "gpu_memory"
        ))
        if gpu[biggest] > avail:
            reasons.append(Reason(f"{biggest.replace('_', ' ')} {_gib(gpu[biggest])} > {_gib(avail)} free", "gpu_memory"))
        if why_gpu:
            reasons.append(Reason(why_gpu, "gpu_memory"))
    cpu_avail = hardware.cpu_memory_gib * GIB
    if cpu > cpu_avail:
        reasons.append(Reason(f"offload needs {_gib(cpu)} host RAM per node > {_gib(cpu_avail)} available", "host_memory"))
    if nvme:
        cap = hardware.nvme.capacity_gib * GIB if hardware.nvme else 0
        if nvme > cap:
            reasons.append(Reason(f"offload needs {_gib(nvme)} NVMe per node > {_gib(cap)} available", "nvme"))
    return reasons


def finish(cands: list[Candidate], model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
           strategy: Strategy, headroom: float, *, params: float, optimizer: float, resident_grads: float,
           resident_buffers: float, cpu_per_gpu: float, nvme_per_gpu: float,
           reserved_elsewhere: float = 0.0, why_gpu: Optional[str] = None) -> MemoryEstimate:
    """The estimate at the largest candidate: the breakdown (the resident states plus what that
    instant holds), the overhead, host and NVMe needs per node, and the verdict with its reasons.
    ``reserved_elsewhere``: memory the allocator keeps reserved outside the peak's live tensors
    (side-stream pools), added to the overhead; ``why_gpu``: a reason added when the GPU limit is exceeded."""
    phases, best = phase_peaks(cands)
    gpu = {"parameters": int(params), "gradients": int(resident_grads + best.grads),
           "optimizer_states": int(optimizer), "activations": int(best.activations), "logits": int(best.logits),
           "buffers": int(resident_buffers + best.buffers)}
    peak = sum(gpu.values())
    # + the measured worst-case under-prediction of the model (PREDICTION_MARGIN)
    gpu["overhead"] = overhead_bytes(hardware, peak) + int(PREDICTION_MARGIN * peak) + int(reserved_elsewhere)
    gpu = {k: gpu[k] for k in GPU_COMPONENTS} | {"peak": int(peak)}

    gpn = hardware.gpus_per_node
    cpu = int(cpu_per_gpu * gpn)
    nvme = int(nvme_per_gpu * gpn)
    reasons = _reasons(list(validate(strategy, model, training, hardware)), gpu, cpu, nvme, hardware, headroom,
                       why_gpu)
    return MemoryEstimate(gpu=gpu, peak_phase=best.phase, cpu_bytes_per_node=cpu, nvme_bytes_per_node=nvme,
                          fits=not reasons, reasons=reasons, phases=phases,
                          activation_peak=int(max(c.activations + c.logits for c in cands)))
