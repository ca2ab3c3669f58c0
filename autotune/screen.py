"""Screening: every candidate of a search space through the analytic models (memory, and the
simulator for those that fit), and the predicted front the study starts from."""

from __future__ import annotations

import gc
from functools import partial
from typing import Callable, NamedTuple, Optional

from autotune.config import Config
from autotune.memory import MemoryEstimate, estimate_memory
from autotune.memory._fast import verdicts
from autotune.memory.common import DeferredEstimate
from autotune.pareto import pareto_front
from autotune.simulate import Simulator
from autotune.space import SearchSpace
from autotune.strategy import Strategy


class Screened(NamedTuple):
    """One candidate as the analytic models see it."""

    strategy: Strategy
    memory: MemoryEstimate
    tokens_per_s_per_gpu: float = 0.0
    """Simulated throughput (0 when infeasible: not simulated)."""


def screen(cfg: Config, space: SearchSpace, headroom: float, params: Optional[dict] = None) -> list[Screened]:
    """Every candidate of the space through the memory model, and the feasible ones through the
    simulator (with efficiency ``params`` when given, e.g. from a calibration).

    The verdicts of the whole space come from memory._fast at once (equal to estimate_memory's);
    each candidate's MemoryEstimate is a DeferredEstimate whose figures estimate_memory computes when
    first read.

    With ``search.fidelity: traced`` every candidate's activations come from a FakeTensorMode trace
    of the real model (autotune.trace; one trace per micro-batch x checkpointing pair, reused across
    ZeRO stages and offload); with ``search.trace_near_limit`` only those within that fraction of
    the usable memory are traced.
    """
    model, training, hardware = cfg.model, cfg.training, cfg.hardware
    traced = _tracer(cfg, headroom)
    capacity = hardware.gpu.memory_bytes * (1 - headroom)
    near = cfg.search.trace_near_limit * capacity
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of small acyclic records: the cyclic collector would rescan them
    try:
        strategies = list(space.candidates(model))
        grid = verdicts(model, training, hardware, strategies, headroom=headroom) if not traced else \
            [None] * len(strategies)
        simulator = Simulator(model, training, hardware, params)
        estimate = partial(estimate_memory, model, training, hardware, headroom=headroom)
        out = []
        deferred, new = DeferredEstimate.of, tuple.__new__  # (Screened's own __new__, without its call)
        for strategy, verdict in zip(strategies, grid):
            if verdict is None:  # not on the grid (or traced): the estimate itself
                mem = estimate(strategy)
                if traced and (cfg.search.fidelity == "traced" or abs(mem.total_gpu_bytes - capacity) <= near):
                    mem = traced(strategy)
            else:
                mem = deferred(verdict[0], verdict[1], estimate, strategy)
            out.append(new(Screened, (strategy, mem, simulator(strategy).tokens_per_s_per_gpu if mem.fits else 0.0)))
        return out
    finally:
        if collecting:
            gc.enable()


def _tracer(cfg: Config, headroom: float) -> Optional[Callable[[Strategy], MemoryEstimate]]:
    """A function tracing one strategy (with a shared cache), or None when tracing is off."""
    if cfg.search.fidelity != "traced" and cfg.search.trace_near_limit <= 0:
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        from autotune.errors import ConfigError

        raise ConfigError("traced memory needs torch: pip install torch==2.13.0 -e '.[profile]'",
                          path="search.fidelity") from None
    from autotune.trace import TraceCache, traced_estimate

    cache = TraceCache()
    return lambda strategy: traced_estimate(cfg, strategy, cache, headroom=headroom)[0]


def predicted_front(screened: list[Screened]) -> list[Screened]:
    """The predicted Pareto front of the feasible candidates on (what the GPU must hold, tokens/s),
    the figures the run's front is drawn on (output.front_rows), memory ascending."""
    feasible = [s for s in screened if s.memory.fits]
    idx = pareto_front([(s.memory.total_gpu_bytes, s.tokens_per_s_per_gpu) for s in feasible])
    return [feasible[i] for i in idx]


def spread(points: list, k: int) -> list:
    """At most ``k`` of ``points`` (a front, memory ascending), evenly spaced and always including
    both ends: a budget smaller than the predicted front still covers low memory and top speed."""
    if k >= len(points):
        return list(points)
    if k == 1:
        return [points[-1]]
    return [points[round(i * (len(points) - 1) / (k - 1))] for i in range(k)]
