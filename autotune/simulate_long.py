"""Throughput terms of the long-context knobs (issue 24), added by autotune.simulate.Simulator.

Pure arithmetic, no torch/deepspeed. What the simulator itself already does for them:

* a sequence split over ``sp x cp`` GPUs (Ulysses, context parallel) gives each GPU seq_len / (sp x cp)
  tokens of every sequence: every per-token term (GEMMs at that M, elementwise, loss) is computed on
  that share, and the attention core, ``T_local * 2 * S * q`` FLOPs with S the whole sequence, comes out
  as the per-sequence causal FLOPs / (sp x cp): Ulysses attends over all S tokens for a/sp heads, the
  load-balanced ring for its q chunks against all k/v (torch _context_parallel/_attention.py
  ``_templated_ring_attention``: step 0 causal on the local chunks, every other step half a block, so
  its tile quantisation equals the unsplit causal kernel's);
* the ZeRO / FSDP2 collectives stay over every GPU: DeepSpeed reduces and partitions over the
  sequence-data-parallel group (deepspeed/utils/groups.py ``_get_sequence_data_parallel_group``),
  torchtitan's FSDP2 over its ``dp_shard_cp`` mesh; only the accumulation steps grow (batch_ranks).

Here, per micro-batch: Ulysses' all-to-alls, the context-parallel k/v exchange, the tiles' GEMM
efficiency and tiled MLP's repeated forward, and the PCIe traffic of activation offload.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from autotune.memory.split import loss_tile_tokens, mlp_tile_tokens  # the tile sizes the memory model uses
from autotune.simulate_comm import _exposed, _link_bandwidth, _ring_time
from autotune.spec import HardwareSpec, ModelSpec
from autotune.strategy import Strategy

RECOMPUTES_ATTENTION = ("full", "attention", "selective")
"""Checkpointing granularities whose recomputation repeats the attention (and so its all-to-alls or
its ring): op-level SAC keeps the sdpa outputs (torchtitan's save list), mlp recomputes the MLP only."""


RING_GRAD_BYTES = 4
"""Bytes per element of the dk/dv passed around the ring (_ContextParallelOptions.convert_to_f32)."""

OFFLOAD_ON_SIDE_STREAM = False
"""Whether activation offload's copies run beside the compute. They do not: autotune.models.long_context
``_pack`` / ``_unpack`` copy with non_blocking on the current (compute) stream, which orders them between
the kernels, and ArcticTraining's ``arg.detach().cpu()`` is synchronous; True would model a side stream."""


class LongTerms(NamedTuple):
    """Seconds per micro-batch on one GPU that the long-context knobs add."""

    compute: float
    """Tiles' GEMMs at their smaller M (tiled MLP and loss), forward and backward."""
    recompute: float
    """Tiled MLP's second MLP forward in backward."""
    communication: float
    """Exposed Ulysses all-to-alls and context-parallel k/v exchange."""
    offload: float
    """Exposed PCIe copies of the offloaded block inputs."""
    fwd_shift: float
    """Backward work run inside the forward (tiled loss's head backward)."""


def uses_long_context(s: Strategy) -> bool:
    """Whether any long-context knob is off its default (default strategies skip this module)."""
    return (s.sequence_parallel_size > 1 or s.context_parallel_size > 1 or s.tiled_loss or s.tiled_mlp
            or s.activation_offload != "none")


def tile_slowdown(T: float, tile: float, m_half: float) -> float:
    """GEMM time at M = tile over its time at M = T, the simulator's saturating efficiency M/(M + m_half)."""
    return (T / (T + m_half)) / (tile / (tile + m_half))


def ulysses_bytes_per_layer(model: ModelSpec, b: int, S: int, sp: int, act_bytes: int) -> float:
    """Bytes one GPU sends in one layer's forward: q, k, v (seq shard -> head shard) and the output back,
    each all-to-all keeping 1/sp of its local tensor (ulysses_sp.py UlyssesSPAttentionHF
    _combine_local_sequences / _partition_global_sequence; k/v heads repeated up to sp when fewer,
    kv_replication_factor = sp // kv heads)."""
    if sp <= 1:
        return 0.0
    kv = max(model.num_key_value_heads, sp) * model.head_size
    local_elems = b * S / sp * (2.0 * model.q_size + 2.0 * kv)
    return (sp - 1) / sp * local_elems * act_bytes


def ulysses_time_per_layer(bytes_fwd: float, sp: int, bw: float, lat: float) -> float:
    """One layer's four forward all-to-alls (the backward repeats them on the gradients): NCCL
    all-to-all t = (n-1)/n x per-rank bytes / busBW (nccl-tests doc/PERFORMANCE.md) + (n-1) hops each."""
    return bytes_fwd / bw + 4 * (sp - 1) * lat if sp > 1 else 0.0


def ring_bytes(model: ModelSpec, b: int, S: int, cp: int, act_bytes: int) -> tuple[float, float]:
    """(local k+v bytes all-gathered in forward and again in backward, local dk+dv bytes passed on at
    each of the cp backward steps) per layer; torch _attention.py: _templated_ring_attention(_backward),
    rotate_method ALL_GATHER for k/v (the _ContextParallelOptions default), ALL_TO_ALL for dk/dv."""
    local = b * S / cp * 2.0 * model.kv_size
    return local * act_bytes, local * RING_GRAD_BYTES


def ring_exposed_per_layer(kv_bytes: float, dkv_bytes: float, cp: int, attn_fwd: float, bw: float, lat: float,
                           ov: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's context-parallel exchange. The k/v all-gather
    (cp-1 chunks in, Liu et al. 2023 arXiv 2310.01889 sec. 3) is waited for after step 0, so it hides
    under that step's attention only (1/cp of it, the steps doing equal work under load balancing);
    each dk/dv hop hides under the next step's attention backward, the last one does not."""
    if cp <= 1:
        return 0.0, 0.0
    gather = _ring_time(cp * kv_bytes, cp, bw, lat)
    hop = dkv_bytes / bw + lat
    step_f, step_b = attn_fwd / cp, 2.5 * attn_fwd / cp  # backward 2.5x forward (simulate: FA-2 sec. 3.1.2)
    fwd = _exposed(gather, step_f, ov)
    bwd = _exposed(gather, step_b, ov) + (cp - 1) * _exposed(hop, step_b, ov) + hop
    return fwd, bwd


def offload_exposed(bytes_per_block: float, blocks: int, pcie: float, fwd_window: float, bwd_window: float,
                    ov: float, side_stream: bool = OFFLOAD_ON_SIDE_STREAM) -> float:
    """Exposed seconds of activation offload: each checkpointed block's input copied to host in the
    forward and back before its recomputation (ALST arXiv 2506.13996 sec. 3.3), bytes / PCIe each way.
    On the compute stream all of it is exposed; on a side stream it would hide under that pass's window
    as far as the PCIe bandwidth allows, but for the first block copied back (nothing to prefetch under)."""
    if blocks <= 0:
        return 0.0
    one = bytes_per_block / pcie
    if not side_stream:
        return 2.0 * blocks * one
    return _exposed(blocks * one, fwd_window, ov) + one + _exposed((blocks - 1) * one, bwd_window, ov)


def long_context_terms(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, rates: Any, p: dict, mb: Any,
                       S: int, T: float, fwd_window: float, bwd_window: float) -> LongTerms:
    """The long-context terms of one micro-batch of ``T`` tokens on this GPU (``S`` the whole sequence;
    ``rates`` / ``mb`` autotune.simulate's _Rates / _MicroBatch for those T tokens; the windows: its
    forward and its backward with recomputation, before these terms)."""
    L = model.num_hidden_layers
    b = strategy.micro_batch_size
    sp, cp = strategy.sequence_parallel_size, strategy.context_parallel_size
    ov, lat, mh = p["overlap"], p["coll_latency_s"], p["gemm_m_half"]
    compute = recompute = comm = fwd_shift = 0.0
    n_ckpt = strategy.num_checkpointed(L)
    repeats = n_ckpt if strategy.checkpointing in RECOMPUTES_ATTENTION else 0
    if strategy.tiled_mlp:
        # TiledMLP runs the MLP forward again in backward (ulysses_sp.py TiledMLP.backward): +1 MLP
        # forward per block, and every MLP GEMM at the tile's M
        slow = tile_slowdown(T, mlp_tile_tokens(b, math.ceil(T / b), model.hidden_size), mh)
        compute += L * 3.0 * mb.mlp_gemm * (slow - 1.0)
        recompute += L * (mb.mlp_module + mb.mlp_gemm * (slow - 1.0))
    if strategy.tiled_loss:
        # TiledFusedLogitsLoss: no extra FLOPs (backward inside forward, its docstring); the head GEMMs at
        # the tile's M, and the head's backward moves into the forward window; loss kernels unchanged
        slow = tile_slowdown(T, loss_tile_tokens(math.ceil(T), model.vocab_size), mh)
        compute += 3.0 * mb.head_gemm * (slow - 1.0)
        fwd_shift = 2.0 * mb.head_gemm * slow
    if sp > 1:
        bw = _link_bandwidth(hardware, p, crosses_nodes=sp > hardware.gpus_per_node)
        t = ulysses_time_per_layer(ulysses_bytes_per_layer(model, b, S, sp, rates.act_bytes), sp, bw, lat)
        comm += (2 * L + repeats) * t  # synchronous around attention: forward, backward, recomputation
    if cp > 1:
        bw = _link_bandwidth(hardware, p, crosses_nodes=cp > hardware.gpus_per_node)
        kv, dkv = ring_bytes(model, b, S, cp, rates.act_bytes)
        fwd, bwd = ring_exposed_per_layer(kv, dkv, cp, mb.attn_fwd_block, bw, lat, ov)
        comm += L * (fwd + bwd) + repeats * fwd
    offload = 0.0
    if strategy.activation_offload == "cpu":
        offload = offload_exposed(T * model.hidden_size * rates.act_bytes, n_ckpt,
                                  hardware.gpu.pcie_bandwidth_gbps * 1e9, fwd_window + fwd_shift,
                                  bwd_window + recompute + compute - fwd_shift, ov)
    return LongTerms(compute, recompute, comm, offload, fwd_shift)
