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

Engine = Literal["deepspeed", "fsdp2"]
ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu", "nvme"]
Checkpointing = Literal["none", "selective", "attention", "mlp", "op", "full"]
Sharding = Literal["full", "hybrid"]
ReduceDtype = Literal["fp32", "bf16"]

ENGINES: tuple[Engine, ...] = get_args(Engine)
ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
CHECKPOINTINGS: tuple[Checkpointing, ...] = get_args(Checkpointing)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)
REDUCE_DTYPES: tuple[ReduceDtype, ...] = get_args(ReduceDtype)

FSDP_SHARDING: dict[int, Optional[str]] = {0: "NO_SHARD", 1: None, 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
"""ZeRO stage -> the FSDP ShardingStrategy that shards the same states (torch/distributed/fsdp/api.py
ShardingStrategy). ZeRO-1 has none: FSDP cannot shard optimizer states alone (SHARD_GRAD_OP also shards
gradients, as ZeRO-2 does; NO_SHARD shards nothing)."""
FSDP_NO_EQUIVALENT = "none: FSDP has no optimizer-state-only sharding (ZeRO-1)"
"""What ``fsdp_equivalent`` says where FSDP_SHARDING has no equivalent."""


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

    engine: Engine = _knob("deepspeed", search_order=0, flag=True)
    """Training engine: deepspeed (ZeRO stages 0-3) or fsdp2 (PyTorch ``fully_shard`` on every
    decoder layer plus the root; parameters, gradients and optimizer states always sharded)."""
    zero_stage: ZeroStage = _knob(0, search_order=1, flag=True)
    """ZeRO stage 0-3 (0 = plain data parallel). deepspeed only (fsdp2: always 3, fully sharded)."""
    micro_batch_size: int = _knob(1, search_order=4, flag=True, int_range=(1, 1 << 20))
    """Sequences per GPU per forward/backward."""
    checkpointing: Checkpointing = _knob("none", search_order=5, flag=True)
    """Activation checkpointing granularity: selective = attention core recomputed
    (Korthikanti et al. 2022 sec. 5); attention / mlp = that module of the block recomputed, the
    other kept (module-level selective recompute, the norms stay outside); op = torchtitan's
    op-level selective checkpointing of the block (attention outputs and every other matmul
    output kept, the rest recomputed); full = whole block recomputed."""
    checkpoint_every: Optional[int] = _knob(None, search_order=6, flag=True, int_range=(1, 10_000))
    """Checkpoint every k-th block (blocks k-1, 2k-1, ...; torchtitan's layer-frequency selective
    option), L // k blocks in all; None: the first ``checkpoint_layers`` blocks instead."""
    checkpoint_layers: Optional[int] = _knob(None, search_order=7, flag=True, int_range=(0, 10_000))
    """Number of blocks checkpointed, the first ones, 0..num_layers (None: all of them when
    checkpointing != none). Not with checkpoint_every."""
    offload_optimizer: Offload = _knob("none", search_order=2, flag=True)
    """Where optimizer states and fp32 master weights live (deepspeed, ZeRO >= 1; fsdp2: follows
    offload_params, as CPUOffloadPolicy moves both)."""
    offload_params: Offload = _knob("none", search_order=3, flag=True)
    """Where the sharded parameters live between uses (deepspeed: ZeRO-3 only; fsdp2: cpu =
    ``CPUOffloadPolicy``, sharded parameters, gradients and the optimizer step on the host)."""
    precision: Precision = _knob("bf16", search_order=8, flag=True)
    """Compute precision; fp16 adds dynamic loss scaling (fsdp2: ``MixedPrecisionPolicy.param_dtype``;
    the sharded parameters stay fp32)."""
    reshard_after_forward: Literal[True, False] = _knob(True, search_order=9, flag=True)
    """fsdp2: free each layer's unsharded parameters after its forward and all-gather them again for
    its backward (ZeRO-3-like); False keeps them from forward to backward (ZeRO-2-like)."""
    sharding: Sharding = _knob("full", search_order=10, flag=True)
    """fsdp2: full = shard over every GPU; hybrid = shard within a node and replicate across nodes
    (HSDP, a 2-D device mesh; needs more than one node)."""
    reduce_dtype: ReduceDtype = _knob("fp32", search_order=11, flag=True)
    """fsdp2: dtype of the gradient reduce-scatter (``MixedPrecisionPolicy.reduce_dtype``)."""
    reduce_bucket_size: Optional[int] = _knob(None, search_order=12, flag=False, int_range=(1, None), buffer=True)
    """Elements per gradient reduce bucket (None: autotune's choice, see default_buckets)."""
    allgather_bucket_size: Optional[int] = _knob(None, search_order=13, flag=False, int_range=(1, None), buffer=True)
    """ZeRO-1/2: elements per parameter all-gather bucket (None: autotune's choice)."""
    prefetch_bucket_size: Optional[int] = _knob(None, search_order=14, flag=False, int_range=(1, None), buffer=True)
    """ZeRO-3: elements prefetched ahead of use (None: autotune's choice)."""
    param_persistence_threshold: Optional[int] = _knob(None, search_order=None, flag=False,
                                                     int_range=(0, None), buffer=True)
    """ZeRO-3: parameters smaller than this stay unpartitioned (None: autotune's choice)."""

    def __post_init__(self) -> None:
        # knobs that do not apply to the engine take one fixed value, so a strategy has one
        # identity (``key``) whatever the caller passed for them
        if self.engine == "fsdp2":
            fixed: dict[str, Any] = {"zero_stage": 3, "offload_optimizer": self.offload_params,
                                     **{k: None for k in _DEEPSPEED_BUFFERS}}
        else:
            fixed = {k: _DEFAULTS[k] for k in _FSDP2_ONLY}
        for name, value in fixed.items():
            object.__setattr__(self, name, value)

    def num_checkpointed(self, num_layers: int) -> int:
        if self.checkpointing == "none":
            return 0
        if self.checkpoint_every is not None:
            return num_layers // self.checkpoint_every
        return num_layers if self.checkpoint_layers is None else self.checkpoint_layers

    def checkpointed_blocks(self, num_layers: int) -> list[int]:
        """Indices of the checkpointed blocks: every k-th (k-1, 2k-1, ...) or the first n."""
        if self.checkpointing == "none":
            return []
        if self.checkpoint_every is not None:
            k = self.checkpoint_every
            return list(range(k - 1, num_layers, k))
        return list(range(min(num_layers, self.num_checkpointed(num_layers))))

    def checkpoint_selection(self, num_layers: int) -> "int | list[int]":
        """Which blocks to checkpoint, as autotune.checkpointing.apply_checkpointing takes it: the
        number of first blocks, or (checkpoint_every) the list of block indices."""
        if self.checkpoint_every is not None and self.checkpointing != "none":
            return self.checkpointed_blocks(num_layers)
        return self.num_checkpointed(num_layers)

    def replace(self, **changes: Any) -> "Strategy":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> tuple:
        """Hashable identity used to detect repeated candidates (field values in order)."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    def describe(self, num_layers: Optional[int] = None) -> str:
        """The strategy in words, e.g. ``ZeRO-3, optimizer->cpu, mbs 4, full ckpt 32/32, bf16``."""
        if self.engine == "fsdp2":
            parts = ["FSDP2" + (" hybrid" if self.sharding == "hybrid" else ""),
                     "reshard" if self.reshard_after_forward else "no reshard"]
            if self.offload_params != "none":
                parts.append(f"{self.offload_params} offload")
        else:
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
            every = f" every {self.checkpoint_every}" if self.checkpoint_every is not None else ""
            parts.append(f"{self.checkpointing} ckpt{every}{of}")
        parts.append(self.precision)
        if self.engine == "fsdp2" and self.reduce_dtype != "fp32":
            parts.append(f"reduce {self.reduce_dtype}")
        for name, short in (("reduce_bucket_size", "reduce bucket"), ("allgather_bucket_size", "allgather bucket"),
                            ("prefetch_bucket_size", "prefetch bucket"),
                            ("param_persistence_threshold", "persistence threshold")):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{short} {value:.0e}".replace("e+0", "e"))
        return ", ".join(parts)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Strategy))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Strategy)}
_FSDP2_ONLY = ("reshard_after_forward", "sharding", "reduce_dtype")
"""Knobs of the fsdp2 engine (fixed at their defaults for deepspeed)."""
_DEEPSPEED_BUFFERS = tuple(f.name for f in dataclasses.fields(Strategy) if f.metadata["buffer"])
"""DeepSpeed's buffer sizes (None for fsdp2)."""

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
    """Whether ``knob`` has an effect on ``strategy`` (a Strategy, or a mapping holding the knobs
    before ``knob`` in KNOBS order; a missing engine is deepspeed): checkpoint_every and
    checkpoint_layers only with checkpointing on (checkpoint_layers not with checkpoint_every);
    the ZeRO stage, optimizer offload and each bucket knob only with deepspeed, the buckets at the
    stages whose DeepSpeed config carries them (see to_deepspeed_config); reshard_after_forward,
    sharding and reduce_dtype only with fsdp2."""
    get = (lambda k: getattr(strategy, k)) if isinstance(strategy, Strategy) else strategy.get
    fsdp2 = (get("engine") or "deepspeed") == "fsdp2"
    if knob in _FSDP2_ONLY:
        return fsdp2
    if fsdp2 and (knob in _DEEPSPEED_BUFFERS or knob in ("zero_stage", "offload_optimizer")):
        return False
    if knob == "checkpoint_every":
        return get("checkpointing") != "none"
    if knob == "checkpoint_layers":
        return get("checkpointing") != "none" and get("checkpoint_every") is None
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


def shard_group_size(strategy: Strategy, hardware: HardwareSpec) -> int:
    """GPUs that parameters, gradients and optimizer states are partitioned over: all of them,
    or one node's with fsdp2's hybrid sharding (replicated across nodes)."""
    if strategy.engine == "fsdp2" and strategy.sharding == "hybrid":
        return hardware.gpus_per_node
    return data_parallel_size(hardware)


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
    if s.checkpoint_every is not None and s.checkpoint_layers is not None:
        errors.append(("checkpoint_every", f"checkpoint_every and checkpoint_layers exclude each other, but got "
                       f"checkpoint_every={s.checkpoint_every}, checkpoint_layers={s.checkpoint_layers}"))
    if s.checkpoint_every is not None and not 1 <= s.checkpoint_every <= model.num_hidden_layers:
        errors.append(("checkpoint_every",
                       f"checkpoint_every must be in 1..{model.num_hidden_layers}, but got {s.checkpoint_every}"))
    if s.engine == "fsdp2":
        if s.offload_params == "nvme":
            errors.append(("offload_params", "offload_params=nvme is not available with engine fsdp2 (CPUOffloadPolicy "
                           "offloads to host RAM only); use cpu, or engine deepspeed for NVMe"))
        if s.sharding == "hybrid" and hardware.num_nodes < 2:
            errors.append(("sharding", f"sharding=hybrid (shard within a node, replicate across nodes) needs more than "
                           f"one node, but got num_nodes {hardware.num_nodes}"))
    if s.precision == "bf16" and hardware.gpu.peak_tflops_bf16 <= 0:
        errors.append(("precision", f"precision bf16 is not supported by {hardware.gpu.name}"))
    return errors


def validate(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> list[str]:
    """Rules a strategy must satisfy to be runnable at all; returns the broken ones in words."""
    return [message for _, message in validation_errors(strategy, model, training, hardware)]


@dataclass(frozen=True)
class DeepSpeedBuffers:
    """The DeepSpeed buffer settings that do not depend on the model: what to_deepspeed_config writes
    into every config and autotune.memory.states sizes (the model-dependent bucket sizes are
    default_buckets'; the optimizer is the job's, TrainingSpec.optimizer)."""

    sub_group_size: int = 1_000_000_000
    """ZeRO-3 ``sub_group_size`` (elements per optimizer-step sub group; NVMe swap buffers hold one)."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 ``stage3_max_live_parameters`` (gathered parameters kept alive), like HF's "auto"."""
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


def to_deepspeed_config(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> dict[str, Any]:
    """The exact DeepSpeed config JSON object for this strategy (parsed by DeepSpeedConfig in tests)."""
    if strategy.engine != "deepspeed":
        raise ValueError(f"to_deepspeed_config needs engine deepspeed, but got engine {strategy.engine}")
    s = strategy
    buf = DEEPSPEED_BUFFERS
    opt = training.optimizer
    gas = gradient_accumulation_steps(s, training, hardware)
    cfg: dict[str, Any] = {
        "train_batch_size": s.micro_batch_size * gas * data_parallel_size(hardware),
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
    buckets = default_buckets(model, s)
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
        off: dict[str, Any] = {"device": s.offload_optimizer, "pin_memory": True}
        if s.offload_optimizer == "nvme":
            off.update(nvme_path=nvme_path, buffer_count=buf.optimizer_nvme_buffer_count, fast_init=False)
        zero["offload_optimizer"] = off
    if s.offload_params != "none":
        offp: dict[str, Any] = {"device": s.offload_params, "pin_memory": True}
        if s.offload_params == "nvme":
            offp.update(nvme_path=nvme_path, buffer_count=buf.param_nvme_buffer_count,
                        buffer_size=buf.param_nvme_buffer_size, max_in_cpu=buf.param_max_in_cpu)
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


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""autotune precision name -> torch dtype attribute."""


def to_fsdp2_config(
    strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
) -> dict[str, Any]:
    """The FSDP2 layout of an fsdp2 strategy as a JSON object (what ``autotune.fsdp2.apply`` and
    the profiling worker build from, and what a front point ships): ``fully_shard`` on each
    decoder layer, then the root (torchtitan parallelize.py ``apply_fsdp``), over a 1-D mesh or,
    hybrid, a 2-D (replicate, shard) mesh."""
    if strategy.engine != "fsdp2":
        raise ValueError(f"to_fsdp2_config needs engine fsdp2, but got engine {strategy.engine}")
    s = strategy
    n_ckpt = s.num_checkpointed(model.num_hidden_layers)
    hybrid = s.sharding == "hybrid"
    return {
        "engine": "fsdp2",
        "mesh": {"shape": [hardware.num_nodes, hardware.gpus_per_node] if hybrid else [hardware.num_gpus],
                 "dim_names": ["replicate", "shard"] if hybrid else ["shard"]},
        "fully_shard": {"units": "each decoder layer, then the root module",
                        "reshard_after_forward": s.reshard_after_forward},
        "mp_policy": {"param_dtype": TORCH_DTYPES[s.precision], "reduce_dtype": TORCH_DTYPES[s.reduce_dtype]},
        "offload_policy": "CPUOffloadPolicy" if s.offload_params == "cpu" else None,
        "activation_checkpointing": {"granularity": s.checkpointing if n_ckpt else "none",
                                     "blocks": s.checkpointed_blocks(model.num_hidden_layers)},
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(s, training, hardware),
        "loss_scaling": s.precision == "fp16",
        "optimizer": {"type": training.optimizer.torch_class, "foreach": True,
                      "params": training.optimizer.torch_kwargs()},
        "gradient_clipping": training.optimizer.gradient_clipping,
    }


def engine_config(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec
                  ) -> dict[str, Any]:
    """The ready-to-use config of the strategy's engine: the DeepSpeed config JSON, or the FSDP2
    layout (to_fsdp2_config)."""
    if strategy.engine == "fsdp2":
        return to_fsdp2_config(strategy, model, training, hardware)
    return to_deepspeed_config(strategy, model, training, hardware)


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
