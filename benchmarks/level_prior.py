"""How wrong the simulator's between-level ratios have been: the prior of the residual model's level
offsets (autotune.samplers._levels.LEVEL_PRIOR_SD, docs/search.md "The level prior").

For each measured table in data/measured/ (every strategy of its space measured), the residual of
each row is log(measured tokens/s / simulated tokens/s) with the job file's own simulator parameters
(what the sampler starts from, before any calibration). For each categorical knob with two or more
levels in the table, the level means of that residual are taken, and their sd (ddof 1) is that
knob's between-level error on that table (sd of one level's offset: a pair of levels differs by
sqrt(2) of it). The prior is the RMS of those sd over every (table, knob).

    python benchmarks/level_prior.py
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def level_errors(measured_dir: Optional[str] = None) -> list[tuple[str, str, float]]:
    """(table, knob, sd of the level means of the log residual) for every table and knob."""
    from tables import load_measured

    from autotune.samplers._levels import level_sd_estimate
    from autotune.simulate import simulate

    root = measured_dir or os.path.join(ROOT, "data", "measured")
    out = []
    for d in sorted(os.listdir(root)):
        folder = os.path.join(root, d)
        if not os.path.isfile(os.path.join(folder, "trials.csv")):
            continue
        cfg, _, _, rows = load_measured(folder)
        res = [math.log(t / simulate(cfg.model, cfg.training, cfg.hardware, s).tokens_per_s_per_gpu)
               for s, _, t, _ in rows]
        for knob, sd in level_sd_estimate(res, [s for s, *_ in rows]).items():
            out.append((d, knob, sd))
    return out


def prior_sd(errors: list[tuple[str, str, float]]) -> float:
    return math.sqrt(sum(e * e for *_, e in errors) / len(errors))


def main() -> int:
    from autotune.samplers._levels import LEVEL_PRIOR_SD

    errors = level_errors()
    print(f"{'table':<34} {'knob':<24} sd of level offsets (log)")
    for table, knob, sd in errors:
        print(f"{table:<34} {knob:<24} {sd:.3f}")
    by_knob: dict[str, list[float]] = {}
    for _, knob, sd in errors:
        by_knob.setdefault(knob, []).append(sd)
    for knob, v in by_knob.items():
        print(f"{'RMS over tables':<34} {knob:<24} {math.sqrt(sum(x * x for x in v) / len(v)):.3f}")
    print(f"prior: RMS over {len(errors)} (table, knob) = {prior_sd(errors):.3f} "
          f"(max {max(e for *_, e in errors):.3f}); LEVEL_PRIOR_SD = {LEVEL_PRIOR_SD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
