"""The ``profile`` backend: every candidate is trained for real, in its own launched process group,
with the strategy's engine (DeepSpeed, or FSDP2's ``fully_shard``: autotune.worker.main picks it
from ``strategy.engine``; an fsdp2 job carries no DeepSpeed config).

``DeepSpeedBackend(cfg, run_dir).evaluate(strategy)`` writes ``runs/<name>/trials/<n>/job.json``
(the schema of autotune.worker.main), launches it through autotune.backends.launch (torchrun or
DeepSpeed's launcher, ``hardware.gpus_per_node`` ranks; on a CPU-only machine the same number of
ranks over gloo), and turns the per-rank results into a Measurement:

* ``peak_memory_bytes``: the largest per-rank steady-state peak of allocated memory
  (``torch.cuda.max_memory_allocated``; on CPU the worker's profiler peak of tensor bytes);
* ``tokens_per_s_per_gpu``: all ranks' tokens per median step / world size;
* ``step_time_s``: the median measured optimizer-step time (upper median, as the worker uses);
* ``mfu``: tokens/s/GPU x ModelSpec.flops_per_token(seq) / the GPU's dense peak for the precision
  (llm-foundry's MFU definition, see ModelSpec.flops_per_token); None on CPU, where the GPU peak
  does not describe the device that ran;
* ``extra``: predicted vs measured peak memory and tokens/s with the error in percent, the log
  directory, reserved bytes, the phase of the peak or of the OOM, per-rank peaks, losses; for an
  expert-parallel trial the routing its measured steps dispatched, as the factors a job states
  (``routing``), and the peak predicted with them stated (``predicted_peak_at_routing_bytes``).

Failures (oom, nan, crash, timeout, error) come from the structured results and exit statuses
(autotune.backends.launch.failure_of); the logs stay under the trial directory.

The job names the model source (``hf_config`` or ``model_factory`` + ``python_path`` from the config,
see autotune.models.sources) and, for trial ``snapshot_trial`` (``--snapshot TRIAL``), the path
of the CUDA memory snapshot (``trials/<n>/memory_snapshot.pickle``); the worker's notes, model source
and snapshot path are copied into ``extra``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

from autotune.backends.base import (MEMORY_ERROR_AT_ROUTING_KEY, MEMORY_ERROR_KEY, PREDICTED_AT_ROUTING_KEY,
                                    PREDICTED_PEAK_KEY, PREDICTED_TPS_KEY, ROUTING_KEY, Backend, Measurement)
from autotune.config import Config
from autotune.backends.launch import LaunchResult, failure_of, launch
from autotune.worker.protocol import WorkerJob, WorkerResult
from autotune.strategy import Strategy
from autotune.engine_configs import to_deepspeed_config


def _pct(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    if predicted is None or not measured:
        return None
    return round(100.0 * (predicted / measured - 1.0), 2)


class DeepSpeedBackend(Backend):
    """Real training steps per candidate, DeepSpeed or FSDP2 (see the module docstring)."""

    name = "profile"
    launches_workers = True
    builds_model = True

    def __init__(self, cfg: Config, run_dir: str, *, nproc: Optional[int] = None, device: str = "auto",
                 memory_limit_bytes: Optional[int] = None, optimizer_impl: str = "auto", memory: str = "auto",
                 seed: int = 0, hostfile: Optional[str] = None, env: Optional[dict[str, str]] = None,
                 params: Optional[dict] = None, calibrator: Any = None, worker_entry: Optional[str] = None,
                 ds_config_overrides: Optional[dict] = None, snapshot_trial: Optional[int] = None) -> None:
        self.cfg = cfg
        # absolute: every path in job.json is read by workers whose working directory is the trial's
        self.run_dir = Path(run_dir).resolve()
        self.trials_dir = self.run_dir / "trials"
        self.nproc = nproc or cfg.hardware.gpus_per_node
        self.device = device
        self.memory_limit_bytes = memory_limit_bytes
        """Address-space limit (RLIMIT_AS) of each worker process: produces real OOMs on CPU."""
        self.optimizer_impl, self.memory, self.seed = optimizer_impl, memory, seed
        self.hostfile, self.env = hostfile, dict(env or {})
        self.params = params
        """Simulator efficiency parameters for the predicted tokens/s (None: the GPU preset's)."""
        self.calibrator = calibrator
        """Optional autotune.calibration.loop.Calibrator fed with every measurement."""
        self.worker_entry = worker_entry
        """Test hook: a Python script run by each rank instead of autotune.worker.main."""
        self.ds_config_overrides = ds_config_overrides or {}
        """Deep-merged into the generated DeepSpeed config (e.g. the optimizer's learning rate)."""
        self.snapshot_trial = snapshot_trial
        """Trial number whose workers record a CUDA memory snapshot (``--snapshot TRIAL``)."""
        self._counter = 0

    # ---------------------------------------------------------------- job files

    def _trial_dir(self, trial_number: Optional[int]) -> Path:
        self.trials_dir.mkdir(parents=True, exist_ok=True)
        if trial_number is None:
            taken = [int(p.name) for p in self.trials_dir.iterdir() if p.name.isdigit()]
            trial_number = max([self._counter - 1, *taken], default=-1) + 1
            self._counter = trial_number + 1
        base = self.trials_dir / str(trial_number)
        path, k = base, 0
        while path.exists():  # never overwrite an earlier attempt's logs
            k += 1
            path = self.trials_dir / f"{trial_number}.{k}"
        path.mkdir(parents=True)
        return path

    def job(self, strategy: Strategy, trial_dir: Path, trial_number: Optional[int] = None) -> WorkerJob:
        """The worker job measuring ``strategy`` in ``trial_dir``."""
        from autotune.models.sources import job_source

        cfg = self.cfg
        profile = cfg.profile
        snapshot = None
        if self.snapshot_trial is not None and trial_number == self.snapshot_trial:
            from autotune.worker.snapshot import SNAPSHOT_FILE

            snapshot = str(trial_dir / SNAPSHOT_FILE)
        return WorkerJob(
            model=dataclasses.asdict(cfg.model), training=dataclasses.asdict(cfg.training),
            strategy=strategy.as_dict(),
            deepspeed_config=_merge(to_deepspeed_config(strategy, cfg.model, cfg.training, cfg.hardware),
                                    self.ds_config_overrides) if strategy.engine == "deepspeed" else None,
            result_path=str(trial_dir / "result.json"), warmup_steps=profile.warmup_steps,
            measure_steps=profile.measure_steps, optimizer_impl=self.optimizer_impl, memory=self.memory,
            seed=self.seed, device=self.device, snapshot=snapshot,
            # an EP rank's received rows follow each batch's routing: every micro-step a new batch, as a job's
            # data loader gives (the peak then the worst of the measured batches, not one batch's)
            fresh_batches=True if strategy.expert_parallel_size > 1 else None, **job_source(cfg))

    def job_for(self, strategy: Strategy, trial_dir: Path, trial_number: Optional[int] = None) -> dict[str, Any]:
        """The job.json object of :meth:`job`."""
        return self.job(strategy, trial_dir, trial_number).to_json()

    # ---------------------------------------------------------------- evaluate

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        trial_dir = self._trial_dir(trial_number)
        job_path = trial_dir / "job.json"
        number = trial_number if trial_number is not None else _number_of(trial_dir)
        job = self.job(strategy, trial_dir, number)
        job_path.write_text(json.dumps(job.to_json(), indent=1))
        env = dict(self.env)
        if self.device == "cpu":
            env.setdefault("DS_ACCELERATOR", "cpu")
        res = launch(str(job_path), nproc=self.nproc, log_dir=str(trial_dir / "logs"),
                     timeout_s=self.cfg.profile.timeout_s, launcher=self.cfg.profile.launcher,
                     memory_limit_bytes=self.memory_limit_bytes, num_nodes=self.cfg.hardware.num_nodes,
                     hostfile=self.hostfile, env=env, worker_entry=self.worker_entry)
        m = self.measurement(strategy, res)
        rank0 = WorkerResult.from_json(res.results.get(0, {}))
        if rank0.notes:
            m.extra["notes"] = rank0.notes
        if rank0.model_source:
            m.extra["model_source"] = rank0.model_source
        if job.snapshot is not None:
            m.extra["snapshot_path"] = rank0.snapshot_path
        (trial_dir / "measurement.json").write_text(json.dumps(m.as_dict(), indent=1, default=str))
        if self.calibrator is not None:
            self.calibrator.add(strategy, m)
        return m

    def predictions(self, strategy: Strategy, device: Optional[str] = None) -> dict[str, Optional[float]]:
        """The analytical models' numbers for this strategy (memory model peak on the device the workers ran on,
        ``_predicted_peak``; simulated tokens/s)."""
        from autotune.simulate import simulate

        cfg = self.cfg
        out: dict[str, Optional[float]] = {PREDICTED_PEAK_KEY: self._predicted_peak(cfg.model, strategy, device),
                                           PREDICTED_TPS_KEY: None}
        params = self.calibrator.current_params() if self.calibrator is not None else self.params
        out[PREDICTED_TPS_KEY] = simulate(cfg.model, cfg.training, cfg.hardware, strategy,
                                                         params).tokens_per_s_per_gpu
        return out

    def measurement(self, strategy: Strategy, res: LaunchResult) -> Measurement:
        """Convert one launch's results into a Measurement (failures included)."""
        ranks = [WorkerResult.from_json(res.results[r]) for r in sorted(res.results)]
        rank0 = WorkerResult.from_json(res.results.get(0, {}))
        extra: dict[str, Any] = {
            "log_dir": res.log_dir, "launcher": self.cfg.profile.launcher, "world_size": res.nproc,
            "elapsed_s": round(res.elapsed_s, 3), "device": rank0.device,
            "launch_id": res.launch_id, "launcher_pid": res.pid,
        }
        extra.update(self.predictions(strategy, rank0.device))
        failed = failure_of(res)
        if failed is not None:
            return self._failure(res, ranks, rank0, failed, extra)
        peaks = [r.peak_allocated_bytes for r in ranks]
        if any(p is None for p in peaks) or not rank0.tokens_per_s or not rank0.step_times_s:
            return Measurement(status="error", reason="worker result lacks peak memory or step times", extra=extra)
        world = int(rank0.world_size or res.nproc)
        peak = int(max(peaks))  # type: ignore[type-var]
        tps_gpu = float(rank0.tokens_per_s) / world
        times = sorted(rank0.step_times_s)
        step = times[len(times) // 2]
        mfu = None
        if rank0.device == "cuda":
            cfg = self.cfg
            peak_flops = cfg.hardware.gpu.peak_flops(strategy.precision)
            if peak_flops > 0:
                from autotune.simulate_moe import moe_flops_per_token  # a MoE's MFU is on its active parameters

                flops = (moe_flops_per_token(cfg.model, cfg.training.seq_len) if cfg.model.is_moe
                         else cfg.model.flops_per_token(cfg.training.seq_len))
                mfu = tps_gpu * flops / peak_flops
        reserved = [r.peak_reserved_bytes for r in ranks]
        extra.update(
            measured_peak_bytes=peak, per_rank_peak_bytes=peaks, peak_phase=ranks[peaks.index(peak)].peak_phase,
            peak_reserved_bytes=max((x for x in reserved if x is not None), default=None),
            init_peak_bytes=rank0.init_peak_bytes, step_times_s=rank0.step_times_s,
            losses=rank0.losses, optimizer=rank0.optimizer,
            gradient_accumulation_steps=rank0.gradient_accumulation_steps,
            measured_tokens_per_s_per_gpu=tps_gpu,
            **{MEMORY_ERROR_KEY: _pct(extra[PREDICTED_PEAK_KEY], peak)},
            tokens_error_pct=_pct(extra[PREDICTED_TPS_KEY], tps_gpu),
        )
        if strategy.expert_parallel_size > 1:
            extra.update(self.routing_extra(strategy, ranks, peak, rank0.device))
        return Measurement(status="ok", peak_memory_bytes=peak, tokens_per_s_per_gpu=tps_gpu, step_time_s=step,
                           mfu=mfu, extra=extra)

    def routing_extra(self, strategy: Strategy, ranks: list[WorkerResult], peak: int,
                      device: Optional[str] = None) -> dict[str, Any]:
        """An expert-parallel trial's measured routing (every rank's measured micro-steps) as the factors a job
        states (ROUTING_KEY), the memory model's peak with them stated and its error; {} without a routing."""
        from autotune.worker.routing import factors_of

        factors = factors_of(self.cfg.model, [r.routing for r in ranks])
        if factors is None:
            return {}
        at = self._predicted_peak(self.cfg.model.replace(**factors._asdict()), strategy, device)
        return {ROUTING_KEY: factors._asdict(), PREDICTED_AT_ROUTING_KEY: at, MEMORY_ERROR_AT_ROUTING_KEY: _pct(at, peak)}

    def _predicted_peak(self, model: Any, strategy: Strategy, device: Optional[str]) -> Optional[int]:
        """The memory model's peak of ``strategy`` for ``model`` on the device the workers ran on (``"cpu"``:
        the CPU accelerator's kernels, estimate_memory's ``device``; else CUDA's); None without the memory model."""
        cfg = self.cfg
        try:
            from autotune.memory import estimate_memory

            return int(estimate_memory(model, cfg.training, cfg.hardware, strategy,
                                       device="cpu" if device == "cpu" else "cuda").gpu["peak"])
        except ImportError:  # memory model not installed in this checkout
            return None

    @staticmethod
    def _failure(res: LaunchResult, ranks: list[WorkerResult], rank0: WorkerResult, failed: tuple[str, str],
                 extra: dict[str, Any]) -> Measurement:
        """A failed launch as a Measurement: status and reason from failure_of, the OOM's phase, the
        exit statuses and the losses so far."""
        status, reason = failed
        phases = [r.phase for r in ranks if r.status == status and r.phase]
        if status == "oom":
            extra["oom_phase"] = phases[0] if phases else None
        extra["exit_status"] = {str(k): v.get("signal") or v.get("returncode") for k, v in res.exits.items()}
        extra["launcher_returncode"] = res.returncode
        if rank0.losses:
            extra["losses"] = rank0.losses
        return Measurement(status=status, reason=reason, extra=extra)  # type: ignore[arg-type]


def _number_of(trial_dir: Path) -> Optional[int]:
    head = trial_dir.name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def default_memory_limit() -> Optional[int]:
    """``AUTOTUNE_WORKER_MEMORY_LIMIT`` (bytes) from the environment, if set."""
    raw = os.environ.get("AUTOTUNE_WORKER_MEMORY_LIMIT")
    return int(raw) if raw and raw.isdigit() else None
