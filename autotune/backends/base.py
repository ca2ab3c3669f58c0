"""The profile-backend interface and the ``simulate`` backend (the factory is backends/factory.py).

A backend turns one strategy into a Measurement: the peak GPU memory and the throughput it
measured (or, for ``simulate``, predicted). The search only talks to this interface.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, Optional, get_args

from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

Status = Literal["ok", "oom", "nan", "timeout", "crash", "error"]
FAIL_STATUSES: tuple[str, ...] = tuple(s for s in get_args(Status) if s != "ok")
"""How a failed evaluation can end (Status without ``ok``)."""

PREDICTED_PEAK_KEY = "predicted_peak_bytes"
"""Measurement.extra key: the memory model's peak for the measured strategy (measuring backends)."""
PREDICTED_TPS_KEY = "predicted_tokens_per_s_per_gpu"
"""Measurement.extra key: the simulator's tokens/s per GPU for the measured strategy (measuring backends)."""
MEMORY_ERROR_KEY = "memory_error_pct"
"""Measurement.extra key: PREDICTED_PEAK_KEY over the measured peak, minus 1, in percent (measuring backends)."""
ROUTING_KEY = "routing"
"""Measurement.extra key of an expert-parallel trial: the routing factors its measured steps gave, as the
ModelSpec fields a job states them with (autotune.memory.expert_parallel.measured_routing)."""
PREDICTED_AT_ROUTING_KEY = "predicted_peak_at_routing_bytes"
"""Measurement.extra key of an expert-parallel trial: the memory model's peak with ROUTING_KEY's factors stated."""
MEMORY_ERROR_AT_ROUTING_KEY = "memory_error_at_routing_pct"
"""Measurement.extra key of an expert-parallel trial: PREDICTED_AT_ROUTING_KEY's error, as MEMORY_ERROR_KEY's."""


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


class Backend:
    """Measures one strategy. Implementations: SimulateBackend here; DeepSpeedBackend (profile) and
    ReplayBackend in backends/. What a backend can do is said by its class attributes below; the
    search, the run directory, the outputs and the report read these, never the backend's name
    (backends/factory.py is the one place that maps names to classes)."""

    name: ClassVar[str] = ""
    """The name a job file or ``--backend`` gives it (profile.backend)."""
    measures: ClassVar[bool] = True
    """Its values are measurements, not the models' predictions: each costs real time, so the
    ``auto`` sampler is ehvi (autotune.search); the outputs are not marked predicted; the report
    reads the measurement record of each trial and shows predicted vs measured."""
    in_memory_study: ClassVar[bool] = False
    """It answers in microseconds: the study runs in memory and is appended to a journal file at the
    end (rundir.is_fast); a slow backend's trials are written through to SQLite one by one."""
    launches_workers: ClassVar[bool] = False
    """It trains in launched worker processes of this interpreter, which therefore needs torch (and
    DeepSpeed, transformers where the job uses them): a run refuses to start without them."""
    builds_model: ClassVar[bool] = False
    """Its workers build the job's model themselves (autotune.models.sources.build_for_job: the
    reference decoder unless the job gives model.hf_config or model.python), so a model that source
    cannot build is refused before a run starts."""
    evaluated_as: ClassVar[str] = "measured"
    """What its evaluated points are, in the report's words."""

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        """Measure one strategy; ``trial_number`` names its log folder where the backend keeps logs."""
        raise NotImplementedError


class SimulateBackend(Backend):
    """Answers with the analytical memory model and the throughput simulator (no torch, no GPU)."""

    name = "simulate"
    measures = False
    in_memory_study = True
    evaluated_as = "simulated"

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
