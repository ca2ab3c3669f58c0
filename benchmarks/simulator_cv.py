"""Cross-validated error of the throughput simulator on the published llm-foundry runs.

    python benchmarks/simulator_cv.py [--csv PATH] [--k 5] [--seeds 0] [--rows] [--json]

Fits the per-GPU efficiency parameters (autotune.calibration.fit.fit_efficiency) on k-1 folds and
predicts tokens_per_s_per_gpu of the held-out fold; reports median / p90 / max absolute relative
error overall and per GPU (out-of-fold only, never the fit error), then the parameters fitted on
all rows (the values stored in autotune/presets.py). Rows that are excluded are listed with why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.calibration.fit import cross_validate, fit_efficiency, load_llmfoundry_csv  # noqa: E402

DEFAULT_CSV = ROOT / "data" / "reference" / "llmfoundry-calibration.csv"


def _fmt(s: dict) -> str:
    return f"n={s['n']:3d}  median {100 * s['median']:5.2f}%  p90 {100 * s['p90']:5.2f}%  max {100 * s['max']:5.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="llmfoundry-calibration.csv path")
    ap.add_argument("--k", type=int, default=5, help="number of folds (default 5)")
    ap.add_argument("--seeds", default="0", help="comma-separated shuffle seeds; each is a full k-fold run")
    ap.add_argument("--rows", action="store_true", help="print every out-of-fold prediction")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)

    if not Path(args.csv).is_file():
        print(f"simulator_cv: error: --csv: no such file {args.csv}", file=sys.stderr)
        return 2
    excluded: list = []
    runs = load_llmfoundry_csv(args.csv, excluded=excluded)
    t0 = time.perf_counter()
    results = {int(s): cross_validate(runs, k=args.k, seed=int(s)) for s in args.seeds.split(",")}
    cv_s = time.perf_counter() - t0
    by_gpu: dict = {}
    for r in runs:
        by_gpu.setdefault(r.hardware.gpu.name, []).append(r)
    fitted = {g: fit_efficiency(rs) for g, rs in sorted(by_gpu.items())}

    if args.json:
        out = {
            "csv": args.csv, "rows_used": len(runs), "excluded": excluded, "k": args.k,
            "cv": {s: {"overall": r["overall"], "per_gpu": r["per_gpu"]} for s, r in results.items()},
            "fitted": fitted,
        }
        print(json.dumps(out, indent=2))
        return 0

    print(f"data: {args.csv}")
    print(f"rows used: {len(runs)}; excluded: {len(excluded)}")
    for label, why in excluded:
        print(f"  excluded {label}: {why}")
    for seed, res in results.items():
        print(f"\n{args.k}-fold cross-validation (seed {seed}), |predicted/measured - 1| of tokens_per_s_per_gpu,"
              " out-of-fold only:")
        print(f"  overall     {_fmt(res['overall'])}")
        for g, s in res["per_gpu"].items():
            print(f"  {g:<11} {_fmt(s)}")
        if args.rows:
            for label, g, meas, pred, err in sorted(res["rows"], key=lambda r: -abs(r[4])):
                print(f"    {label:<45} measured {meas:9.0f} predicted {pred:9.0f} {100 * err:+6.1f}%")
    print(f"\n(cross-validation took {cv_s:.1f} s)")
    print("\nparameters fitted on all rows (autotune/presets.py efficiency=):")
    for g, p in fitted.items():
        print(f"  {g}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
