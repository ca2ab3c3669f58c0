"""Held-out check: published torchtitan FSDP2 memory vs what autotune predicts for the same job.

    python benchmarks/published_memory.py

Each row of data/reference/torchtitan-memory.csv (Llama 3.1 8B, FSDP2, op-level selective
activation checkpointing, seq 8192, 2 sequences per GPU, H100) is predicted with the strategy
``autotune estimate --engine fsdp2 --checkpointing op --micro-batch-size 2`` gives: engine fsdp2,
resharding after forward, bf16 parameters, fp32 reduce. The published figure is torchtitan's
logged memory, ``torch.cuda.max_memory_reserved`` (the caching allocator's reserved segments,
the CUDA context excluded). Compared:

* ``needed``: what autotune says the GPU must hold, ``peak + overhead`` (``total_gpu_bytes``:
  allocated peak, allocator slack, CUDA context and the prediction margin), the figure its
  verdict uses;
* ``allocated``: the predicted allocated peak alone (``gpu["peak"]``), a lower bound of reserved.

Both for autotune's default loop (``keep_outputs``: the logits stay referenced through
backward) and for torchtitan's own loop (``drop_outputs``: ``del pred`` before
``loss.backward()``). The simulator's tokens/s for the same rows is printed as well (its
hardware preset is H100 SXM5 80 GB, the runs used 96 GB parts at 500 W).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.memory import estimate_memory  # noqa: E402
from autotune.presets import gpu_from_name, model_from_name  # noqa: E402
from autotune.simulate import simulate  # noqa: E402
from autotune.spec import GIB, HardwareSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

TABLE = ROOT / "data" / "reference" / "torchtitan-memory.csv"


def rows() -> list[dict]:
    with open(TABLE, newline="") as f:
        return list(csv.DictReader(f))


def predict(row: dict) -> dict:
    n, gpn = int(row["num_gpus"]), int(row["gpus_per_node"])
    model = model_from_name(row["model"])
    hardware = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=gpn, num_nodes=n // gpn)
    mbs = int(row["local_batch_size"])
    training = TrainingSpec(seq_len=int(row["seq_len"]), global_batch_size=mbs * n, precision=row["precision"])
    strategy = Strategy(engine="fsdp2", micro_batch_size=mbs, checkpointing=row["activation_checkpointing"],
                        precision=row["precision"], reduce_dtype=row["reduce_dtype"])
    published = float(row["memory_gib"]) * GIB
    out = {"row": f"{row['model']} {n} GPUs ({row['table']})", "published_gib": published / GIB}
    for loop in ("keep_outputs", "drop_outputs"):
        est = estimate_memory(model, training, hardware, strategy, loop=loop)
        out[loop] = {"needed_gib": est.total_gpu_bytes / GIB, "allocated_gib": est.gpu["peak"] / GIB,
                     "needed_err": est.total_gpu_bytes / published - 1,
                     "allocated_err": est.gpu["peak"] / published - 1, "phase": est.peak_phase}
    sim = simulate(model, training, hardware, strategy)
    out["tokens_per_s"] = {"published": float(row["tokens_per_s_per_gpu"]), "predicted": sim.tokens_per_s_per_gpu,
                           "err": sim.tokens_per_s_per_gpu / float(row["tokens_per_s_per_gpu"]) - 1}
    return out


def main() -> int:
    results = [predict(r) for r in rows()]
    print(f"{'row':<42}{'published':>10}  {'loop':<13}{'needed':>8}{'err':>8}{'allocated':>11}{'err':>8}  peak in")
    for r in results:
        for loop in ("keep_outputs", "drop_outputs"):
            x = r[loop]
            print(f"{r['row']:<42}{r['published_gib']:>10.1f}  {loop:<13}{x['needed_gib']:>8.1f}"
                  f"{100 * x['needed_err']:>+7.1f}%{x['allocated_gib']:>11.1f}{100 * x['allocated_err']:>+7.1f}%"
                  f"  {x['phase']}")
    for loop in ("keep_outputs", "drop_outputs"):
        worst = min((r[loop]["needed_err"] for r in results))
        largest = max((abs(r[loop]["needed_err"]) for r in results))
        print(f"{loop}: needed vs published reserved: worst {100 * worst:+.1f}%, largest |error| {100 * largest:.1f}%"
              f" (target: within 10%)")
    for r in results:
        t = r["tokens_per_s"]
        print(f"tokens/s/GPU {r['row']}: published {t['published']:,.0f}, simulated {t['predicted']:,.0f} "
              f"({100 * t['err']:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
