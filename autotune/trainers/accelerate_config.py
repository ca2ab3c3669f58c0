"""accelerate's config file of a front point (``accelerate launch --config_file accelerate.yaml``):
the DeepSpeed plugin with the point's DeepSpeed config file, or FSDP version 2 with the point's
resharding, offload and wrapped layer class. Keys as accelerate's ``ClusterConfig`` and its launch
arguments name them (accelerate/commands/config/config_args.py, utils/launch.py)."""

from __future__ import annotations

from typing import Any

from autotune.trainers.common import (WRAPPED_LAYER_NOTE, Point, all_layers, checkpointing_call, expert_parallel_line,
                                      long_context_lines, mixed_precision, norm_kernel_line, pinned_anyway_line,
                                      sp_attention)


def accelerate_config(p: Point) -> dict[str, Any]:
    """The config file as a mapping (written as YAML)."""
    s, hw = p.strategy, p.cfg.hardware
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": hw.num_nodes,
        "num_processes": hw.num_gpus,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if hw.num_nodes > 1:
        out.update(main_process_ip="MASTER_ADDR", main_process_port=29500)
    if s.engine == "fsdp2":
        out["distributed_type"] = "FSDP"
        out["mixed_precision"] = mixed_precision(s)
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": s.reshard_after_forward,
            "fsdp_offload_params": s.offload_params == "cpu",
            # the decoder layer: the model's _no_split_modules (accelerate fsdp_utils.py
            # fsdp2_prepare_auto_wrap_policy falls back to it when no class is named)
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": s.checkpointing == "full" and all_layers(p),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
        }
        cp = s.context_parallel_size
        if s.sharding == "hybrid":  # HSDP: replicate across nodes, shard within one (launch.py --parallelism_config_*)
            out["parallelism_config"] = {"parallelism_config_dp_replicate_size": hw.num_nodes,
                                         "parallelism_config_dp_shard_size": hw.gpus_per_node // cp}
        elif cp > 1:
            out["parallelism_config"] = {"parallelism_config_dp_shard_size": hw.num_gpus // cp}
        if cp > 1:  # torch context parallel over the mesh's cp dimension (accelerate/parallelism_config.py)
            out["parallelism_config"].update(parallelism_config_cp_size=cp, parallelism_config_cp_backend="torch",
                                             parallelism_config_cp_comm_strategy="allgather")
    else:
        # with deepspeed_config_file every other DeepSpeed setting comes from the file (accelerate
        # refuses zero_stage, offload, accumulation ... next to it); mixed precision too
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"deepspeed_config_file": p.ds_config_path,
                                   "zero3_init_flag": s.zero_stage == 3,
                                   "deepspeed_multinode_launcher": "standard"}
        if s.sequence_parallel_size > 1:
            # ALST/Ulysses (accelerator.py _prepare_deepspeed: register_with_transformers, the DataLoader
            # adapter, the mpu); dp_shard_size: the data-parallel ranks the batch arithmetic counts
            out["parallelism_config"] = {
                "parallelism_config_dp_shard_size": p.batch_ranks,
                "parallelism_config_sp_size": s.sequence_parallel_size,
                "parallelism_config_sp_backend": "deepspeed",
                "parallelism_config_sp_seq_length": p.cfg.training.seq_len,
                "parallelism_config_sp_attn_implementation": sp_attention(p)}
    return out


def differences(p: Point) -> list[str]:
    """What the point needs in the training script beyond the config file."""
    s = p.strategy
    out = []
    if s.engine == "deepspeed":
        out.append("the DeepSpeed config holds the optimizer: create it as `accelerate.utils.DummyOptim(model."
                   "parameters())` and pass that to `accelerator.prepare` (DeepSpeed builds the real one, with "
                   "the job's settings); the micro-batch is the DataLoader's batch_size and accumulation is "
                   "the config's gradient_accumulation_steps (use `with accelerator.accumulate(model):`)")
    fsdp_ckpt = s.engine == "fsdp2" and s.checkpointing == "full" and all_layers(p)
    if s.num_checkpointed(p.layers) and not fsdp_ckpt:
        out.append(f"checkpointing: call `{checkpointing_call(p.cfg, s)}` on the model before `accelerator.prepare`")
    if s.engine == "fsdp2":
        if not p.hf_model:
            out.append(WRAPPED_LAYER_NOTE)
        if s.precision != "fp32" and s.reduce_dtype == "fp32":
            out.append("FSDP2 reduce dtype fp32: accelerate's mixed_precision reduces in the compute dtype; for the "
                       "point's fp32 reduce pass `fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, "
                       "mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                       "reduce_dtype=torch.float32))` to Accelerator")
        if s.context_parallel_size > 1:
            out.append("context parallel: run each micro-batch inside `with accelerator.maybe_context_parallel("
                       "buffers=[input_ids, shift_labels, position_ids], buffer_seq_dims=[1, 1, 1], "
                       "no_restore_buffers={input_ids, shift_labels, position_ids}):` (shift the labels and make "
                       "the positions explicit before the split, as HF Trainer does)")
    out += long_context_lines(p, "accelerate") + norm_kernel_line(p, "accelerate")
    out += expert_parallel_line(p) + pinned_anyway_line(p, "accelerate")
    return out
