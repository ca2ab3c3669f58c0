"""The ehvi tuner's path through one measured table, trial by trial: which candidate it profiled, what
it predicted before measuring it (mean tokens/s and the sd in log), what the table holds, the
standardised error, and the hypervolume reached so far (strict / noise-aware, as
benchmarks/search_cost.py counts it), with the stopping statistic after each measurement.

    python benchmarks/search_trajectory.py data/measured/tiny-llama-1rank-loaded --trials 16
    python benchmarks/search_trajectory.py data/measured/tiny-gpt2-2rank --step 3   # one measured step

It replays the table through the same loop and sampler as search_cost.py (``Recording`` over
``ReplayBackend`` with a Calibrator; the stopping rule is read, not applied). The ehvi tuner is
deterministic, so the path is the one behind search_cost.py's count. Rows marked F are true-front
points of the table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import search_cost as sc  # noqa: E402


def trajectory(folder: str, trials: int) -> list[dict[str, Any]]:
    """Replay ``folder`` (a data/measured table) through the ehvi tuner for ``trials`` trials; one dict
    per profiled trial."""
    import autotune.samplers.front as sampler_mod
    from autotune.calibration.loop import Calibrator
    from autotune.backends.replay import ReplayBackend

    cfg, space, table, rows = sc.load_measured(folder)
    ref = (cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom) / sc.GIB, 0.0)
    targets = sc.Targets(rows, ref)
    front = {rows[i][0].key() for i in sc.pareto_front([(m, t) for _, m, t, _ in rows])}
    stop_gain = sampler_mod.DEFAULT_STOP_GAIN
    sampler_mod.DEFAULT_STOP_GAIN = -1.0  # run the whole budget; the stopping statistic is reported
    try:
        rec = sc.Recording(ReplayBackend(table, cfg, calibrator=Calibrator(cfg, None, autosave=False)))
        smp = sc._study(cfg, space, rec, 0, "ehvi", min(trials, len(rows)), False).study.sampler
    finally:
        sampler_mod.DEFAULT_STOP_GAIN = stop_gain
    chosen = [smp._chosen[n] for n in sorted(smp._chosen)]  # candidate index per trial, in order
    out, points = [], []
    for k, (idx, p) in enumerate(zip(chosen, rec.points), start=1):
        points.append(p)
        _, frac, _, nfrac = targets.of(points)
        s = smp.strategies[idx] if idx >= 0 else None
        mu, sd = smp._predicted.get(idx), smp._predicted_sd.get(idx)
        err = math.log(p[1]) - mu if (p is not None and mu is not None) else None
        out.append({"trial": k, "front": s is not None and s.key() in front,
                    "strategy": s.describe(cfg.model.num_hidden_layers) if s is not None else "-",
                    "predicted": math.exp(mu) if mu is not None else None, "sd": sd,
                    "measured": None if p is None else p[1], "gib": None if p is None else p[0],
                    "spread": None if p is None else p[2], "error": err,
                    "z": err / sd if (err is not None and sd) else None,
                    "hv": frac, "hv_noise": nfrac,
                    "gain": smp.history[k - 1].gain if k <= len(smp.history) else None})
    return out


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a measured table: a folder with config.yaml and trials.csv")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--step", type=int, default=None, help="use measured step K (1-3) instead of the median")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.folder, "trials.csv")):
        print(f"search_trajectory.py: error: {args.folder}: no trials.csv there", file=sys.stderr)
        return 2
    folder = args.folder
    if args.step is not None:
        folder = sc.step_table(folder, args.step - 1, os.path.join(tempfile.mkdtemp(), f"step{args.step}"))
    print(f"{'#':>3}   {'strategy':<58} {'predicted':>9} {'sd':>5} {'measured':>9} {'spread':>6} "
          f"{'error':>6} {'z':>5} {'HV strict / noise':>17} {'gain':>7}")
    for r in trajectory(folder, args.trials):
        print(f"{r['trial']:>3} {'F' if r['front'] else ' '} {r['strategy'][:58]:<58} {_f(r['predicted'], '9,.0f')} "
              f"{_f(r['sd'], '5.2f')} {_f(r['measured'], '9,.0f')} {_f(r['spread'], '6.2f')} {_f(r['error'], '+6.2f')} "
              f"{_f(r['z'], '+5.1f')} {r['hv']:>8.3f} / {r['hv_noise']:.3f} {_f(r['gain'], '7.3f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
