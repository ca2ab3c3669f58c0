"""The memory model over a whole candidate grid at once, for the screen: each candidate's verdict
(fits) and what the GPU must hold (``MemoryEstimate.total_gpu_bytes``), equal to the byte to what
``estimate_memory`` returns for it.

The terms that depend on few knobs are computed once per distinct key by the scalar functions
themselves (model states: ``states._model_states``; activations: ``activation_breakdown``; the
rules: ``strategy.validate``); the step walk of estimate.py / fsdp2.py (and walk.py's blocks and
verdict) is transcribed to numpy arrays over the candidates, in the same order of operations
(float64; every integer stays below 2**53, so integer and float arithmetic agree), an instant a
candidate does not have masked out. tests/search/test_screen_fast.py checks it against
``estimate_memory`` on every candidate of several spaces; a change to the walk goes in both.
Strategies outside what the grid covers (``checkpoint_every``) are left to ``estimate_memory``.
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence

import numpy as np

from autotune.knobs import memory_key
from autotune.memory.activations import ActivationBreakdown, activation_breakdown
from autotune.memory.common import PREDICTION_MARGIN
from autotune.memory.estimate import _accumulation_carry, carry_buckets, split_carry
from autotune.memory.expert_parallel import ep_excess
from autotune.memory.fsdp2 import _Units, _units, offload_host, rs_input_copies
from autotune.memory.mixed import blocks_within, dense_block_spec, kind_spec, layer_kinds, params_after
from autotune.memory.moe import down_weight_elements
from autotune.memory.states import _model_states, zero3_gathered
from autotune.spec import BYTES_PER_ELEMENT, GIB, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, data_parallel_size, validate
from autotune.engine_configs import engine_settings, gradient_accumulation_steps

_ACT_FIELDS = ("blocks", "per_block_plain", "per_block_checkpointed", "num_checkpointed", "nonblock", "logits_saved",
               "loss_forward_transient", "loss_backward_transient", "mlp_saved_per_block",
               "attention_backward_transient", "final_norm_saved", "forward_only_masks", "final_norm_forward_extra",
               "hidden_grad", "checkpoint_frame_kept", "final_norm_backward_live", "mlp_backward_transient", "mlp_backward_released",
               "logits_tokens", "offloaded", "moe_forward_transient", "moe_recompute_transient", "masks_only_later",
               "recompute", "core_recompute_transient", "ep_mean_saved", "ep_spread", "ep_blocks_hold")
_act_fields = attrgetter(*_ACT_FIELDS)


rules_key = attrgetter(*memory_key(Strategy, "rules"))
"""The knobs ``strategy.validation_errors`` reads."""
activation_key = attrgetter(*memory_key(Strategy, "activations"))
"""The knobs ``activation_breakdown`` reads (and whether the last block is checkpointed)."""
states_key = attrgetter(*memory_key(Strategy, "states"))
"""The knobs a DeepSpeed candidate's ``states_row`` reads (``_model_states``, ``default_buckets``,
``_accumulation_carry``)."""
units_key = attrgetter(*memory_key(Strategy, "units"))
"""The knobs an FSDP2 candidate's ``units_row`` reads (``fsdp2._units``, the accumulation)."""


def covered(s: Strategy, model: Optional[ModelSpec] = None) -> bool:
    """Whether the grid computes this strategy (else: estimate_memory): the first n blocks
    checkpointed, not every k-th (a MoE with dense layers among its sparse ones, memory/mixed.py,
    included: each block of its kind)."""
    return s.checkpoint_every is None


def _table(strategies: Sequence[Strategy], key: Callable[[Strategy], tuple],
           make: Callable[[Strategy], list[Any]]) -> np.ndarray:
    """(fields, candidates) float64: ``make``'s row once per distinct ``key`` (any strategy of a key
    stands for all of them), gathered per candidate, one field per row."""
    keys = list(map(key, strategies))
    distinct = dict(zip(keys, strategies))
    index = {k: i for i, k in enumerate(distinct)}
    rows = np.array([make(s) for s in distinct.values()], dtype=np.float64)
    return rows[np.fromiter(map(index.__getitem__, keys), dtype=np.intp, count=len(keys))].T


def verdicts(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategies: Sequence[Strategy], *,
             headroom: float = 0.0, device: str = "cuda",
             loop: str = "keep_outputs") -> list[Optional[tuple[bool, Optional[int]]]]:
    """Per strategy: (fits, total_gpu_bytes) as ``estimate_memory(..., headroom, device, loop)`` gives
    them; (False, None) for one that breaks a rule (it never fits; its figures are not computed);
    None for one the grid does not cover (``covered``)."""
    keys = list(map(rules_key, strategies))
    valid = {k: not validate(s, model, training, hardware) for k, s in dict(zip(keys, strategies)).items()}
    ok = list(map(valid.__getitem__, keys))
    broken = (False, None)
    out: list[Optional[tuple[bool, Optional[int]]]] = [
        None if s.checkpoint_every is not None else (None if good else broken) for s, good in zip(strategies, ok)]
    for engine, walk in (("deepspeed", _deepspeed), ("fsdp2", _fsdp2)):
        idx = [i for i, (s, good) in enumerate(zip(strategies, ok))
               if good and s.engine == engine and s.checkpoint_every is None]  # covered()
        if idx:
            fits, total, _ = walk(model, training, hardware, [strategies[i] for i in idx], headroom, device, loop)
            for i, f, t in zip(idx, fits.tolist(), total.tolist()):
                out[i] = (f, t)
    return out


def phase_peaks(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategies: Sequence[Strategy],
                engine: str, *, device: str = "cuda",
                loop: str = "keep_outputs") -> tuple[dict[str, list[int]], list[int]]:
    """``MemoryEstimate.phases`` and ``activation_peak`` of each strategy (all of ``engine``, all
    covered), from the grid's walk: what the tests compare with estimate_memory instant by phase."""
    walk = _deepspeed if engine == "deepspeed" else _fsdp2
    w = walk(model, training, hardware, strategies, 0.0, device, loop)[2]
    stacked = [np.stack(c) for c in zip(*w.items)]
    phases = {phase: np.trunc(stacked[0][[i for i, ph in enumerate(w.phases) if ph == phase]].max(axis=0))
              .astype(np.int64).tolist() for phase in dict.fromkeys(w.phases)}
    alive = np.where(np.isfinite(stacked[0]), stacked[2] + stacked[3], -np.inf)
    return phases, np.trunc(alive.max(axis=0)).astype(np.int64).tolist()


class _Walk:
    """The instants of a step over all candidates (the scalar walk's Candidate list, as arrays)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.items: list[tuple[Any, ...]] = []
        self.phases: list[str] = []

    def add(self, phase: str, total: Any, grads: Any, activations: Any, logits: Any, buffers: Any,
            valid: Any = True) -> None:
        full = lambda x: np.broadcast_to(np.asarray(x, dtype=np.float64), (self.n,))  # noqa: E731
        self.items.append((np.where(valid, full(total), -np.inf), full(grads), full(activations), full(logits),
                           full(buffers)))
        self.phases.append(phase)

    def best(self) -> tuple[np.ndarray, ...]:
        """grads, activations, logits, buffers of each candidate's largest instant (the first on a
        tie, walk.phase_peaks)."""
        stacked = [np.stack(c) for c in zip(*self.items)]
        at = np.argmax(stacked[0], axis=0)
        cols = np.arange(self.n)
        return tuple(c[at, cols] for c in stacked[1:])


def _verdict(best: tuple[np.ndarray, ...], hardware: HardwareSpec, headroom: float, *, params: Any, optimizer: Any,
             resident_grads: Any, resident_buffers: Any, cpu_per_gpu: Any, nvme_per_gpu: Any,
             reserved_elsewhere: Any = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """walk.finish and walk._reasons on arrays: (fits, total) per candidate."""
    grads, acts, logits, buffers = best
    i64 = lambda x: np.trunc(np.asarray(x, dtype=np.float64)).astype(np.int64)  # noqa: E731  (int())
    peak = (i64(params) + i64(resident_grads + grads) + i64(optimizer) + i64(acts) + i64(logits)
            + i64(resident_buffers + buffers))
    overhead = (i64(hardware.cuda_context_gib * GIB + hardware.allocator_slack * peak.astype(np.float64))
                + i64(PREDICTION_MARGIN * peak.astype(np.float64)) + i64(reserved_elsewhere))
    total = peak + overhead
    gpn = hardware.gpus_per_node
    cpu = i64(np.asarray(cpu_per_gpu, dtype=np.float64) * gpn)
    nvme = i64(np.asarray(nvme_per_gpu, dtype=np.float64) * gpn)
    fits = total <= hardware.gpu.memory_bytes * (1.0 - headroom)
    fits &= cpu <= hardware.cpu_memory_gib * GIB
    nvme_cap = hardware.nvme.capacity_gib * GIB if hardware.nvme else 0
    fits &= (nvme == 0) | (nvme <= nvme_cap)
    return fits, total


def _points(n_ck: np.ndarray, L: int, extra: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """walk.backward_blocks' instants (first n blocks checkpointed): per slot, each candidate's
    block index (descending, as the scalar loop visits them) and whether the slot holds one."""
    pts = np.stack([np.full(n_ck.shape, L - 1), n_ck, n_ck - 1, np.zeros_like(n_ck), *extra], axis=1)
    pts = np.where((pts >= 0) & (pts < L), pts, -1)
    pts = -np.sort(-pts, axis=1)
    valid = pts >= 0
    valid[:, 1:] &= pts[:, 1:] != pts[:, :-1]  # a set: each block once
    return [(pts[:, j], valid[:, j]) for j in range(pts.shape[1])]


def _recompute_top(k: dict[str, np.ndarray], moe_recomputed: np.ndarray) -> np.ndarray:
    """walk._recompute's transient: the larger of the MoE forward's (when the granularity recomputes the MoE)
    and the attention core's recomputation instants against the recomputed set, the core's alone (below it
    where the block's later saves are not made yet) without the MoE's (0: none)."""
    moe = np.where(moe_recomputed, k["moe_recompute_transient"], 0.0)
    return np.where(moe != 0, np.maximum(moe, k["core_recompute_transient"]), k["core_recompute_transient"])


def _block_point(a: dict[str, np.ndarray], i: np.ndarray, other_saved: np.ndarray, L: int,
                 recomputed_late: np.ndarray, moe_recomputed: np.ndarray, released: Any = False) -> tuple[np.ndarray, ...]:
    """walk.backward_blocks for block ``i``: (done, saved, mlp, attention, frame, recompute, has_recompute,
    has_attention);
    ``released``: per candidate, the MLP instant at ``mlp_backward_released`` (states.ffn_grads_released)."""
    n_ck, per_plain, per_ck = a["num_checkpointed"], a["per_block_plain"], a["per_block_checkpointed"]
    ck = i < n_ck
    count = np.minimum(i + 1, n_ck)
    remaining = count * per_ck + (i + 1 - count) * per_plain
    frame = np.where(ck, a["checkpoint_frame_kept"], 0.0)
    block_other = other_saved - a["final_norm_saved"] + a["hidden_grad"]
    saved = remaining + np.where(ck, a["recompute"], 0.0) + block_other + frame - np.where(i == 0, a["masks_only_later"], 0.0)
    late = ck & recomputed_late
    a_mlp = np.where(late, saved - a["recompute"], saved)
    attn_delta = a["attention_backward_transient"] - a["mlp_saved_per_block"]
    top = _recompute_top(a, moe_recomputed)
    has_recompute = ck & (top != 0)
    mlp_bwd = np.where(released, a["mlp_backward_released"], a["mlp_backward_transient"])
    # walk.ep_held / ep_excess_at: the blocks below holding their received rows, all MoE blocks
    held = i - np.where(a["ep_blocks_hold"] > 0, 0, np.minimum(i, n_ck))
    without, with_ = _ep_excess(a, held, L), _ep_excess(a, held + 1, L)
    return (L - 1 - i, saved + np.maximum(without, with_), a_mlp + mlp_bwd + with_, saved + attn_delta + without, frame,
            saved + top + with_, has_recompute, (a["attention_backward_transient"] > 0) | late)


def _ep_held(a: dict[str, np.ndarray], ks: list[Any]) -> np.ndarray:
    """walk.ep_held per candidate: (L + 1, candidates), row i the MoE blocks below block i (``ks[j] is a``)
    holding their received rows (the first n_ck checkpointed)."""
    n_ck, hold = a["num_checkpointed"], a["ep_blocks_hold"] > 0
    rows = [np.zeros(len(n_ck))]
    for j, k in enumerate(ks):
        rows.append(rows[-1] + ((k is a) & (hold | (j >= n_ck))))
    return np.stack(rows)


def _ep_excess(a: dict[str, np.ndarray], held: Any, moe_blocks: int) -> np.ndarray:
    """expert_parallel.ep_excess per candidate."""
    return ep_excess(a["ep_spread"], a["ep_mean_saved"], moe_blocks, held)


def activation_row(model: ModelSpec, training: TrainingSpec, s: Strategy, device: str) -> list[Any]:
    """The activation terms of a candidate (``_ACT_FIELDS``), whether it recomputes after the MLP's backward
    (``ActivationBreakdown.recomputed_after_mlp``),
    whether its last block is checkpointed (fsdp2's forward) and whether a checkpointed block recomputes
    its MoE (``ActivationBreakdown.moe_recomputed``)."""
    L = model.num_hidden_layers
    act: ActivationBreakdown = activation_breakdown(model, training, s, device)
    return [*_act_fields(act), act.recomputed_after_mlp, (L - 1) in s.checkpointed_blocks(L), act.moe_recomputed]


def _dense_activations(model: ModelSpec, training: TrainingSpec, strategies: Sequence[Strategy],
                       device: str) -> dict[str, np.ndarray]:
    """A MoE model's dense-MLP blocks (memory/mixed.py): their activation terms (``ActivationBreakdown.dense``,
    ``_ACT_FIELDS``) per candidate."""
    cols = _table(strategies, activation_key,
                  lambda s: list(_act_fields(activation_breakdown(model, training, s, device).dense)))
    return {f: cols[k] for k, f in enumerate(_ACT_FIELDS)}


def _dense_units(model: ModelSpec, hardware: HardwareSpec, strategies: Sequence[Strategy]) -> dict[str, np.ndarray]:
    """A MoE model's dense-MLP blocks' FSDP2 units (``fsdp2._layer_units``: the dense block spec's ``_U``)."""
    dense = dense_block_spec(model)
    units = _table(strategies, units_key, lambda s: list(_u_fields(_units(dense, s, hardware))))
    return {f: units[k] for k, f in enumerate(_U)}


def _activations(model: ModelSpec, training: TrainingSpec, strategies: Sequence[Strategy],
                 device: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The activation terms per candidate (one activation_row per distinct activation_key)."""
    cols = _table(strategies, activation_key, lambda s: activation_row(model, training, s, device))
    a = {f: cols[k] for k, f in enumerate(_ACT_FIELDS)}
    a["num_checkpointed"] = a["num_checkpointed"].astype(np.int64)
    n = len(_ACT_FIELDS)
    return a, cols[n] > 0, cols[n + 1] > 0, cols[n + 2] > 0


_ST = ("params", "grads", "optimizer", "buffers_bwd", "buffers_bwd_end", "buffers_step", "step_gather", "buffers_fwd",
       "grad_per_block", "grad_buffer", "resident_buffers", "partition_after", "reduce_flat", "reduce_clone", "cpu",
       "nvme", "reduce_clone_dense", "ffn_grads_released", "leaf_hook", "head_released", "core_grads_held")
_st_fields = attrgetter(*_ST)
_DS = _ST + ("p", "carry", "grow", "carry_ipg", "split", "zero1", "zero0", "k", "k2", "blocked")


def states_row(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy, device: str,
               cache: Optional[dict] = None) -> list[Any]:
    """A DeepSpeed candidate's model states (``_ST``) and the walk's other per-strategy terms (``_DS``).
    ``cache``: the states without the checkpointing knobs, which move ZeRO-3's gathered parameters only
    (states.zero3_gathered), by their key."""
    head, block_params = m.vocab_size * m.hidden_size, m.block_params()
    plain = dataclasses.replace(s, checkpointing="none", checkpoint_layers=None, checkpoint_every=None)
    key = states_key(plain)
    st = cache.get(key) if cache is not None else None
    if st is None:
        st = _model_states(m, training, hardware, plain, device)
        if cache is not None:
            cache[key] = st
    if s.zero_stage == 3 and s.checkpointing != "none":
        st = dataclasses.replace(st, **zero3_gathered(m, s, engine_settings(m, training, s),
                                                      data_parallel_size(hardware), device))
    p = BYTES_PER_ELEMENT[s.precision]
    gas = gradient_accumulation_steps(s, training, hardware)
    carry, grow = _accumulation_carry(m, hardware, s, gas)
    carry_ipg = carry_buckets(st, s, carry)
    bucket = st.partition_after or 0
    blocked = bool(bucket and block_params)
    # estimate._blocks_backward: blocks done before the gradient partition exists, before the second reduce
    if blocked and layer_kinds(m) is not None:  # blocks of two sizes
        k, k2 = blocks_within(m, max(0.0, bucket - head)), blocks_within(m, max(0.0, 2 * bucket - head))
    else:
        k = int(max(0.0, bucket - head) // block_params) if blocked else 0
        k2 = int(max(0.0, 2 * bucket - head) // block_params) if blocked else 0
    # then ZeRO-3's retained expert copies summed over the first i blocks, i = 0..L (states.experts_retained)
    retained = np.concatenate(([0.0], np.cumsum(st.experts_retained or [0.0] * m.num_hidden_layers)))
    return [*_st_fields(st), p, carry, grow, carry_ipg, split_carry(m, s, gas, carry, carry_ipg),
            s.zero_stage == 1, s.zero_stage == 0, k, k2, blocked, *retained]


def _last_core_forward(m: ModelSpec, a: dict[str, np.ndarray], a_dense: Optional[dict[str, np.ndarray]],
                       other_saved: np.ndarray, recomputed_late: np.ndarray, moe_recomputed: np.ndarray) -> np.ndarray:
    """The last checkpointed block's attention core in the forward, per candidate (walk.last_forward_relief off its
    backward instant ``BlockPoint.saved``; both walks)."""
    kinds, L = layer_kinds(m), m.num_hidden_layers
    if kinds is not None:
        saved = next(_mixed_points([a_dense if d else a for d in kinds], a, recomputed_late, moe_recomputed,
                                   other_saved))[3]
    else:
        saved = _block_point(a, np.full(len(other_saved), L - 1), other_saved, L, recomputed_late, moe_recomputed)[1]
    k = a_dense if (kinds is not None and kinds[-1]) else a
    core = k["attention_backward_transient"] if m.attn_implementation == "eager" else np.maximum(
        0.0, k["core_recompute_transient"])
    return saved - (k["mlp_saved_per_block"] + k["hidden_grad"] - core)


def _deepspeed(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategies: Sequence[Strategy],
               headroom: float, device: str, loop: str) -> tuple[np.ndarray, np.ndarray, _Walk]:
    """estimate.estimate_memory's walk (deepspeed engine) over the candidates."""
    m, L = model, model.num_hidden_layers
    head, block_params, V = m.vocab_size * m.hidden_size, m.block_params(), m.vocab_size
    cache: dict = {}
    table = _table(strategies, states_key, lambda s: states_row(m, training, hardware, s, device, cache))
    c = dict(zip(_DS, table))
    a, recomputed_late, last_ck, moe_recomputed = _activations(m, training, strategies, device)
    # ZeRO-3's released expert copies but a checkpointed block's whose experts are recomputed
    # (states.experts_retained; the checkpointed blocks are the first num_checkpointed)
    cum = table[len(_DS):]
    n = len(strategies)
    retained = cum[L] - np.where(moe_recomputed, cum[a["num_checkpointed"].astype(np.intp), np.arange(n)], 0.0)
    c["buffers_fwd"], c["buffers_bwd"] = c["buffers_fwd"] + retained, c["buffers_bwd"] + retained
    kinds = layer_kinds(m)
    a_dense = _dense_activations(m, training, strategies, device) if kinds is not None else None
    p, carry, grow, carry_ipg, split = c["p"], c["carry"], c["grow"] > 0, c["carry_ipg"], c["split"]
    released = c["ffn_grads_released"] > 0  # the MLP instants' transient (estimate._blocks_backward)
    tokens = a["logits_tokens"]
    kept = p * V * tokens if loop == "keep_outputs" else np.zeros(n)
    w = _Walk(n)
    fixed = c["params"] + c["optimizer"] + c["grad_buffer"] + c["resident_buffers"]
    pending_head = p * head if m.tie_word_embeddings else np.zeros(n)

    def add(phase: str, grads: Any = 0.0, activations: Any = 0.0, logits: Any = 0.0, buffers: Any = 0.0,
            pending: Any = 0.0, valid: Any = True, hooked: tuple[Any, Any] = (0.0, 0.0)) -> None:
        logits = logits + kept
        if phase != "optimizer":  # estimate.split_relief over the candidates
            relief = np.maximum(0.0, np.minimum(p * hooked[0], split - p * hooked[1]))
            grads = np.where(grow, grads + carry - np.minimum(carry_ipg, buffers) - relief,
                             np.maximum(grads - pending, carry) + pending)
        w.add(phase, fixed + grads + activations + logits + buffers, grads, activations, logits, buffers, valid)

    saved_blocks, logits_saved = a["blocks"], a["logits_saved"]
    other_saved = a["nonblock"] - logits_saved
    moe_fwd = (a_dense if kinds is not None and kinds[-1] else a)["moe_forward_transient"]  # estimate.py's last_kind
    add("forward", activations=saved_blocks + other_saved - a["final_norm_saved"] + a["forward_only_masks"] + moe_fwd,
        buffers=c["buffers_fwd"], valid=(moe_fwd > 0) & ~(last_ck & moe_recomputed))
    add("forward", activations=saved_blocks + other_saved + a["final_norm_forward_extra"] + a["forward_only_masks"],
        buffers=c["buffers_fwd"])
    add("forward", activations=saved_blocks + other_saved, logits=logits_saved + a["loss_forward_transient"],
        buffers=c["buffers_fwd"])
    add("backward", activations=saved_blocks + other_saved, logits=logits_saved + a["loss_backward_transient"],
        buffers=c["buffers_fwd"])
    add("backward", grads=p * head, activations=saved_blocks + other_saved, logits=p * V * tokens,
        buffers=c["buffers_fwd"], pending=pending_head)
    add("backward", grads=p * head, activations=saved_blocks + other_saved, buffers=c["buffers_bwd"],
        pending=pending_head)
    zero0 = c["zero0"] > 0
    head_grad = np.where(zero0 | m.tie_word_embeddings, p * head, 0.0)
    bwd = c["buffers_bwd"] - c["head_released"]
    head_hooked = 0.0 if m.tie_word_embeddings else float(head)  # estimate.py's
    add("backward", grads=head_grad, activations=saved_blocks + other_saved - a["final_norm_saved"]
        + a["final_norm_backward_live"], buffers=bwd, pending=pending_head,
        hooked=(head_hooked, head_hooked + m.norm_params()))
    hooked_before = head_hooked + m.norm_params()

    # estimate._blocks_backward
    held = np.where(c["core_grads_held"] != 0, p, 0.0)  # bytes per parameter made before the attention core's backward
    bucket = c["partition_after"]
    blocked = c["blocked"] > 0
    k, k2 = c["k"].astype(np.int64), c["k2"].astype(np.int64)
    none = np.full(n, -1, dtype=np.int64)
    extra = [np.where(blocked, L - 1 - k, none), np.where(blocked, L - 2 - k, none),
             np.where(blocked, L - 2 - k2, none)]
    reduce_flat, reduce_clone = c["reduce_flat"], c["reduce_clone"]
    reducing = blocked & (reduce_flat != 0)
    r_true, r_false = L - 2 - k2, L - 2 - k  # {L-2-k2: True, L-2-k: False}, the later key winning
    if kinds is not None:  # every block, each of its kind (walk._mixed_blocks; estimate._blocks_backward)
        after = params_after(m)
        for i, kd, _, saved, mlp, _, attention, has_attention, recompute, has_recompute in _mixed_points(
                [a_dense if d else a for d in kinds], a, recomputed_late, moe_recomputed, other_saved, released):
            g_before = head_grad + np.where(c["grad_per_block"] != 0, p * after[i], 0.0)
            g = g_before + np.where((bucket != 0) & (head + after[i] > bucket), c["grads"], 0.0)
            after_core = m.params_after_attention_core(False if kinds[i] else None)
            hooked = (hooked_before + after[i], hooked_before + after[i] + m.block_params(False if kinds[i] else None))
            late = (hooked[0] + after_core, hooked[1])
            add("backward", grads=g, activations=mlp, buffers=bwd, pending=pending_head, hooked=hooked)
            core_grads = g + held * after_core
            # a recomputation under attention / selective runs after the MLP's backward (estimate._blocks_backward)
            add("backward", grads=np.where(recomputed_late, core_grads, g_before), activations=recompute, buffers=bwd,
                pending=pending_head, valid=has_recompute,
                hooked=(np.where(recomputed_late, late[0], hooked[0]), hooked[1]))
            add("backward", grads=core_grads, activations=attention,
                buffers=bwd, pending=pending_head, valid=has_attention, hooked=late)
            clone = c["reduce_clone_dense"] if kinds[i] else reduce_clone
            add("backward", grads=g, activations=mlp - kd["mlp_backward_transient"],
                buffers=bwd + p * down_weight_elements(kind_spec(m, kinds[i])) + clone,
                pending=pending_head, valid=clone != 0, hooked=hooked)
            add("backward", grads=g, activations=saved - kd["mlp_saved_per_block"] + kd["hidden_grad"],
                buffers=bwd + c["leaf_hook"], pending=pending_head, valid=(c["leaf_hook"] != 0) & (not kinds[i]),
                hooked=hooked)
            add("backward", grads=np.where(i == r_false, g_before, g), activations=saved,
                buffers=bwd + reduce_flat, pending=pending_head,
                valid=reducing & ((i == r_true) | (i == r_false)), hooked=hooked)
    for i, valid in (_points(a["num_checkpointed"], L, extra) if kinds is None else ()):
        done, saved, mlp, attention, _, recompute, has_recompute, has_attention = _block_point(
            a, i, other_saved, L, recomputed_late, moe_recomputed, released)
        g_before = head_grad + done * c["grad_per_block"]
        g = g_before + np.where((bucket != 0) & (head + done * block_params > bucket), c["grads"], 0.0)
        hooked = (hooked_before + done * block_params, hooked_before + (done + 1) * block_params)
        late = (hooked[0] + m.params_after_attention_core(), hooked[1])
        add("backward", grads=g, activations=mlp, buffers=bwd, pending=pending_head, valid=valid, hooked=hooked)
        core_grads = g + held * m.params_after_attention_core()
        add("backward", grads=np.where(recomputed_late, core_grads, g_before), activations=recompute, buffers=bwd,
            pending=pending_head, valid=valid & has_recompute,
            hooked=(np.where(recomputed_late, late[0], hooked[0]), hooked[1]))
        add("backward", grads=core_grads, activations=attention, buffers=bwd,
            pending=pending_head, valid=valid & has_attention, hooked=late)
        add("backward", grads=g, activations=mlp - a["mlp_backward_transient"],
            buffers=bwd + p * down_weight_elements(m) + reduce_clone, pending=pending_head,
            valid=valid & (reduce_clone != 0), hooked=hooked)
        add("backward", grads=g, activations=saved - a["mlp_saved_per_block"] + a["hidden_grad"],
            buffers=bwd + c["leaf_hook"], pending=pending_head, valid=valid & (c["leaf_hook"] != 0), hooked=hooked)
        in_reduces = reducing & ((i == r_true) | (i == r_false))
        add("backward", grads=np.where(i == r_false, g_before, g), activations=saved,
            buffers=bwd + reduce_flat, pending=pending_head, valid=valid & in_reduces, hooked=hooked)

    add("forward", activations=_last_core_forward(m, a, a_dense, other_saved, recomputed_late, moe_recomputed),
        buffers=c["buffers_fwd"], valid=last_ck)
    moved = np.where(c["zero1"] > 0, carry - carry_ipg, 0.0)
    add("backward", grads=c["grads"] - moved, buffers=bwd + c["buffers_bwd_end"])
    add("backward", grads=np.where(m.num_parameters > bucket, c["grads"], 0.0) - moved,
        buffers=bwd + reduce_flat, valid=reduce_flat != 0)
    add("optimizer", grads=c["grads"], buffers=c["buffers_step"])
    add("optimizer", buffers=c["step_gather"])  # estimate.py's step() instants
    add("optimizer", grads=carry)
    return (*_verdict(w.best(), hardware, headroom, params=c["params"], optimizer=c["optimizer"],
                      resident_grads=c["grad_buffer"], resident_buffers=c["resident_buffers"],
                      cpu_per_gpu=c["cpu"] + a["offloaded"],
                      nvme_per_gpu=c["nvme"]), w)


_U = _Units._fields
_u_fields = attrgetter(*_U)


def units_row(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy, device: str) -> list[Any]:
    """An FSDP2 candidate's layout (``_U``) and the walk's other per-strategy terms (its host bytes last)."""
    u = _units(m, s, hardware)
    gas = gradient_accumulation_steps(s, training, hardware)
    return [*_u_fields(u), u.all_grads if gas > 1 else 0.0, s.reshard_after_forward,
            offload_host(m, training, hardware, s, device)]


def _saved_below(ks: list[dict[str, np.ndarray]], n_ck: np.ndarray) -> list[np.ndarray]:
    """mixed.saved_below per candidate: the saved activations of blocks 0..i (the first n_ck checkpointed)."""
    out, total = [], 0.0
    for i, k in enumerate(ks):
        total = total + np.where(i < n_ck, k["per_block_checkpointed"], k["per_block_plain"])
        out.append(total)
    return out


def _mixed_points(ks: list[dict[str, np.ndarray]], a: dict[str, np.ndarray], recomputed_late: np.ndarray,
                  moe_recomputed: np.ndarray, other_saved: np.ndarray, released: Any = False):
    """walk._mixed_blocks per candidate, last block first: (i, kind, checkpointed, saved, mlp, frame,
    attention instant, whether it has one, recomputation instant, whether it has one); ``released`` as
    in ``_block_point``."""
    n_ck = a["num_checkpointed"]
    below = _saved_below(ks, n_ck)
    block_other = other_saved - a["final_norm_saved"] + a["hidden_grad"]
    held, moe_blocks = _ep_held(a, ks), sum(k is a for k in ks)  # walk.ep_held / ep_excess_at
    for i in range(len(ks) - 1, -1, -1):
        k = ks[i]
        ck = i < n_ck
        frame = np.where(ck, k["checkpoint_frame_kept"], 0.0)
        recompute = np.where(ck, k["recompute"], 0.0)
        saved = below[i] + recompute + block_other + frame - (a["masks_only_later"] if i == 0 else 0.0)
        without, with_ = _ep_excess(a, held[i], moe_blocks), _ep_excess(a, held[i] + (k is a), moe_blocks)
        late = ck & recomputed_late
        a_mlp = np.where(late, saved - recompute, saved)
        attn_delta = k["attention_backward_transient"] - k["mlp_saved_per_block"]
        mlp_bwd = np.where(released, k["mlp_backward_released"], k["mlp_backward_transient"])
        top = _recompute_top(k, moe_recomputed)
        yield (i, k, ck, saved + np.maximum(without, with_), a_mlp + mlp_bwd + with_, frame,
               saved + attn_delta + without, (k["attention_backward_transient"] > 0) | late,
               saved + top + with_, ck & (top != 0))


def _mixed_blocks_backward(add: Callable[..., None], ks: list[dict[str, np.ndarray]], us: list[dict[str, np.ndarray]],
                           a: dict[str, np.ndarray], recomputed_late: np.ndarray, moe_recomputed: np.ndarray,
                           other_saved: np.ndarray, head_grad: Any, carry: np.ndarray, reshard: np.ndarray,
                           gloo: bool) -> None:
    """fsdp2._blocks_backward over walk._mixed_blocks' points (every block, each of its kind: ``ks``, ``us``)."""
    L = len(ks)
    done_after = [0.0] * L
    for i in range(L - 2, -1, -1):
        done_after[i] = done_after[i + 1] + us[i + 1]["grad_block"]
    upto = [us[0]["u_block"]]
    for x in us[1:]:
        upto.append(upto[-1] + x["u_block"])
    for i, k, ck, saved, mlp, frame, attention, has_attention, recompute, has_recompute in _mixed_points(
            ks, a, recomputed_late, moe_recomputed, other_saved):
        u = us[i]
        done = u["on_gpu"] * done_after[i]
        rs_prev = u["r"] * us[i + 1]["rs_mlp"] if i < L - 1 else 0.0
        nxt = us[i - 1]["flat"] if i > 0 else 0.0
        gathered = u["u_root"] + np.where(reshard, u["u_block"], upto[i]) + (np.where(reshard, nxt, 0.0) if i > 0 else 0.0)
        if gloo and i > 0:
            pre = saved - np.where(frame != 0, k["recompute"] + frame, 0.0)
            add("backward", sharded=done, unsharded=head_grad, activations=pre,
                buffers=gathered + rs_prev + nxt + us[i - 1]["cast_in"], valid=reshard & (nxt != 0))
        add("backward", sharded=done, unsharded=head_grad, activations=mlp, buffers=gathered + rs_prev)
        core_rs = np.where(u["rs_own"] != 0, (u["r"] - u["p"]) * u["rs_own"], rs_prev)  # at the attention instant
        # (fsdp2.py: a recomputation under attention / selective runs as the attention instant, after the MLP's)
        own = u["on_gpu"] * u["grad_own"]  # fsdp2.py: the experts unit's new gradient shard
        add("backward", sharded=done + np.where(recomputed_late, own, 0.0),
            unsharded=head_grad + np.where(recomputed_late, u["p"] * u["core_params"], 0.0),
            activations=recompute, buffers=gathered - np.where(recomputed_late, 0.0, (np.where(reshard, nxt, 0.0)
                                                                                         if i > 0 else 0.0))
            + np.where(recomputed_late, core_rs, rs_prev), valid=has_recompute)
        add("backward", sharded=done, unsharded=head_grad + u["p"] * u["mlp_params"],
            activations=saved - k["mlp_saved_per_block"], buffers=gathered + np.maximum(rs_prev, u["r"] * u["rs_own"]))
        add("backward", sharded=done + own, unsharded=head_grad + u["p"] * u["core_params"], activations=attention,
            buffers=gathered + core_rs, valid=has_attention)
        after = saved - k["per_block_plain"] - frame
        # fsdp2.py: the block resharded before its reduce-scatter; gloo's clone of the input beside the new shard
        add("backward", sharded=done, unsharded=head_grad + u["u_block"], activations=after,
            buffers=gathered - u["u_block"] + u["r"] * u["rs_unit"])
        add("backward", sharded=np.where(carry != 0, carry, done) + u["grad_block"], unsharded=head_grad,
            activations=after, buffers=gathered - u["u_block"]
            + u["r"] * u["rs_unit"] * rs_input_copies(gloo, u["n"]))


def _fsdp2(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategies: Sequence[Strategy],
           headroom: float, device: str, loop: str) -> tuple[np.ndarray, np.ndarray, _Walk]:
    """fsdp2.estimate_fsdp2's walk over the candidates."""
    m, L, V = model, model.num_hidden_layers, model.vocab_size
    k_opt = training.optimizer.state_bytes_per_parameter
    u = dict(zip(_U + ("carry", "reshard", "host"),
                 _table(strategies, units_key, lambda s: units_row(m, training, hardware, s, device))))
    a, recomputed_late, last_ck, moe_recomputed = _activations(m, training, strategies, device)
    n = len(strategies)
    un, up, ur, carry, reshard = u["n"], u["p"], u["r"], u["carry"], u["reshard"] > 0
    tokens = a["logits_tokens"]
    kept = up * V * tokens if loop == "keep_outputs" else np.zeros(n)
    u_root, u_block, flat, on_gpu = u["u_root"], u["u_block"], u["flat"], u["on_gpu"]
    shard = m.num_parameters / un
    params = on_gpu * 4 * shard
    optimizer = on_gpu * k_opt * shard
    w = _Walk(n)

    def add(phase: str, sharded: Any = 0.0, unsharded: Any = 0.0, activations: Any = 0.0, logits: Any = 0.0,
            buffers: Any = 0.0, valid: Any = True) -> None:
        logits = logits + kept
        if phase != "optimizer":
            sharded = np.maximum(sharded, carry)
        grads = sharded + unsharded
        w.add(phase, params + optimizer + grads + activations + logits + buffers, grads, activations, logits, buffers,
              valid)

    saved_blocks, logits_saved = a["blocks"], a["logits_saved"]
    other_saved = a["nonblock"] - logits_saved
    kinds = layer_kinds(m)  # blocks of two kinds (memory/mixed.py): each block's own terms and units
    a_dense = None
    if kinds is None:
        ks, us, all_blocks = [a] * L, [u] * L, u_block * L
    else:
        a_dense, u_dense = _dense_activations(m, training, strategies, device), _dense_units(m, hardware, strategies)
        u_dense.update(root=u["root"], u_root=u_root, all_grads=u["all_grads"])  # fsdp2._layer_units
        ks, us = [a_dense if d else a for d in kinds], [u_dense if d else u for d in kinds]
        all_blocks = sum(x["u_block"] for x in us)
    last_a, last_u = ks[-1], us[-1]
    last_saved = np.where(last_ck, last_a["per_block_checkpointed"], last_a["per_block_plain"])
    kept_blocks = np.where(reshard, 0.0, all_blocks)
    gathered_last = np.where(reshard, last_u["u_block"], all_blocks)
    # expert parallelism: the blocks' received rows (fsdp2.py; walk.ep_held / ep_excess_at)
    held, moe_blocks = _ep_held(a, ks), sum(k is a for k in ks)
    ep_all = _ep_excess(a, held[L], moe_blocks)
    add("forward", activations=saved_blocks - last_saved + other_saved + a["forward_only_masks"]
        + _ep_excess(a, held[L - 1], moe_blocks), buffers=u_root + gathered_last + last_u["flat"] + last_u["cast_in"])
    if kinds is not None:  # an earlier block of the other kind: its own gather transient
        below = _saved_below(ks, a["num_checkpointed"])
        upto = np.zeros(n)
        for i in range(L - 1):
            upto = upto + us[i]["u_block"]
            if kinds[i] != kinds[-1]:
                add("forward", activations=(below[i - 1] if i else 0.0) + other_saved + a["forward_only_masks"]
                    + _ep_excess(a, held[i], moe_blocks),
                    buffers=u_root + np.where(reshard, us[i]["u_block"], upto) + us[i]["flat"] + us[i]["cast_in"])
    moe_fwd = last_a["moe_forward_transient"]
    add("forward", activations=saved_blocks + other_saved - a["final_norm_saved"] + a["forward_only_masks"] + moe_fwd
        + _ep_excess(a, held[L - 1] + (ks[-1] is a), moe_blocks), buffers=u_root + gathered_last + last_u["flat"],
        valid=(moe_fwd > 0) & ~(last_ck & moe_recomputed))
    add("forward", activations=_last_core_forward(m, a, a_dense, other_saved, recomputed_late, moe_recomputed),
        buffers=u_root + gathered_last + last_u["flat"], valid=last_ck)
    add("forward", activations=saved_blocks + other_saved + a["final_norm_forward_extra"] + a["forward_only_masks"]
        + ep_all, buffers=u_root + kept_blocks + last_u["flat"])
    add("forward", activations=saved_blocks + other_saved + ep_all, logits=logits_saved + a["loss_forward_transient"],
        buffers=u_root + kept_blocks + last_u["flat"])
    at_start = u_root + np.where(reshard, last_u["flat"], all_blocks)
    add("backward", activations=saved_blocks + other_saved + ep_all, logits=logits_saved,
        buffers=2 * u_root + kept_blocks, valid=un > 1)
    add("backward", activations=saved_blocks + other_saved + ep_all,
        logits=logits_saved + a["loss_backward_transient"], buffers=at_start)
    head_grad = up * V * m.hidden_size
    add("backward", unsharded=head_grad, activations=saved_blocks + other_saved + ep_all, logits=up * V * tokens,
        buffers=at_start)
    add("backward", unsharded=head_grad, activations=saved_blocks + other_saved - a["final_norm_saved"]
        + a["final_norm_backward_live"] + ep_all, buffers=at_start)

    # fsdp2._blocks_backward
    extra = [np.full(n, 1, dtype=np.int64), np.full(n, L - 2, dtype=np.int64)]
    rs_block = ur * u["rs_unit"]
    rs_copies = rs_input_copies(device == "cpu", un)
    if kinds is not None:
        _mixed_blocks_backward(add, ks, us, a, recomputed_late, moe_recomputed, other_saved, head_grad, carry, reshard,
                               device == "cpu")
    for i, valid in (_points(a["num_checkpointed"], L, extra) if kinds is None else ()):
        done_blocks, saved, mlp, attention, frame, recompute, has_recompute, has_attention = _block_point(
            a, i, other_saved, L, recomputed_late, moe_recomputed)
        done = on_gpu * done_blocks * u["grad_block"]
        rs_prev = np.where(done_blocks != 0, ur * u["rs_mlp"], 0.0)
        gathered = u_root + u_block * np.where(reshard, 1, i + 1) + np.where(reshard & (i > 0), flat, 0.0)
        pre = saved - np.where(frame != 0, a["recompute"] + frame, 0.0)
        add("backward", sharded=done, unsharded=head_grad, activations=pre, buffers=gathered + rs_prev + flat
            + u["cast_in"], valid=valid & reshard & (i > 0) & (flat != 0) & (device == "cpu"))  # fsdp2: gloo's copy
        add("backward", sharded=done, unsharded=head_grad, activations=mlp, buffers=gathered + rs_prev, valid=valid)
        core_rs = np.where(u["rs_own"] != 0, (ur - up) * u["rs_own"], rs_prev)  # at the attention instant
        own = on_gpu * u["grad_own"]  # fsdp2.py: the experts unit's new gradient shard
        add("backward", sharded=done + np.where(recomputed_late, own, 0.0),
            unsharded=head_grad + np.where(recomputed_late, up * u["core_params"], 0.0),
            activations=recompute, buffers=gathered - np.where(recomputed_late, 0.0, np.where(reshard & (i > 0), flat, 0.0))
            + np.where(recomputed_late, core_rs, rs_prev), valid=valid & has_recompute)
        add("backward", sharded=done, unsharded=head_grad + up * u["mlp_params"],
            activations=saved - a["mlp_saved_per_block"], buffers=gathered + np.maximum(rs_prev, ur * u["rs_own"]),
            valid=valid)
        add("backward", sharded=done + own, unsharded=head_grad + up * u["core_params"], activations=attention,
            buffers=gathered + core_rs, valid=valid & has_attention)
        after = saved - a["per_block_plain"] - frame
        add("backward", sharded=done, unsharded=head_grad + u_block, activations=after,
            buffers=gathered - u_block + rs_block, valid=valid)
        add("backward", sharded=np.where(carry != 0, carry, done) + u["grad_block"], unsharded=head_grad,
            activations=after, buffers=gathered - u_block + rs_block * rs_copies, valid=valid)

    root_shard = on_gpu * 4 * u["root"] / un
    blocks_sharded = u["all_grads"] - root_shard
    add("backward", sharded=blocks_sharded, unsharded=up * u["root"], activations=a["hidden_grad"],
        buffers=u_root + ur * us[0]["rs_unit"])
    add("backward", sharded=blocks_sharded, unsharded=up * u["root"], buffers=u_root + ur * u["root"])
    add("backward", sharded=u["all_grads"] + np.where(carry != 0, root_shard, 0.0),
        unsharded=up * V * m.hidden_size, buffers=ur * u["root"] * rs_copies)  # fsdp2.py: the root's reduce-scatter
    add("optimizer", sharded=u["all_grads"], buffers=on_gpu * 4 * shard)
    host = u["host"]
    pair = 2 * u_block if kinds is None else np.max([x["u_block"] + y["u_block"] for x, y in zip(us, us[1:])], axis=0)
    side_pool = np.where((un > 1) & (device == "cuda"), u_root + pair, 0.0)
    return (*_verdict(w.best(), hardware, headroom, params=params, optimizer=optimizer, resident_grads=0.0,
                      resident_buffers=0.0, cpu_per_gpu=host + a["offloaded"], nvme_per_gpu=0.0,
                      reserved_elsewhere=side_pool), w)
