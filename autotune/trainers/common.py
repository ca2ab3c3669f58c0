"""What every trainer's files of a front point share: the point's checkpointing as data, how a
trainer can (or cannot) express it, and the precision names each library uses. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from autotune.config import Config
from autotune.engine_configs import gradient_accumulation_steps
from autotune.strategy import Strategy, data_parallel_size


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
    def hf_model(self) -> bool:
        """The job trains a Hugging Face model (model.hf_config): transformers' own checkpointing applies."""
        return self.cfg.model.implementation == "hf"


def checkpointing_spec(p: Point) -> dict[str, Any]:
    """The point's checkpointing as ``autotune.apply_checkpointing(model, granularity, num_layers)``
    takes it (checkpointing.json; the example scripts read it)."""
    s = p.strategy
    n = s.num_checkpointed(p.layers)
    selection: Union[int, list[int]] = s.checkpoint_selection(p.layers)
    return {"granularity": s.checkpointing if n else "none", "num_layers": selection if n else 0,
            "of_layers": p.layers,
            "call": checkpointing_call(p.cfg, s)}


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
