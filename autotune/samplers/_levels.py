"""The levels of the categorical knobs, for the ehvi sampler's residual model and stopping rule.

A level is one value of one categorical knob (a ``Strategy`` field with a ``Literal`` type, KNOBS
order: engine, ZeRO stage, offload, checkpointing granularity, precision, the fsdp2 knobs, and any
knob added later) on the candidates where that knob applies (strategy.knob_applies). Each level has
its own offset in the log-throughput residual, a priori independent of every other level's, with
sd ``LEVEL_PRIOR_SD``: measurements of bf16 say nothing about fp32's offset, so a level nobody
measured keeps that uncertainty whatever else was measured. Knobs with one level among
the feasible candidates carry no offset (the residual model's constant term is that level's).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from autotune.strategy import KNOBS, knob_applies, knob_choices

LEVEL_PRIOR_SD = 0.37
"""Prior sd of one level's log-throughput offset: the RMS, over the measured tables of data/measured/
and their categorical knobs, of the sd between that knob's level means of log(measured / simulated)
with the job file's own parameters (docs/search.md, "The level prior"; `python
benchmarks/level_prior.py` prints it; tests/search/test_level_prior.py keeps it equal)."""
REACH_Z = 2.326
"""A level "could reach the front" while one of its eligible candidates' one-sided 99% upper bounds
(mean + REACH_Z sd of log tokens/s, memory at its lower bound) clears the measured front by more
than the noise."""

CATEGORICAL_KNOBS: tuple[str, ...] = tuple(k for k in KNOBS if knob_choices(k) is not None)
"""The searched knobs with a fixed set of values (strategy.knob_choices), KNOBS order."""


def label(level: tuple[str, Any]) -> str:
    return f"{level[0]}={level[1]}"


def level_matrix(strategies: Sequence[Any]) -> tuple[list[tuple[str, Any]], np.ndarray]:
    """(levels as (knob, value), membership matrix: candidate x level, 1.0 where the candidate has
    that level) over the knobs with at least two levels among ``strategies``."""
    levels: list[tuple[str, Any]] = []
    for knob in CATEGORICAL_KNOBS:
        values = sorted({getattr(s, knob) for s in strategies if knob_applies(knob, s)}, key=str)
        if len(values) >= 2:
            levels += [(knob, v) for v in values]
    col = {lv: j for j, lv in enumerate(levels)}
    g = np.zeros((len(strategies), len(levels)))
    for i, s in enumerate(strategies):
        for knob, _ in levels:
            j = col.get((knob, getattr(s, knob)))
            if j is not None and knob_applies(knob, s):
                g[i, j] = 1.0
    return levels, g


def _front_height(front: Sequence[tuple[float, float]], mem: np.ndarray) -> np.ndarray:
    """Best measured throughput at memory <= mem (0 where none)."""
    out = np.zeros(len(mem))
    for m, t in front:
        out = np.where(mem >= m, np.maximum(out, t), out)
    return out


def reachable(mem: np.ndarray, mu: np.ndarray, sd: np.ndarray, mem_sd: np.ndarray,
              front: Sequence[tuple[float, float]], ref_x: float, noise: float) -> np.ndarray:
    """Whether each candidate could reach the measured front: its upper bound exp(mu + REACH_Z sd),
    at memory mem * exp(-REACH_Z mem_sd), beats the front there by more than ``noise``."""
    lo = mem * np.exp(-REACH_Z * mem_sd)
    return (lo < ref_x) & (np.exp(mu + REACH_Z * sd) > (1.0 + noise) * _front_height(front, lo))


def unmeasured(levels: Sequence[tuple[str, Any]], g: np.ndarray, resolved: np.ndarray, eligible: np.ndarray,
               reach: np.ndarray) -> list[int]:
    """Indices of the levels that no resolved candidate has (``resolved``: measured, or failed for a
    reason other than memory) and that an eligible candidate which could reach the front has."""
    if not len(levels):
        return []
    seen = (g[resolved] > 0).any(0) if resolved.any() else np.zeros(len(levels), dtype=bool)
    open_ = (g[eligible & reach] > 0).any(0) if (eligible & reach).any() else np.zeros(len(levels), dtype=bool)
    return [j for j in range(len(levels)) if open_[j] and not seen[j]]


def level_sd_estimate(residuals: Sequence[float], strategies: Sequence[Any]) -> dict[str, float]:
    """knob -> sd (ddof 1) of the per-level means of ``residuals`` (log measured / simulated) over
    the knobs with two or more levels: the spread of the simulator's between-level errors."""
    levels, g = level_matrix(strategies)
    r = np.asarray(residuals, dtype=float)
    out: dict[str, list[float]] = {}
    for j, (knob, _) in enumerate(levels):
        out.setdefault(knob, []).append(float(r[g[:, j] > 0].mean()))
    return {k: math.sqrt(sum((v - sum(m) / len(m)) ** 2 for v in m) / (len(m) - 1)) for k, m in out.items()}
