"""Traced activations + analytical model states: ``combine`` and ``traced_estimate`` (what
``autotune estimate --trace`` and ``search: {fidelity: traced}`` call)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from autotune.config import Config
from autotune.reason import Reason, kind_of
from autotune.spec import GIB, ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.trace.run import TraceCache, TraceResult


ACTIVATION_COMPONENTS = ("activations", "logits")
"""Analytical GPU components replaced by the trace (MemoryEstimate.gpu keys)."""
NON_PEAK_COMPONENTS = ("overhead", "peak")
"""MemoryEstimate.gpu keys that are not part of the allocated peak."""


def combine(trace: TraceResult, estimate: Any, *, capacity_bytes: Optional[float] = None,
            model: Optional[ModelSpec] = None, training: Optional[TrainingSpec] = None,
            strategy: Optional[Strategy] = None) -> tuple[Any, dict]:
    """A MemoryEstimate whose activations/temporaries come from `trace`, model states and buffers from `estimate`.

    With ``E`` the analytical estimate (``autotune.memory.MemoryEstimate``):

    * ``states_fb`` = what E holds besides activations at its forward/backward peak:
      ``E.gpu["peak"] - E.gpu["activations"] - E.gpu["logits"]`` when E peaks in forward or
      backward (params, optimizer states, gradients so far and DeepSpeed buffers of that instant);
      when E peaks at the optimizer step, ``E.phases["backward"]`` minus E's backward-start
      activations (``activation_breakdown``: saved blocks + non-block + loss backward transient);
    * combined ``peak`` = max(``states_fb`` + traced activation peak, ``E.phases["optimizer"]``);
    * ``gpu["activations"]`` = the traced activation + temporary peak (logits, the fp32 loss upcast
      and every backward temporary included, so ``gpu["logits"]`` = 0) when the combined peak is in
      forward/backward; ``gpu["buffers"]`` absorbs the rest so the components still sum to the peak.

    When `capacity_bytes` (GPU memory x (1 - headroom)) is given, ``fits``/``reasons`` are re-decided
    on the combined peak + overhead (host RAM / NVMe reasons of E are kept). Returns the estimate
    and a provenance dict naming where each component came from.
    """
    gpu = dict(estimate.gpu)
    phases = dict(getattr(estimate, "phases", {}) or {})
    peak_phase = getattr(estimate, "peak_phase", "backward")
    analytic_act = sum(int(gpu.get(k, 0)) for k in ACTIVATION_COMPONENTS)
    if peak_phase != "optimizer" or "backward" not in phases or None in (model, training, strategy):
        states_fb = int(gpu["peak"]) - analytic_act
        how = f"analytic peak ({peak_phase}) minus its activations and logits"
    else:
        from autotune.memory import activation_breakdown

        act = activation_breakdown(model, training, strategy)  # type: ignore[arg-type]
        states_fb = int(phases["backward"] - act.blocks - act.nonblock - act.loss_backward_transient)
        how = "analytic backward phase minus its backward-start activations"
    fb_peak = states_fb + int(trace.activation_peak)
    opt_peak = int(phases.get("optimizer", 0))
    new_peak = max(fb_peak, opt_peak)
    states = {k: int(v) for k, v in gpu.items() if k not in ACTIVATION_COMPONENTS + NON_PEAK_COMPONENTS}
    if fb_peak >= opt_peak:
        new_phase = trace.at_activation_peak.get("phase", "backward")
        gpu["activations"] = int(trace.activation_peak)
        gpu["logits"] = 0
        gpu["buffers"] = int(gpu.get("buffers", 0)) + (states_fb - sum(states.values()))
    else:  # the optimizer step dominates: the analytical breakdown of that phase stands
        new_phase = "optimizer"
    gpu["peak"] = int(new_peak)
    changes: dict[str, Any] = {"gpu": gpu}
    if hasattr(estimate, "peak_phase"):
        changes["peak_phase"] = new_phase
    if phases:
        phases[trace.at_activation_peak.get("phase", "backward")] = fb_peak
        changes["phases"] = phases
    if capacity_bytes is not None and hasattr(estimate, "fits"):
        changes["fits"], changes["reasons"] = _verdict(estimate, gpu, capacity_bytes)
    try:
        combined = dataclasses.replace(estimate, **changes)
    except (TypeError, ValueError):
        combined = estimate
        for k, v in changes.items():
            setattr(combined, k, v)
    return combined, _provenance(trace, estimate, gpu, states, how, analytic_act)


def _verdict(estimate: Any, gpu: dict[str, int], capacity_bytes: float) -> tuple[bool, list[str]]:
    """fits / reasons re-decided on the combined peak + overhead; the estimate's other reasons
    (rules, host RAM, NVMe) stand."""
    total = gpu["peak"] + int(gpu.get("overhead", 0))
    fits_gpu = total <= capacity_bytes
    reasons = [r for r in getattr(estimate, "reasons", []) if kind_of(r) != "gpu_memory"]
    if not fits_gpu:
        reasons.insert(0, Reason(f"traced peak {gpu['peak'] / GIB:.2f} GiB + overhead "
                                 f"{int(gpu.get('overhead', 0)) / GIB:.2f} GiB > {capacity_bytes / GIB:.2f} GiB free",
                                 "gpu_memory"))
    return fits_gpu and not reasons, reasons


def _provenance(trace: TraceResult, estimate: Any, gpu: dict[str, int], states: dict[str, int], how: str,
                analytic_act: int) -> dict[str, Any]:
    """Where each component of the combined estimate came from, and the trace's own figures."""
    return {
        "fidelity": "traced",
        "traced": {"activations": f"{trace.source} model under FakeTensorMode + MemTracker: peak of activations "
                                  f"+ temporaries over forward/backward ({trace.at_activation_peak.get('phase', '?')})",
                   "logits": "included in traced activations"},
        "analytic": {**{k: "autotune.memory (model states / DeepSpeed buffers are invisible to a plain trace)"
                        for k in states}, "states_at_fwd_bwd_peak": how, "optimizer_phase": "autotune.memory"},
        "analytic_activations_bytes": analytic_act,
        "traced_activations_bytes": int(trace.activation_peak),
        "traced_saved_activations_bytes": int(trace.saved_activations),
        "analytic_peak_bytes": int(estimate.gpu.get("peak", 0)),
        "combined_peak_bytes": gpu["peak"],
        "trace": {"source": trace.source, "micro_batch_size": trace.micro_batch_size,
                  "checkpointing": trace.checkpointing, "checkpoint_layers": trace.checkpoint_layers,
                  "wall_s": round(trace.wall_s, 2), "flops_per_micro_batch": trace.flops["total"],
                  "notes": list(trace.notes)},
    }


def traced_estimate(cfg: Config, strategy: Strategy, cache: Optional[TraceCache] = None,
                    headroom: Optional[float] = None) -> tuple[Any, dict]:
    """``estimate_memory`` with activations from a trace: what ``autotune estimate --trace`` and
    ``search: {fidelity: traced}`` call."""
    from autotune.memory import estimate_memory

    h = cfg.search.headroom if headroom is None else headroom
    mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy, headroom=h)
    cache = cache if cache is not None else TraceCache()
    if cfg.model_factory:  # the factory module may sit next to the job file, as for profiling
        from autotune.models.sources import load_factory

        load_factory(cfg.model_factory, [os.path.dirname(os.path.abspath(cfg.path)), os.getcwd()])
    trace = cache.get(cfg.model, cfg.training, strategy, hf_config=cfg.hf_config, model_factory=cfg.model_factory)
    return combine(trace, mem, capacity_bytes=cfg.hardware.gpu.memory_bytes * (1 - h),
                   model=cfg.model, training=cfg.training, strategy=strategy)
