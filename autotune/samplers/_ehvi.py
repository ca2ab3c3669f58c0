"""Expected hypervolume improvement and the 2-D hypervolume for the ehvi sampler (autotune.samplers.front's
module docstring gives the formulas and their sources)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF through erf's rational approximation (Abramowitz & Stegun 7.1.26, |error|
    < 1.5e-7), vectorised: scipy is not a core dependency."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def expected_hvi(x: np.ndarray, mu: np.ndarray, sd: np.ndarray, front: Sequence[tuple[float, float]],
                 ref_x: float, noise: float = 0.0) -> np.ndarray:
    """Expected hypervolume improvement of points (x_i, Y_i), log Y_i ~ N(mu_i, sd_i^2), over ``front``
    (memory minimised, throughput maximised; reference point (ref_x, 0)); heights are raised by
    ``noise`` (relative) so that improvements within the noise count for nothing."""
    pts = sorted((m, t) for m, t in front if m < ref_x and t > 0)
    edges = [p[0] for p in pts] + [ref_x]
    heights, run = [], 0.0
    for m, t in pts:
        run = max(run, t)
        heights.append(run)
    lo = np.array([-np.inf] + edges[:-1])  # segment j spans [lo_j, hi_j) at height h_j (0 before the first point)
    hi = np.array(edges)
    h = np.array([0.0] + heights) * (1.0 + noise)
    length = np.clip(hi[None, :] - np.maximum(x[:, None], lo[None, :]), 0.0, None)
    mean = np.exp(mu + 0.5 * sd * sd)
    with np.errstate(divide="ignore", invalid="ignore"):
        d2 = (mu[:, None] - np.log(np.where(h > 0, h, 1.0))[None, :]) / sd[:, None]
    d1 = d2 + sd[:, None]
    call = np.where(h[None, :] > 0, mean[:, None] * _norm_cdf(d1) - h[None, :] * _norm_cdf(d2), mean[:, None])
    return (length * np.maximum(call, 0.0)).sum(1)


def _staircase_area(m: np.ndarray, t: np.ndarray, ref_x: float) -> np.ndarray:
    """Area dominated by 2-D point sets, one set per row of ``m`` / ``t`` (memory minimised,
    throughput maximised, reference (ref_x, 0)): the integral over memory x < ref_x of the best
    throughput at memory <= x, i.e. sum_k (m_(k+1) - m_k) * max_(j<=k) t_j over the sorted points
    (the 2-D hypervolume; Optuna's compute_hypervolume gives the same per set, one set per call)."""
    t = np.where(m < ref_x, np.maximum(t, 0.0), 0.0)
    m = np.minimum(m, ref_x)
    order = np.argsort(m, axis=1)
    ms = np.take_along_axis(m, order, 1)
    best = np.maximum.accumulate(np.take_along_axis(t, order, 1), axis=1)
    widths = np.diff(np.concatenate([ms, np.full((len(m), 1), ref_x)], axis=1), axis=1)
    return (widths * best).sum(1)


def expected_remaining_gain(x: np.ndarray, mu: np.ndarray, sd: np.ndarray, front: Sequence[tuple[float, float]],
                            ref_x: float, noise: float = 0.0, mem_sd: Optional[np.ndarray] = None,
                            samples: int = 256, seed: int = 0) -> float:
    """Expected hypervolume improvement of profiling *every* remaining candidate (x_i, Y_i), log Y_i ~
    N(mu_i, sd_i^2) independently, memory log-normal with sd ``mem_sd``, over ``front``; each draw is
    lowered by the relative ``noise`` (gains within noise count for nothing, as in expected_hvi).
    Monte Carlo over ``samples`` draws (common random numbers: ``seed``)."""
    if len(x) == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    fm = np.array([p[0] for p in front] or [ref_x], dtype=float)
    ft = np.array([p[1] for p in front] or [0.0], dtype=float)
    ys = np.exp(mu[None, :] + sd[None, :] * rng.standard_normal((samples, len(x)))) / (1.0 + noise)
    xs = np.broadcast_to(x, ys.shape)
    if mem_sd is not None:
        xs = x[None, :] * np.exp(mem_sd[None, :] * rng.standard_normal((samples, len(x))))
    base = float(_staircase_area(fm[None, :], ft[None, :], ref_x)[0])
    m = np.concatenate([np.broadcast_to(fm, (samples, len(fm))), xs], axis=1)
    t = np.concatenate([np.broadcast_to(ft, (samples, len(ft))), ys], axis=1)
    return float(np.mean(_staircase_area(m, t, ref_x)) - base)


def hypervolume(points: Sequence[tuple[float, float]], ref_x: float) -> float:
    """Optuna's hypervolume of (memory, tokens/s) points, both as minimised objectives."""
    from autotune._optuna_compat import compute_hypervolume

    pts = [(m, -t) for m, t in points if m < ref_x and t > 0]
    if not pts:
        return 0.0
    return float(compute_hypervolume(np.array(pts, dtype=float), np.array([ref_x, 0.0]), assume_pareto=False))
