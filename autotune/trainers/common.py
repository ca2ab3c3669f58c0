"""What every trainer's files of a front point share: the point's checkpointing as data, how a
trainer can (or cannot) express it, and the precision names each library uses. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from autotune.config import Config
from autotune.engine_configs import gradient_accumulation_steps, long_context_knobs
from autotune.model_rules import LIGER_KERNEL_CONFIG
from autotune.strategy import Strategy, batch_ranks, data_parallel_size


@dataclass(frozen=True)
class Point:
    """One front point as the trainer writers read it."""

    cfg: Config
    strategy: Strategy
    ds_config: Optional[dict[str, Any]]
    """The point's DeepSpeed config (to_deepspeed_config; None for an fsdp2 point)."""
    ds_config_path: Optional[str]
    """Absolute path of that config in the run directory (None for an fsdp2 point)."""
    layout_path: Optional[str] = None
    """Absolute path of the fsdp2 point's layout (fsdp2_configs/<k>.json; None for DeepSpeed)."""
    folder: str = ""
    """Absolute path of the point's trainers/<k> folder (where its files are written)."""

    @property
    def layers(self) -> int:
        return self.cfg.model.num_hidden_layers

    @property
    def gas(self) -> int:
        return gradient_accumulation_steps(self.strategy, self.cfg.training, self.cfg.hardware)

    @property
    def world(self) -> int:
        return data_parallel_size(self.cfg.hardware)

    @property
    def batch_ranks(self) -> int:
        """The ranks that take their own micro-batches: GPUs / (sequence x context parallel)."""
        return batch_ranks(self.cfg.hardware, self.strategy)

    @property
    def hf_model(self) -> bool:
        """The job trains a Hugging Face model (model.hf_config): transformers' own checkpointing applies."""
        return self.cfg.model.implementation == "hf"


def checkpointing_spec(p: Point) -> dict[str, Any]:
    """The point's checkpointing as ``autotune.apply_checkpointing(model, granularity, num_layers)``
    takes it (checkpointing.json; the example scripts read it), and under ``long_context`` the
    point's long-context knobs (long_context_spec) when it has any."""
    s = p.strategy
    n = s.num_checkpointed(p.layers)
    selection: Union[int, list[int]] = s.checkpoint_selection(p.layers)
    out: dict[str, Any] = {"granularity": s.checkpointing if n else "none", "num_layers": selection if n else 0,
                           "of_layers": p.layers,
                           "call": checkpointing_call(p.cfg, s)}
    spec = long_context_spec(p)
    if spec:
        out["long_context"] = spec
    return out


LONG_CONTEXT = "autotune.models.long_context"
"""The module of the model-side long-context calls (Ulysses, tiled loss and MLP, activation offload)."""


def long_context_spec(p: Point) -> Optional[dict[str, Any]]:
    """What ``autotune.models.long_context.apply_long_context(model, strategy, seq_length)`` takes
    for the point: its ``strategy`` (``Strategy.as_dict``; autotune.examples.train_deepspeed rebuilds it
    with ``autotune.Strategy(**strategy)``) and the global sequence, with the ``knobs`` that are not
    at their defaults and the ``call`` in words; None when the point has none of them."""
    s = p.strategy
    knobs = long_context_knobs(s)
    if not knobs:
        return None
    return {"knobs": knobs, "strategy": s.as_dict(), "seq_length": p.cfg.training.seq_len,
            "call": long_context_call(p)}


def model_side_long_context(s: Strategy) -> bool:
    """The strategy asks for a model-side long-context call (Ulysses, tiling, offload; context
    parallel is the FSDP2 engine's own, in its snippet)."""
    return s.sequence_parallel_size > 1 or s.tiled_loss or s.tiled_mlp or s.activation_offload != "none"


def long_context_call(p: Point) -> str:
    """The model-side call of the point's long-context knobs, before the engine is built, as code
    ("none" without them): ``apply_long_context`` with the knobs as an ``autotune.Strategy``; under
    Ulysses its mpu goes to ``deepspeed.initialize`` and every batch through ``shard_batch``."""
    s = p.strategy
    if not model_side_long_context(s):
        return "none"
    knobs = ["engine='fsdp2'"] if s.engine == "fsdp2" else ([f"zero_stage={s.zero_stage}"] if s.zero_stage else [])
    knobs += [f"{k}={v!r}" for k, v in long_context_knobs(s).items() if k != "context_parallel_size"]
    if s.activation_offload != "none":
        knobs.append("checkpointing='full'")
        if not s.pin_memory:
            knobs.append("pin_memory=False")
    if s.sequence_parallel_size > 1:
        knobs.append(f"micro_batch_size={s.micro_batch_size}")
    # the accumulation steps: the tiled loss back-propagates its head inside the forward, scaled by them
    gas = f", gradient_accumulation_steps={p.gas}" if p.gas > 1 else ""
    call = (f"mpu = {LONG_CONTEXT}.apply_long_context(model, autotune.Strategy({', '.join(knobs)}), "
            f"seq_length={p.cfg.training.seq_len}{gas})")
    if s.sequence_parallel_size > 1:
        call += f"; deepspeed.initialize(..., mpu=mpu); batch = {LONG_CONTEXT}.shard_batch(batch, mpu)"
    return call


def sp_attention(p: Point) -> str:
    """The attention implementation Ulysses wraps (the model's; DeepSpeed refuses eager)."""
    impl = p.cfg.model.attn_implementation
    return impl if impl in ("sdpa", "flash_attention_2", "flash_attention_3") else "sdpa"


def long_context_lines(p: Point, trainer: str) -> list[str]:
    """What a trainer's script adds for the point's long-context knobs, one line each (the README's
    and each trainer's ``differences``): ``trainer`` is hf, accelerate or lightning; the plain
    DeepSpeed script and the FSDP2 snippet apply them themselves."""
    s = p.strategy
    out = []
    if s.engine == "deepspeed" and s.sequence_parallel_size > 1:
        if trainer == "lightning":
            out.append(f"sequence_parallel_size {s.sequence_parallel_size}: Lightning's DeepSpeedStrategy takes no "
                       "mpu, so it cannot run DeepSpeed Ulysses; use the plain DeepSpeed script, HF Trainer or "
                       "accelerate for this point")
        else:
            out.append("the Hugging Face model only (DeepSpeed's UlyssesSPAttentionHF): Ulysses is accelerate's "
                       "ParallelismConfig(sp_backend=\"deepspeed\", sp_size=...), which registers the attention, "
                       "wraps the DataLoader (UlyssesSPDataLoaderAdapter) and passes the mpu to DeepSpeed")
    if s.tiled_mlp:
        out.append(f"tiled MLP: call `{LONG_CONTEXT}.tile_mlp(model)` before the engine is built")
    if s.tiled_loss:
        if trainer == "lightning" and s.engine == "deepspeed":
            out.append(f"tiled loss: in training_step `loss = {LONG_CONTEXT}.causal_lm_loss(self.model, batch, "
                       "tiled=True)[0]` (a Hugging Face causal LM)")
        else:
            sp = s.sequence_parallel_size > 1 and trainer == "accelerate"
            mpu = ("mpu=deepspeed.runtime.sequence_parallel.parallel_state_sp, " if sp else "")
            out.append(f"tiled loss: call `{LONG_CONTEXT}.use_long_context_loss(model, {mpu}tiled=True"
                       f"{_loss_scale_args(p, sp)})` before "
                       "the engine is built (model(**batch).loss is then computed in sequence tiles"
                       + ("; Trainer averages the SP ranks' losses itself)" if trainer == "hf" and
                          s.sequence_parallel_size > 1 else ")"))
    elif s.sequence_parallel_size > 1 and trainer == "accelerate":
        out.append(f"the loss: each rank's covers its shard; average over the SP group with "
                   f"`{LONG_CONTEXT}.use_long_context_loss(model, mpu=deepspeed.runtime.sequence_parallel."
                   "parallel_state_sp)` before `accelerator.prepare`")
    if s.activation_offload != "none":
        pin = "" if s.pin_memory else ", pin_memory=False"
        out.append(f"activation offload: call `{LONG_CONTEXT}.offload_in_forward(model{pin})` (checkpointed block "
                   "inputs kept in host memory) after the checkpointing call")
    return out


def norm_kernel_line(p: Point, trainer: str) -> list[str]:
    """The job's ``model.rms_norm_kernel: liger`` where the trainer's files cannot carry it (HF Trainer's do:
    ``use_liger_kernel``); ``trainer``: accelerate, lightning or torchtitan."""
    if p.cfg.model.rms_norm_kernel != "liger":
        return []
    if trainer == "torchtitan":
        return ["model.rms_norm_kernel liger: torchtitan builds its own model with torch's RMSNorm, which holds "
                "more activation memory in backward than the Liger norm the point was sized with"]
    return [f"Liger's RMSNorm (model.rms_norm_kernel liger): call `transformers.integrations.liger.apply_liger_kernel("
            f"model, {LIGER_KERNEL_CONFIG})` (pip install liger-kernel) before the engine is built"]


def expert_parallel_line(p: Point) -> list[str]:
    """HF Trainer's and accelerate's line for an expert-parallel point: neither can express it."""
    ep = p.strategy.expert_parallel_size
    if ep == 1:
        return []
    return [f"expert_parallel_size {ep}: neither the FSDP settings nor accelerate's ParallelismConfig (dp_replicate, "
            "dp_shard, tp, cp, sp) has an expert dimension, so this point cannot be expressed here; use torchtitan.toml "
            "(expert_parallel_degree), the FSDP2 launch line (autotune.examples.train_fsdp2), the snippet or Lightning"]


def pinned_anyway_line(p: Point, trainer: str) -> list[str]:
    """An FSDP2 offload point with pin_memory false, for a trainer whose FSDP2 offload always pins
    (CPUOffloadPolicy()'s default: HF Trainer and accelerate through accelerate's plugin, torchtitan's
    fsdp_cpu_offload)."""
    s = p.strategy
    if s.engine != "fsdp2" or s.offload_params != "cpu" or s.pin_memory:
        return []
    return [f"pin_memory false: {trainer}'s FSDP2 CPU offload pins the shards (CPUOffloadPolicy's default), so "
            "host RAM is what `autotune estimate --pin-memory true` gives; for pageable shards use the FSDP2 "
            "launch line, the snippet or Lightning"]


def _loss_scale_args(p: Point, with_mpu: bool) -> str:
    """The keyword arguments ``use_long_context_loss`` needs to scale the tiled head's gradient as the
    engine does (the ZeRO stage when an mpu is passed: ZeRO-3's Ulysses seed scale; the accumulation
    steps: the head's backward runs inside the forward); "" when both are the defaults."""
    s = p.strategy
    args = [f", zero_stage={s.zero_stage}"] if with_mpu and s.engine == "deepspeed" and s.zero_stage == 3 else []
    return "".join(args + ([f", gradient_accumulation_steps={p.gas}"] if p.gas > 1 else []))


def checkpointing_call(cfg: Config, s: Strategy) -> str:
    """The model-side call that reproduces the strategy's activation checkpointing (no engine config
    carries it): "none", transformers' own for a fully checkpointed Hugging Face model, else
    ``autotune.apply_checkpointing``."""
    n = s.num_checkpointed(cfg.model.num_hidden_layers)
    if n == 0:
        return "none"
    if cfg.model.implementation == "hf" and s.checkpointing == "full" and n >= cfg.model.num_hidden_layers:
        return 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    return (f"autotune.apply_checkpointing(model, {s.checkpointing!r}, "
            f"num_layers={s.checkpoint_selection(cfg.model.num_hidden_layers)})")


def every_k_full(p: Point) -> Optional[int]:
    """k when the point checkpoints whole blocks on every layer (k = 1) or every k-th one with k
    dividing the layer count (then "every k-th" means the same number of blocks in every library);
    None otherwise."""
    s = p.strategy
    if s.checkpointing != "full":
        return None
    if s.checkpoint_every is not None:
        return s.checkpoint_every if p.layers % s.checkpoint_every == 0 else None
    return 1 if s.num_checkpointed(p.layers) >= p.layers else None


def all_layers(p: Point) -> bool:
    """Every block is checkpointed (at the point's granularity)."""
    return p.strategy.num_checkpointed(p.layers) >= p.layers


WRAPPED_LAYER_NOTE = ("the layers FSDP2 shards are the model's `_no_split_modules` (every transformers model names "
                      "its decoder layer there); for a model without it name the block class "
                      "(`transformer_layer_cls_to_wrap` / `fsdp_transformer_layer_cls_to_wrap`)")
"""How the files name the wrapped layer (HF Trainer and accelerate fall back to _no_split_modules)."""


def mixed_precision(s: Strategy) -> str:
    """accelerate's ``mixed_precision`` name of the point's precision."""
    return {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[s.precision]
