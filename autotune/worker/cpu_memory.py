"""Peak tensor memory on the CPU accelerator: torch.profiler's allocation events, counted on every
thread (``track_all_threads``), with the measured steps marked (``MEASURED_MARK``) so the peak of each
step and phase can be read back (``CpuMemoryProbe``)."""

from __future__ import annotations

import bisect
import os
import time
from typing import Any, Optional

PHASES = ("forward", "backward", "optimizer")


MEASURED_MARK = "autotune::measured::"


class CpuMemoryProbe:
    """Peak CPU tensor bytes from torch.profiler allocation events (profile_memory=True).

    The profiler reports, for every allocation and free of the c10 CPU allocator, the running
    total of bytes allocated since profiling started. Profiling starts before the model is
    built, so that total is the absolute tensor memory of the process (DeepSpeed's flat buffers,
    master weights, buckets, activations...). Phase markers are record_function ranges.
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.marks: list[tuple[str, int, int]] = []  # (phase, start_ns, end_ns) of measured phases
        self.window: Optional[tuple[int, int]] = None
        self.init_end: Optional[int] = None
        self.last_step_start: Optional[int] = None
        self.gas = 1  # micro-steps per optimizer step (set by the worker)

    def __enter__(self) -> "CpuMemoryProbe":
        self.all_threads = track_all_threads()
        self.started = False
        if not self.all_threads:
            self.start()  # the per-address fallback must see every allocation from the start
        return self

    def start(self) -> None:
        """Start recording (idempotent). With c10's tally counting every thread from ``__enter__``
        on, ``total_allocated`` is absolute whenever recording starts, so the worker starts it at
        the first measured step: the model build and warm-up steps are not recorded (far fewer
        events to analyse; ``init_peak_bytes`` is then unknown)."""
        if not self.started:
            self.started = True
            self.prof.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.started:
            self.prof.__exit__(*exc)

    @staticmethod
    def now() -> int:
        return time.time_ns()

    def analyse(self) -> dict[str, Any]:
        from torch._C._profiler import _EventType

        raw: list[tuple[int, int, int]] = []  # (time, ptr, +size allocated / -size freed)
        ranges = []
        if not self.started:  # failed before the first measured step: nothing recorded
            return {"init_peak_bytes": None, "peak_allocated_bytes": None, "peak_phase": None,
                    "phase_peaks_bytes": {}, "step_start_bytes": None}
        stack = list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.typed[0] == _EventType.Allocation and str(node.typed[1].device).startswith("cpu"):
                f = node.typed[1]
                raw.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated))
            elif node.name.startswith(MEASURED_MARK):
                ranges.append(node)
            stack.extend(node.children)
        raw.sort()
        if self.all_threads:  # c10's tally is exact (every thread's allocations and frees)
            events = [(t, total) for t, _, _, total in raw]
        else:
            events = live_totals([(t, ptr, size) for t, ptr, size, _ in raw])
        out: dict[str, Any] = {"init_peak_bytes": None, "peak_allocated_bytes": None, "peak_phase": None,
                               "phase_peaks_bytes": {}, "step_start_bytes": None}
        if not events:
            return out
        # phase windows from the profiler's own record_function events (same clock as allocations)
        marks = [(n.name.rsplit(":", 1)[-1], n.start_time_ns, n.end_time_ns) for n in ranges]
        if not marks:
            marks = self.marks
        marks.sort(key=lambda m: m[1])
        times = [ts for ts, _ in events]
        totals = [t for _, t in events]

        def at(t: int) -> int:  # running total just before time t
            i = bisect.bisect_right(times, t) - 1
            return totals[i] if i >= 0 else 0

        def peak_in(t0: int, t1: int) -> int:
            i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            return max([at(t0)] + totals[i:j])

        if self.init_end is not None and not self.all_threads:  # init recorded (fallback mode only)
            out["init_peak_bytes"] = max(totals[: bisect.bisect_right(times, self.init_end)], default=0)
        if marks:
            out["step_start_bytes"] = at(marks[-3][1] if len(marks) >= 3 else marks[0][1])
        peaks = {ph: 0 for ph in PHASES}
        best, best_phase = -1, None
        step_peaks: list[int] = []
        per_step = 3 * max(1, self.gas)  # forward, backward, step of every micro-step
        for k, (phase, t0, t1) in enumerate(marks):
            m = peak_in(t0, t1)
            if k % per_step == 0:  # a new optimizer step (all its micro-steps)
                step_peaks.append(0)
            if step_peaks:
                step_peaks[-1] = max(step_peaks[-1], m)
            peaks[phase] = max(peaks[phase], m)
            if m > best:
                best, best_phase = m, phase
        out.update(peak_allocated_bytes=max(best, 0), peak_phase=best_phase, phase_peaks_bytes=peaks,
                   step_peaks_bytes=step_peaks, min_step_peak_bytes=min(step_peaks) if step_peaks else None,
                   max_step_peak_bytes=max(step_peaks) if step_peaks else None)
        return out


def track_all_threads() -> bool:
    """Make c10's CPU allocation tally count every thread (``FLAGS_caffe2_report_cpu_memory_usage``).

    c10's ProfiledCPUMemoryReporter (c10/core/CPUAllocator.cpp) updates the tally that the
    profiler reports as ``total_allocated`` only on threads with the profiler active unless this
    flag is set: a tensor allocated on the main thread and released on one of gloo's worker
    threads (ProcessGroupGloo drops the last reference to a collective's tensors there) is never
    subtracted, and the tally drifts up by random amounts per rank and run. The flag is a plain
    exported global of libc10 (no Python API), set through ctypes; False if that fails.
    """
    try:
        import ctypes

        import torch

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
        return True
    except (OSError, ValueError, AttributeError):
        return False


def live_totals(raw: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """Running live tensor bytes from allocation events ``(time, ptr, +size | -size)``.

    The fallback when c10's tally cannot be made to count every thread (``track_all_threads``):
    frees on other threads have no event, but an allocation at an address that is still live
    proves that block was freed unseen, so it is dropped here; a block freed unseen and not
    reused yet still counts (this errs high, never low).
    """
    live: dict[int, int] = {}
    total = 0
    out: list[tuple[int, int]] = []
    for t, ptr, size in raw:
        if size > 0:
            total += size - live.get(ptr, 0)
            live[ptr] = size
        else:
            total -= live.pop(ptr, 0)
        out.append((t, total))
    return out


def record_phase(name: str):
    from torch.profiler import record_function

    return record_function(name)
