"""A strategy's engine configs: the DeepSpeed config JSON and the FSDP2 layout, the data-parallel
arithmetic they share, and a DeepSpeed strategy in FSDP terms (autotune.strategy owns Strategy; this
module reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from autotune.knobs import long_context_fields
from autotune.spec import HardwareSpec, ModelSpec, OptimizerSpec, TrainingSpec
from autotune.strategy import Strategy, batch_ranks, data_parallel_size


def shard_group_size(strategy: Strategy, hardware: HardwareSpec) -> int:
    """GPUs that parameters, gradients and optimizer states are partitioned over: all of them,
    or one node's with fsdp2's hybrid sharding (replicated across nodes)."""
    if strategy.engine == "fsdp2" and strategy.sharding == "hybrid":
        return hardware.gpus_per_node
    return data_parallel_size(hardware)


def gradient_accumulation_steps(strategy: Strategy, training: TrainingSpec, hardware: HardwareSpec) -> int:
    """global batch / (micro batch x data-parallel size, the GPUs over the sequence split); callers
    check divisibility with validate()."""
    return max(1, training.global_batch_size // (strategy.micro_batch_size * batch_ranks(hardware, strategy)))



@dataclass(frozen=True)
class DeepSpeedBuffers:
    """The DeepSpeed buffer settings that do not depend on the model: what to_deepspeed_config writes
    into every config and autotune.memory.states sizes (the model-dependent bucket sizes are
    default_buckets'; the optimizer is the job's, TrainingSpec.optimizer)."""

    sub_group_size: int = 1_000_000_000
    """ZeRO-3 ``sub_group_size`` (elements per optimizer-step sub group; NVMe swap buffers hold one)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_live_parameters``, like HF's "auto": it bounds prefetching only (a module is gathered whole
    whatever its size; memory/zero3_fetch.py)."""
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_reuse_distance`` (a gathered parameter reused within it stays gathered)."""
    optimizer_nvme_buffer_count: int = 4
    """``offload_optimizer.buffer_count`` for NVMe: pinned fp32 swap buffers of one sub group each."""
    param_nvme_buffer_count: int = 5
    """``offload_param.buffer_count`` for NVMe: pinned buffers of ``param_nvme_buffer_size`` each."""
    param_nvme_buffer_size: int = 100_000_000
    """``offload_param.buffer_size`` for NVMe (elements)."""
    param_max_in_cpu: int = 1_000_000_000
    """``offload_param.max_in_cpu`` for NVMe (elements kept in host memory)."""
    allreduce_bucket_size: int = 500_000_000
    """DeepSpeed's default ``allreduce_bucket_size`` (elements; not written): ZeRO-0's gradient
    all-reduce flattens this many at a time."""


DEEPSPEED_BUFFERS = DeepSpeedBuffers()
"""The settings every DeepSpeed config autotune writes carries."""


def default_buckets(model: ModelSpec, strategy: Strategy) -> dict[str, int]:
    """Bucket sizes autotune writes into the DeepSpeed config (elements).

    Stage 3 follows the HF Trainer's "auto" rule (transformers integrations/deepspeed.py:
    reduce_bucket_size = d^2, stage3_prefetch_bucket_size = 0.9 d^2, persistence = 10 d).
    Stages 1/2 use 2e8 (DeepSpeed docs' recommended value) but never more than the model, so small
    models do not pay DeepSpeed's 5e8-element default buffers.
    """
    d, n = model.hidden_size, model.num_parameters
    if strategy.zero_stage == 3:
        out = {
            "reduce_bucket_size": d * d,
            "prefetch_bucket_size": int(0.9 * d * d),
            "param_persistence_threshold": 10 * d,
        }
    else:
        bucket = int(min(2e8, n))
        out = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    for key in out:
        value = getattr(strategy, key)
        if value is not None:
            out[key] = value
    return out


@dataclass(frozen=True)
class EngineSettings:
    """What an engine's config carries beyond the strategy's knobs, one object read by
    to_deepspeed_config, to_fsdp2_config and the memory model (autotune.memory.states), so what is
    sized is what is configured."""

    optimizer: OptimizerSpec
    """The job's optimizer and its hyper-parameters (TrainingSpec.optimizer)."""
    buffers: DeepSpeedBuffers
    """DeepSpeed's model-independent buffer settings (DEEPSPEED_BUFFERS)."""
    buckets: dict[str, int]
    """DeepSpeed bucket sizes resolved for the model and strategy (default_buckets; empty for fsdp2)."""


def engine_settings(model: ModelSpec, training: TrainingSpec, strategy: Strategy) -> EngineSettings:
    """The settings an engine config of ``strategy`` carries for this model and job."""
    buckets = default_buckets(model, strategy) if strategy.engine == "deepspeed" else {}
    return EngineSettings(training.optimizer, DEEPSPEED_BUFFERS, buckets)


def to_deepspeed_config(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> dict[str, Any]:
    """The exact DeepSpeed config JSON object for this strategy (parsed by DeepSpeedConfig in tests)."""
    if strategy.engine != "deepspeed":
        raise ValueError(f"to_deepspeed_config needs engine deepspeed, but got engine {strategy.engine}")
    s = strategy
    settings = engine_settings(model, training, s)
    buf, opt, buckets = settings.buffers, settings.optimizer, settings.buckets
    gas = gradient_accumulation_steps(s, training, hardware)
    cfg: dict[str, Any] = {
        "train_batch_size": s.micro_batch_size * gas * batch_ranks(hardware, s),
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": opt.gradient_clipping,
        "steps_per_print": 1_000_000,
        "optimizer": opt.deepspeed_section(),
    }
    if opt.type == "sgd" and s.zero_stage >= 1:
        # torch.optim.SGD is outside ZeRO's tested optimizers (runtime/zero/utils.py
        # ZERO_SUPPORTED_OPTIMIZERS; runtime/engine.py _do_optimizer_sanity_check asserts this flag)
        cfg["zero_allow_untested_optimizer"] = True
    if s.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif s.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage in (1, 2):
        zero.update(
            overlap_comm=True, contiguous_gradients=True, reduce_scatter=True, allgather_partitions=True,
            reduce_bucket_size=buckets["reduce_bucket_size"], allgather_bucket_size=buckets["allgather_bucket_size"],
        )
    elif s.zero_stage == 3:
        zero.update(
            overlap_comm=True, contiguous_gradients=True, sub_group_size=buf.sub_group_size,
            reduce_bucket_size=buckets["reduce_bucket_size"],
            stage3_prefetch_bucket_size=buckets["prefetch_bucket_size"],
            stage3_param_persistence_threshold=buckets["param_persistence_threshold"],
            stage3_max_live_parameters=buf.max_live_parameters, stage3_max_reuse_distance=buf.max_reuse_distance,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    nvme_path = hardware.nvme.path if hardware.nvme else "/local_nvme"
    if s.offload_optimizer != "none":
        off: dict[str, Any] = {"device": s.offload_optimizer, "pin_memory": s.pin_memory}
        if s.offload_optimizer == "nvme":
            off.update(nvme_path=nvme_path, buffer_count=buf.optimizer_nvme_buffer_count, fast_init=False)
        zero["offload_optimizer"] = off
    if s.offload_params != "none":
        offp: dict[str, Any] = {"device": s.offload_params, "pin_memory": s.pin_memory}
        if s.offload_params == "nvme":
            offp.update(nvme_path=nvme_path, buffer_count=buf.param_nvme_buffer_count,
                        buffer_size=buf.param_nvme_buffer_size, max_in_cpu=buf.param_max_in_cpu)
        zero["offload_param"] = offp
    cfg["zero_optimization"] = zero
    if s.sequence_parallel_size > 1:
        # Ulysses: DeepSpeedConfig counts the data-parallel ranks as world / this without an mpu
        # (runtime/config.py DeepSpeedConfig.__init__); the engine reduces gradients in this dtype
        # under sequence parallelism (runtime/engine.py communication_data_type; DeepSpeed's default fp32)
        cfg["sequence_parallel_size"] = s.sequence_parallel_size
        cfg["seq_parallel_communication_data_type"] = s.precision
    if "nvme" in (s.offload_optimizer, s.offload_params):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                      "single_submit": False, "overlap_events": True}
    # No activation_checkpointing section: that section configures deepspeed.checkpointing, which a
    # model calls itself; autotune's checkpointing is applied to the model (front.json
    # ``checkpointing``, autotune.apply_checkpointing), so the section would only contradict it.
    return cfg


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""autotune precision name -> torch dtype attribute."""


def to_fsdp2_config(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> dict[str, Any]:
    """The FSDP2 layout of an fsdp2 strategy as a JSON object (what ``autotune.models.fsdp2.apply`` and
    the profiling worker build from, and what a front point ships): ``fully_shard`` on each
    decoder layer, then the root (torchtitan parallelize.py ``apply_fsdp``), over a 1-D mesh or,
    hybrid, a 2-D (replicate, shard) mesh. ``mesh`` is always the mesh ``fully_shard`` shards over;
    a context-parallel point adds ``context_parallel`` (the device mesh with its ``cp`` dimension:
    context_parallel_layout) and a point with tiling or activation offload ``long_context``
    (long_context_knobs), both absent otherwise."""
    if strategy.engine != "fsdp2":
        raise ValueError(f"to_fsdp2_config needs engine fsdp2, but got engine {strategy.engine}")
    s = strategy
    opt = engine_settings(model, training, s).optimizer
    n_ckpt = s.num_checkpointed(model.num_hidden_layers)
    hybrid = s.sharding == "hybrid"
    layout: dict[str, Any] = {
        "engine": "fsdp2",
        "mesh": {"shape": [hardware.num_nodes, hardware.gpus_per_node] if hybrid else [hardware.num_gpus],
                 "dim_names": ["replicate", "shard"] if hybrid else ["shard"]},
        "fully_shard": {"units": "each decoder layer, then the root module",
                        "reshard_after_forward": s.reshard_after_forward},
        "mp_policy": {"param_dtype": TORCH_DTYPES[s.precision], "reduce_dtype": TORCH_DTYPES[s.reduce_dtype]},
        "offload_policy": "CPUOffloadPolicy" if s.offload_params == "cpu" else None,
        "offload_pin_memory": s.pin_memory if (s.offload_params == "cpu" or s.activation_offload != "none") else None,
        "activation_checkpointing": {"granularity": s.checkpointing if n_ckpt else "none",
                                     "blocks": s.checkpointed_blocks(model.num_hidden_layers)},
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(s, training, hardware),
        "loss_scaling": s.precision == "fp16",
        "optimizer": {"type": opt.torch_class, "foreach": True, "params": opt.torch_kwargs()},
        "gradient_clipping": opt.gradient_clipping,
    }
    if s.context_parallel_size > 1:
        layout["context_parallel"] = context_parallel_layout(s, hardware)
    if s.expert_parallel_size > 1:
        layout["expert_parallel"] = expert_parallel_layout(s, model, hardware)
    extra = long_context_knobs(s)
    if extra:
        layout["long_context"] = extra
    return layout


def context_parallel_layout(strategy: Strategy, hardware: HardwareSpec) -> dict[str, Any]:
    """torch context parallel of an fsdp2 point as torchtitan lays it out
    (torchtitan/distributed/parallel_dims.py ``_build_mesh_without_ep``): a device mesh
    ``(dp_replicate,) dp_shard x cp``, ring attention over ``cp``, ``fully_shard`` over the flattened
    ``dp_shard_cp`` (every GPU, or a node's under hybrid sharding: the layout's ``mesh``), the batch
    split over ``dp_replicate x dp_shard``."""
    cp = strategy.context_parallel_size
    hybrid = strategy.sharding == "hybrid"
    shard = (hardware.gpus_per_node if hybrid else hardware.num_gpus) // cp
    return {"context_parallel_size": cp,
            "mesh": {"shape": [hardware.num_nodes, shard, cp] if hybrid else [shard, cp],
                     "dim_names": ["dp_replicate", "dp_shard", "cp"] if hybrid else ["dp_shard", "cp"]},
            "fully_shard_mesh": ["dp_replicate", "dp_shard_cp"] if hybrid else ["dp_shard_cp"],
            "rotate_method": "allgather",  # torchtitan's default context_parallel_rotate_method
            "load_balance": "head-tail", "seq_dim": 1}


def expert_parallel_layout(strategy: Strategy, model: ModelSpec, hardware: HardwareSpec) -> dict[str, Any]:
    """Expert parallelism of an fsdp2 point as torchtitan lays it out (torchtitan/distributed/
    parallel_dims.py ``_build_mesh_with_ep``, models/llama4/infra/parallelize.py ``apply_fsdp``): a
    device mesh ``(dp_replicate,) dp_shard_mod_ep x dp_shard_in_ep``; the routed experts split over
    ``ep`` (= dp_shard_in_ep; ExpertParallel: dim 0 of each expert tensor, all_to_all_single to
    dispatch and combine), then ``fully_shard`` over ``dp_shard_mod_ep`` (their dim 1 when
    dp_shard_mod_ep x ep exceeds the experts), gradients divided by the whole data-parallel size;
    every other parameter ``fully_shard`` over the flattened ``dp_shard_cp`` (every GPU of a replica)."""
    ep = strategy.expert_parallel_size
    hybrid = strategy.sharding == "hybrid"
    shard = hardware.gpus_per_node if hybrid else hardware.num_gpus
    mod_ep = shard // ep
    rep = ["dp_replicate"] if hybrid else []
    return {"expert_parallel_size": ep, "num_experts": model.num_experts, "local_experts": model.num_experts // ep,
            "mesh": {"shape": ([hardware.num_nodes] if hybrid else []) + [mod_ep, ep],
                     "dim_names": rep + ["dp_shard_mod_ep", "dp_shard_in_ep"]},
            "ep_mesh": ["dp_shard_in_ep"], "fully_shard_mesh": rep + ["dp_shard_cp"],
            "experts_fully_shard_mesh": rep + ["dp_shard_mod_ep"],
            "experts_shard_dim": 1 if mod_ep * ep > model.num_experts else 0,
            "gradient_divide_factor": shard * (hardware.num_nodes if hybrid else 1),
            "dispatch": "all_to_all_single", "combine": "all_to_all_single"}


FSDP_SHARDING: dict[int, Optional[str]] = {0: "NO_SHARD", 1: None, 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""ZeRO stage -> the FSDP ShardingStrategy that shards the same states (torch/distributed/fsdp/api.py
ShardingStrategy). ZeRO-1 has none: FSDP cannot shard optimizer states alone (SHARD_GRAD_OP also shards
gradients, as ZeRO-2 does; NO_SHARD shards nothing)."""
FSDP_NO_EQUIVALENT = "none: FSDP has no optimizer-state-only sharding (ZeRO-1)"
"""What ``fsdp_equivalent`` says where FSDP_SHARDING has no equivalent."""


def fsdp_equivalent(strategy: Strategy, hardware: HardwareSpec) -> dict[str, Any]:
    """The same strategy in PyTorch FSDP terms, for users who train with FSDP."""
    sharding = FSDP_SHARDING[strategy.zero_stage]
    out: dict[str, Any] = {
        "sharding_strategy": sharding,
        "cpu_offload": strategy.offload_params == "cpu" or strategy.offload_optimizer == "cpu",
        "activation_checkpointing": strategy.checkpointing,
    }
    notes = [FSDP_NO_EQUIVALENT] if sharding is None else []
    if strategy.zero_stage == 3 and hardware.num_nodes > 1:
        out["alternative"] = "HYBRID_SHARD (shard within a node, replicate across nodes)"
    if "nvme" in (strategy.offload_params, strategy.offload_optimizer):
        notes.append("FSDP has no NVMe offload; use DeepSpeed ZeRO-Infinity for this point")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def fsdp_equivalent_text(fsdp: dict[str, Any]) -> str:
    """One line for ``fsdp_equivalent``'s result: the sharding strategy, or why there is none."""
    return fsdp["sharding_strategy"] or FSDP_NO_EQUIVALENT


def long_context_knobs(strategy: Any) -> dict[str, Any]:
    """The strategy's model-side long-context knobs (``long_context`` in their metadata) that are not
    at their defaults (the calls of autotune.models.long_context; no engine config has a key for
    them): empty for a plain point. A strategy-like object without a knob has it at its default."""
    return {f.name: v for f in long_context_fields(Strategy)
            for v in [getattr(strategy, f.name, f.default)] if v != f.default}


def engine_config(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
                  ) -> dict[str, Any]:
    """The ready-to-use config of the strategy's engine: the DeepSpeed config JSON, or the FSDP2
    layout (to_fsdp2_config)."""
    if strategy.engine == "fsdp2":
        return to_fsdp2_config(strategy, model, training, hardware)
    return to_deepspeed_config(strategy, model, training, hardware)

