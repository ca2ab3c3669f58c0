"""The launcher <-> worker protocol: ``job.json`` (WorkerJob) in, one ``result.json`` per rank
(WorkerResult) out. The meaning of every key is in autotune.worker.main's docstring; these are
the typed records both sides read and write, with the JSON format unchanged: a key whose value
is None is not written, and the worker then uses its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


WORKER_DEFAULTS: dict[str, Any] = {
    "warmup_steps": 2, "measure_steps": 2, "optimizer_impl": "auto", "memory": "auto", "seed": 0,
    "device": "auto", "loop": "keep_outputs", "gc_collect": True, "fresh_batches": False, "exchange_timeout_s": 60, "gpu": "h100-80gb",
}
"""What the worker uses for a WorkerJob field left out (None)."""


@dataclass(frozen=True)
class WorkerJob:
    """One measurement job (``python -m autotune.worker JOB.json``)."""

    model: dict[str, Any]
    """ModelSpec fields."""
    training: dict[str, Any]
    """TrainingSpec fields."""
    strategy: dict[str, Any]
    """Strategy fields."""
    deepspeed_config: Optional[dict[str, Any]] = None
    """The exact DeepSpeed config (None: the worker derives it with data-parallel size = WORLD_SIZE)."""
    result_path: Optional[str] = None
    """Rank 0's result file; rank r > 0 writes ``<stem>.rank<r>.json`` (None: next to the job)."""
    warmup_steps: Optional[int] = None
    """Optimizer steps before measuring."""
    measure_steps: Optional[int] = None
    """Optimizer steps measured (the peak is the max over their micro-steps)."""
    optimizer_impl: Optional[str] = None
    """deepspeed | torch | auto."""
    memory: Optional[str] = None
    """How peak memory is measured: cuda | profiler | none | auto."""
    seed: Optional[int] = None
    """Seed of the model and the batches."""
    fresh_batches: Optional[bool] = None
    """Every micro-step a new batch, as a job's data loader gives (False: two batches, reused every step): an
    expert-parallel model's received rows follow its batches' routing."""
    data_seed: Optional[int] = None
    """Seed of the batches alone (None: ``seed``): the same model on other batches (the memory benchmark's pilot
    of an expert-parallel row measures the routing it states there)."""
    device: Optional[str] = None
    """cuda | cpu | auto."""
    gpu: Optional[str] = None
    """GPU preset for the default DeepSpeed config (when ``deepspeed_config`` is not given)."""
    model_factory: Optional[str] = None
    """``package.module:function``: the user's model factory (autotune.models.sources)."""
    python_path: Optional[list[str]] = None
    """Put first on sys.path before importing the factory."""
    hf_config: Optional[str] = None
    """An HF config.json to build the model from (transformers)."""
    tokens: Optional[str] = None
    """A .npy of token ids the built-in sources' batches are windows of (profile.tokens; None: uniform random
    ids)."""
    snapshot: Optional[str] = None
    """Where rank 0 dumps a CUDA memory snapshot (--snapshot)."""
    loop: Optional[str] = None
    """keep_outputs | drop_outputs."""
    gc_collect: Optional[bool] = None
    """Collect garbage (and flush gloo's work objects) after backward and after the step."""
    exchange_timeout_s: Optional[float] = None
    """Bound of the final cross-rank exchange."""
    fault: Optional[dict[str, Any]] = None
    """Test-only fault injection: {rank, phase, kind}."""

    def setting(self, name: str) -> Any:
        """The field's value, or the worker's default (WORKER_DEFAULTS) when it is left out."""
        value = getattr(self, name)
        return WORKER_DEFAULTS.get(name) if value is None else value

    def to_json(self) -> dict[str, Any]:
        """The job.json object (keys in field order; None values left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "WorkerJob":
        """A job from job.json; unknown keys are a ValueError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ValueError(f"unknown job key(s): {', '.join(unknown)}")
        return cls(**obj)


@dataclass(frozen=True)
class WorkerResult:
    """What one rank reports (its result.json); any field may be absent (None)."""

    status: Optional[str] = None
    """ok | oom | nan | error (None: the file has no status)."""
    reason: Optional[str] = None
    """Short sentence for a failure."""
    phase: Optional[str] = None
    """init | forward | backward | optimizer: where it failed."""
    rank: Optional[int] = None
    world_size: Optional[int] = None
    device: Optional[str] = None
    """cpu | cuda."""
    peak_allocated_bytes: Optional[int] = None
    """Steady-state peak of this rank (CUDA max_memory_allocated / CPU peak tensor bytes)."""
    peak_reserved_bytes: Optional[int] = None
    peak_phase: Optional[str] = None
    phase_peaks_bytes: Optional[dict[str, int]] = None
    step_peaks_bytes: Optional[list[int]] = None
    min_step_peak_bytes: Optional[int] = None
    max_step_peak_bytes: Optional[int] = None
    loop: Optional[str] = None
    step_start_bytes: Optional[int] = None
    init_peak_bytes: Optional[int] = None
    step_times_s: Optional[list[float]] = None
    """Measured optimizer steps, wall clock."""
    tokens_per_s: Optional[float] = None
    """All ranks: mbs x seq x GAS x world / (sp x cp) / median step time."""
    host_offload_peak_bytes: Optional[int] = None
    """activation_offload: the most host bytes the offloaded checkpoint inputs held."""
    routing: Optional[dict[str, Any]] = None
    """Expert parallelism: ``sent`` rows per dispatch and the measured micro-steps' received splits
    (autotune.worker.routing)."""
    losses: Optional[list[float]] = None
    num_parameters: Optional[int] = None
    optimizer: Optional[str] = None
    """DeepSpeed's final optimizer wrapper class."""
    optimizer_settings: Optional[dict[str, Any]] = None
    """The optimizer the engine built, read back: class, lr, betas, eps, weight_decay (sgd: momentum),
    gradient_clipping."""
    gradient_accumulation_steps: Optional[int] = None
    all_ranks: Optional[dict[str, list[Any]]] = None
    """Rank 0, after the cross-rank exchange: per-rank status, phase, peaks."""
    model_source: Optional[str] = None
    notes: Optional[list[str]] = None
    snapshot_path: Optional[str] = None
    elapsed_s: Optional[float] = None
    other: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a newer worker's), kept rather than dropped."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "WorkerResult":
        names = {f.name for f in dataclasses.fields(cls)} - {"other"}
        return cls(**{k: v for k, v in obj.items() if k in names},
                   other={k: v for k, v in obj.items() if k not in names})

    def to_json(self) -> dict[str, Any]:
        """The result.json object (None values left out, unknown keys kept)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "other" and getattr(self, f.name) is not None}
        return {**out, **self.other}
