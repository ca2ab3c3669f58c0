"""FSDP2 (``torch.distributed.fsdp.fully_shard``) per-GPU memory of one steady-state step.

The layout is the one ``autotune.models.fsdp2.apply`` builds (torchtitan parallelize.py ``apply_fsdp``):
``fully_shard`` on every decoder block, then on the root (embeddings, final norm, head), with
``MixedPrecisionPolicy(param_dtype=<precision>, reduce_dtype=<reduce_dtype>)``, AdamW with
``foreach=True`` and ``zero_grad(set_to_none=True)``. What FSDP2 allocates, from
torch/distributed/fsdp/_fully_shard (_fsdp_param_group.py, _fsdp_collectives.py):

* sharded parameters stay in their original dtype (fp32): 4 B per parameter / N; the sharded
  gradients are fp32 too (``foreach_reduce`` casts the reduce output back to the original dtype),
  created per unit by its reduce-scatter and freed by ``zero_grad``; AdamW keeps two fp32 moments
  and its foreach step makes one fp32 temporary of the shard (``_foreach_sqrt``);
* a unit's unsharded parameters (``param_dtype``) exist from its all-gather to its reshard: the
  root from its pre-forward to its post-forward (the loss inside the model's forward included) and
  through the whole backward; a block through its forward, and again from its backward
  all-gather; ``reshard_after_forward=False`` keeps every block from its forward to its backward;
* with N > 1 the all-gather goes through one flat buffer per unit: in forward the previous unit's
  is held until the next copy-out (``all_gather_state``), in backward the next block is
  prefetched (all-gathered) while the current one runs: one more block's worth either way; with
  mixed precision, the cast of a shard for the all-gather input is a short-lived copy;
* backward: a block's unsharded gradients (``param_dtype``), then at its post-backward a flat
  ``reduce_dtype`` reduce-scatter input of the whole unit, kept until the next unit's
  reduce-scatter (``reduce_scatter_states``, one buffer by default); the root's gradients (the
  head's from the start of backward, the embedding's at the end) stay unsharded until the root's
  post-backward at the very end;
* ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step on the host; the
  GPU keeps only the unsharded working set and the reduce buffers;
* hybrid sharding (HSDP): shards over one node's GPUs, replicas across nodes (all-reduce in place);
* on CUDA, the all-gather stream's allocator pool stays reserved beside the peak (overhead).

Activations and the loss are the same as for DeepSpeed at the same precision (module-level
half precision): ``activation_breakdown``, with plain ``nn.Linear`` autograd.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from autotune.memory.activations import ActivationBreakdown, activation_breakdown
from autotune.memory.common import MemoryEstimate, _partition, forked_copies, host_pinned, pinned_bytes
from autotune.memory.expert_parallel import block_expert_elements, ep_units
from autotune.memory.mixed import dense_block_spec, layer_kinds, layer_params, saved_below
from autotune.memory.moe import expert_width, ffn_weight_elements
from autotune.memory.states import parameter_shapes
from autotune.memory.walk import (Candidate, Loop, backward_blocks, ep_excess_at, ep_excess_held, ep_held, finish,
                                  last_forward_relief)
from autotune.spec import BYTES_PER_ELEMENT, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.engine_configs import engine_settings, gradient_accumulation_steps, shard_group_size


class _Units(NamedTuple):
    """The byte sizes of one FSDP2 layout on one GPU (``fully_shard`` units: each block, the root)."""

    n: int
    """GPUs a unit is sharded over."""
    p: int
    """Bytes of param_dtype (the unsharded parameters and their gradients)."""
    r: int
    """Bytes of reduce_dtype (the reduce-scatter input)."""
    per_block: int
    """Parameters of one block."""
    root: int
    """Parameters of the root unit: embeddings, final norm, untied head."""
    on_gpu: float
    """1, or 0 with CPUOffloadPolicy (the shards live on the host)."""
    u_root: float
    """The root's unsharded parameters."""
    u_block: float
    """One block's unsharded parameters."""
    flat: float
    """The flat all-gather buffer next to the current block (none with one GPU)."""
    cast_in: float
    """A shard cast to param_dtype as the all-gather input (none without mixed precision)."""
    grad_block: float
    """One block's fp32 gradient shard."""
    all_grads: float
    """Every unit's fp32 gradient shard."""
    mlp_params: int
    """Weights of one block's MLP."""
    core_params: int
    """Parameters whose gradients exist at the block's attention core backward: the MLP's weights
    (``mlp_params``), o_proj, the norms and biases after the core (spec.params_after_attention_core); latent
    attention the whole block (its attention instant reads under with the core's alone: hf-deepseekv3-sv
    FSDP2 attention bf16 -1.37%, -0.91% with the whole block); with expert parallelism less the experts,
    whose unit's post-backward came first (their gradients its reduce-scatter input, ``rs_own``)."""
    rs_unit: int
    """Parameters of a block's largest unit (its reduce-scatter input): the block, or with expert
    parallelism the larger of its dense part and its experts unit."""
    rs_mlp: int
    """Parameters of the unit whose reduce-scatter input is live during a block's MLP backward (the unit
    before it in backward order): the later block, or with expert parallelism its dense unit."""
    rs_own: int
    """With expert parallelism, the block's experts unit, whose reduce-scatter input is live during the
    block's attention backward (its post-backward came first, its unsharded parameters freed: allocation
    traces of hf-deepseekv2-sv fsdp2-keep EP 2 full bf16, GA 1 and 2, the peaks at a softmax backward);
    0 without (then as the MLP's)."""
    grad_own: float = 0.0
    """With expert parallelism, the experts unit's fp32 gradient shard, made by its post-backward: beside the
    shards of the blocks done at the block's attention backward (accumulating, added into the carried one)."""


@functools.lru_cache(maxsize=1024)
def pinned_shards(m: ModelSpec, n: int, ep: int) -> float:
    """Host bytes of every parameter's fp32 shard on the rank holding the most, each its own pinned
    tensor (CPUOffloadPolicy(pin_memory): _fsdp_param.py ``padded_sharded_param.pin_memory()``, dim 0
    chunked over the n ranks and padded to the first rank's chunk, ``chunks[0].size()``), as torch's
    host allocator holds them (``pinned_bytes``); the reduced gradients are as many pinned blocks of
    the same sizes (_fsdp_collectives.py ``foreach_reduce``: ``.to("cpu", non_blocking=True)``, which
    allocates its output pinned). With expert parallelism a block's expert tensors hold E / ep experts
    over the n / ep ranks of their unit (memory/expert_parallel.py)."""
    e, mod_ep, hf = m.num_experts, max(1, n // ep), m.hidden_size * expert_width(m)
    expert_sizes = {e * 2 * hf, e * hf} if (m.is_moe and ep > 1) else set()  # gate_up_proj, down_proj
    out = 0.0
    for d0, numel in parameter_shapes(m):
        if d0 == e and numel in expert_sizes:  # (ep above the experts breaks a rule: one each, the estimate total)
            d0, numel, ranks = max(1, d0 // ep), numel // ep, mod_ep
        else:
            ranks = n
        out += pinned_bytes(4 * _partition(d0, ranks) * (numel // d0), True)
    return out


def offload_host(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy, device: str) -> float:
    """Host bytes per GPU under CPUOffloadPolicy: the fp32 parameter shards, their gradients, the
    moments and the optimizer step's fp32 temporary ((4 + 4 + k_opt + 4) x the shard; under
    pin_memory on CUDA the shards and gradients as ``pinned_shards`` holds them), with a forked data
    loader's copies (``forked_copies``) of the parameter shards' bytes: the moments come with the first step,
    and the gradients are new every step (``zero_grad`` sets them to None). 0 without the policy."""
    if s.offload_params != "cpu":
        return 0.0
    k_opt = engine_settings(m, training, s).optimizer.state_bytes_per_parameter
    n = shard_group_size(s, hardware)
    shard = m.num_parameters / n
    on_host = pinned_shards(m, n, s.expert_parallel_size) if host_pinned(s.pin_memory, device) else 4 * shard
    return 2 * on_host + (k_opt + 4) * shard + forked_copies(training, 4 * shard, k_opt * shard)


def rs_input_copies(gloo: bool, n: Any) -> Any:
    """Copies of a reduce-scatter's input alive during the collective: gloo's reduce-scatter (the CPU, more
    than one rank) clones its input (c10d::_reduce_scatter_base_, allocation traces: beside the input and the
    new shard), 2; else 1. ``n`` the shard group's size, a number or (the screen) an array of them."""
    return 1 + gloo * (n > 1)


def _units(m: ModelSpec, s: Strategy, hardware: HardwareSpec) -> _Units:
    n = shard_group_size(s, hardware)
    p = BYTES_PER_ELEMENT[s.precision]
    per_block = m.block_params()
    on_gpu = 0.0 if s.offload_params == "cpu" else 1.0
    root = m.num_parameters - sum(layer_params(m))
    u = _Units(n=n, p=p, r=BYTES_PER_ELEMENT[s.reduce_dtype], per_block=per_block, root=root, on_gpu=on_gpu,
               u_root=p * root, u_block=p * per_block,
               flat=p * per_block if n > 1 else 0.0, cast_in=p * per_block / n if p < 4 else 0.0,
               grad_block=on_gpu * 4 * per_block / n, all_grads=on_gpu * 4 * m.num_parameters / n,
               mlp_params=ffn_weight_elements(m), core_params=per_block if m.is_mla else m.params_after_attention_core(),
               rs_unit=per_block,
               rs_mlp=per_block, rs_own=0)  # a MoE's: its router and every expert (moe.py)
    if s.expert_parallel_size <= 1 or not m.is_moe:
        return u
    # expert parallelism: the block's dense unit (n ranks) and its experts unit (E / ep experts over
    # n / ep ranks) are gathered together during the block; one flat all-gather buffer at a time (the
    # previous unit's is released at the next copy-out, _fsdp_collectives.py); the gradient shard is
    # the same, 4 (dense + X / ep / (n / ep)) / n = 4 per_block / n (memory/expert_parallel.py)
    e = ep_units(m, n, s.expert_parallel_size)
    return u._replace(u_block=p * (e.dense + e.local),
                      flat=p * max(e.dense if n > 1 else 0, e.local if e.mod_ep > 1 else 0),
                      cast_in=p * max(e.dense / n, e.local / e.mod_ep) if p < 4 else 0.0,
                      mlp_params=u.mlp_params - block_expert_elements(m) + e.local,
                      core_params=u.core_params - block_expert_elements(m), rs_unit=max(e.dense, e.local),
                      # the backward's units: layers.i, its experts, layers.i-1, ... (FSDP2 runs and prefetches
                      # them in reverse post-forward order, _fsdp_state.py _pre_backward; one reduce-scatter
                      # input kept until the next post-backward, _fsdp_param_group.py post_backward)
                      rs_mlp=e.dense, rs_own=e.local, grad_own=4 * e.local / e.mod_ep)


def _layer_units(m: ModelSpec, s: Strategy, hardware: HardwareSpec, u: _Units) -> list[_Units]:
    """Each block's units by index: ``u`` for all, or with dense-MLP blocks among MoE ones (memory/mixed.py)
    a dense block's sizes from its kind's spec, the root and the whole model's gradient shards from ``u``."""
    kinds = layer_kinds(m)
    if kinds is None:
        return [u] * m.num_hidden_layers
    d = _units(dense_block_spec(m), s, hardware)._replace(root=u.root, u_root=u.u_root, all_grads=u.all_grads)
    return [d if dense else u for dense in kinds]


def estimate_fsdp2(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategy: Strategy,
                   *, headroom: float = 0.0, device: str = "cuda", loop: Loop = "keep_outputs") -> MemoryEstimate:
    """``estimate_memory`` for an fsdp2 strategy (same arguments, same record)."""
    m, s = model, strategy
    L = m.num_hidden_layers
    u = _units(m, s, hardware)
    k_opt = engine_settings(m, training, s).optimizer.state_bytes_per_parameter
    shard = m.num_parameters / u.n
    params = u.on_gpu * 4 * shard
    optimizer = u.on_gpu * k_opt * shard

    act = activation_breakdown(m, training, s, device)
    tokens = act.logits_tokens
    saved_blocks, nonblock, logits_saved = act.blocks, act.nonblock, act.logits_saved
    other_saved = nonblock - logits_saved
    kept = u.p * m.vocab_size * tokens if loop == "keep_outputs" else 0.0
    # gradient accumulation reduce-scatters every micro-step and adds into the sharded gradients:
    # they exist through the later micro-steps
    carry = u.all_grads if gradient_accumulation_steps(s, training, hardware) > 1 else 0.0
    reshard = s.reshard_after_forward
    cands: list[Candidate] = []

    def add(phase: str, sharded: float = 0.0, unsharded: float = 0.0, activations: float = 0.0,
            logits: float = 0.0, buffers: float = 0.0) -> None:
        """``sharded``: the units' fp32 gradient shards so far; ``unsharded``: gradients still in
        param_dtype (the root's, the current block's)."""
        logits += kept
        if phase != "optimizer":
            sharded = max(sharded, carry)
        grads = sharded + unsharded
        cands.append(Candidate(phase, params + optimizer + grads + activations + logits + buffers, grads,
                               activations, logits, buffers))

    us = _layer_units(m, s, hardware, u)  # each block's units (two sizes with dense layers among MoE ones)
    mixed = us[0] is not us[-1] or any(x is not u for x in us)
    all_blocks = u.u_block * L if not mixed else sum(x.u_block for x in us)  # every block gathered
    last = us[-1]
    # forward, last block: its gather transient on top of every earlier block's saved activations
    last_kind = act.dense if (act.dense is not None and act.dense_layers[-1]) else act
    last_ck = (L - 1) in s.checkpointed_blocks(L)
    last_saved = last_kind.per_block_checkpointed if last_ck else last_kind.per_block_plain
    held_below, moe_blocks = ep_held(act, s, L)  # expert parallelism: the blocks' received rows (ep_excess)
    ep_all = ep_excess_held(act, held_below[L], moe_blocks)
    add("forward", activations=saved_blocks - last_saved + other_saved + act.forward_only_masks
        + ep_excess_at(act, held_below, moe_blocks, L - 1)[0],
        buffers=u.u_root + (last.u_block if reshard else all_blocks) + last.flat + last.cast_in)
    if mixed:  # an earlier block of the other kind: its own gather transient (memory/mixed.py)
        below = saved_below(act, s.checkpointed_blocks(L), L)
        for i in range(L - 1):
            if us[i] is not last:
                gathered = us[i].u_block if reshard else sum(x.u_block for x in us[:i + 1])
                add("forward", activations=(below[i - 1] if i else 0.0) + other_saved + act.forward_only_masks
                    + ep_excess_at(act, held_below, moe_blocks, i)[0],
                    buffers=u.u_root + gathered + us[i].flat + us[i].cast_in)
    if last_kind.moe_forward_transient and not (last_ck and last_kind.moe_recomputed):
        # the last block's experts combine (EP; a checkpointed block's own recomputation instant is larger):
        # every block's saved tensors but what the decoder makes after it (the final norm's)
        add("forward", activations=saved_blocks + other_saved - act.final_norm_saved + act.forward_only_masks
            + last_kind.moe_forward_transient + ep_excess_at(act, held_below, moe_blocks, L - 1)[1], buffers=u.u_root + (last.u_block if reshard else all_blocks) + last.flat)
    if last_ck:  # the last block's attention core in the forward (walk.last_forward_relief)
        lp = backward_blocks(act, s, L, other_saved)[0]
        add("forward", activations=lp.saved - last_forward_relief(m, lp.act or act),
            buffers=u.u_root + (last.u_block if reshard else all_blocks) + last.flat)
    # the final norm's forward, inside the decoder's (activations.py final_norm_forward_extra)
    add("forward", activations=saved_blocks + other_saved + act.final_norm_forward_extra + act.forward_only_masks
        + ep_all,
        buffers=u.u_root + (0.0 if reshard else all_blocks) + last.flat)
    # forward end: the loss transients (inside the model's forward: the root is still gathered; the
    # last block's flat buffer waits for the root's post-forward)
    add("forward", activations=saved_blocks + other_saved + ep_all, logits=logits_saved + act.loss_forward_transient,
        buffers=u.u_root + (0.0 if reshard else all_blocks) + last.flat)
    # backward start: the root gathered again, and (resharded) the last block's all-gather issued
    # as the root's backward prefetch (its flat buffer; copied out by the block's own hook);
    # the forward's last flat buffer was released by the root's post-forward
    at_start = u.u_root + (last.flat if reshard else all_blocks)
    if u.n > 1:
        # first the root's own pre-backward all-gather: its unsharded parameters are allocated by the
        # copy-out while the flat all-gather output still exists (_fsdp_collectives.py
        # foreach_all_gather_copy_out: alloc_all_gather_outputs, then copies from all_gather_output),
        # before the logits gradient
        add("backward", activations=saved_blocks + other_saved + ep_all, logits=logits_saved,
            buffers=2 * u.u_root + (0.0 if reshard else all_blocks))
    add("backward", activations=saved_blocks + other_saved + ep_all,
        logits=logits_saved + act.loss_backward_transient,
        buffers=at_start)
    # lm_head backward: its unsharded gradient stays until the root's post-backward
    head_grad = u.p * m.vocab_size * m.hidden_size
    add("backward", unsharded=head_grad, activations=saved_blocks + other_saved + ep_all,
        logits=u.p * m.vocab_size * tokens, buffers=at_start)
    # the final norm's backward: its fp32 transients next to everything saved (the logits gradient gone)
    add("backward", unsharded=head_grad, activations=saved_blocks + other_saved - act.final_norm_saved
        + act.final_norm_backward_live + ep_all,
        buffers=at_start)
    _blocks_backward(add, us, act, s, L, other_saved, head_grad, carry, device == "cpu")
    # backward end: the root's post-backward (head and embedding gradients, unsharded, then its
    # reduce-scatter input), every block's sharded gradient
    root_shard = u.on_gpu * 4 * u.root / u.n
    blocks_sharded = u.all_grads - root_shard
    add("backward", sharded=blocks_sharded, unsharded=u.p * u.root, activations=act.hidden_grad,
        buffers=u.u_root + u.r * us[0].rs_unit)
    add("backward", sharded=blocks_sharded, unsharded=u.p * u.root, buffers=u.u_root + u.r * u.root)
    # its reduce-scatter (root_post_backward_callback): the root resharded first, the lm_head's gradient still
    # referenced beside the input (and gloo's clone of it); accumulating, the new shard beside the carried one
    # (allocation trace of hf-qwen2moe-dense fsdp2-keep EP 2 GA 4 full bf16: the peak of micro-steps 2-4)
    add("backward", sharded=u.all_grads + (root_shard if carry else 0.0),
        unsharded=u.p * m.vocab_size * m.hidden_size, buffers=u.r * u.root * rs_input_copies(device == "cpu", u.n))
    # optimizer step: AdamW foreach's fp32 temporary of the shard
    add("optimizer", sharded=u.all_grads, buffers=u.on_gpu * 4 * shard)

    host = offload_host(m, training, hardware, s, device)
    # CUDA: the flat all-gather buffers are allocated on FSDP2's all-gather stream
    # (_fsdp_collectives.py foreach_all_gather under ``all_gather_stream``), and the caching
    # allocator reuses a freed block only for the stream it was allocated on
    # (c10/cuda/CUDACachingAllocator.cpp, stream-ordered blocks): that stream's pool keeps the
    # largest buffers it held (the root's, and a block's next to the prefetched one) reserved,
    # outside what the peak's tensors can use
    pair = max((a.u_block + b.u_block for a, b in zip(us, us[1:])), default=2 * u.u_block) if mixed else 2 * u.u_block
    side_pool = u.u_root + pair if (device == "cuda" and u.n > 1) else 0.0
    return finish(cands, m, training, hardware, s, headroom, params=params, optimizer=optimizer,
                  resident_grads=0.0, resident_buffers=0.0, cpu_per_gpu=host + act.offloaded, nvme_per_gpu=0.0,
                  reserved_elsewhere=side_pool)


def _blocks_backward(add: Callable[..., None], us: list[_Units], act: ActivationBreakdown, s: Strategy, L: int,
                     other_saved: float, head_grad: float, carry: float, gloo: bool = False) -> None:
    """The candidates through the blocks' backward, last block to first (``add`` as in
    estimate_fsdp2; ``us``: each block's units; ``gloo``: gloo's all-gather makes a temporary, CPU)."""
    reshard = s.reshard_after_forward
    uniform = all(x is us[0] for x in us)
    done_after = [0.0] * L  # the gradient shards of the blocks after each one (blocks of two sizes)
    for i in range(L - 2, -1, -1):
        done_after[i] = done_after[i + 1] + us[i + 1].grad_block
    # the previous unit's reduce-scatter input (from the second block on) and the prefetched next block
    # (up to the second-last) break the linearity in the block index: both ends of that run too
    for pt in backward_blocks(act, s, L, other_saved, (1, L - 2)):
        i, u = pt.block, us[pt.block]
        k = pt.act if pt.act is not None else act
        done = u.on_gpu * (pt.done * u.grad_block if uniform else done_after[i])
        rs_prev = u.r * us[i + 1].rs_mlp if pt.done else 0.0  # the previous unit's reduce-scatter input
        # gathered: the root, this block (all blocks up to it without resharding) and, resharded,
        # the next block's all-gather prefetched during this one's backward
        upto = u.u_block * (1 if reshard else i + 1) if uniform else (
            u.u_block if reshard else sum(x.u_block for x in us[:i + 1]))
        nxt = us[i - 1].flat if i > 0 else 0.0
        gathered = u.u_root + upto + (nxt if (reshard and i > 0) else 0.0)
        gloo_copy = nxt if gloo else 0.0
        if gloo_copy and reshard and pt.block > 0:
            # the block's pre-backward (before a checkpointed one's recomputation): the next block's
            # prefetched all-gather, whose gloo collective allocates a temporary as large as its flat
            # output (c10d::_allgather_base_ / gloo:all_gather, allocation traces; ProcessGroupGloo.cpp),
            # beside its input, the shard cast to param_dtype (_fsdp_collectives.py _get_param_all_gather_inputs:
            # flat_foreach_copy_input, alive through the collective; traced: hf-qwen3moe-nf FSDP2 selective bf16)
            pre = pt.saved - (k.recompute + pt.frame if pt.frame else 0.0)
            add("backward", sharded=done, unsharded=head_grad, activations=pre,
                buffers=gathered + rs_prev + gloo_copy + us[i - 1].cast_in)
        # MLP backward at its peak: the down projection's weight gradient (unsharded, param_dtype) is
        # part of the MLP's transient (activations.py _mlp_backward_transient); the other weight
        # gradients come after the multiply's backward has released its f-wide gradients
        add("backward", sharded=done, unsharded=head_grad, activations=pt.mlp, buffers=gathered + rs_prev)
        # at the attention instant (after the MLP's): with expert parallelism the experts unit's post-backward done,
        # its reduce-scatter input in place of its unsharded parameters (rs_own); else the previous unit's input
        core_rs = (u.r - u.p) * u.rs_own if u.rs_own else rs_prev
        own = u.on_gpu * u.grad_own  # and its new gradient shard
        if pt.recompute is not None:
            # the recomputation's experts combine (EP), before the MLP's backward: the next block's all-gather
            # is not issued yet (its prefetch comes with the experts unit's pre-backward, after the
            # recomputation: reverse post-forward order, layers.i, its experts, layers.i-1; allocation traces)
            # (attention / selective: the core's, after the MLP's backward, as at its attention instant)
            late = k.recomputed_after_mlp
            add("backward", sharded=done + (own if late else 0.0), unsharded=head_grad + (u.p * u.core_params if late else 0.0),
                activations=pt.recompute,
                buffers=gathered - (nxt if (reshard and i > 0 and not late) else 0.0)
                + (core_rs if late else rs_prev))
        # the MLP done: all its weight gradients, its saved tensors released
        # (with expert parallelism the experts' post-backward: their reduce-scatter input replaces the other)
        add("backward", sharded=done, unsharded=head_grad + u.p * u.mlp_params,
            activations=pt.saved - k.mlp_saved_per_block, buffers=gathered + max(rs_prev, u.r * u.rs_own))
        if pt.attention is not None:  # the MLP's, o_proj's and the norms' weight gradients (not q, k, v yet)
            add("backward", sharded=done + own, unsharded=head_grad + u.p * u.core_params, activations=pt.attention,
                buffers=gathered + core_rs)
        # post-backward (the block's activations gone, the previous reduce-scatter input released): its
        # unsharded parameters freed first (reshard after backward, _fsdp_param_group.py post_backward, whatever
        # reshard_after_forward says), its gradients copied into a new reduce-scatter input, then freed before
        # the reduce output (the new shard) is allocated; accumulating, that output is added into the existing
        # shard; on gloo beside its input's clone (rs_input_copies)
        after = pt.saved - k.per_block_plain - pt.frame
        add("backward", sharded=done, unsharded=head_grad + u.u_block, activations=after,
            buffers=gathered - u.u_block + u.r * u.rs_unit)
        add("backward", sharded=(carry if carry else done) + u.grad_block, unsharded=head_grad, activations=after,
            buffers=gathered - u.u_block + u.r * u.rs_unit * rs_input_copies(gloo, u.n))
