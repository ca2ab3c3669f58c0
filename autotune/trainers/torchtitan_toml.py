"""torchtitan's TOML job file of an fsdp2 front point (``torchrun ... torchtitan/train.py
--job.config_file torchtitan.toml``), in torchtitan's JobConfig schema (torchtitan/config/job_config.py
of release 0.2.0, the last that reads TOML: 0.3 moved to Python config registries with the same
section and field names). torchtitan lays FSDP2 out as autotune does (``fully_shard`` per block and
the root, parallelize.py ``apply_fsdp``)."""

from __future__ import annotations

import json
from typing import Any, Optional

from autotune.trainers.common import Point, norm_kernel_line, pinned_anyway_line

TITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
"""autotune precision -> torchtitan ``mixed_precision_param`` (it has no fp16)."""
TITAN_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
"""torchtitan's optimizers (components/optimizer.py ``build_optimizers``); no SGD."""


def activation_checkpoint(p: Point) -> Optional[dict[str, Any]]:
    """torchtitan's ``[activation_checkpoint]`` for the point, None when it has no such mode:
    ``full`` (every block), ``selective`` with ``selective_ac_option = "k"`` (whole blocks k-1,
    2k-1, ...: distributed/activation_checkpoint.py ``_apply_layer_sac``) or ``"op"`` (op-level,
    every block)."""
    s = p.strategy
    n = s.num_checkpointed(p.layers)
    if n == 0:
        return {"mode": "none"}
    if s.checkpointing == "full" and s.checkpoint_every not in (None, 1):
        return {"mode": "selective", "selective_ac_option": str(s.checkpoint_every)}
    if s.checkpointing == "full" and n >= p.layers:
        return {"mode": "full"}
    if s.checkpointing == "op" and n >= p.layers:
        return {"mode": "selective", "selective_ac_option": "op"}
    return None


def torchtitan_sections(p: Point) -> dict[str, dict[str, Any]]:
    """The TOML's sections; what torchtitan cannot express gets its nearest setting and is listed
    by ``differences``."""
    s, hw, tr, opt = p.strategy, p.cfg.hardware, p.cfg.training, p.cfg.training.optimizer
    hybrid, cp = s.sharding == "hybrid", s.context_parallel_size
    ac = activation_checkpoint(p) or {"mode": "full"}  # the nearest that needs no more memory
    optimizer: dict[str, Any] = {"name": TITAN_OPTIMIZERS.get(opt.type, "AdamW"), "lr": opt.lr,
                                 "eps": opt.eps, "weight_decay": opt.weight_decay, "implementation": "foreach"}
    optimizer.update(beta1=opt.betas[0], beta2=opt.betas[1])
    parallelism = {"data_parallel_replicate_degree": hw.num_nodes if hybrid else 1,
                   "data_parallel_shard_degree": (hw.gpus_per_node if hybrid else hw.num_gpus) // cp,
                   "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "context_parallel_degree": cp,
                   "fsdp_reshard_after_forward": "always" if s.reshard_after_forward else "never"}
    if s.expert_parallel_size > 1:  # JobConfig Parallelism.expert_parallel_degree: ep borrows dp_shard ranks
        parallelism["expert_parallel_degree"] = s.expert_parallel_size
    return {
        "job": {"description": f"autotune front point: {s.describe(p.layers)}"},
        "training": {"local_batch_size": s.micro_batch_size, "global_batch_size": tr.global_batch_size,
                     "seq_len": tr.seq_len, "max_norm": opt.gradient_clipping,
                     "enable_cpu_offload": s.offload_params == "cpu",
                     "mixed_precision_param": TITAN_DTYPES.get(s.precision, "bfloat16"),
                     "mixed_precision_reduce": "float32"},
        "optimizer": optimizer,
        # torchtitan's mesh: dp_replicate x dp_shard x cp, FSDP over dp_shard x cp (parallel_dims.py)
        "parallelism": parallelism,
        "activation_checkpoint": ac,
    }


def differences(p: Point) -> list[str]:
    """What of the point torchtitan's TOML cannot carry."""
    s, opt = p.strategy, p.cfg.training.optimizer
    out = []
    if activation_checkpoint(p) is None:
        out.append(f"checkpointing {s.checkpointing} on {s.num_checkpointed(p.layers)} of {p.layers} blocks: torchtitan "
                   "has no such mode; the file says full (more recompute, less memory)")
    if s.precision == "fp16":
        out.append("fp16: torchtitan computes in bf16 or fp32; the file says bfloat16")
    if s.precision != "fp32" and s.reduce_dtype != "fp32":
        out.append(f"reduce dtype {s.reduce_dtype}: torchtitan reduces in float32 (more gradient memory than measured)")
    if opt.type not in TITAN_OPTIMIZERS:
        out.append(f"optimizer {opt.type}: torchtitan builds Adam or AdamW only; the file says AdamW")
    for knob, on in (("tiled_loss", s.tiled_loss), ("tiled_mlp", s.tiled_mlp),
                     ("activation_offload", s.activation_offload != "none")):
        if on:
            out.append(f"{knob}: torchtitan 0.2 has no such setting (its own model, not Hugging Face's): the file "
                       "runs without it (more activation memory than the point)")
    return out + norm_kernel_line(p, "torchtitan") + pinned_anyway_line(p, "torchtitan")


YOURS = "[model] (name, flavor, hf_assets_path), the dataset and the step count are yours: add them"
"""What the TOML leaves to the user (torchtitan builds its own model and data loader)."""


def toml_text(sections: dict[str, dict[str, Any]], header: list[str]) -> str:
    """TOML of flat sections (strings, numbers, booleans), ``header`` as leading comments."""
    lines = [f"# {h}" for h in header]
    for name, body in sections.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a TOML basic string
