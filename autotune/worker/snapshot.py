"""CUDA memory snapshots for one trial (``--snapshot TRIAL``) and the OOM-phase advice.

The profiling worker wraps the measured steps of the chosen trial in ``memory_snapshot(path)``;
the pickle opens in PyTorch's memory viz (https://pytorch.org/memory_viz, drag the file in; it
runs locally in the browser). The snapshot is written in a ``finally``, so an OOM trial still
leaves its allocation history up to the failure, which is the interesting one.

torch is imported lazily: importing this module is free on the simulate path.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

SNAPSHOT_FILE = "memory_snapshot.pickle"
DEFAULT_MAX_ENTRIES = 200_000
"""Allocation events kept (ring buffer): enough for a few steps of a 7B model, about 100 MB."""

OOM_ADVICE = {
    "init": ("the model states do not fit (parameters, gradients, optimizer states)",
             "shard them: ZeRO-3 / FSDP2, or offload the optimizer/parameters"),
    "forward": ("activations are too large", "activation checkpointing, or a smaller micro-batch"),
    "backward": ("gradients plus the activations still alive are too large",
                 "a smaller micro-batch with more gradient accumulation, sharded gradients (ZeRO-2+ / FSDP2)"),
    "optimizer": ("the optimizer step's states/temporaries do not fit",
                  "sharded optimizer states (ZeRO-1+ / FSDP2) or offload (optimizer offload / CPUOffloadPolicy)"),
}
"""phase -> (cause, remedy) for an OOM in init, forward, backward or the optimizer step."""


def oom_note(phase: Optional[str]) -> str:
    """One line for a trial's failure note, e.g. ``OOM in forward: activations are too large (try ...)``."""
    if not phase or phase not in OOM_ADVICE:
        return "out of memory (phase unknown)"
    cause, remedy = OOM_ADVICE[phase]
    return f"OOM in {phase}: {cause} (try {remedy})"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def start(max_entries: int = DEFAULT_MAX_ENTRIES) -> bool:
    """Start recording allocation history with stack traces; False (a no-op) without CUDA."""
    if not cuda_available():
        return False
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True


def dump(path: str) -> Optional[str]:
    """Write the snapshot pickle and stop recording; returns the path (None without CUDA)."""
    if not cuda_available():
        return None
    import torch

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


@contextlib.contextmanager
def memory_snapshot(path: str, enabled: bool = True, max_entries: int = DEFAULT_MAX_ENTRIES) -> Iterator[dict[str, Any]]:
    """Record CUDA allocations inside the block and dump them to ``path`` on exit, also when the
    block raises (OOM). Yields a dict whose ``path`` is set once the snapshot exists (stays None
    when disabled or without CUDA)."""
    info: dict[str, Any] = {"path": None}
    recording = enabled and start(max_entries)
    try:
        yield info
    finally:
        if recording:
            try:
                info["path"] = dump(path)
            except Exception as err:  # never hide the block's own exception (often the OOM itself)
                info["error"] = f"snapshot not written: {type(err).__name__}: {err}"[:300]


def summarize(path: str) -> dict[str, Any]:
    """Small facts about a snapshot pickle (for tests and the trial's user attrs): segment count,
    reserved and allocated bytes, number of recorded trace events."""
    import pickle

    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    segments = snap.get("segments", [])
    traces = snap.get("device_traces", [])
    return {
        "segments": len(segments),
        "reserved_bytes": sum(s.get("total_size", 0) for s in segments),
        "allocated_bytes": sum(s.get("allocated_size", 0) for s in segments),
        "trace_events": sum(len(t) for t in traces),
    }
