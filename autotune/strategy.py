"""One training strategy value and its validity rules.

The knob list is defined once, here: the fields of ``Strategy``, made with autotune.knobs.knob,
whose metadata (help, when the knob applies, its place in the search, its CLI flag, its range)
every other list of knobs is read from: ``KNOBS`` (what a search space varies, the trials.csv
columns, what ``compare`` carries), the CLI's strategy flags, the job file's and the search
space's checkers, the docs/config.md table. The engine configs (DeepSpeed JSON, FSDP2 layout)
are autotune.engine_configs', which reads this module.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, get_args

from autotune import knobs
from autotune.knobs import ONE_HOT, When, knob
from autotune.spec import HardwareSpec, ModelSpec, Precision, TrainingSpec

Engine = Literal["deepspeed", "fsdp2"]
ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu", "nvme"]
Checkpointing = Literal["none", "selective", "attention", "mlp", "op", "full"]
Sharding = Literal["full", "hybrid"]
ReduceDtype = Literal["fp32", "bf16"]
ActivationOffload = Literal["none", "cpu"]


def data_parallel_size(hardware: HardwareSpec) -> int:
    """The ranks the model states shard over: every GPU (autotune does not search tensor/pipeline
    parallelism; ZeRO shards over the sequence-parallel ranks too, deepspeed/utils/groups.py
    ``_get_sequence_data_parallel_group``, and torchtitan's FSDP2 over its ``dp_shard_cp`` mesh)."""
    return hardware.num_gpus


def sequence_shards(strategy: "Strategy") -> int:
    """The GPUs one sequence is split over: the Ulysses or context-parallel degree (1: none)."""
    return strategy.sequence_parallel_size * strategy.context_parallel_size


def batch_ranks(hardware: HardwareSpec, strategy: "Strategy") -> int:
    """The ranks that each take their own micro-batches: every GPU over the sequence split (the
    batch arithmetic: global batch = micro-batch x accumulation steps x this)."""
    return max(1, hardware.num_gpus // sequence_shards(strategy))

ENGINES: tuple[Engine, ...] = get_args(Engine)
ZERO_STAGES: tuple[ZeroStage, ...] = get_args(ZeroStage)
OFFLOADS: tuple[Offload, ...] = get_args(Offload)
CHECKPOINTINGS: tuple[Checkpointing, ...] = get_args(Checkpointing)
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)
REDUCE_DTYPES: tuple[ReduceDtype, ...] = get_args(ReduceDtype)

_CKPT_ON = When("checkpointing != none", ("checkpointing",), lambda get: get("checkpointing") != "none")
_CKPT_FULL = When("checkpointing full", ("checkpointing",), lambda get: get("checkpointing") == "full")
_NO_EVERY = When("checkpoint_every unset", ("checkpoint_every",), lambda get: get("checkpoint_every") is None)
_OFFLOADED = When("offload_optimizer, offload_params or activation_offload not none",
                  ("offload_optimizer", "offload_params", "activation_offload"),
                  lambda get: "cpu" in (get("offload_optimizer"), get("offload_params"), get("activation_offload"))
                  or "nvme" in (get("offload_optimizer"), get("offload_params")))
_ZERO = {"1-3": When("zero_stage >= 1", ("zero_stage",), lambda get: get("zero_stage") >= 1),
         "1-2": When("zero_stage 1 or 2", ("zero_stage",), lambda get: get("zero_stage") in (1, 2)),
         "3": When("zero_stage 3", ("zero_stage",), lambda get: get("zero_stage") == 3)}
"""The ZeRO stages whose DeepSpeed config carries a bucket knob (see to_deepspeed_config)."""


@dataclass(frozen=True)
class Strategy:
    """How one training job is laid out on the GPUs."""

    engine: Engine = knob("deepspeed", search_order=0, feature=("switch", ONE_HOT), flag=True, added=True,
                          memory=("rules", "activations"), help="""Training engine: deepspeed
        (ZeRO stages 0-3) or fsdp2 (PyTorch fully_shard on every decoder layer plus the root; parameters,
        gradients and optimizer states always sharded).""")
    zero_stage: ZeroStage = knob(0, search_order=1, feature=("levels", ONE_HOT), flag=True, engine="deepspeed",
                                 space=(0, 1, 2, 3), memory=("rules", "activations", "states"), help="""
        ZeRO stage 0-3 (0 = plain data parallel); fsdp2 is always 3, fully sharded.""")
    micro_batch_size: int = knob(1, search_order=4, feature=("log2", 1.0), flag=True, int_range=(1, 1 << 20),
                                 space=(1, 2, 4, 8), memory=("rules", "activations", "states", "units"),
                                 help="Sequences per GPU per forward/backward.")
    checkpointing: Checkpointing = knob("none", search_order=5, feature=("blocks", 1.0), flag=True,
                                        space=("none", "full"), memory=("rules", "activations", "states"), help="""
        Activation checkpointing granularity: selective = attention core recomputed (Korthikanti et al. 2022
        sec. 5); attention / mlp = that module of the block recomputed, the other kept (module-level selective
        recompute, the norms stay outside); op = torchtitan's op-level selective checkpointing of the block
        (attention outputs and every other matmul output kept, the rest recomputed); full = whole block
        recomputed.""")
    checkpoint_every: Optional[int] = knob(None, search_order=6, nest=7, flag=True, int_range=(1, 10_000),
                                           applies=_CKPT_ON, added=True, memory=("rules", "activations", "states"),
                                           help="""Checkpoint every k-th block
        (blocks k-1, 2k-1, ...; torchtitan's layer-frequency selective option), L // k blocks in all; unset:
        the first checkpoint_layers blocks instead.""")
    checkpoint_layers: Optional[int] = knob(None, search_order=7, nest=8, flag=True, int_range=(0, 10_000),
                                            applies=_CKPT_ON & _NO_EVERY, space=("all",), of_layers=True,
                                            memory=("rules", "activations", "states"), help="""
        Number of blocks checkpointed, the first ones, 0..num_layers (unset: all of them). Not with
        checkpoint_every.""")
    offload_optimizer: Offload = knob("none", search_order=2, feature=("levels", ONE_HOT), flag=True,
                                      engine="deepspeed", memory=("rules", "states"), help="""Where
        optimizer states and fp32 master weights live (ZeRO >= 1; fsdp2: follows offload_params, as
        CPUOffloadPolicy moves both).""")
    offload_params: Offload = knob("none", search_order=3, feature=("levels", ONE_HOT), flag=True,
                                   memory=("rules", "states", "units"), help="""Where the sharded parameters
        live between uses (deepspeed: ZeRO-3 only; fsdp2: cpu = CPUOffloadPolicy, sharded parameters,
        gradients and the optimizer step on the host).""")
    precision: Precision = knob("bf16", search_order=8, feature=("levels", ONE_HOT), nest=6, flag=True,
                                from_training="precision", memory=("rules", "activations", "states", "units"), help="""
        Compute precision (unset: the job's training.precision); fp16 adds dynamic loss scaling (fsdp2:
        MixedPrecisionPolicy.param_dtype; the sharded parameters stay fp32).""")
    reshard_after_forward: Literal[True, False] = knob(True, search_order=9, feature=("switch", 0.5), flag=True,
                                                       engine="fsdp2", added=True, memory=("units",),
                                                       help="""Free each layer's unsharded
        parameters after its forward and all-gather them again for its backward (ZeRO-3-like); false keeps
        them from forward to backward (ZeRO-2-like).""")
    sharding: Sharding = knob("full", search_order=10, feature=("switch", 0.5), flag=True, engine="fsdp2", added=True,
                              memory=("rules", "units"), help="""full =
        shard over every GPU; hybrid = shard within a node and replicate across nodes (HSDP, a 2-D device
        mesh; needs more than one node).""")
    reduce_dtype: ReduceDtype = knob("fp32", search_order=11, feature=("switch", 0.5), flag=True, engine="fsdp2",
                                     added=True, memory=("units",), help="""
        Dtype of the gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype).""")
    reduce_bucket_size: Optional[int] = knob(None, search_order=12, feature=("set", 0.5), flag=False,
                                             engine="deepspeed", applies=_ZERO["1-3"], int_range=(1, None), buffer=True,
                                             memory=("states",), help="""
        Elements per gradient reduce bucket (auto: autotune's choice, see default_buckets).""")
    allgather_bucket_size: Optional[int] = knob(None, search_order=13, feature=("set", 0.5), flag=False,
                                                engine="deepspeed", applies=_ZERO["1-2"], int_range=(1, None),
                                                buffer=True, memory=(),
                                                help="Elements per parameter all-gather bucket (auto: autotune's choice).")
    prefetch_bucket_size: Optional[int] = knob(None, search_order=14, feature=("set", 0.5), flag=False,
                                               engine="deepspeed", applies=_ZERO["3"], int_range=(1, None), buffer=True,
                                               memory=("states",),
                                               help="Elements prefetched ahead of use (auto: autotune's choice).")
    param_persistence_threshold: Optional[int] = knob(None, search_order=None, flag=False, engine="deepspeed",
                                                      applies=_ZERO["3"], int_range=(0, None), buffer=True,
                                                      memory=("states",), help="""
        Parameters smaller than this stay unpartitioned (auto: autotune's choice).""")
    pin_memory: Literal[True, False] = knob(True, search_order=None, flag=True, added=True, applies=_OFFLOADED,
                                            memory=("activations", "states", "units"), help="""Page-lock offload's
        host buffers (DeepSpeed offload_optimizer / offload_param pin_memory; fsdp2: CPUOffloadPolicy(pin_memory);
        activation_offload: the host copies of long_context.offload_activations):
        asynchronous copies at full PCIe speed, but on CUDA torch's pinned allocator rounds every pinned
        tensor up to a power of two bytes (ATen/core/CachingHostAllocator.h) and keeps freed blocks cached.""")
    sequence_parallel_size: int = knob(1, search_order=15, feature=("log2", 1.0), flag=True, engine="deepspeed",
                                       int_range=(1, 1 << 16), added=True, memory=("rules", "activations", "states"),
                                       long_context=True, help="""DeepSpeed Ulysses sequence
        parallelism (ALST, arXiv 2506.13996; deepspeed/runtime/sequence_parallel/ulysses_sp.py): each group of
        this many GPUs splits every sequence into equal shards and exchanges the attention heads by
        all-to-all around attention; data parallel = GPUs / this. ZeRO still shards over every GPU.""")
    context_parallel_size: int = knob(1, search_order=16, feature=("log2", 1.0), flag=True, engine="fsdp2",
                                      int_range=(1, 1 << 16), added=True, memory=("rules", "activations", "units"),
                                      long_context=True, help="""torch context parallelism
        (torch/distributed/tensor/experimental/_attention.py, ring attention; torchtitan's cp degree): each group
        of this many GPUs splits every sequence into 2 x this load-balanced chunks and passes key/value
        chunks around a ring inside attention; data parallel = GPUs / this; FSDP2 shards over every GPU.""")
    tiled_loss: Literal[False, True] = knob(False, search_order=17, feature=("switch", 0.5), flag=True, added=True,
                                            memory=("activations",), long_context=True,
                                            help="""Compute the head's logits and the loss in sequence tiles
        (DeepSpeed TiledFusedLogitsLoss), each tile's forward and backward at once: the full logits never
        exist.""")
    tiled_mlp: Literal[False, True] = knob(False, search_order=18, feature=("switch", 0.5), flag=True, added=True,
                                           memory=("activations",), long_context=True,
                                           help="""Run each block's MLP over sequence tiles of hidden_size
        tokens (DeepSpeed TiledMLP): only the MLP input is saved, each tile recomputed in backward.""")
    activation_offload: ActivationOffload = knob("none", search_order=19, feature=("switch", 0.5), flag=True,
                                                 added=True, applies=_CKPT_FULL, memory=("rules", "activations"),
                                                 long_context=True, help="""Where the checkpointed blocks' saved inputs
        live between forward and backward (cpu: host memory, copied back before each block's
        recomputation; ALST's activation checkpoint offload).""")

    expert_parallel_size: int = knob(1, search_order=20, feature=("log2", 1.0), flag=True, engine="fsdp2",
                                     int_range=(1, 1 << 16), added=True, memory=("rules", "activations", "units"),
                                     help="""Expert parallelism of an MoE
        model (torchtitan's expert_parallel_degree, torchtitan/distributed/expert_parallel.py ExpertParallel):
        each group of this many data parallel GPUs splits every MoE block's routed experts between them and
        sends each token to the GPU of its experts (all_to_all_single: dispatch) and back (combine); the
        experts are sharded by FSDP over GPUs / this, the dense parts over every GPU.""")

    def __post_init__(self) -> None:
        # knobs that do not apply to the engine take one fixed value, so a strategy has one
        # identity (``key``) whatever the caller passed for them
        # (set in the instance dict, as object.__setattr__ would one by one: a screen makes ~10^4 strategies)
        if self.engine == "fsdp2":
            vars(self).update(_FSDP2_FIXED, offload_optimizer=self.offload_params)
        else:
            vars(self).update(_DEEPSPEED_FIXED)

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
        """Which blocks to checkpoint, as autotune.models.checkpointing.apply_checkpointing takes it: the
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
        return _field_values(self)

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
        if self.sequence_parallel_size > 1:
            parts.append(f"Ulysses SP {self.sequence_parallel_size}")
        if self.context_parallel_size > 1:
            parts.append(f"CP {self.context_parallel_size}")
        if self.expert_parallel_size > 1:
            parts.append(f"EP {self.expert_parallel_size}")
        parts.append(f"mbs {self.micro_batch_size}")
        if self.checkpointing == "none":
            parts.append("no ckpt")
        else:
            n = self.num_checkpointed(num_layers) if num_layers else self.checkpoint_layers
            of = f" {n}/{num_layers}" if num_layers else (f" {n}" if n is not None else "")
            every = f" every {self.checkpoint_every}" if self.checkpoint_every is not None else ""
            parts.append(f"{self.checkpointing} ckpt{every}{of}")
        if self.activation_offload != "none" and self.checkpointing != "none":
            parts.append(f"activations->{self.activation_offload}")
        parts += [name for name, on in (("tiled loss", self.tiled_loss), ("tiled MLP", self.tiled_mlp)) if on]
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


_FIELDS = {f.name: f for f in knobs.knob_fields(Strategy)}
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Strategy))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Strategy)}
_FSDP2_ONLY = tuple(k for k, f in _FIELDS.items() if f.metadata["engine"] == "fsdp2")
"""Knobs of the fsdp2 engine (fixed at their defaults for deepspeed)."""
_DEEPSPEED_BUFFERS = tuple(k for k, f in _FIELDS.items() if f.metadata["buffer"])
"""DeepSpeed's buffer sizes (None for fsdp2)."""
_DEEPSPEED_LAYOUT = tuple(k for k, f in _FIELDS.items() if f.metadata["engine"] == "deepspeed"
                          and not f.metadata["buffer"] and k not in ("zero_stage", "offload_optimizer"))
"""DeepSpeed's other knobs (fixed at their defaults for fsdp2; zero_stage and offload_optimizer
take fsdp2's own values)."""
_FSDP2_FIXED = {"zero_stage": 3, **{k: None for k in _DEEPSPEED_BUFFERS}, **{k: _DEFAULTS[k] for k in _DEEPSPEED_LAYOUT}}
"""What __post_init__ sets under engine fsdp2 (and offload_optimizer = offload_params)."""
_DEEPSPEED_FIXED = {k: _DEFAULTS[k] for k in _FSDP2_ONLY}
"""What __post_init__ sets under engine deepspeed."""
_field_values = operator.attrgetter(*_FIELD_NAMES)

KNOBS: tuple[str, ...] = knobs.searched(Strategy)
"""The knobs a search space varies, in the order they are suggested to Optuna; also the strategy
columns of trials.csv and the fields that identify a point across runs."""

FLAG_KNOBS: tuple[str, ...] = knobs.flagged(Strategy)
"""The knobs ``autotune estimate`` takes as ``--flags`` (field order)."""

BUCKET_KNOBS: tuple[str, ...] = tuple(k for k in KNOBS if _FIELDS[k].metadata["buffer"])
"""The searched DeepSpeed buffer sizes (KNOBS order)."""

MEMORY_FAMILY: tuple[str, ...] = ("zero_stage", "offload_optimizer", "offload_params", "precision", "engine",
                                  "expert_parallel_size")
"""The knobs that lay the model states out: candidates sharing their values share the memory model's
error (the calibration's per-family correction, the sampler's families). Expert parallelism lays out the
experts' states, and its received rows are sized at the stated routing factors (or their defaults),
an error no other layout shares."""

_CHOICES = knobs.literal_choices(Strategy)


def knob_choices(knob: str) -> Optional[tuple[Any, ...]]:
    """The fixed values of a knob with a ``Literal`` type (None for integers)."""
    return _CHOICES[knob]


def knob_applies(knob: str, strategy: "Strategy | Mapping[str, Any]") -> bool:
    """Whether ``knob`` has an effect on ``strategy`` (a Strategy, or a mapping holding the knobs
    before ``knob`` in the nesting order; a missing engine is deepspeed): the field's ``engine``
    and ``applies`` metadata (the bucket knobs at the stages whose DeepSpeed config carries them,
    see to_deepspeed_config)."""
    get = (strategy.get if type(strategy) is dict else strategy.__getattribute__ if type(strategy) is Strategy
           else knobs.getter(strategy))
    key = (knob, *map(get, _APPLIES_READS[knob]))  # the answer depends on these values only
    try:
        return _APPLIES_SEEN[key]
    except KeyError:
        applies = _APPLIES_SEEN[key] = knobs.applies(_FIELDS[knob], get)
        return applies
    except TypeError:  # an unhashable value
        return knobs.applies(_FIELDS[knob], get)


_APPLIES_READS = {k: (("engine",) if f.metadata["engine"] else ()) + (f.metadata["applies"].reads
                                                                      if f.metadata["applies"] else ())
                  for k, f in _FIELDS.items()}
"""Knob -> the knobs whether it applies reads (its engine, its condition's ``reads``)."""
_APPLIES_SEEN: dict[tuple, bool] = {}
"""(knob, the values it reads) -> knob_applies: a search asks it ~20,000 times over a few dozen answers."""


def strategy_from_dict(values: Mapping[str, Any]) -> "Strategy":
    """A Strategy from a mapping that may carry other keys (front.json points, measured rows)."""
    return Strategy(**{k: v for k, v in values.items() if k in _FIELD_NAMES})


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
    split = _sequence_split_errors(s, model, training, hardware)
    errors += split
    errors += _expert_parallel_errors(s, model, hardware) if not split else []
    if model.attention_sinks and (s.sequence_parallel_size > 1 or s.context_parallel_size > 1):
        # Ulysses scatters the heads, ring attention the sequence: neither passes gpt-oss's per-head sinks
        errors.append(("sequence_parallel_size" if s.sequence_parallel_size > 1 else "context_parallel_size",
                       f"attention sinks (gpt-oss) are not sized with sequence parallel {s.sequence_parallel_size} "
                       f"or context parallel {s.context_parallel_size}: eager attention with sinks runs unsplit"))
    if model.norms_per_block == 4 and s.sequence_parallel_size > 1:
        # Gemma-3 under Ulysses: one rank's step holds more than the other's, not located (docs/long-context.md)
        errors.append(("sequence_parallel_size", f"four-norm blocks (Gemma-2/3) are not sized with sequence parallel "
                       f"{s.sequence_parallel_size}: the ranks' peaks differ by a term not modelled"))
    if model.is_mla and (s.checkpointing == "op" or s.sequence_parallel_size > 1
                         or s.context_parallel_size > 1 or s.tiled_mlp):
        # memory/mla.py sizes DeepSeek-V2's attention whole, fully checkpointed or its kernel (selective), unsplit
        errors.append(("checkpointing" if s.checkpointing == "op" else "sequence_parallel_size",
                       f"multi-head latent attention is not sized with checkpointing {s.checkpointing}, sequence "
                       f"parallel {s.sequence_parallel_size}, context parallel {s.context_parallel_size}, "
                       f"tiled_mlp {s.tiled_mlp}: use checkpointing none/full/selective/attention/mlp without "
                       f"sequence splits"))
    if s.micro_batch_size >= 1 and not split:
        dp = batch_ranks(hardware, s)
        per_step = s.micro_batch_size * dp
        if training.global_batch_size % per_step:
            errors.append(("micro_batch_size",
                f"micro_batch_size x data-parallel size must divide global_batch_size, but got "
                f"{s.micro_batch_size} x {dp} = {per_step} for {training.global_batch_size}"
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
    if s.engine == "deepspeed" and s.zero_stage == 3 and s.checkpointing == "op":
        # ZeRO-3 gathers a submodule's parameters in its pre-forward hook, inside the checkpointed block,
        # and prefetching moves gathers between blocks; torch's selective checkpoint replays the forward's
        # ops by count (torch/utils/checkpoint.py _CachedTorchDispatchMode) and raises when a block's
        # recomputation gathers more than its forward did (docs/engines.md, "Op-level checkpointing")
        errors.append(("checkpointing", "checkpointing op is not available with zero_stage 3: ZeRO-3 gathers "
                       "parameters inside the checkpointed block, and torch's selective checkpoint raises "
                       "'c10d._allgather_base_ ... not found in storage' when its recomputation gathers more than "
                       "its forward; use full, selective, attention or mlp, or engine fsdp2"))
    if s.tiled_mlp and model.is_moe:
        # transformers' MoE blocks return (hidden states, router logits), which DeepSpeed's TiledMLP cannot
        # concatenate over tiles (measured: Mixtral, Qwen-MoE, gpt-oss raise), and no MoE block is sized tiled
        errors.append(("tiled_mlp", "tiled_mlp on a mixture-of-experts model is not sized (the tiled MLP of a MoE "
                       "block is not modelled; DeepSpeed's TiledMLP cannot tile transformers' MoE blocks, which "
                       "return router logits too), but got tiled_mlp true"))
    if s.checkpointing == "mlp" and model.input_jitter_draws:
        # PhimoeSparseMoeBlock.forward multiplies its input in place by the jitter draw (``hidden_states *=``),
        # the very tensor a checkpoint of the block saved: torch's unpack raises "modified by an inplace
        # operation" in the backward (measured: hf-phimoe, ZeRO-0/1, bf16 and fp32)
        errors.append(("checkpointing", "checkpointing mlp is not available with input_jitter_noise > 0 (PhiMoE): "
                       "the MoE block multiplies its input in place, which a checkpoint of that block saved, and "
                       "torch raises in the backward; use full, op, selective or attention, or input_jitter_noise 0"))
    if s.activation_offload != "none" and s.checkpointing != "full":
        errors.append(("activation_offload", f"activation_offload={s.activation_offload} moves the inputs of "
                       f"fully checkpointed blocks, so it needs checkpointing full, but got {s.checkpointing}"))
    if s.precision == "bf16" and hardware.gpu.peak_tflops_bf16 <= 0:
        errors.append(("precision", f"precision bf16 is not supported by {hardware.gpu.name}"))
    return errors


def _sequence_split_errors(s: Strategy, model: ModelSpec, training: TrainingSpec,
                           hardware: HardwareSpec) -> list[tuple[str, str]]:
    """The rules of splitting a sequence over GPUs: Ulysses (DeepSpeed's UlyssesSPAttentionHF
    checks: heads divisible by the degree, kv heads divisible by it or it by them; the data-loader
    adapter's equal shards) and torch's context parallel (2 x degree load-balanced chunks,
    torch/distributed/tensor/experimental/_attention.py ``_HeadTailLoadBalancer``; sdpa only)."""
    errors: list[tuple[str, str]] = []
    n = hardware.num_gpus
    for key, d in (("sequence_parallel_size", s.sequence_parallel_size), ("context_parallel_size",
                                                                         s.context_parallel_size)):
        if d < 1:
            errors.append((key, f"{key} must be >= 1, but got {d}"))
        elif d > 1 and n % d:
            errors.append((key, f"{key} must divide the number of GPUs, but got {d} for {n} GPUs"))
    if errors:
        return errors
    sp, cp = s.sequence_parallel_size, s.context_parallel_size
    a, kv = model.num_attention_heads, model.num_key_value_heads
    if sp > 1:
        if a % sp:
            errors.append(("sequence_parallel_size", f"sequence_parallel_size must divide num_attention_heads, "
                           f"but got {sp} for {a} heads"))
        elif kv % sp and sp % kv:
            errors.append(("sequence_parallel_size", f"sequence_parallel_size and num_key_value_heads must divide "
                           f"one another, but got {sp} and {kv}"))
        elif training.seq_len % sp:
            errors.append(("sequence_parallel_size", f"sequence_parallel_size must divide seq_len, but got {sp} "
                           f"for seq_len {training.seq_len}"))
        elif model.attn_implementation == "eager":
            errors.append(("sequence_parallel_size", "sequence_parallel_size > 1 needs attn_implementation sdpa "
                           "(UlyssesSPAttentionHF refuses eager, which builds a 4-D mask), but got eager"))
    if sp * cp > 1 and model.sliding_window is not None and training.seq_len >= model.sliding_window:
        key = "sequence_parallel_size" if sp > 1 else "context_parallel_size"
        errors.append((key, f"{key} > 1 at or beyond the sliding window (seq_len {training.seq_len}, "
                       f"sliding_window {model.sliding_window}) is not sized: each shard's window mask is not "
                       "modelled"))
    if cp > 1:
        if training.seq_len % (2 * cp):
            errors.append(("context_parallel_size", f"context_parallel_size: 2 x it must divide seq_len (load-"
                           f"balanced chunks), but got 2 x {cp} for seq_len {training.seq_len}"))
        elif model.attn_implementation != "sdpa":
            errors.append(("context_parallel_size", f"context_parallel_size > 1 needs attn_implementation sdpa "
                           f"(ring attention replaces sdpa's kernels), but got {model.attn_implementation}"))
    return errors


def _expert_parallel_errors(s: Strategy, model: ModelSpec, hardware: HardwareSpec) -> list[tuple[str, str]]:
    """Expert parallelism as torchtitan builds it (torchtitan/distributed/parallel_dims.py
    ``_build_mesh_with_ep``: the ep ranks are a divisor of the data-parallel ranks, ``dp_shard_in_ep``,
    and ExpertParallel's ``Shard(0)`` splits the experts evenly between them)."""
    ep = s.expert_parallel_size
    key = "expert_parallel_size"
    if ep < 1:
        return [(key, f"{key} must be >= 1, but got {ep}")]
    if ep == 1:
        return []
    dp = batch_ranks(hardware, s)
    if not model.is_moe:
        return [(key, f"{key} > 1 needs a mixture-of-experts model (num_experts > 0), but got {ep} for a dense model")]
    if model.num_experts % ep:
        return [(key, f"{key} must divide num_experts, but got {ep} for {model.num_experts} experts")]
    if s.context_parallel_size > 1:
        return [(key, f"{key} > 1 with context_parallel_size > 1 is not modelled (torchtitan's ep then borrows "
                 f"the cp ranks), but got {ep} and {s.context_parallel_size}")]
    if dp % ep:
        return [(key, f"{key} must divide the data-parallel size (GPUs / sequence split), but got {ep} for {dp}")]
    if s.sharding == "hybrid" and hardware.num_nodes > 1 and hardware.gpus_per_node % ep:
        return [(key, f"{key} must divide gpus_per_node under sharding hybrid (the experts shard within a node), "
                 f"but got {ep} for {hardware.gpus_per_node}")]
    if model.expert_bias:
        return [(key, f"{key} > 1 with biased experts (gpt-oss) is not built: autotune.models.expert_parallel "
                 f"splits unbiased [experts, 2f, h] gate_up / down weights, but got {ep}")]
    if s.checkpointing == "op":
        return [(key, f"{key} > 1 with checkpointing op is not sized (the op policy's saved mm outputs of the "
                 f"expert chunks are not modelled), but got {ep}")]
    return []


def validate(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> list[str]:
    """Rules a strategy must satisfy to be runnable at all; returns the broken ones in words."""
    return [message for _, message in validation_errors(strategy, model, training, hardware)]


def ignored_knobs(given: Mapping[str, Any], strategy: Strategy) -> list[tuple[str, str]]:
    """(key, message) for each knob ``given`` explicitly (a job file's strategy section, a CLI flag)
    whose value the strategy's engine replaces (``__post_init__``: a knob of the other engine takes
    one fixed value), so it would be ignored without a word."""
    out = []
    for key, value in given.items():
        field = _FIELDS.get(key)
        if field is None or getattr(strategy, key) == value:
            continue
        out.append((key, f"{key} {value!r} has no effect under engine {strategy.engine}, which fixes it to "
                         f"{getattr(strategy, key)!r} ({key} applies with {knobs.applies_text(field)}): "
                         f"set the engine it belongs to, or leave it out"))
    return out
