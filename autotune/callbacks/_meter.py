"""StepMeter: what both callbacks share. It times the script's optimizer steps, reads the peak memory
of the measured ones (torch.cuda.max_memory_allocated on GPUs; on the CPU the worker's method,
autotune.worker.cpu_memory.CpuMemoryProbe), writes this rank's WorkerResult where the ``script``
backend said (autotune.backends.script_command.RESULT_ENV) and says when to stop: after the warm-up
plus the measured steps. Without that environment (the script run on its own) it does nothing.

A measured step is the interval between the end of the previous optimizer step and the end of this
one: the script's data loading, forward, backward, optimizer and its trainer's overheads (logging,
callbacks). Phase marks (forward / backward / optimizer) are the callbacks' best boundaries: the
peak is exact, the phase it is attributed to approximate (DeepSpeed steps inside backward)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from autotune.backends.script_command import MEASURED_ENV, RESULT_ENV, TOKENS_ENV, WARMUP_ENV
from autotune.worker.protocol import WorkerResult


def arm() -> None:
    """On the CPU, make c10's allocation tally count from now on (track_all_threads): called when a
    callback module is imported, so memory allocated after the import (the model) is counted."""
    if os.environ.get(RESULT_ENV):
        from autotune.worker.cpu_memory import track_all_threads

        track_all_threads()


class StepMeter:
    """Steps in, one result file out (see the module docstring)."""

    def __init__(self, source: str, result_path: Optional[str] = None, warmup_steps: Optional[int] = None,
                 measure_steps: Optional[int] = None, tokens_per_step: Optional[float] = None) -> None:
        env = os.environ
        path = result_path or env.get(RESULT_ENV)
        self.enabled = bool(path)
        self.source = source
        self.warmup = int(warmup_steps if warmup_steps is not None else env.get(WARMUP_ENV, 1))
        self.measure = int(measure_steps if measure_steps is not None else env.get(MEASURED_ENV, 2))
        tokens = tokens_per_step if tokens_per_step is not None else env.get(TOKENS_ENV)
        self.tokens_per_step = float(tokens) if tokens else None
        self.rank, self.world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        self.out: Optional[Path] = None
        self.steps = 0
        self.done = False
        self.t_start = time.time()
        self.step_t0: Optional[float] = None  # this step's window start (perf_counter)
        self._ns0 = 0  # the same instant in time.time_ns (the CPU profiler's clock)
        self.last_end: Optional[float] = None
        self.marks: dict[str, float] = {}
        self.step_times: list[float] = []
        self.step_peaks: list[int] = []
        self.losses: list[float] = []
        self.phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}
        self.reserved = 0
        self.phase = "init"
        self.gas: Optional[int] = None
        self.probe: Any = None
        self.use_cuda = False
        if not self.enabled:
            return
        from autotune.worker.main import result_path_for_rank

        self.out = result_path_for_rank(path, self.rank)
        import torch

        self.use_cuda = torch.cuda.is_available()
        if not self.use_cuda:
            from autotune.worker.cpu_memory import CpuMemoryProbe

            self.probe = CpuMemoryProbe().__enter__()
        previous = sys.excepthook

        def hook(kind: type, exc: BaseException, tb: Any) -> None:  # an uncaught error is a failed trial
            self.fail(exc)
            previous(kind, exc, tb)

        sys.excepthook = hook

    # ---------------------------------------------------------------- events

    @property
    def measuring(self) -> bool:
        return self.enabled and not self.done and self.steps >= self.warmup

    def _now(self) -> float:
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _open_window(self) -> None:
        """The measured steps start now: reset the CUDA peak / start the CPU profiler."""
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.probe.start()

    def step_begin(self) -> None:
        """An optimizer step begins (its first micro-batch)."""
        if not self.enabled or self.done:
            return
        self.phase = "forward"
        self.marks = {}
        if self.last_end is None:
            if self.measuring:
                self._open_window()
            self.step_t0 = self._now()
            self._ns0 = time.time_ns()

    def mark(self, phase: str) -> None:
        """Phase ``phase`` (backward, optimizer) of the current step begins (first call per step counts)."""
        if not self.enabled or self.done or phase in self.marks or self.step_t0 is None:
            return
        self.phase = phase
        self.marks[phase] = time.time_ns()
        if self.measuring and self.use_cuda:
            import torch

            before = {"backward": "forward", "optimizer": "backward"}[phase]
            torch.cuda.synchronize()
            self.phase_peaks[before] = max(self.phase_peaks[before], torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()

    def step_end(self, loss: Optional[float] = None) -> bool:
        """The optimizer step ended; True when training should stop (the result is written)."""
        if not self.enabled or self.done or self.step_t0 is None:
            return self.done
        t1, ns1 = self._now(), time.time_ns()
        if loss is not None:
            self.losses.append(float(loss))
        if self.measuring:
            self.step_times.append(t1 - self.step_t0)
            ns0, back, opt = self._ns0, self.marks.get("backward"), self.marks.get("optimizer")
            back = back or opt or ns1
            opt = opt or ns1
            if self.use_cuda:
                import torch

                last = "optimizer" if "optimizer" in self.marks else "backward" if "backward" in self.marks else "forward"
                self.phase_peaks[last] = max(self.phase_peaks[last], torch.cuda.max_memory_allocated())
                self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
                self.step_peaks.append(max(self.phase_peaks.values()))
                torch.cuda.reset_peak_memory_stats()
            else:
                self.probe.marks += [("forward", ns0, back), ("backward", back, opt), ("optimizer", opt, ns1)]
            if loss is not None and not math.isfinite(float(loss)):
                self._write(status="nan", reason=f"non-finite loss {loss} at step {self.steps}", phase="forward")
                return True
        self.steps += 1
        if self.steps == self.warmup and self.measure > 0:
            self._open_window()
        self.step_t0, self._ns0, self.last_end = t1, ns1, t1
        if self.steps >= self.warmup + self.measure:
            self._finish()
        return self.done

    # ---------------------------------------------------------------- results

    def _finish(self) -> None:
        fields: dict[str, Any] = {}
        if self.use_cuda:
            peak = max(self.phase_peaks.values())
            fields.update(peak_allocated_bytes=peak, peak_reserved_bytes=self.reserved,
                          phase_peaks_bytes=dict(self.phase_peaks), step_peaks_bytes=self.step_peaks,
                          peak_phase=max(self.phase_peaks, key=self.phase_peaks.get))
        else:
            self.probe.__exit__(None, None, None)
            fields.update({k: v for k, v in self.probe.analyse().items() if v is not None})
        times = sorted(self.step_times)
        if times and self.tokens_per_step:
            fields["tokens_per_s"] = self.tokens_per_step / times[len(times) // 2]
        self._write(status="ok", **fields)

    def fail(self, exc: BaseException) -> None:
        """Record an exception that ends the script (oom when it is an out-of-memory error)."""
        if not self.enabled or self.done:
            return
        from autotune.models.sources import is_oom

        first = (str(exc).strip().splitlines() or [""])[0][:300]
        status = "oom" if is_oom(exc) else "error"
        reason = f"{type(exc).__name__}: {first}"
        if status == "oom":
            from autotune.worker.snapshot import oom_note

            reason = f"{oom_note(self.phase)}; {reason}"
        self._write(status=status, reason=reason, phase=self.phase)

    def _write(self, **fields: Any) -> None:
        self.done = True
        record = WorkerResult(rank=self.rank, world_size=self.world, device="cuda" if self.use_cuda else "cpu",
                              step_times_s=self.step_times, losses=self.losses,
                              gradient_accumulation_steps=self.gas, model_source=f"script:{self.source}",
                              notes=[f"measured in the training script's own loop ({self.source} callback)"],
                              elapsed_s=round(time.time() - self.t_start, 3), **fields)
        assert self.out is not None
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(record.to_json(), indent=1, default=str))
        tmp.replace(self.out)
