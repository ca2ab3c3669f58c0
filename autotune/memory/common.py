"""The memory model's shared pieces: component names, the estimate record, overheads and units."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional

from autotune.spec import GIB, HardwareSpec, TrainingSpec


GPU_COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one training step (bytes), where its peak falls, and the verdict."""

    gpu: dict[str, int]
    """GPU_COMPONENTS plus ``peak`` (predicted max_memory_allocated, overhead excluded)."""
    peak_phase: str
    """``forward`` | ``backward`` | ``optimizer``."""
    cpu_bytes_per_node: int
    """Host RAM that offload (and its pinned buffers) needs per node."""
    nvme_bytes_per_node: int
    """NVMe bytes that ZeRO-Infinity offload needs per node."""
    fits: bool
    """Whether peak + overhead fits the GPU (minus headroom) and host RAM / NVMe suffice."""
    reasons: list[str] = field(default_factory=list)
    """Why it does not fit, in words."""
    phases: dict[str, int] = field(default_factory=dict)
    """Predicted allocated bytes at the peak of each phase (forward/backward/optimizer)."""
    activation_peak: int = 0
    """Largest activations + logits at any point of the step (the peak's own may be smaller when
    the step's peak falls where model states dominate, e.g. the optimizer step)."""

    @property
    def total_gpu_bytes(self) -> int:
        """Peak plus overhead: what must fit in the GPU."""
        return self.gpu["peak"] + self.gpu["overhead"]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_gpu_bytes"] = self.total_gpu_bytes
        return d


PREDICTION_MARGIN = 0.01
"""The memory model's worst measured under-prediction of a job's peak, rounded up to a whole percent,
as a fraction of the peak: the worst row of ``python benchmarks/memory_vs_deepspeed.py`` (real steps
of both engines, the max over measured optimizer steps and ranks; its figures: docs/accuracy.md).
``estimate_memory`` adds this fraction of the predicted peak to ``gpu["overhead"]``, so ``fits`` and
the recommended point keep that much headroom beyond ``search.headroom``."""


def overhead_bytes(hardware: HardwareSpec, peak_allocated: float) -> int:
    """Memory outside the allocator's live tensors: the CUDA context plus the caching allocator's
    fragmentation, a fraction of the allocated peak (hardware.cuda_context_gib, allocator_slack)."""
    return int(hardware.cuda_context_gib * GIB + hardware.allocator_slack * peak_allocated)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _partition(n: int, dp: int) -> int:
    """Elements of one data-parallel partition (DeepSpeed pads to equal partitions)."""
    return -(-n // dp)


def host_pinned(pin_memory: bool, device: str) -> bool:
    """Whether a strategy's host buffers are page-locked: ``Strategy.pin_memory`` on CUDA (DeepSpeed's
    CPU accelerator and a CPU-only torch pin nothing)."""
    return pin_memory and device == "cuda"


def pinned_bytes(nbytes: float, pinned: bool) -> float:
    """Host bytes one tensor of ``nbytes`` holds: pinned on CUDA, the caching host allocator's block,
    the next power of two (torch's ATen/core/CachingHostAllocator.h ``allocate``:
    ``c10::llvm::PowerOf2Ceil(size)`` below pinned_max_round_threshold, unset by default), which it
    keeps cached when the tensor is freed; pageable, ``nbytes``."""
    if not pinned or nbytes <= 1:
        return nbytes
    return float(1 << (int(-(-nbytes // 1)) - 1).bit_length())


def forked_copies(training: TrainingSpec, at_init: float, later: float) -> float:
    """Host bytes per GPU that the data loader's forked workers keep a second copy of
    (``TrainingSpec.data_loader_fork``). fork(2) shares the trainer's pages copy-on-write: a worker
    keeps each page as it was at the fork and the trainer's first write to it afterwards copies it.
    ``at_init``: the host partitions that exist once the engine is built and that every step
    rewrites (master weights, gradient partitions, 16-bit copies); ``later``: those the first step
    creates (the optimizer's moments, created lazily), copied only by a fork at a later epoch."""
    fork = training.data_loader_fork
    if fork == "none":
        return 0.0
    return at_init + (later if fork == "each_epoch" else 0.0)


class DeferredEstimate(MemoryEstimate):
    """A MemoryEstimate whose verdict (and what the GPU must hold, when given) is known and whose
    figures are computed by ``build`` (``estimate_memory``) when first read: the screen computes
    the verdicts of a whole space at once (memory._fast) and most candidates are never read further."""

    @classmethod
    def of(cls, fits: bool, total_gpu_bytes: Optional[int], build: Callable[..., MemoryEstimate], *args: Any,
           ) -> "DeferredEstimate":
        """The verdict and total known; ``build(*args)`` the whole estimate."""
        est = object.__new__(cls)
        object.__setattr__(est, "__dict__", {"fits": fits, "_total": total_gpu_bytes, "_build": build, "_args": args})
        return est

    def __getattr__(self, name: str) -> Any:  # a field not built yet
        build = None if name.startswith("__") else self.__dict__.pop("_build", None)  # (not for copy's probes)
        if build is None:
            raise AttributeError(name)
        full = build(*self.__dict__.pop("_args"))
        total = self.__dict__.pop("_total")
        if full.fits != self.fits or total not in (None, full.total_gpu_bytes):
            raise AssertionError(f"screen verdict {self.fits}, {total} != estimate_memory's {full.fits}, "
                                 f"{full.total_gpu_bytes}")
        self.__dict__.update({f.name: getattr(full, f.name) for f in fields(MemoryEstimate)})
        return getattr(self, name)

    @property
    def total_gpu_bytes(self) -> int:
        total = self.__dict__.get("_total")
        return total if total is not None else self.gpu["peak"] + self.gpu["overhead"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryEstimate):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(MemoryEstimate))

    __hash__ = None  # type: ignore[assignment]  (as MemoryEstimate's: its gpu dict is unhashable)
