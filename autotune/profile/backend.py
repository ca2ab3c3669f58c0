"""The profile-backend interface and the ``simulate`` backend (the factory is profile/factory.py).

A backend turns one strategy into a Measurement: the peak GPU memory and the throughput it
measured (or, for ``simulate``, predicted). The search only talks to this interface.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Protocol, get_args

from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

Status = Literal["ok", "oom", "nan", "timeout", "crash", "error"]
FAIL_STATUSES: tuple[str, ...] = tuple(s for s in get_args(Status) if s != "ok")
"""How a failed evaluation can end (Status without ``ok``)."""

PREDICTED_PEAK_KEY = "predicted_peak_bytes"
"""Measurement.extra key: the memory model's peak for the measured strategy (measuring backends)."""
PREDICTED_TPS_KEY = "predicted_tokens_per_s_per_gpu"
"""Measurement.extra key: the simulator's tokens/s per GPU for the measured strategy (measuring backends)."""


def fail_reason_text(status: str, detail: str) -> str:
    """A failed trial's ``fail_reason``, for people: its status, then the backend's reason
    (``"oom: rank 0 in backward: CUDA out of memory"``; just the status when there is no reason).
    Code reads the status from ``fail_status``, never from this text."""
    return f"{status}: {detail}".rstrip(": ")


def fail_detail(status: str, text: str) -> str:
    """The backend's reason in a ``fail_reason`` text (fail_reason_text's inverse): the text after
    ``"<status>:"``, or all of it when it does not start with the status."""
    head, _, rest = text.partition(":")
    return rest.strip() if head.strip() == status else text


@dataclass(frozen=True)
class Measurement:
    """What a backend reports for one candidate."""

    status: Status
    """ok, or why the candidate failed (oom, nan, timeout, crash, error)."""
    peak_memory_bytes: Optional[int] = None
    """Peak allocated GPU memory per GPU (torch.cuda.max_memory_allocated, or the prediction)."""
    tokens_per_s_per_gpu: Optional[float] = None
    step_time_s: Optional[float] = None
    mfu: Optional[float] = None
    reason: str = ""
    """Short failure reason (from the structured result or the exit status)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Backend-specific details (time breakdown, reserved memory, log directory...)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Backend(Protocol):
    """Measures one strategy. Implementations: SimulateBackend here; deepspeed and replay in profile/."""

    name: str

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        """Measure one strategy; ``trial_number`` names its log folder where the backend keeps logs."""
        ...


class SimulateBackend:
    """Answers with the analytical memory model and the throughput simulator (no torch, no GPU)."""

    name = "simulate"

    def __init__(self, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                 params: Optional[dict] = None) -> None:
        self.model, self.training, self.hardware, self.params = model, training, hardware, params

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        from autotune.memory import estimate_memory
        from autotune.simulate import simulate

        mem = estimate_memory(self.model, self.training, self.hardware, strategy)
        sim = simulate(self.model, self.training, self.hardware, strategy, self.params)
        return Measurement(status="ok", peak_memory_bytes=mem.gpu["peak"],
                           tokens_per_s_per_gpu=sim.tokens_per_s_per_gpu, step_time_s=sim.step_time_s,
                           mfu=sim.mfu, extra={"time_breakdown_s": dict(sim.breakdown),
                                               "calibrated": sim.calibrated})
