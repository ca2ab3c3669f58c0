"""Hugging Face Trainer files of a front point: ``TrainingArguments`` keyword arguments (JSON) and,
for a DeepSpeed point, its DeepSpeed config with ``"auto"`` wherever Trainer fills the value from
those arguments (transformers integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_process``:
micro-batch, accumulation, train batch, clipping, the optimizer's lr / betas / eps / weight decay,
fp16 / bf16), so its mismatch check has nothing to compare; for an fsdp2 point the FSDP arguments
(``fsdp`` and ``fsdp_config`` with version 2: transformers training_args.py ``_process_fsdp_args``)."""

from __future__ import annotations

import copy
from typing import Any, Optional

from autotune.model_rules import LIGER_KERNEL_CONFIG
from autotune.trainers.common import (WRAPPED_LAYER_NOTE, Point, all_layers, checkpointing_call, every_k_full,
                                      expert_parallel_line, long_context_lines, pinned_anyway_line, sp_attention)

AUTO = "auto"
_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
              "gradient_clipping")
"""Top-level DeepSpeed keys Trainer fills from TrainingArguments (trainer_config_process)."""
_AUTO_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
"""optimizer.params keys Trainer fills (learning_rate, adam_beta1/2, adam_epsilon, weight_decay)."""


def hf_deepspeed_config(p: Point) -> dict[str, Any]:
    """The point's DeepSpeed config as HF Trainer takes it: the values Trainer owns set to "auto"
    (the same values are in the TrainingArguments), everything else (ZeRO, offload, buckets, the
    optimizer type) as the point has it."""
    cfg = copy.deepcopy(p.ds_config)
    for key in _AUTO_KEYS:
        cfg[key] = AUTO
    params = cfg["optimizer"]["params"]
    for key in _AUTO_OPTIMIZER:
        if key in params:
            params[key] = AUTO
    for section in ("bf16", "fp16"):
        if section in cfg:
            cfg[section]["enabled"] = AUTO
    return cfg


def checkpointing_args(p: Point) -> tuple[dict[str, Any], Optional[str]]:
    """TrainingArguments for the point's checkpointing, or the model-side call when Trainer cannot
    express it. Trainer runs transformers' own ``activation_checkpointing_enable`` (``every_n_layers``:
    layers 0, n, 2n, ...; modeling_utils.py ``_set_gradient_checkpointing``) on Hugging Face models
    only, and whole layers only; FSDP2 points use FSDP's own (fsdp_config activation_checkpointing,
    every wrapped layer)."""
    s = p.strategy
    if s.num_checkpointed(p.layers) == 0:
        return {}, None
    if s.engine == "fsdp2":
        if s.checkpointing == "full" and all_layers(p):
            return {}, None  # fsdp_config["activation_checkpointing"]
        return {}, checkpointing_call(p.cfg, s)
    k = every_k_full(p)
    if p.hf_model and k is not None:
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if k > 1:
            kwargs["every_n_layers"] = k
        return {"activation_checkpointing": True, "activation_checkpointing_kwargs": kwargs}, None
    return {}, checkpointing_call(p.cfg, s)


def training_arguments(p: Point, ds_config_file: Optional[str]) -> dict[str, Any]:
    """``TrainingArguments(**this)`` for the point: batch, accumulation, the job's optimizer,
    clipping, precision, checkpointing where Trainer expresses it, and the engine (``deepspeed``:
    the "auto" config file; ``fsdp`` / ``fsdp_config`` for fsdp2). ``max_steps`` and
    ``output_dir`` are the user's; the learning rate is constant, as autotune measured it."""
    s, opt = p.strategy, p.cfg.training.optimizer
    args: dict[str, Any] = {
        "per_device_train_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": p.gas,
        "learning_rate": opt.lr,
        "weight_decay": opt.weight_decay,
        "max_grad_norm": opt.gradient_clipping,
        "lr_scheduler_type": "constant",
        "bf16": s.precision == "bf16",
        "fp16": s.precision == "fp16",
    }
    if opt.type in ("adam", "adamw"):
        args.update(adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_epsilon=opt.eps)
    ckpt, _ = checkpointing_args(p)
    args.update(ckpt)
    if p.cfg.model.rms_norm_kernel == "liger":  # Trainer applies it (transformers.integrations.liger)
        args.update(use_liger_kernel=True, liger_kernel_config=dict(LIGER_KERNEL_CONFIG))
    if s.engine == "fsdp2":
        # Trainer builds its own optimizer for FSDP (trainer_optimizer.py): torch AdamW / SGD
        if opt.type == "adamw":
            args["optim"] = "adamw_torch"
        elif opt.type == "sgd":
            args["optim"] = "sgd"
            args["optim_args"] = f"momentum={opt.momentum}"
        args["fsdp"] = True
        args["fsdp_config"] = fsdp_config(p)
    else:
        args["deepspeed"] = ds_config_file
    return args


def fsdp_config(p: Point) -> dict[str, Any]:
    """``TrainingArguments.fsdp_config`` of an fsdp2 point (transformers ``_process_fsdp_args``):
    FSDP2, the layers wrapped are the model's ``_no_split_modules`` (its decoder layer class, the
    unit autotune shards), resharding after forward as the point, CPU offload, and FSDP's activation
    checkpointing when every layer is fully checkpointed."""
    s = p.strategy
    out: dict[str, Any] = {"version": 2, "reshard_after_forward": s.reshard_after_forward,
                           "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                           "cpu_offload": s.offload_params == "cpu"}
    if s.checkpointing == "full" and all_layers(p):
        out["activation_checkpointing"] = True
    return out


def parallelism_config(p: Point) -> Optional[str]:
    """``TrainingArguments(parallelism_config=...)`` of a sequence- or context-parallel point, as
    code (an accelerate ``ParallelismConfig`` object, which JSON cannot carry; transformers
    trainer.py passes it to the Accelerator): Ulysses with ``sp_backend="deepspeed"``
    (accelerate/parallelism_config.py), context parallel with ``cp_size`` over a ``dp_shard x cp``
    mesh. None for other points."""
    s, hw = p.strategy, p.cfg.hardware
    if s.sequence_parallel_size > 1:
        dp = f", dp_shard_size={p.batch_ranks}" if p.batch_ranks > 1 else ""
        return (f"ParallelismConfig(sp_backend=\"deepspeed\", sp_size={s.sequence_parallel_size}{dp}, "
                f"sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length={p.cfg.training.seq_len}, "
                f"sp_attn_implementation={sp_attention(p)!r}))")
    if s.context_parallel_size > 1:
        hybrid = s.sharding == "hybrid"
        shard = (hw.gpus_per_node if hybrid else hw.num_gpus) // s.context_parallel_size
        rep = f"dp_replicate_size={hw.num_nodes}, " if hybrid else ""
        return f"ParallelismConfig({rep}dp_shard_size={shard}, cp_size={s.context_parallel_size}, cp_backend=\"torch\")"
    return None


def differences(p: Point) -> list[str]:
    """What of the point HF Trainer's files cannot carry, in words (each also in the point's README)."""
    s, opt = p.strategy, p.cfg.training.optimizer
    out = []
    _, call = checkpointing_args(p)
    if call:
        out.append(f"checkpointing: Trainer cannot express {s.checkpointing} on these layers; call `{call}` on the "
                   "model before `Trainer(model=model, ...)`")
    pc = parallelism_config(p)
    if pc:
        kind = "Ulysses" if s.sequence_parallel_size > 1 else "context parallel"
        out.append(f"{kind}: add `parallelism_config={pc}` to the TrainingArguments (from accelerate.utils; not "
                   "JSON, so not in the file)" + ("; Trainer then splits each batch (shift_labels, position_ids) "
                                                   "over the cp ranks itself" if s.context_parallel_size > 1 else ""))
    out += long_context_lines(p, "hf")
    out += expert_parallel_line(p) + pinned_anyway_line(p, "Trainer")
    if s.engine == "fsdp2":
        if not p.hf_model:
            out.append(WRAPPED_LAYER_NOTE)
        if s.precision in ("bf16", "fp16") and s.reduce_dtype == "fp32":
            out.append("FSDP2 gradient reduce dtype: Trainer's mixed precision reduces in the compute dtype "
                       f"({s.precision}); the point reduced in fp32 (less gradient memory in Trainer, not more)")
        if s.sharding == "hybrid":
            out.append("hybrid sharding: Trainer's fsdp_config has no replicate dimension; shard over all GPUs "
                       "or use accelerate's parallelism_config (dp_replicate_size)")
        if opt.type == "adam":
            out.append("optimizer Adam (L2 weight decay): Trainer has no torch.optim.Adam `optim`; override "
                       "Trainer.create_optimizer")
    return out
