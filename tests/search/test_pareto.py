"""Pareto math, tested directly (pure functions)."""

import random

from autotune.pareto import dominates, hypervolume, pareto_front


def brute_front(points):
    return sorted(i for i, p in enumerate(points)
                  if not any(dominates(q, p) for q in points)
                  and all(points[j] != p for j in range(i)))


def test_front_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        pts = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(rng.randint(1, 40))]
        front = pareto_front(pts)
        assert sorted(front) == brute_front(pts)
        mems = [pts[i][0] for i in front]
        assert mems == sorted(mems)


def test_hypervolume():
    pts = [(1.0, 1.0), (2.0, 3.0), (3.0, 2.0)]  # (3,2) is dominated by (2,3)
    # region: [1,2]x[0,1] + [2,4]x[0,3] = 1 + 6
    assert hypervolume(pts, (4.0, 0.0)) == 7.0
    assert hypervolume(pts[:1], (4.0, 0.0)) < hypervolume(pts, (4.0, 0.0))
    assert hypervolume([], (4.0, 0.0)) == 0.0


def test_spread_keeps_both_ends_and_budget():
    from autotune.search import spread

    pts = list(range(46))
    assert spread(pts, 100) == pts
    got = spread(pts, 20)
    assert len(got) == len(set(got)) == 20 and got[0] == 0 and got[-1] == 45 and got == sorted(got)
    assert spread(pts, 1) == [45]  # the fastest point when only one evaluation is allowed
