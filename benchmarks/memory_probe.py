"""Off-grid probes of the memory model: seeded random rows (family, engine, ranks, accumulation, micro-batch,
sequence, checkpointing, precision, long-context or expert-parallel knobs) that the stored benchmark does not
hold, each run for real like a benchmark row (``memory_vs_deepspeed.run_row``: the worst step and rank) and
compared with ``estimate_memory(device="cpu")``. A row off by more than the targets is a mechanism to trace
(docs/accuracy.md); the rows that fail on an old model are added to the grid with their fix.

    python benchmarks/memory_probe.py --seed 1 --count 40            # dense and long-context families
    python benchmarks/memory_probe.py --moe --seed 11 --count 40     # mixture-of-experts families, EP 2

Prints one line per row: the signed error (predicted / measured - 1; for EP rows also at the load factors
the step measured, stated), REFUSED with the rule a job would raise (not run), or SKIP with the worker's
reason when an accepted row cannot run (a rule validation should have raised: a finding).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_rows import HF_FAMILIES, MOE_FAMILIES, ROW_KEYS, row_key  # noqa: E402

DENSE_LONG = ("hf-gemma-long", "hf-llama-long", "hf-qwen2-long", "hf-mistral-long", "hf-gemma3-long")
"""The long-context families the dense probes draw from beside HF_FAMILIES (sequences 1024-2048)."""


def draw(rng: random.Random, moe: bool) -> dict:
    """One random row (ROW_KEYS and knobs)."""
    fam = rng.choice(sorted(MOE_FAMILIES) if moe else sorted(HF_FAMILIES) + list(DENSE_LONG))
    stage = rng.choice([0, 1, 2, 3, "fsdp2", "fsdp2-keep", "fsdp2-rbf16"])
    nproc = rng.choice([1, 2])
    seq = rng.choice([128, 256, 512] if moe else ([1024, 2048] if fam in DENSE_LONG else [256, 512, 1024]))
    row = dict(zip(ROW_KEYS, (fam, stage, nproc, rng.choice([1, 1, 2, 4]), rng.choice([1, 2]), seq,
                              rng.choice(["none", "full", "op", "selective", "attention", "mlp"]),
                              rng.choice(["bf16", "fp32"]))))
    knobs: dict = {}
    if rng.random() < 0.35:
        knobs.update({k: True for k in ("tiled_loss", "tiled_mlp") if rng.random() < 0.5})
        if row["ckpt"] == "full" and rng.random() < 0.3:
            knobs["activation_offload"] = "cpu"
        if nproc == 2 and not moe and not str(stage).startswith("fsdp2") and rng.random() < 0.3:
            knobs["sequence_parallel_size"] = 2
    if moe and nproc == 2 and str(stage).startswith("fsdp2") and rng.random() < 0.6:
        knobs["expert_parallel_size"] = 2
    row["knobs"] = knobs
    return row


def _order(spec: tuple) -> tuple:
    """``specs``' (model, training, hardware, strategy) in ``validate``'s order."""
    model, training, hardware, strategy = spec
    return strategy, model, training, hardware


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1, help="the draw's seed (the same seed, the same rows)")
    ap.add_argument("--count", type=int, default=20, help="rows to run")
    ap.add_argument("--moe", action="store_true", help="mixture-of-experts families (EP 2 on 2 ranks)")
    ap.add_argument("--stored", default=str(Path(__file__).parent / "data" / "memory_vs_deepspeed.json"),
                    help="rows already measured (skipped)")
    args = ap.parse_args(argv)
    from memory_vs_deepspeed import run_row, specs

    from autotune.strategy import validate

    stored = {row_key(r) for r in json.loads(Path(args.stored).read_text())} if os.path.exists(args.stored) else set()
    rng, work = random.Random(args.seed), Path(tempfile.mkdtemp(prefix="autotune_probe_"))
    done = 0
    while done < args.count:
        row = draw(rng, args.moe)
        if row_key(row) in stored:
            continue
        done += 1
        t0 = time.time()
        name = tuple(row[k] for k in ROW_KEYS) + (row["knobs"] or "",)
        refused = validate(*_order(specs(row, Path(tempfile.mkdtemp(dir=work)))))
        if refused:  # what a job would refuse is not probed (the benchmark itself does not validate)
            print(f"REFUSED {name}: {refused[0][:160]}", flush=True)
            continue
        out = run_row(row, Path(tempfile.mkdtemp(dir=work)), timeout=300)
        if out.get("status") != "ok":
            print(f"SKIP {name} {out.get('status')}: {str(out.get('reason'))[:160]}", flush=True)
            continue
        stated = f" stated {100 * out['error_stated']:+.2f}%" if out.get("error_stated") is not None else ""
        print(f"{100 * out['error']:+7.2f}%{stated} {name} {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
