"""``estimate_memory``: the phases of one steady-state step (forward, backward, optimizer) and the
verdict, from the activations and model states."""

from __future__ import annotations

import dataclasses
from typing import Callable

from autotune.memory.activations import ActivationBreakdown, activation_breakdown
from autotune.memory.common import MemoryEstimate, _gib
from autotune.memory.mixed import blocks_within, kind_spec, layer_kinds, params_after
from autotune.memory.moe import down_weight_elements
from autotune.memory.states import _model_states, _States, experts_retained, grad_partition_elements
from autotune.memory.walk import LOOPS, Candidate, Loop, backward_blocks, finish, last_forward_relief
from autotune.spec import BYTES_PER_ELEMENT, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, data_parallel_size
from autotune.engine_configs import default_buckets, gradient_accumulation_steps


def _accumulation_carry(m: ModelSpec, hardware: HardwareSpec, s: Strategy, gas: int) -> tuple[float, bool]:
    """Bytes that live across the micro-steps of one optimizer step (gradient accumulation > 1),
    and whether a later micro-step's backward still grows gradients block by block.

    * ZeRO-0 (plain optimizer, FP16_Optimizer / FP16_UnfusedOptimizer): ``param.grad`` keeps
      the whole model's gradients (model dtype) from the first micro-step on; later micro-steps
      add into them in place, the all-reduce runs only at the boundary (engine.py
      ``allreduce_gradients``: "Communicate only at gradient accumulation boundaries").
    * ZeRO-1 (``partition_gradients`` False): nothing is reduced before the boundary
      (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``: ``if self.partition_gradients
      or self.is_gradient_accumulation_boundary()``), so the epilogue's ``all_grad_tensors``
      (``independent_gradient_partition_epilogue``, ``get_all_grad_tensors``) keeps full-size
      gradients, and the ipg double buffer (two reduce buckets, model dtype) they were gathered
      in stays referenced; measured on allocation traces (benchmarks/memory_vs_deepspeed.py, 1 and
      2 ranks): the gradients plus the two buckets, where the boundary micro-step reuses the
      buckets rather than adding new ones.
    * ZeRO-2: each micro-step reduces into ``grads_in_partition``; the epilogue keeps that
      partition in ``all_grad_tensors`` and the next micro-step allocates a new one to add into
      it (stage_1_and_2.py ``copy_grads_in_partition`` / ``accumulated_grad.add_``): one
      partition (Psi/N, model dtype) lives across micro-steps.
    * ZeRO-3: the gradient partition buffer allocated at init accumulates in place
      (stage3.py ``partition_grads``: ``grad_buffer.add_``): nothing extra.
    With optimizer offload the accumulated gradients live in host RAM (not modelled on the GPU).
    FP16 with loss scaling (ZeRO-0 fp16: ``FP16_Optimizer``) carries like ZeRO-0 bf16.
    ``BF16_Optimizer`` (fp32 gradient accumulation buffers) is picked only for ZeRO-1 with
    ``data_types.grad_accum_dtype: fp32`` or with pipeline parallelism (engine.py
    ``_do_optimizer_sanity_check``), and ``contiguous_gradients`` is always on in the configs
    autotune writes (strategy.py ``to_deepspeed_config``): neither is modelled.
    """
    if gas <= 1 or s.offload_optimizer != "none":
        return 0.0, True
    p = BYTES_PER_ELEMENT[s.precision]
    psi = m.num_parameters
    if s.zero_stage == 0:
        return float(p * psi), False
    if s.zero_stage == 1:
        bucket = min(default_buckets(m, s)["reduce_bucket_size"], psi)
        return float(p * psi + 2 * p * bucket), True
    if s.zero_stage == 2:  # grads_in_partition, whole straddling parameters included (states.py)
        return float(p * grad_partition_elements(m, data_parallel_size(hardware))), True
    return 0.0, True


def carry_buckets(st: _States, s: Strategy, carry: float) -> float:
    """ZeRO-1: the part of the accumulation carry that is the ipg double buffer (2 reduce buckets) filled in
    the earlier micro-steps; where the boundary micro-step's own buckets are counted, they are those buffers."""
    return st.buffers_bwd if (carry and s.zero_stage == 1) else 0.0


def split_carry(m: ModelSpec, s: Strategy, gas: int, carry: float, carry_ipg: float) -> float:
    """ZeRO-1 with exactly two micro-steps: the carried gradients (``carry`` less the ipg buckets), which
    the backward's instants then split between its two micro-steps (``split_relief``); 0 otherwise.

    The micro-step that holds the carry is the boundary one, whose gradient hooks add each new gradient
    into the carried ``param.grad`` and copy it into the reduce bucket, rebinding it there
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``: ``grad_reduc.data =
    new_grad_tensor.data``): the carry of every parameter hooked so far is gone. The first micro-step
    (no carry, no reduce) holds those parameters' own ``param.grad`` instead. With three or more
    micro-steps a middle one holds the whole carry (measured on allocation traces, docs/accuracy.md).
    """
    return float(carry - carry_ipg) if (s.zero_stage == 1 and gas == 2 and carry) else 0.0


def split_relief(split: float, lo: float, hi: float) -> float:
    """Bytes of ``split`` (split_carry) not alive at a backward instant whose hooked parameters'
    gradients take ``lo`` to ``hi`` bytes: the carry micro-step holds at most ``split - lo``, the
    first one at most ``hi``; never negative."""
    return max(0.0, min(lo, split - hi))


def estimate_memory(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategy: Strategy,
                    *, headroom: float = 0.0, device: str = "cuda", loop: Loop = "keep_outputs") -> MemoryEstimate:
    """Predict per-GPU peak memory of a steady-state step, host/NVMe needs and the verdict.

    ``device="cpu"`` predicts the same step on DeepSpeed's CPU accelerator (the benchmark's
    ground truth): dropout masks in the model dtype instead of 1-byte bool, and sdpa with
    attention dropout on PyTorch's math kernel.

    ``loop``: ``keep_outputs`` (default) is the usual ``outputs = engine(**batch);
    engine.backward(outputs.loss); engine.step()``: ``outputs`` holds the logits (model dtype) until
    the next forward rebinds it; ``drop_outputs`` keeps only the loss (the logits die in the forward).
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
    if strategy.engine == "fsdp2":
        from autotune.memory.fsdp2 import estimate_fsdp2

        return estimate_fsdp2(model, training, hardware, strategy, headroom=headroom, device=device, loop=loop)
    m, s, p = model, strategy, BYTES_PER_ELEMENT[strategy.precision]
    st = _model_states(m, training, hardware, s, device)
    act = activation_breakdown(m, training, s, device)
    L = m.num_hidden_layers
    retained = experts_retained(st, m, s, act.moe_recomputed)
    if retained:  # ZeRO-3's released expert copies, held through the forward and the backward (states.py)
        st = dataclasses.replace(st, buffers_fwd=st.buffers_fwd + retained, buffers_bwd=st.buffers_bwd + retained)
    tokens = act.logits_tokens
    saved_blocks, nonblock, logits_saved = act.blocks, act.nonblock, act.logits_saved
    other_saved = nonblock - logits_saved  # final norm, masks, rope tables
    # the logits the user's ``outputs`` keeps (lm_head output, model dtype; fp32 training: the
    # very tensor the loss reads): alive everywhere in the steady state, the previous micro-step's
    # through the next forward until ``outputs`` is rebound
    kept = p * m.vocab_size * tokens if loop == "keep_outputs" else 0.0
    gas = gradient_accumulation_steps(s, training, hardware)
    carry, grow = _accumulation_carry(m, hardware, s, gas)
    carry_ipg = carry_buckets(st, s, carry)
    split = split_carry(m, s, gas, carry, carry_ipg)

    fixed = st.params + st.optimizer + st.grad_buffer + st.resident_buffers
    cands: list[Candidate] = []

    head = m.vocab_size * m.hidden_size
    # a tied head's gradient waits in autograd's input buffer of the shared weight until the
    # embedding's backward (one AccumulateGrad for both uses): outside param.grad until then
    pending_head = p * head if m.tie_word_embeddings else 0.0

    def add(phase: str, grads: float = 0.0, activations: float = 0.0, logits: float = 0.0,
            buffers: float = 0.0, pending: float = 0.0, hooked: tuple[float, float] = (0.0, 0.0)) -> None:
        logits += kept
        if phase != "optimizer":
            # later micro-steps: accumulated gradients (ZeRO-0 adds into them in place, but not
            # what autograd still holds, ``pending``); ``hooked``: the parameters whose gradient hooks
            # have run, at least and at most (split_carry)
            grads = (grads + carry - min(carry_ipg, buffers) - split_relief(split, p * hooked[0], p * hooked[1])
                     if grow else max(grads - pending, carry) + pending)
        cands.append(Candidate(phase, fixed + grads + activations + logits + buffers, grads, activations, logits,
                                buffers))

    # the last block's experts at their forward peak (moe.grouped_forward_transient): every block's saved
    # tensors but the final norm's (a checkpointed block's own recomputation instant is larger: walk.py)
    last_kind = act.dense if (act.dense is not None and act.dense_layers[-1]) else act
    if last_kind.moe_forward_transient and not ((L - 1) in s.checkpointed_blocks(L) and last_kind.moe_recomputed):
        add("forward", activations=saved_blocks + other_saved - act.final_norm_saved + act.forward_only_masks
            + last_kind.moe_forward_transient, buffers=st.buffers_fwd)
    # the final norm's forward, inside the decoder's: its masks still alive (activations.py)
    add("forward", activations=saved_blocks + other_saved + act.final_norm_forward_extra + act.forward_only_masks,
        buffers=st.buffers_fwd)
    # forward end: everything saved plus the loss transient (logits, their fp32 copy, log_softmax)
    add("forward", activations=saved_blocks + other_saved, logits=logits_saved + act.loss_forward_transient,
        buffers=st.buffers_fwd)
    # backward start: the logits gradient (fp32 nll grad + log_softmax grad next to its saved output);
    # DeepSpeed's gradient buffers appear with the first parameter gradient, right after
    add("backward", activations=saved_blocks + other_saved, logits=logits_saved + act.loss_backward_transient,
        buffers=st.buffers_fwd)
    # lm_head backward: its weight gradient is computed next to the logits gradient (model dtype)
    add("backward", grads=p * head, activations=saved_blocks + other_saved, logits=p * m.vocab_size * tokens,
        buffers=st.buffers_fwd, pending=pending_head)
    # its gradient hook: ZeRO-1/2 allocate the reduce buckets (the logits gradient is gone)
    add("backward", grads=p * head, activations=saved_blocks + other_saved, buffers=st.buffers_bwd,
        pending=pending_head)
    # from the hook on, the head's weight gradient stays alive only in ZeRO-0's param.grad or, tied,
    # pending; ZeRO-1/2/3 copied it into the reduce bucket and rebound param.grad to that copy
    # (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads, stage3.py
    # __add_grad_to_ipg_bucket)
    head_grad = p * head if (s.zero_stage == 0 or m.tie_word_embeddings) else 0.0
    bwd = st.buffers_after_head
    # the final norm's backward at its peak (activations.py final_norm_backward_live)
    head_hooked = 0.0 if m.tie_word_embeddings else float(head)  # a tied head's hook waits for the embedding
    add("backward", grads=head_grad, activations=saved_blocks + other_saved - act.final_norm_saved
        + act.final_norm_backward_live, buffers=bwd, pending=pending_head,
        hooked=(head_hooked, head_hooked + m.norm_params()))
    _blocks_backward(add, m, s, st, act, other_saved, head_grad, pending_head, head_hooked + m.norm_params())
    if (L - 1) in s.checkpointed_blocks(L):  # the last block's attention core in the forward (walk.last_forward_relief)
        last = backward_blocks(act, s, L, other_saved)[0]
        add("forward", activations=last.saved - last_forward_relief(m, last.act or act), buffers=st.buffers_fwd)
    # ZeRO-1 at the accumulation boundary: each carried full-size gradient is copied into the
    # reduce bucket and rebound to it (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads:
    # ``grad_reduc.data = new_grad_tensor.data``), so after the last hook only the buckets and the
    # partition hold gradients
    moved = carry - carry_ipg if s.zero_stage == 1 else 0.0
    bucket = st.partition_after or 0
    # backward end: all gradients, ZeRO-0's flat all-reduce bucket
    add("backward", grads=st.grads - moved, buffers=bwd + st.buffers_bwd_end)
    if st.reduce_flat:  # the last bucket's reduce; the partition exists if an earlier reduce made it
        add("backward", grads=(st.grads if m.num_parameters > bucket else 0.0) - moved,
            buffers=bwd + st.reduce_flat)
    # optimizer step
    add("optimizer", grads=st.grads, buffers=st.buffers_step)
    add("optimizer", buffers=st.step_gather)
    # the usual loop calls engine.step() after every micro-step: a non-boundary one enters it holding
    # what the accumulation carries (the step itself does nothing there; engine.py ``step``)
    add("optimizer", grads=carry)

    why = (f"the buffers hold {_gib(retained)} of expert weights ZeRO-3 gathered in the forward and the experts' "
           "grouped_mm keeps to the backward (checkpointing the blocks' feed-forward, op, mlp or full, recomputes "
           "them instead; docs/moe.md)" if retained else None)
    return finish(cands, model, training, hardware, s, headroom, params=st.params, optimizer=st.optimizer,
                  resident_grads=st.grad_buffer, resident_buffers=st.resident_buffers,
                  cpu_per_gpu=st.cpu + act.offloaded, nvme_per_gpu=st.nvme, why_gpu=why)


def _blocks_backward(add: Callable[..., None], m: ModelSpec, s: Strategy, st: _States, act: ActivationBreakdown,
                     other_saved: float, head_grad: float, pending_head: float, hooked_before: float) -> None:
    """The candidates through the blocks' backward, last block to first (``add`` as in
    estimate_memory; ``st`` the model states; ``head_grad`` the head's weight gradient still
    alive beside the buckets: ZeRO-0 keeps every gradient; a tied one is pending, so no gradient
    hook fires for it before the embedding's backward; ``hooked_before``: the parameters hooked
    before the blocks, head and final norm)."""
    p = BYTES_PER_ELEMENT[s.precision]
    L = m.num_hidden_layers
    head = m.vocab_size * m.hidden_size
    bwd = st.buffers_after_head
    # through the blocks (last to first): saved activations shrink while gradients accumulate;
    # a checkpointed block is recomputed (its full activations) before its backward
    bucket = st.partition_after or 0
    block_params = m.block_params()
    mixed = layer_kinds(m)  # dense-MLP blocks among MoE ones: blocks of two sizes (memory/mixed.py)
    after = params_after(m) if mixed else ()
    # the state at block i is linear in i within a run of same-kind blocks, so only the ends of
    # each run (and both sides of the point where ZeRO-1/2's gradient partition appears) matter
    extra: set[int] = set()
    reduces: dict[int, bool] = {}  # block -> whether the gradient partition exists at its bucket reduce
    if bucket and block_params:
        if mixed:
            k, k2 = blocks_within(m, max(0.0, bucket - head)), blocks_within(m, max(0.0, 2 * bucket - head))
        else:
            k = int(max(0.0, bucket - head) // block_params)  # blocks done before the partition exists
            k2 = int(max(0.0, 2 * bucket - head) // block_params)  # ... before the second reduce
        extra.update({L - 1 - k, L - 2 - k, L - 2 - k2})
        if st.reduce_flat:
            reduces = {L - 2 - k2: True, L - 2 - k: False}
    for pt in backward_blocks(act, s, L, other_saved, extra, released=st.ffn_grads_released):
        done = after[pt.block] if mixed else pt.done * block_params  # parameters of the blocks done
        # without ZeRO-1/2's gradient partition (ZeRO-0 keeps every block's gradients)
        g_before = head_grad + (p * done if (mixed and st.grad_per_block) else pt.done * st.grad_per_block)
        g = g_before + (st.grads if bucket and head + done > bucket else 0.0)
        dense = bool(mixed and mixed[pt.block])
        after_core = m.params_after_attention_core(False if dense else None)
        # the parameters hooked at this block's instants: the blocks done, at most this one too (split_carry)
        hooked = (hooked_before + done, hooked_before + done + m.block_params(False if dense else None))
        late = (hooked[0] + after_core, hooked[1])  # after the MLP's backward: its hooks (and o_proj's) have run
        add("backward", grads=g, activations=pt.mlp, buffers=bwd, pending=pending_head, hooked=hooked)
        # ZeRO-0 without accumulation keeps the block's weight gradients made so far as param.grad
        held = p * after_core if st.core_grads_held else 0.0
        if pt.recompute is not None:  # a checkpointed block's recomputation at its experts' / core's forward peak
            # (attention / selective: after the MLP's backward, with its gradients)
            add("backward", grads=(g + held) if act.recomputed_after_mlp else g_before, activations=pt.recompute,
                buffers=bwd, pending=pending_head, hooked=late if act.recomputed_after_mlp else hooked)
        if pt.attention is not None:  # its attention backward: MLP tensors freed, the core's gradients appear
            add("backward", grads=g + held, activations=pt.attention, buffers=bwd, pending=pending_head, hooked=late)
        clone = st.reduce_clone_dense if dense else st.reduce_clone
        if clone:  # ZeRO-3 on CPU: the down projection's weight gradient reduce-scattered by
            # its hook, the linear's saved input released, its input gradient (as wide) alive; gloo's
            # copy of the gradient (states.py)
            add("backward", grads=g, activations=pt.mlp - pt.act.mlp_backward_transient,
                buffers=bwd + p * down_weight_elements(kind_spec(m, dense)) + clone,
                pending=pending_head, hooked=hooked)
        if st.leaf_hook and not dense:  # ZeRO-3, a leaf MoE block's backward hook: its saved tensors released,
            # its input's gradient alive, every expert gradient reduced there (moe.leaf_hook_elements)
            add("backward", grads=g, activations=pt.saved - pt.act.mlp_saved_per_block + pt.act.hidden_grad,
                buffers=bwd + st.leaf_hook, pending=pending_head, hooked=hooked)
        if pt.block in reduces:  # a bucket is all-reduced during this block's backward
            add("backward", grads=g if reduces[pt.block] else g_before, activations=pt.saved,
                buffers=bwd + st.reduce_flat, pending=pending_head, hooked=hooked)
