"""One training strategy value, its validity rules and its DeepSpeed / FSDP translations.

The knob list is defined once, here: the fields of ``Strategy`` (their ``Literal`` types give the
choices). ``KNOBS`` (what a search space varies and what trials.csv and ``compare`` carry) and the
CLI's strategy flags are read off the fields' metadata; ``knob_applies`` says whether a knob has
an effect for a given ZeRO stage and checkpointing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, get_args

from autotune.spec import HardwareSpec, ModelSpec, Precision, TrainingSpec

ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu", "nvme"]
Checkpointing = Literal["none", "selective", "attention", "mlp", "op", "full"]

ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
CHECKPOINTINGS: tuple[Checkpointing, ...] = get_args(Checkpointing)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)

FSDP_SHARDING = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""ZeRO stage -> closest FSDP ShardingStrategy (the seed's table; FSDP has no optimizer-only mode)."""


def _knob(default: Any, *, search_order: Optional[int], flag: bool,
          int_range: Optional[tuple[int, Optional[int]]] = None, buffer: bool = False) -> Any:
    """A Strategy field. ``search_order``: its place in KNOBS (the order Optuna is asked and the
    trials.csv columns; None: not searched). ``flag``: ``autotune estimate`` has a ``--flag`` for it.
    ``int_range``: (low, high) an integer knob accepts in a job file (high None: no bound).
    ``buffer``: a DeepSpeed buffer size (None: autotune's choice, see default_buckets)."""
    return dataclasses.field(default=default, metadata={"search_order": search_order, "flag": flag,
                                                        "int_range": int_range, "buffer": buffer})


@dataclass(frozen=True)
class Strategy:
    """How one training job is laid out on the GPUs."""

    zero_stage: ZeroStage = _knob(0, search_order=0, flag=True)
    """ZeRO stage 0-3 (0 = plain data parallel)."""
    micro_batch_size: int = _knob(1, search_order=3, flag=True, int_range=(1, 1 << 20))
    """Sequences per GPU per forward/backward."""
    checkpointing: Checkpointing = _knob("none", search_order=4, flag=True)
    """Activation checkpointing granularity: selective = attention core recomputed
    (Korthikanti et al. 2022 sec. 5); attention / mlp = that module of the block recomputed, the
    other kept (module-level selective recompute, the norms stay outside); op = torchtitan's
    op-level selective checkpointing of the block (attention outputs and every other matmul
    output kept, the rest recomputed); full = whole block recomputed."""
    checkpoint_layers: Optional[int] = _knob(None, search_order=5, flag=True, int_range=(0, 10_000))
    """Number of blocks checkpointed, 0..num_layers (None: all of them when checkpointing != none)."""
    offload_optimizer: Offload = _knob("none", search_order=1, flag=True)
    """Where optimizer states and fp32 master weights live (ZeRO >= 1)."""
    offload_params: Offload = _knob("none", search_order=2, flag=True)
    """Where the sharded 16-bit parameters live between uses (ZeRO-3 only)."""
    precision: Precision = _knob("bf16", search_order=6, flag=True)
    """Compute precision; fp16 adds dynamic loss scaling."""
    reduce_bucket_size: Optional[int] = _knob(None, search_order=7, flag=False, int_range=(1, None), buffer=True)
    """Elements per gradient reduce bucket (None: autotune's choice, see default_buckets)."""
    allgather_bucket_size: Optional[int] = _knob(None, search_order=8, flag=False, int_range=(1, None), buffer=True)
    """ZeRO-1/2: elements per parameter all-gather bucket (None: autotune's choice)."""
    prefetch_bucket_size: Optional[int] = _knob(None, search_order=9, flag=False, int_range=(1, None), buffer=True)
    """ZeRO-3: elements prefetched ahead of use (None: autotune's choice)."""
    param_persistence_threshold: Optional[int] = _knob(None, search_order=None, flag=False,
                                                     int_range=(0, None), buffer=True)
    """ZeRO-3: parameters smaller than this stay unpartitioned (None: autotune's choice)."""

    def num_checkpointed(self, num_layers: int) -> int:
        if self.checkpointing == "none":
            return 0
        return num_layers if self.checkpoint_layers is None else self.checkpoint_layers

    def replace(self, **changes: Any) -> "Strategy":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> tuple:
        """Hashable identity used to detect repeated candidates (field values in order)."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    def describe(self, num_layers: Optional[int] = None) -> str:
        """The strategy in words, e.g. ``ZeRO-3, optimizer->cpu, mbs 4, full ckpt 32/32, bf16``."""
        parts = [f"ZeRO-{self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        parts.append(f"mbs {self.micro_batch_size}")
        if self.checkpointing == "none":
            parts.append("no ckpt")
        else:
            n = self.num_checkpointed(num_layers) if num_layers else self.checkpoint_layers
            of = f" {n}/{num_layers}" if num_layers else (f" {n}" if n is not None else "")
            parts.append(f"{self.checkpointing} ckpt{of}")
        parts.append(self.precision)
        for name, short in (("reduce_bucket_size", "reduce bucket"), ("allgather_bucket_size", "allgather bucket"),
                            ("prefetch_bucket_size", "prefetch bucket"),
                            ("param_persistence_threshold", "persistence threshold")):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{short} {value:.0e}".replace("e+0", "e"))
        return ", ".join(parts)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Strategy))

KNOBS: tuple[str, ...] = tuple(f.name for f in sorted(
    (f for f in dataclasses.fields(Strategy) if f.metadata["search_order"] is not None),
    key=lambda f: f.metadata["search_order"]))
"""The knobs a search space varies, in the order they are suggested to Optuna; also the strategy
columns of trials.csv and the fields that identify a point across runs."""

FLAG_KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Strategy) if f.metadata["flag"])
"""The knobs ``autotune estimate`` takes as ``--flags`` (field order)."""

BUCKET_KNOBS: tuple[str, ...] = tuple(k for k in KNOBS if Strategy.__dataclass_fields__[k].metadata["buffer"])
"""The searched DeepSpeed buffer sizes (KNOBS order)."""


def knob_choices(knob: str) -> Optional[tuple[Any, ...]]:
    """The fixed values of a knob with a ``Literal`` type (None for integers)."""
    return _CHOICES[knob]


def _literal_choices() -> dict[str, Optional[tuple[Any, ...]]]:
    import typing

    hints = typing.get_type_hints(Strategy)
    return {name: get_args(hint) if typing.get_origin(hint) is Literal else None for name, hint in hints.items()}


_CHOICES = _literal_choices()


def knob_applies(knob: str, strategy: "Strategy | Mapping[str, Any]") -> bool:
    """Whether ``knob`` has an effect on ``strategy`` (a Strategy, or a mapping holding at least its
    ``zero_stage`` and ``checkpointing``): checkpoint_layers only with checkpointing on; each bucket
    knob only at the ZeRO stages whose DeepSpeed config carries it (see to_deepspeed_config)."""
    get = (lambda k: getattr(strategy, k)) if isinstance(strategy, Strategy) else strategy.get
    if knob == "checkpoint_layers":
        return get("checkpointing") != "none"
    if knob == "reduce_bucket_size":
        return get("zero_stage") >= 1
    if knob == "allgather_bucket_size":
        return get("zero_stage") in (1, 2)
    if knob in ("prefetch_bucket_size", "param_persistence_threshold"):
        return get("zero_stage") == 3
    return True


def strategy_from_dict(values: Mapping[str, Any]) -> "Strategy":
    """A Strategy from a mapping that may carry other keys (front.json points, measured rows)."""
    return Strategy(**{k: v for k, v in values.items() if k in _FIELD_NAMES})


def data_parallel_size(hardware: HardwareSpec) -> int:
    """Every GPU is a data-parallel rank (autotune does not search tensor/pipeline parallelism)."""
    return hardware.num_gpus


def gradient_accumulation_steps(strategy: Strategy, training: TrainingSpec, hardware: HardwareSpec) -> int:
    """global batch / (micro batch x data-parallel size); callers check divisibility with validate()."""
    return max(1, training.global_batch_size // (strategy.micro_batch_size * data_parallel_size(hardware)))


def validation_errors(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> list[tuple[str, str]]:
    """Rules a strategy must satisfy to be runnable at all, as (strategy key, message) pairs."""
    errors: list[tuple[str, str]] = []
    s = strategy
    if s.zero_stage not in ZERO_STAGES:
        errors.append(("zero_stage", f"zero_stage must be one of 0-3, but got {s.zero_stage}"))
    if s.micro_batch_size < 1:
        errors.append(("micro_batch_size", f"micro_batch_size must be >= 1, but got {s.micro_batch_size}"))
    else:
        per_step = s.micro_batch_size * data_parallel_size(hardware)
        if training.global_batch_size % per_step:
            errors.append(("micro_batch_size",
                f"micro_batch_size x data-parallel size must divide global_batch_size, but got "
                f"{s.micro_batch_size} x {data_parallel_size(hardware)} = {per_step} for {training.global_batch_size}"
            ))
    if s.offload_params != "none" and s.zero_stage != 3:
        errors.append(("offload_params",
                       f"offload_params={s.offload_params} requires zero_stage 3, but got zero_stage {s.zero_stage}"))
    if s.offload_optimizer != "none" and s.zero_stage == 0:
        errors.append(("offload_optimizer", f"offload_optimizer={s.offload_optimizer} requires zero_stage >= 1, but got 0"))
    for key in ("offload_optimizer", "offload_params"):
        if getattr(s, key) == "nvme" and hardware.nvme is None:
            errors.append((key, f"{key}=nvme requires hardware.nvme, but none is configured"))
    if s.checkpoint_layers is not None and not 0 <= s.checkpoint_layers <= model.num_hidden_layers:
        errors.append(("checkpoint_layers",
                       f"checkpoint_layers must be in 0..{model.num_hidden_layers}, but got {s.checkpoint_layers}"))
    if s.checkpointing == "selective" and model.implementation == "hf" and s.num_checkpointed(model.num_hidden_layers):
        errors.append(("checkpointing", "checkpointing=selective (attention core recomputed) is not available for "
                       "Hugging Face models, which checkpoint whole layers; use full or none"))
    if s.precision == "bf16" and hardware.gpu.peak_tflops_bf16 <= 0:
        errors.append(("precision", f"precision bf16 is not supported by {hardware.gpu.name}"))
    return errors


def validate(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> list[str]:
    """Rules a strategy must satisfy to be runnable at all; returns the broken ones in words."""
    return [message for _, message in validation_errors(strategy, model, training, hardware)]


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


def to_deepspeed_config(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> dict[str, Any]:
    """The exact DeepSpeed config JSON object for this strategy (parsed by DeepSpeedConfig in tests)."""
    s = strategy
    gas = gradient_accumulation_steps(s, training, hardware)
    cfg: dict[str, Any] = {
        "train_batch_size": s.micro_batch_size * gas * data_parallel_size(hardware),
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": {
            "type": "AdamW" if training.optimizer == "adamw" else "Adam",
            "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
    }
    if s.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif s.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    buckets = default_buckets(model, s)
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.zero_stage in (1, 2):
        zero.update(
            overlap_comm=True, contiguous_gradients=True, reduce_scatter=True, allgather_partitions=True,
            reduce_bucket_size=buckets["reduce_bucket_size"], allgather_bucket_size=buckets["allgather_bucket_size"],
        )
    elif s.zero_stage == 3:
        zero.update(
            overlap_comm=True, contiguous_gradients=True, sub_group_size=int(1e9),
            reduce_bucket_size=buckets["reduce_bucket_size"],
            stage3_prefetch_bucket_size=buckets["prefetch_bucket_size"],
            stage3_param_persistence_threshold=buckets["param_persistence_threshold"],
            stage3_max_live_parameters=int(1e9), stage3_max_reuse_distance=int(1e9),
            stage3_gather_16bit_weights_on_model_save=True,
        )
    nvme_path = hardware.nvme.path if hardware.nvme else "/local_nvme"
    if s.offload_optimizer != "none":
        off: dict[str, Any] = {"device": s.offload_optimizer, "pin_memory": True}
        if s.offload_optimizer == "nvme":
            off.update(nvme_path=nvme_path, buffer_count=4, fast_init=False)
        zero["offload_optimizer"] = off
    if s.offload_params != "none":
        offp: dict[str, Any] = {"device": s.offload_params, "pin_memory": True}
        if s.offload_params == "nvme":
            offp.update(nvme_path=nvme_path, buffer_count=5, buffer_size=int(1e8), max_in_cpu=int(1e9))
        zero["offload_param"] = offp
    cfg["zero_optimization"] = zero
    if "nvme" in (s.offload_optimizer, s.offload_params):
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                      "single_submit": False, "overlap_events": True}
    n_ckpt = s.num_checkpointed(model.num_hidden_layers)
    if n_ckpt:
        # Consumed by deepspeed.checkpointing users; autotune's worker applies torch.utils.checkpoint
        # (non-reentrant) to the first `number_checkpoints` blocks at the chosen granularity.
        cfg["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False,
            "contiguous_memory_optimization": False, "number_checkpoints": n_ckpt,
            "synchronize_checkpoint_boundary": False, "profile": False,
        }
    return cfg


def fsdp_equivalent(strategy: Strategy, hardware: HardwareSpec) -> dict[str, Any]:
    """The same strategy in PyTorch FSDP terms, for users who train with FSDP."""
    out: dict[str, Any] = {
        "sharding_strategy": FSDP_SHARDING[strategy.zero_stage],
        "cpu_offload": strategy.offload_params == "cpu" or strategy.offload_optimizer == "cpu",
        "activation_checkpointing": strategy.checkpointing,
    }
    if strategy.zero_stage == 3 and hardware.num_nodes > 1:
        out["alternative"] = "HYBRID_SHARD (shard within a node, replicate across nodes)"
    if "nvme" in (strategy.offload_params, strategy.offload_optimizer):
        out["note"] = "FSDP has no NVMe offload; use DeepSpeed ZeRO-Infinity for this point"
    return out
