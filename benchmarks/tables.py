"""The replay tables the search-cost benchmarks run on: simulated tables (exact or perturbed) written
from a screened space, and the measured tables of data/measured read back as rows. Shared by
search_cost.py and level_tables.py."""

from __future__ import annotations

import csv
import hashlib
import math
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autotune.config import load_config  # noqa: E402
from autotune.backends.replay import ReplayBackend  # noqa: E402
from autotune.runfiles import CSV_COLUMNS, STRATEGY_COLUMNS  # noqa: E402
from autotune.simulate import efficiency_params, simulate  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

GIB = float(1 << 30)


def _noise(key: tuple, salt: str, sigma: float) -> float:
    """Deterministic log-normal factor per candidate (hash of its strategy)."""
    h = hashlib.sha256((repr(key) + salt).encode()).digest()
    u1 = (int.from_bytes(h[:8], "big") + 1) / 2**64
    u2 = int.from_bytes(h[8:16], "big") / 2**64
    z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)  # Box-Muller
    return math.exp(sigma * z)


NOISE_TPS, NOISE_MEM = 0.05, 0.03
"""Per-candidate log-normal noise of the noisy tables (sd of log tokens/s, of log peak memory)."""

PERTURBATIONS = {
    "exact": ({}, False),
    "efficiency": ({"gemm_eff": 0.8, "attn_eff": 0.7}, False),
    "slow-comm": ({"comm_eff": 0.4, "overlap": 0.5, "coll_latency_s": 4.0}, False),
    "noise": ({}, True),
    "combined": ({"gemm_eff": 0.8, "attn_eff": 0.7, "comm_eff": 0.6, "overlap": 0.7}, True),
}
"""table name -> (efficiency parameter scale factors, per-candidate noise)."""


def build_table(cfg: Any, screened: list, path: str, perturb: Any) -> list[tuple[Strategy, float, float, float]]:
    """Write the replay table: one COMPLETE row per feasible candidate; returns (strategy, GiB, tok/s,
    relative spread). A noisy table records the noise it was drawn with (NOISE_TPS) as every row's
    ``tokens_per_s_spread``, as a profiled trial records its step-to-step spread; the others record 0.

    ``perturb``: a PERTURBATIONS name, or True for "combined" (the earlier --perturb), False for exact."""
    name = "combined" if perturb is True else ("exact" if perturb is False else perturb)
    scales, noisy = PERTURBATIONS[name]
    params = None
    if scales:
        params = efficiency_params(cfg.hardware.gpu)[0]
        params.update({k: params[k] * f for k, f in scales.items()})
    perturb = noisy
    rows = []
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*CSV_COLUMNS, "tokens_per_s_spread"], restval="")
        w.writeheader()
        n = 0
        for sc in screened:
            if not sc.memory.fits:
                continue
            s = sc.strategy
            sim = simulate(cfg.model, cfg.training, cfg.hardware, s, params)
            mem_gib = sc.memory.gpu["peak"] / GIB
            tps = sim.tokens_per_s_per_gpu
            spread = NOISE_TPS if perturb else 0.0
            if perturb:
                tps *= _noise(s.key(), "tps", NOISE_TPS)
                mem_gib *= _noise(s.key(), "mem", NOISE_MEM)
            w.writerow({"number": n, "state": "COMPLETE", **{k: "" if getattr(s, k) is None else getattr(s, k)
                                                              for k in STRATEGY_COLUMNS},
                        "peak_memory_gib": repr(mem_gib), "tokens_per_s_per_gpu": repr(tps),
                        "step_time_s": repr(sim.step_time_s), "mfu": repr(sim.mfu), "strategy": s.describe(),
                        "tokens_per_s_spread": repr(spread)})
            rows.append((s, mem_gib, tps, spread))
            n += 1
    return rows


def load_measured(folder: str) -> tuple[Any, Any, str, list[tuple[Strategy, float, float, float]]]:
    """A measured table: (config, space, trials.csv path, ok rows as (strategy, GiB, tok/s, relative
    spread; 0 where the table records none))."""
    from autotune.space import space_for

    cfg = load_config(os.path.join(folder, "config.yaml"))
    space = space_for(cfg)
    table = os.path.join(folder, "trials.csv")
    replay = ReplayBackend(table, cfg)
    rows = []
    for s in space.candidates(cfg.model):
        m = replay.evaluate(s)
        if m.ok:
            spread = (m.extra or {}).get("tokens_per_s_spread") or 0.0
            rows.append((s, m.peak_memory_bytes / GIB, m.tokens_per_s_per_gpu, float(spread)))
    return cfg, space, table, rows
