"""Model states: parameters, gradients, optimizer states and DeepSpeed's buffers per ZeRO stage and
offload, as DeepSpeed 0.19 allocates them (see the package docstring); the ZeRO paper's rule."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from autotune.memory import mla, moe, zero3_fetch
from autotune.memory.modules import parameter_modules, parameter_order, parameter_shapes  # noqa: F401 (re-exported)
from autotune.memory.common import _partition, forked_copies, host_pinned, pinned_bytes
from autotune.memory.mixed import dense_block_spec, layer_kinds
from autotune.spec import BYTES_PER_ELEMENT, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, data_parallel_size
from autotune.engine_configs import EngineSettings, engine_settings, gradient_accumulation_steps


def _largest_param(m: ModelSpec) -> int:
    """Elements of the largest single parameter tensor."""
    d = m.hidden_size
    experts = moe.ffn_parameter_order(m) if m.is_moe else []  # a MoE's 3-D expert tensors
    attention = mla.parameter_order(m) if m.is_mla else [d * m.q_size]
    return max(m.vocab_size * d, d * m.intermediate_size, *attention, *experts,
               m.max_position_embeddings * d if m.position_embedding == "learned" else 0)


@functools.lru_cache(maxsize=4096)
def _persistent_params(m: ModelSpec, threshold: int) -> int:
    """ZeRO-3 params with numel <= threshold stay whole on every rank (norm weights, biases...):
    partition_parameters.py ``_convert_to_zero_parameters`` per tensor, ``param.ds_numel <=
    param_persistence_threshold``, over ``parameter_order``."""
    return sum(n for n in parameter_order(m) if n <= threshold)


def _zero12_partition(total: int, dp: int) -> int:
    """Elements of one rank's ZeRO-1/2 partition of a flat group of ``total``: the group padded to a
    multiple of 2 x dp (``nccl_start_alignment_factor``), split dp ways; the whole group on one rank."""
    return -(-total // (2 * dp)) * 2 if dp > 1 else total


@functools.lru_cache(maxsize=4096)
def rank_params(m: ModelSpec, dp: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the elements of each parameter that overlaps its ZeRO-1/2 partition, whole
    (stage_1_and_2.py ``get_partition_info``: ``params_in_partition``), so a parameter straddling a
    partition boundary counts on both sides (partitions: ``_zero12_partition``)."""
    sizes = parameter_order(m)
    if dp <= 1:
        return (tuple(sizes),)
    part = _zero12_partition(sum(sizes), dp)
    out = []
    for r in range(dp):
        lo, hi = r * part, (r + 1) * part
        mine, start = [], 0
        for size in sizes:
            if start < hi and start + size > lo:
                mine.append(size)
            start += size
        out.append(tuple(mine))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def largest_partition_piece(m: ModelSpec, dp: int) -> int:
    """Elements of the largest piece of one parameter inside a rank's ZeRO-1/2 partition, over the ranks
    (a parameter straddling a boundary is narrowed to its piece: stage_1_and_2.py ``get_flat_partition``)."""
    sizes = parameter_order(m)
    part = _zero12_partition(sum(sizes), dp)
    best, start = 0, 0
    for size in sizes:
        for r in range(start // part, min(dp, -(-(start + size) // part))):
            best = max(best, min(start + size, (r + 1) * part) - max(start, r * part))
        start += size
    return best


@functools.lru_cache(maxsize=4096)
def grad_partition_elements(m: ModelSpec, dp: int) -> int:
    """Elements of ZeRO-1/2's ``grads_in_partition`` on the rank where it is largest: every parameter
    that overlaps the rank's partition counts whole (stage_1_and_2.py ``copy_grads_in_partition``:
    ``total_size += param_in_partition.numel()`` over ``params_in_partition``)."""
    return max(map(sum, rank_params(m, dp)))


@functools.lru_cache(maxsize=4096)
def zero3_sub_groups(m: ModelSpec, dp: int, sub_group_size: int) -> tuple[int, ...]:
    """Elements of each ZeRO-3 optimizer sub group on one rank: the parameters' partitions
    (``partition_numel``, each parameter padded to a multiple of dp) in ``parameters()`` order, a
    group closed once it reaches ``sub_group_size`` (stage3.py ``_create_fp16_sub_groups``; one group
    when the whole partition is no larger)."""
    parts = [_partition(n, dp) for n in parameter_order(m)]
    if sub_group_size >= sum(parts):
        return (sum(parts),)
    groups, n = [], 0
    for i, size in enumerate(parts):
        n += size
        if n >= sub_group_size or i == len(parts) - 1:
            groups.append(n)
            n = 0
    return tuple(groups)


@dataclass
class _States:
    params: float = 0.0
    grads: float = 0.0            # gradients held at the end of backward (model dtype)
    optimizer: float = 0.0        # fp32 master + moments on the GPU
    buffers_bwd: float = 0.0      # DeepSpeed buffers alive from the first gradient on (buckets, live params)
    buffers_bwd_end: float = 0.0  # extra buffers at the end of backward (ZeRO-0 all-reduce flatten)
    buffers_step: float = 0.0     # extra buffers at the optimizer step
    step_gather: float = 0.0      # ZeRO-1/2 on CPU, several ranks: gloo's all-gather output after the step
    buffers_fwd: float = 0.0      # extra buffers during forward (ZeRO-3 fetched params)
    grad_per_block: float = 0.0   # gradient bytes that accumulate per block during backward
    grad_buffer: float = 0.0      # gradient storage allocated once and resident (ZeRO-3 partition)
    resident_buffers: float = 0.0  # other always-allocated buffers (ZeRO-3 reduce bucket)
    partition_after: float = 0.0  # ZeRO-1/2: grads (elements) after which the partition buffer exists
    reduce_flat: float = 0.0      # ZeRO-1/2, several ranks: flat copy of a bucket while it is all-reduced
    reduce_clone: float = 0.0     # ZeRO-3 on CPU, several ranks: gloo's copy of a gradient it reduce-scatters
    reduce_clone_dense: float = 0.0  # the same for the dense-MLP blocks of a MoE with dense layers (mixed.py)
    leaf_hook: float = 0.0        # ZeRO-3, a leaf MoE block: what its backward hook holds (moe.leaf_hook_elements)
    head_released: float = 0.0   # ZeRO-3: gathered parameters released after the head's backward (zero3_fetch.py)
    experts_retained: tuple[float, ...] = ()  # ZeRO-3: per block, its released experts' copies (zero3_fetch.py)
    ffn_grads_released: bool = False  # each feed-forward weight gradient leaves autograd once made (ffn_grads_released)
    cpu: float = 0.0              # host bytes per GPU (offload)
    nvme: float = 0.0             # NVMe bytes per GPU

    @property
    def core_grads_held(self) -> bool:
        """Whether a block's weight gradients made before its attention core's backward (the feed-forward's,
        o_proj's, the later norms': ``ModelSpec.params_after_attention_core``) are still alive there: ZeRO-0
        keeps each as ``param.grad`` (``grad_per_block``) unless they leave autograd once made (accumulation
        adds them into the carried ones, ``ffn_grads_released``). Traced: hf-gemma2 ZeRO-0 mbs 2 seq 512 full
        bf16 (benchmarks/peak_trace_worker.py), the peak at block 1's softmax backward beside its MLP's and
        o_proj's gradients."""
        return bool(self.grad_per_block) and not self.ffn_grads_released

    @property
    def buffers_after_head(self) -> float:
        """``buffers_bwd`` once the head's backward is done (ZeRO-3's ``head_released``)."""
        return self.buffers_bwd - self.head_released


def ffn_grads_released(m: ModelSpec, s: Strategy, gas: int, reduce_bucket_size: int) -> bool:
    """Whether a feed-forward weight gradient leaves autograd right after its AccumulateGrad, before the
    next op's backward (the gated multiply after the down projection): the walk's MLP instants then
    hold none made earlier in the block (``ActivationBreakdown.mlp_backward_released``). DeepSpeed 0.19.8,
    the overlap_comm and contiguous_gradients autotune writes, any accelerator (CPU included):
    * ZeRO-1/2: the hook (utils/torch.py:40-42, ``register_post_accumulate_grad_hook``) runs
      ``process_gradients`` -> ``reduce_ready_partitions_and_remove_grads`` (stage_1_and_2.py:2290-2295: every
      micro-step under ZeRO-2, the boundary under ZeRO-1), which copies the gradient into the ipg bucket and
      rebinds ``param.grad`` to the copy (1441-1461: ``grad_reduc.data = new_grad_tensor.data``), freeing
      autograd's tensor; one larger than the bucket stays (1443-1449, ``extra_large_param_to_reduce``), so
      released only when every feed-forward parameter fits.
    * Accumulating under ZeRO-0 / ZeRO-1: ``param.grad`` lives across the micro-steps (engine.py:3084-3093
      reduces, and ZeRO-1's epilogue clears it, stage_1_and_2.py:1067, only at the boundary), so a later
      micro-step's AccumulateGrad adds into it in place (torch ``accumulate_grad.h``: ``variable_grad +=
      new_grad``) and frees the new one. The walk's instants are a later micro-step's (the carry); the
      first (no carry, smaller) keeps it, and with optimizer offload (no carry) the walk stands for it.
    * ZeRO-0 without accumulation keeps it as ``param.grad``; ZeRO-3 (estimate.py's ``reduce_clone``) and
      FSDP2 (fsdp2.py) keep their own rules.
    Traced (benchmarks/peak_trace_worker.py): Phi-3.5-MoE ZeRO-1 GA 1 frees every expert's down weight
    gradient (704,512 bytes) at its AccumulateGrad, before the multiply that holds the peak; Llama ZeRO-2
    (4096 tokens) its 22,016 bytes; GPT-2 ZeRO-1 GA 4 (a non-boundary micro-step) and ZeRO-0 GA 2 c_proj's."""
    if s.zero_stage in (0, 1) and gas > 1:
        return s.offload_optimizer == "none"
    return s.zero_stage in (1, 2) and moe.largest_ffn_parameter(m) <= reduce_bucket_size


def experts_retained(st: _States, m: ModelSpec, s: Strategy, moe_recomputed: bool) -> float:
    """ZeRO-3: the released experts' gathered copies still held from their block's forward to its backward
    (``_States.experts_retained``), but a checkpointed block's whose experts are recomputed (its forward's saved
    tensors are dropped)."""
    if not st.experts_retained:
        return 0.0
    ck = set(s.checkpointed_blocks(m.num_hidden_layers)) if moe_recomputed else set()
    return float(sum(b for i, b in enumerate(st.experts_retained) if i not in ck))


def _model_states(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy,
                  device: str = "cuda") -> _States:
    """Model states and DeepSpeed's buffers of one GPU for the strategy's ZeRO stage."""
    es = engine_settings(m, training, s)
    if s.zero_stage == 0:
        out = _zero0_states(m, s, es)
    elif s.zero_stage in (1, 2):
        out = _zero12_states(m, training, hardware, s, es, device)
    else:
        return _zero3_states(m, training, hardware, s, es, device)
    gas = gradient_accumulation_steps(s, training, hardware)
    out.ffn_grads_released = ffn_grads_released(m, s, gas, es.buckets.get("reduce_bucket_size", 0))
    return out


def _zero0_states(m: ModelSpec, s: Strategy, es: EngineSettings) -> _States:
    """Plain data parallel: full params, grads, master weights and moments on every GPU."""
    k_opt = es.optimizer.state_bytes_per_parameter  # adam: two moments; sgd: momentum or none
    psi = m.num_parameters
    p = BYTES_PER_ELEMENT[s.precision]
    out = _States()
    out.params = p * psi
    out.grads = p * psi
    master = 4 * psi if p < 4 else 0
    out.optimizer = (k_opt * psi) + master
    bucket = min(es.buffers.allreduce_bucket_size, psi)
    out.buffers_bwd_end = p * bucket  # allreduce_bucket flattens the grads (even on one rank)
    out.buffers_step = 4 * psi if p < 4 else 0  # flattened fp32 grads
    out.grad_per_block = p * m.block_params()
    return out


def _zero12_states(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy,
                   es: EngineSettings, device: str) -> _States:
    """ZeRO-1/2 (DeepSpeedZeroOptimizer), with or without optimizer offload."""
    k_opt = es.optimizer.state_bytes_per_parameter
    psi = m.num_parameters
    dp = data_parallel_size(hardware)
    p = BYTES_PER_ELEMENT[s.precision]
    out = _States()
    part = _partition(psi, dp)
    off_opt = s.offload_optimizer != "none"
    out.params = p * psi
    bucket = min(es.buckets["reduce_bucket_size"], psi)
    # grads_in_partition (allocated when the first bucket is reduced): the whole parameters that
    # overlap the rank's partition, the worst rank's (grad_partition_elements)
    out.grads = p * grad_partition_elements(m, dp)
    out.partition_after = bucket
    if off_opt:
        # ZeRO-Offload (stage_1_and_2.py: any offload_optimizer device, nvme included, sets
        # cpu_offload; stages 1/2 have no NVMe swapper): fp32 master, moments and the fp32
        # gradient partition live in host RAM; reduced gradients go straight from the reduce
        # buckets to the host through temp_grad_buffer_for_gpu_offload (GPU) and
        # temp_grad_buffer_for_cpu_offload (host, pinned), both of the largest parameter in
        # the model dtype, so the GPU holds no gradient partition. With gradient accumulation
        # each parameter of the partition accumulates on the host, whole (accumulated_grads_in_cpu:
        # buffer_to_accumulate_to_in_cpu, torch.zeros(param.numel()), model dtype), from the first
        # backward. Under pin_memory (CUDA) every host buffer but the moments (DeepSpeedCPUAdam's
        # zeros_like of the master) is pinned: weights_partition, temp_pinned, the fp32 .grad
        # (initialize_optimizer_states), the two temp buffers and each accumulation buffer.
        out.optimizer = 0
        out.grads = 0
        out.resident_buffers = p * _largest_param(m)
        out.buffers_bwd = 2 * p * bucket
        out.buffers_step = 0
        gas = gradient_accumulation_steps(s, training, hardware)
        pinned = host_pinned(s.pin_memory, device)
        # master, its fp32 gradient, param_buffer_of_bit16_for_cpu_offload_groups (the model-dtype
        # copy the updated master is cast into) and temp_grad_buffer_for_cpu_offload, at init
        at_init = (2 * pinned_bytes(4 * part, pinned) + pinned_bytes(p * part, pinned)
                   + pinned_bytes(p * _largest_param(m), pinned))
        accumulated = (max(sum(pinned_bytes(p * n, pinned) for n in params) for params in rank_params(m, dp))
                       if gas > 1 else 0.0)
        # a forked data loader's copies: the pages the trainer rewrites (the tensors' own bytes, not
        # their pinned blocks' tails), all but what the first step and backward create
        written = (4 + 4 + p) * part + p * _largest_param(m)
        later = k_opt * part + (p * grad_partition_elements(m, dp) if gas > 1 else 0.0)
        host = at_init + k_opt * part + accumulated + forked_copies(training, written, later)
    else:
        out.optimizer = (4 + k_opt) * part
        out.buffers_bwd = 2 * p * bucket  # ipg double buffer (overlap_comm)
        # the step (stage_1_and_2.py ``step``): the gradient norm casts each gradient piece to fp64 in turn
        # (``get_grad_norm_direct``: ``g.data.to(get_norm_dtype())``, torch.double where the device has it),
        # then the partition is flattened (``self.flatten(self.averaged_gradients[i])``) and cast to the
        # master's fp32 (``flat_grad_partition.to(...)``: a copy unless the model is fp32)
        fp32_grad = 4 * part if p < 4 else 0
        out.buffers_step = max(8 * largest_partition_piece(m, dp), p * part + fp32_grad)
        # after the step the gradients are freed and the updated partitions all-gathered; gloo's
        # ``_allgather_base`` allocates the whole flat output (on CUDA all_gather_into_tensor fills the
        # model's own flat buffer: nothing new)
        out.step_gather = p * psi if (device == "cpu" and dp > 1) else 0.0
        host = 0
    if dp > 1:
        # each bucket reduce goes through allreduce_and_scatter -> allreduce_bucket, which
        # flattens the bucket's gradients (zero/stage_1_and_2.py allreduce_bucket: self.flatten);
        # under sequence parallelism it all-reduces an fp32 copy of that flat tensor
        # (``if pg_correctness_test or self.sequence_parallel_size > 1: communication_data_type =
        # torch.float32``, then ``tensor.to(communication_data_type)``)
        fp32_copy = 4 * bucket if (s.sequence_parallel_size > 1 and p < 4) else 0
        out.reduce_flat = p * bucket + fp32_copy
    out.grad_per_block = 0
    out.cpu = host
    return out


def zero3_gathered(m: ModelSpec, s: Strategy, es: EngineSettings, dp: int, device: str) -> dict[str, Any]:
    """ZeRO-3's gathered parameters as ``_States`` fields (``buffers_fwd``, ``buffers_bwd``, ``head_released``,
    ``experts_retained``): zero3_fetch.py replays DeepSpeed's coordinator on the module trace. With one rank the
    gathered tensor is the partition itself, except when the partitions live on the host (offload_param): then
    every module is fetched to the GPU; on DeepSpeed's CPU accelerator "fetching" a host partition to the device
    is no copy. The only state the checkpointing knobs move (memory/_fast.py ``states_row``)."""
    p = BYTES_PER_ELEMENT[s.precision]
    fetch_copies = dp > 1 or (s.offload_params != "none" and device != "cpu")
    # blocks checkpointed whole run their forward again inside the backward, fetching as they go
    whole = tuple(s.checkpointed_blocks(m.num_hidden_layers)) if s.checkpointing in ("full", "op") else ()
    b = es.buckets
    g = zero3_fetch.gathered(m, b["param_persistence_threshold"], es.buffers.max_live_parameters,
                             es.buffers.max_reuse_distance, b["prefetch_bucket_size"], whole) if fetch_copies else (
        zero3_fetch.Gathered(0, 0, 0))
    return {"buffers_fwd": float(p * g.forward), "buffers_bwd": float(p * g.head_backward),
            "head_released": float(p * (g.head_backward - g.after_head)),
            "experts_retained": tuple(float(p * n) for n in g.released_experts)}


def _zero3_states(m: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, s: Strategy, es: EngineSettings,
                  device: str) -> _States:
    """ZeRO-3 (DeepSpeedZeroOptimizer_Stage3), with optimizer and parameter offload."""
    k_opt = es.optimizer.state_bytes_per_parameter
    psi = m.num_parameters
    dp = data_parallel_size(hardware)
    p = BYTES_PER_ELEMENT[s.precision]
    out = _States()
    part = _partition(psi, dp)
    off_opt = s.offload_optimizer != "none"
    buckets = es.buckets
    host = 0.0
    thr = buckets["param_persistence_threshold"]
    persist = _persistent_params(m, thr)
    rb = buckets["reduce_bucket_size"]
    prefetch = buckets["prefetch_bucket_size"]
    off_par = s.offload_params != "none"
    out.params = (0 if off_par else p * part) + p * persist
    # the reduce bucket (ipg buffer) is allocated at init on the GPU (stage3.py
    # _setup_for_real_optimizer: "bucket.buffer = torch.empty(self.reduce_bucket_size, ...)")
    out.resident_buffers = p * min(rb, psi)
    out.grads = 0
    for name, value in zero3_gathered(m, s, es, dp, device).items():
        setattr(out, name, value)
    if device == "cpu" and dp > 1 and moe.down_weight_elements(m) > rb:
        # an MLP weight's gradient (larger than the reduce bucket) is reduce-scattered on its own
        # right after its linear's backward (stage3.py __reduce_and_partition_ipg_grads ->
        # coalesced_collectives.py reduce_scatter_coalesced -> dist.reduce_scatter_tensor), and
        # gloo's reduce-scatter clones its input (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp
        # _reduce_scatter_base: ``inputTensor.clone()``, seen as aten::clone under
        # c10d::_reduce_scatter_base_ in the allocation trace); NCCL writes from the input directly
        out.reduce_clone = p * moe.down_weight_elements(m)  # a MoE's: every expert's down_proj
    if m.is_moe and m.zero3_leaf_block:
        out.leaf_hook = p * moe.leaf_hook_elements(m, rb, clone=device == "cpu" and dp > 1)
    if device == "cpu" and dp > 1 and layer_kinds(m) and moe.down_weight_elements(dense_block_spec(m)) > rb:
        out.reduce_clone_dense = p * moe.down_weight_elements(dense_block_spec(m))  # a dense block's, as above
    pinned = host_pinned(s.pin_memory, device)
    # under pin_memory (CUDA) the pinned tensors are what torch's caching host allocator holds for
    # them (pinned_bytes); their sizes are the parameters' own partitions (partition_numel), summed
    sub_groups = zero3_sub_groups(m, dp, es.buffers.sub_group_size)
    parts = sum(sub_groups) if pinned else part
    written = 0.0  # host bytes the trainer rewrites every step (a forked data loader copies them)
    if off_opt:
        # stage3.py: self.device = "cpu" when the optimizer is offloaded, and the gradient
        # partitions (grad_partitions_flat_buffer, gradient_accumulation_dtype = model dtype)
        # are allocated there (pinned under pin_memory): no gradient partition and no optimizer
        # state on the GPU
        out.grad_buffer = 0
        out.optimizer = 0
        out.buffers_step = 0
        grad_flat = pinned_bytes(p * parts, pinned)
        if s.offload_optimizer == "cpu":
            # the fp32 master (_create_fp32_partitions: a clone, pageable) and the moments
            # (DeepSpeedCPUAdam), pageable; each sub group's fp32 gradient
            # (initialize_optimizer_states: subgroup_gradient_buffer, pinned under pin_memory)
            grads = sum(pinned_bytes(4 * n, True) for n in sub_groups) if pinned else 4 * part
            host += (4 + k_opt) * part + grads + grad_flat
            written = (4 + 4 + p) * part
        else:
            # ZeRO-Infinity: master, moments and fp32 gradients swap to NVMe; the host keeps the
            # gradient partitions and buffer_count (4) fp32 swap buffers of one sub group
            # (autotune writes sub_group_size 1e9), page-locked by the aio handle's own allocator
            out.nvme += (4 + k_opt + 4) * part
            buf = es.buffers
            swap = buf.optimizer_nvme_buffer_count * 4 * min(buf.sub_group_size, part)
            host += grad_flat + swap
            written = p * part + swap
    else:
        # the 16-bit gradient partition is allocated once, at init, on the GPU (stage3.py
        # grad_partitions_flat_buffer on self.device)
        out.grad_buffer = p * part
        out.optimizer = (4 + k_opt) * part
        out.buffers_step = (4 * part if p < 4 else 0) + p * part
    if s.offload_params == "cpu":
        # the 16-bit parameter partitions: one flat buffer per param group
        # (_create_param_groups_fp16_flat_cpu_memory); under pin_memory each parameter's own pinned
        # partition (partition_parameters.py _partition_param: ``get_accelerator().pin_memory``)
        # is copied into it and freed, its block kept cached by torch's host allocator
        own = (sum(pinned_bytes(p * _partition(n, dp), True) for n in parameter_order(m) if n > thr)
               if pinned else 0.0)
        host += pinned_bytes(p * parts, pinned) + own
        written += p * part  # the flat buffer (the cached blocks are never written again)
    elif s.offload_params == "nvme":
        # partitions swap to NVMe through buffer_count (5) x buffer_size (1e8) pinned buffers
        # (autotune's offload_param config; AsyncPartitionedParameterSwapper)
        out.nvme += p * part
        swap = es.buffers.param_nvme_buffer_count * es.buffers.param_nvme_buffer_size * p
        host += swap
        written += swap
    # a forked data loader's copies: the pages the trainer rewrites of every host tensor above that
    # exists after deepspeed.initialize (initialize_optimizer_states creates the fp32 gradients), the
    # tensors' own bytes; the moments, which DeepSpeedCPUAdam creates in its first step, later
    later = k_opt * part if s.offload_optimizer == "cpu" else 0.0
    host += forked_copies(training, written, later)
    out.cpu = host
    return out


def zero_model_states(num_parameters: float, dp: int, stage: int, precision: str = "fp16", *,
                      offload_optimizer: bool = False) -> dict[str, float]:
    """Model states per GPU by the ZeRO paper's rule, plus DeepSpeed's estimator's count.

    ``parameters``/``gradients``/``optimizer_states``/``total``: Rajbhandari et al. 2020
    (Figure 1): 2 + 2 + K bytes per parameter (K = 12: fp32 master + two moments; 8 in pure
    fp32 training with 4-byte params and grads), partitioned by stage (1: optimizer, 2: +grads,
    3: +params). ``deepspeed``: what ``estimate_zero2/3_model_states_mem_needs`` counts on the
    GPU (2 + 18/N for ZeRO-2, the extra 4 bytes being the fp32 gradient partition; 18/N for
    ZeRO-3 without its largest-layer term; with optimizer offload only the 16-bit params).
    """
    psi, n = float(num_parameters), dp
    p = BYTES_PER_ELEMENT[precision]
    k = 12 if p < 4 else 8
    params = p * psi / (n if stage >= 3 else 1)
    grads = p * psi / (n if stage >= 2 else 1)
    opt = k * psi / (n if stage >= 1 else 1)
    if offload_optimizer:
        ds = params
    else:
        if stage == 2:
            ds = params + (p + 4 + k) * psi / n
        elif stage == 3:  # DeepSpeed counts 18 B/param/N here (16-bit params + grads + K + 2)
            ds = (2 * p + k + 2) * psi / n
        else:
            ds = params + grads + opt
    return {"parameters": params, "gradients": grads, "optimizer_states": opt, "total": params + grads + opt,
            "deepspeed": ds}


def model_states_bytes(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                       strategy: Strategy) -> dict[str, int]:
    """:func:`zero_model_states` for a model / strategy (ints, bytes per GPU)."""
    ms = zero_model_states(model.num_parameters, data_parallel_size(hardware), strategy.zero_stage,
                           strategy.precision, offload_optimizer=strategy.offload_optimizer != "none")
    return {k: int(v) for k, v in ms.items()}
