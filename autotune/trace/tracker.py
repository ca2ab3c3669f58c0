"""MemTracker for traces: per-phase peaks, the activation (non-state) peak, categories for fp32
master weights and gradients; and where the cycle collector runs so fake tensors die when real
ones would."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

MASTER = "Master"
"""Category for fp32 master weights (MemTracker would file them as Activation)."""
GRAD32 = "Grad fp32"
"""Category for fp32 gradients fed to the optimizer (MemTracker would file them as Temp)."""

STATE_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", MASTER, GRAD32)
"""MemTracker categories that are model states (the analytical model owns these in combine)."""
ACT_CATEGORIES = ("Activation", "Temp", "Other")
"""Categories that are activations / temporaries (inputs are 'Other': they live on the GPU too)."""


def make_tracker():
    """MemTracker that also records per-phase peaks and the activation (non-state) peak."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class _PhaseTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            # plain-string extra categories; MemTracker only indexes the snapshot dict with them
            self._ref_class = list(_MemRefType) + [MASTER, GRAD32]  # type: ignore[assignment]
            self.phase = "setup"
            self.phase_peaks: dict[str, dict[str, int]] = {}
            self.act_peak = 0
            self.act_peak_snap: dict[str, int] = {}
            self.act_peak_phase = ""

        def refile(self, tensor: Any, category: Any) -> None:
            """Put the storage of `tensor` under `category` (MemTracker's own re-filing path)."""
            self._update_and_maybe_create_winfos(tensor, category)

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():  # one device: cpu
                total = snap.get("Total", 0)
                act = sum(v for k, v in snap.items() if str(getattr(k, "value", k)) in ACT_CATEGORIES)
                ph = self.phase_peaks.setdefault(self.phase, {"total": 0, "activations": 0})
                ph["total"] = max(ph["total"], total)
                ph["activations"] = max(ph["activations"], act)
                if self.phase in ("forward", "backward") and act > self.act_peak:
                    self.act_peak = act
                    self.act_peak_phase = self.phase
                    self.act_peak_snap = {str(getattr(k, "value", k)): v for k, v in snap.items()}

        def categories(self) -> dict[str, int]:
            out: dict[str, int] = {}
            for snap in self._curr_mem_snap.values():
                for k, v in snap.items():
                    out[str(getattr(k, "value", k))] = out.get(str(getattr(k, "value", k)), 0) + v
            return out

    return _PhaseTracker()


@contextlib.contextmanager
def frozen_heap():
    """Collect once, then move every existing object to the collector's permanent generation
    (``gc.freeze``) for the trace: the collections inside it (``collect_after_each_module``) then
    scan only objects the trace created, not the whole torch/transformers heap."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def collect_after_each_module(model: Any) -> None:
    """Run the cycle collector after the backward of each layer and of each of its leaf modules
    (layers: the children of ModuleLists).

    Under FakeTensorMode a checkpointed layer's recomputed tensors end up in reference cycles, so
    they outlive their use until Python's collector happens to run; real autograd frees them as
    soon as their node has run. Collecting after every leaf module (not just every layer: the
    recomputed MLP tensors sit inside it) gives the real lifetimes back (docs/accuracy.md has the
    figures); ``frozen_heap`` keeps those collections cheap. The trace's module is thrown away
    afterwards, so the hooks stay.
    """
    import torch

    def collect(module: Any, grad_input: Any, grad_output: Any) -> None:
        gc.collect()

    for mlist in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for layer in mlist:
            for sub in layer.modules():
                if sub is layer or next(sub.children(), None) is None:
                    sub.register_full_backward_hook(collect)
