"""How many profiled trials does the tuner need? (issue 5, "Backend replay and tuning cost")

A replayed table stands in for real measurements: every feasible candidate of a space (llama2-7b
on 8 x A100-80GB, default space, by default) is "measured" by the simulate backend and written as
a trials.csv-shaped CSV. Then, with the replay backend answering from that table:

* tuner: ``autotune.search.run_study`` (NSGA-II, in-memory storage) with the analytic-front seeding
  (default) and without it (``seed_predicted_front=False``), over several seeds. Cost = profiled trials (calls to
  backend.evaluate: pruned candidates and repeats cost nothing) until the evaluated points reach
  >= 95% of the hypervolume of the table's true front (autotune.pareto.hypervolume, reference
  point: (GPU memory with headroom, 0 tokens/s)). Goal: <= 1.5 x the number of front points.
* exhaustive: profile every candidate the memory model lets through.
* DeepSpeed-autotuning-style sweep (DeepSpeed autotuner, docs/_tutorials/autotuning.md): for each
  ZeRO stage, with the user's other settings fixed (no offload; activation checkpointing as the
  user set it: reported for none and full), find the largest micro-batch that runs by bisection
  over the space's micro-batch sizes (a failing probe = OOM), then profile up to 3 micro-batch
  sizes up to it (``num_tuning_micro_batch_sizes`` = 3). It optimises throughput only, so the
  hypervolume it reaches is reported next to its trial count.

``--perturb`` makes the table disagree with the models the tuner seeds from (a GPU that behaves
unlike its preset: GEMM/attention/communication efficiencies scaled, plus seeded per-candidate
log-normal noise on tokens/s and memory), which is the honest case for the seeding: with an exact
table the seeded front is right by construction.

Run: ``python benchmarks/search_cost.py [--config examples/llama2-7b.yaml] [--seeds 5] [--perturb]``
"""

from __future__ import annotations

import argparse
import warnings
import csv
import hashlib
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autotune.config import load_config  # noqa: E402
from autotune.output import CSV_COLUMNS, STRATEGY_COLUMNS  # noqa: E402
from autotune.pareto import hypervolume, pareto_front  # noqa: E402
from autotune.profile.backend import Measurement  # noqa: E402
from autotune.profile.replay import ReplayBackend  # noqa: E402
from autotune.search import run_study, screen  # noqa: E402
from autotune.simulate import efficiency_params, simulate  # noqa: E402
from autotune.space import load_space  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

GIB = float(1 << 30)
TARGET = 0.95


def _noise(key: tuple, salt: str, sigma: float) -> float:
    """Deterministic log-normal factor per candidate (hash of its strategy)."""
    h = hashlib.sha256((repr(key) + salt).encode()).digest()
    u1 = (int.from_bytes(h[:8], "big") + 1) / 2**64
    u2 = int.from_bytes(h[8:16], "big") / 2**64
    z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)  # Box-Muller
    return math.exp(sigma * z)


def build_table(cfg: Any, screened: list, path: str, perturb: bool) -> list[tuple[Strategy, float, float]]:
    """Write the replay table: one COMPLETE row per feasible candidate; returns (strategy, GiB, tok/s)."""
    params = None
    if perturb:
        params = efficiency_params(cfg.hardware.gpu)[0]
        params.update(gemm_eff=params["gemm_eff"] * 0.8, attn_eff=params["attn_eff"] * 0.7,
                      comm_eff=params["comm_eff"] * 0.6, overlap=params["overlap"] * 0.7)
    rows = []
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, restval="")
        w.writeheader()
        n = 0
        for sc in screened:
            if not sc.memory.fits:
                continue
            s = sc.strategy
            sim = simulate(cfg.model, cfg.training, cfg.hardware, s, params)
            mem_gib = sc.memory.gpu["peak"] / GIB
            tps = sim.tokens_per_s_per_gpu
            if perturb:
                tps *= _noise(s.key(), "tps", 0.05)
                mem_gib *= _noise(s.key(), "mem", 0.03)
            w.writerow({"number": n, "state": "COMPLETE", **{k: "" if getattr(s, k) is None else getattr(s, k)
                                                              for k in STRATEGY_COLUMNS},
                        "peak_memory_gib": repr(mem_gib), "tokens_per_s_per_gpu": repr(tps),
                        "step_time_s": repr(sim.step_time_s), "mfu": repr(sim.mfu), "strategy": s.describe()})
            rows.append((s, mem_gib, tps))
            n += 1
    return rows


class Recording:
    """Wraps a backend and records every profiled point in order."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.points = inner, inner.name, []
        self.calls = 0

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        self.calls += 1
        m = self.inner.evaluate(strategy, trial_number=trial_number)
        self.points.append((m.peak_memory_bytes / GIB, m.tokens_per_s_per_gpu) if m.ok else None)
        return m


def trials_to_target(points: list, hv_true: float, ref: tuple[float, float]) -> tuple[Optional[int], float]:
    """First number of profiled trials whose points reach TARGET x hv_true, and the final fraction."""
    got: list = []
    hit = None
    for i, p in enumerate(points, start=1):
        if p is not None:
            got.append(p)
            if hit is None and hypervolume(got, ref) >= TARGET * hv_true:
                hit = i
    return hit, (hypervolume(got, ref) / hv_true if got else 0.0)


def ds_autotuning_sweep(cfg: Any, space: Any, replay: ReplayBackend, checkpointing: str) -> tuple[int, list]:
    """DeepSpeed-autotuner-style: per ZeRO stage, bisect the largest runnable micro-batch, then
    profile up to 3 micro-batch sizes up to it. Returns (profiled trials, measured points)."""
    dp = cfg.hardware.num_gpus
    mbs_all = sorted(m for m in space.micro_batch_size if cfg.training.global_batch_size % (m * dp) == 0)
    cache: dict[int, Optional[tuple[float, float]]] = {}
    points: list = []
    trials = 0
    for stage in space.zero_stage:
        cache.clear()
        n_layers = cfg.model.num_hidden_layers if checkpointing != "none" else None

        def probe(mbs: int) -> bool:
            nonlocal trials
            if mbs not in cache:
                s = Strategy(zero_stage=stage, micro_batch_size=mbs, checkpointing=checkpointing,
                             checkpoint_layers=n_layers, precision=cfg.training.precision)
                m = replay.evaluate(s)
                trials += 1
                cache[mbs] = (m.peak_memory_bytes / GIB, m.tokens_per_s_per_gpu) if m.ok else None
                points.append(cache[mbs])
            return cache[mbs] is not None

        if not mbs_all or not probe(mbs_all[0]):
            continue  # the stage does not run even at the smallest micro-batch
        lo, hi = 0, len(mbs_all) - 1  # invariant: mbs_all[lo] runs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if probe(mbs_all[mid]):
                lo = mid
            else:
                hi = mid - 1
        runnable = mbs_all[: lo + 1]
        picks = {runnable[-1], runnable[len(runnable) // 2], runnable[0]} if len(runnable) > 2 else set(runnable)
        for mbs in sorted(picks):
            probe(mbs)
    return trials, points


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    ap.add_argument("--space", default=None, help="search space (default: the config's)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=400, help="trial budget per study")
    ap.add_argument("--perturb", action="store_true", help="table disagrees with the analytic models")
    ap.add_argument("--table", default=None, help="where to write the replay CSV (default: a temp file)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*set_metric_names is experimental.*")

    t_start = time.perf_counter()
    cfg = load_config(args.config)
    space = load_space(args.space or cfg.search.space, ROOT)
    headroom = cfg.search.headroom
    screened = screen(cfg, space, headroom)
    table = args.table or os.path.join(tempfile.mkdtemp(prefix="autotune-replay-"), "trials.csv")
    rows = build_table(cfg, screened, table, args.perturb)
    ref = (cfg.hardware.gpu.memory_bytes * (1 - headroom) / GIB, 0.0)
    pts = [(m, t) for _, m, t in rows]
    front = pareto_front(pts)
    hv_true = hypervolume(pts, ref)
    goal = 1.5 * len(front)
    print(f"# {cfg.model.name} on {cfg.hardware.num_gpus} x {cfg.hardware.gpu.name}, space {space.name}, "
          f"table {'perturbed' if args.perturb else 'exact (= simulate backend)'}: {table}")
    print(f"candidates {len(screened)}, fit the memory model {len(rows)}, true front {len(front)} points; "
          f"goal <= {goal:.1f} profiled trials to reach {TARGET:.0%} of the front's hypervolume")
    print()
    print(f"{'method':<44} {'profiled trials to 95% HV':>26} {'HV reached':>11}")
    print(f"{'exhaustive (every candidate that fits)':<44} {len(rows):>26} {1.0:>11.3f}")
    exhaustive_order_hit, _ = trials_to_target(pts, hv_true, ref)
    print(f"{'  (same, in screening order: 95% reached at)':<44} {exhaustive_order_hit:>26}")
    summary: dict[str, list] = {}
    for label, seeded in (("tuner, seeded with the analytic front", True), ("tuner, no seeding", False)):
        hits, fracs, calls = [], [], []
        for seed in range(args.seeds):
            rec = Recording(ReplayBackend(table, cfg))
            run_study(cfg, space, rec, storage=None, study_name=f"cost-{seed}", n_trials=args.trials, seed=seed,
                      sampler="nsga2", headroom=headroom, seed_predicted_front=seeded)
            hit, frac = trials_to_target(rec.points, hv_true, ref)
            hits.append(hit)
            fracs.append(frac)
            calls.append(rec.calls)
        reached = [h for h in hits if h is not None]
        shown = ", ".join("-" if h is None else str(h) for h in hits)
        med = f"median {statistics.median(reached):g}" if len(reached) == len(hits) else \
            f"{len(reached)}/{len(hits)} seeds reached"
        print(f"{label:<44} {med:>26} {min(fracs):>11.3f}   per seed: {shown} "
              f"(of {min(calls)}-{max(calls)} profiled)")
        summary[label] = hits
    for ckpt in ("none", "full"):
        n, got = ds_autotuning_sweep(cfg, space, ReplayBackend(table, cfg), ckpt)
        hit, frac = trials_to_target(got, hv_true, ref)
        label = f"DeepSpeed-autotuning sweep (ckpt {ckpt})"
        print(f"{label:<44} {('never; ' + str(n) + ' trials') if hit is None else hit:>26} {frac:>11.3f}")
    print(f"\n(wall {time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
