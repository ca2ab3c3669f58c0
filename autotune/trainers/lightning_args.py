"""Lightning arguments of a front point: the strategy's constructor arguments and the Trainer's.

DeepSpeed points: ``DeepSpeedStrategy(config=...)`` with the point's DeepSpeed config less what
Lightning owns: ``gradient_accumulation_steps`` (refused in the config: it is the Trainer's
``accumulate_grad_batches``, lightning/pytorch/strategies/deepspeed.py
``_format_batch_size_and_grad_accum_config``), ``train_batch_size`` (DeepSpeed derives it) and
``gradient_clipping`` (the Trainer's ``gradient_clip_val``, which Lightning writes into the config).
fsdp2 points: ``ModelParallelStrategy`` (Lightning's FSDP2 strategy; ``FSDPStrategy`` is FSDP1's
FlatParameter sharding, a different memory layout), whose ``configure_model`` applies the layout
with ``autotune.apply`` (checkpointing, ``fully_shard`` per block and the root)."""

from __future__ import annotations

import copy
from typing import Any

from autotune.trainers.common import Point, checkpointing_call, long_context_lines, norm_kernel_line

_LIGHTNING_OWNS = ("gradient_accumulation_steps", "train_batch_size", "gradient_clipping")
_NO_ULYSSES = ("sequence_parallel_size", "seq_parallel_communication_data_type")
"""Ulysses keys dropped: DeepSpeedStrategy calls deepspeed.initialize without an mpu, so DeepSpeed
would count world / sequence_parallel_size data-parallel ranks while every rank trains its own batch."""
PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
"""autotune precision -> Lightning's ``precision`` for DeepSpeed (its DeepSpeedPrecision)."""


def lightning_args(p: Point) -> dict[str, Any]:
    """``{"strategy": class path, "strategy_args": {...}, "trainer_args": {...}}``:
    ``Trainer(strategy=Strategy(**strategy_args), **trainer_args)``."""
    s, hw, opt = p.strategy, p.cfg.hardware, p.cfg.training.optimizer
    trainer: dict[str, Any] = {"accelerator": "gpu", "devices": hw.gpus_per_node, "num_nodes": hw.num_nodes,
                               "accumulate_grad_batches": p.gas}
    if s.engine == "fsdp2":
        # mixed precision is the layout's MixedPrecisionPolicy (autotune.apply): no autocast on top
        trainer["precision"] = "32-true"
        if opt.gradient_clipping and s.expert_parallel_size == 1:  # EP: configure_gradient_clipping (differences)
            trainer["gradient_clip_val"] = opt.gradient_clipping
        return {"strategy": "lightning.pytorch.strategies.ModelParallelStrategy",
                "strategy_args": {"data_parallel_size": p.world, "tensor_parallel_size": 1},
                "trainer_args": trainer, "dataloader_batch_size": s.micro_batch_size}
    config = copy.deepcopy(p.ds_config)
    for key in _LIGHTNING_OWNS + _NO_ULYSSES:
        config.pop(key, None)
    trainer["precision"] = PRECISION[s.precision]
    trainer["gradient_clip_val"] = opt.gradient_clipping
    return {"strategy": "lightning.pytorch.strategies.DeepSpeedStrategy", "strategy_args": {"config": config},
            "trainer_args": trainer, "dataloader_batch_size": s.micro_batch_size}


def differences(p: Point) -> list[str]:
    """What the LightningModule must do beyond these arguments."""
    s = p.strategy
    out = [f"the train DataLoader's batch_size is the micro-batch, {s.micro_batch_size}"]
    if s.engine == "fsdp2":
        out.append("in configure_model: `autotune.apply(self.model, json.load(open(LAYOUT)))` (the point's "
                   "fsdp2_configs/<k>.json: checkpointing, fully_shard per block and the root, its "
                   "MixedPrecisionPolicy); configure_optimizers returns the job's optimizer: "
                   "`autotune.models.fsdp2.make_optimizer(self.model, layout)`")
        if s.precision == "fp16":
            out.append("fp16: the layout computes in fp16; add a ShardedGradScaler in the training step")
        if s.expert_parallel_size > 1:
            clip = p.cfg.training.optimizer.gradient_clipping
            out.append(f"expert parallel {s.expert_parallel_size}: autotune.apply splits the experts itself; the "
                       "experts' and the dense parts' gradients sit on two meshes, which Lightning's "
                       "gradient_clip_val refuses, so clip in `configure_gradient_clipping` with "
                       f"`autotune.models.expert_parallel.clip_grad_norm(self.model, {clip})`" if clip else
                       f"expert parallel {s.expert_parallel_size}: autotune.apply splits the experts itself")
        if s.context_parallel_size > 1:
            out.append(f"context_parallel_size {s.context_parallel_size}: ModelParallelStrategy's mesh has no context-"
                       "parallel dimension (data and tensor parallel only) and its sampler gives every rank its own "
                       "batch, so Lightning cannot express it; use the FSDP2 snippet, torchtitan, accelerate or HF "
                       "Trainer for this point")
    else:
        out.append("the DeepSpeed config holds the optimizer (the job's): configure_optimizers returns nothing")
        if s.num_checkpointed(p.layers):
            out.append(f"checkpointing: call `{checkpointing_call(p.cfg, s)}` in configure_model")
    return out + long_context_lines(p, "lightning") + norm_kernel_line(p, "lightning")
