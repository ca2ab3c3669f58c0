"""Pareto-front math for (memory, throughput) points: pure functions, no I/O.

Objectives: minimise memory, maximise throughput.
"""

from __future__ import annotations

from typing import Sequence

Point = tuple[float, float]
"""(memory, throughput)."""


def dominates(a: Point, b: Point) -> bool:
    """a is no worse in both objectives and strictly better in one."""
    return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices of the non-dominated points, memory ascending (duplicates keep the first index).

    Sort by memory asc, throughput desc; sweep keeping points that beat the best throughput so far
    (Kung, Luccio & Preparata 1975, the 2-D maxima algorithm), O(n log n).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    best = float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def hypervolume(points: Sequence[Point], reference: Point) -> float:
    """Area dominated by ``points`` and bounded by ``reference`` (max memory, min throughput)."""
    ref_mem, ref_tps = reference
    area = 0.0
    front = [points[i] for i in pareto_front(points)]
    for k, (mem, tps) in enumerate(front):
        if mem >= ref_mem or tps <= ref_tps:
            continue
        next_mem = min(front[k + 1][0], ref_mem) if k + 1 < len(front) else ref_mem
        area += (next_mem - mem) * (tps - ref_tps)
    return area
