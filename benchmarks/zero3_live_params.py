"""ZeRO-3's gathered parameters when stage3_max_live_parameters / stage3_max_reuse_distance are smaller than the
model's modules: memory-benchmark rows (ZeRO-3, 2 gloo ranks) measured with both settings at CAP (the job's
DeepSpeed config written here) beside the memory model's prediction under the same settings
(autotune/memory/zero3_fetch.py). At autotune's 1e9 the tiny CPU rows keep every parameter gathered; a real
job's modules are larger than that (a Mixtral-8x7B experts module has 1.41e9 parameters), which these rows
reproduce at CPU size.

    python benchmarks/zero3_live_params.py --json out.json      # the GRID rows (about 20 s each)
    python benchmarks/zero3_live_params.py --reuse benchmarks/data/zero3_live_params.json --no-run  # re-predict
    python benchmarks/zero3_live_params.py --reuse out.json --json out.json  # measure the GRID rows it lacks
    python benchmarks/zero3_live_params.py --model hf-llama --cap 5e4 --precision bf16             # one row
    python benchmarks/zero3_live_params.py --model hf-mixtral-sv --cap 0                           # autotune's 1e9
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_vs_deepspeed as bench  # noqa: E402

import autotune.engine_configs as ec  # noqa: E402

GRID = [  # (model, cap, checkpointing, precision): every family kind the trace builds (memory/zero3_fetch.py)
    ("hf-mixtral-sv", 1e5, "none", "fp32"), ("hf-mixtral-sv", 1e5, "full", "fp32"),
    ("hf-qwen3moe-sv", 1e5, "none", "fp32"), ("hf-qwen3moe-sv", 1e5, "full", "bf16"),
    ("hf-qwen2moe-sv", 1e5, "none", "fp32"), ("hf-olmoe-sv", 1e5, "none", "fp32"),
    ("hf-deepseekv2-sv", 1e5, "none", "fp32"), ("hf-deepseekv3-sv", 5e4, "none", "bf16"),
    ("hf-gptoss-sv", 1e5, "none", "bf16"), ("hf-llama", 5e4, "none", "bf16"), ("hf-gpt2", 1e5, "none", "fp32"),
    ("hf-phi3", 1e5, "none", "bf16"), ("hf-neox", 1e5, "none", "fp32"), ("hf-gemma2", 5e4, "none", "fp32"),
    # blocks recomputed in part (the parameters gathered again for the recomputed module only)
    ("hf-mixtral-sv", 1e5, "attention", "fp32"), ("hf-mixtral-sv", 1e5, "mlp", "fp32"),
    ("hf-mixtral-sv", 1e5, "selective", "fp32"), ("hf-qwen3moe-sv", 1e5, "mlp", "fp32"),
    ("hf-llama", 5e4, "attention", "bf16"), ("hf-llama", 5e4, "mlp", "bf16"), ("hf-llama", 5e4, "selective", "bf16"),
    ("hf-gptoss-sv", 1e5, "full", "bf16"), ("hf-gptoss-sv", 1e5, "full", "fp32"),
    # the long-context knobs (Ulysses, tiled MLP / loss, checkpoint offload): mbs 1, seq 512 / 256
    ("hf-llama", 5e4, "full", "bf16", 1, 512, "sp"), ("hf-llama", 5e4, "full", "bf16", 1, 512, "tm"),
    ("hf-mistral", 5e4, "full", "bf16", 1, 512, "sp+tl+tm+ao"), ("hf-qwen2", 5e4, "none", "fp32", 1, 256, "tl"),
]


@contextlib.contextmanager
def capped(cap: float) -> Iterator[None]:
    """autotune's DeepSpeed settings with stage3_max_live_parameters = stage3_max_reuse_distance = cap (0: as
    they are)."""
    saved = ec.DEEPSPEED_BUFFERS
    if cap:
        ec.DEEPSPEED_BUFFERS = dataclasses.replace(saved, max_live_parameters=int(cap), max_reuse_distance=int(cap))
    try:
        yield
    finally:
        ec.DEEPSPEED_BUFFERS = saved


def grid_row(model: str, cap: float, ckpt: str, precision: str, mbs: int = 2, seq: int = 256,
             knobs: str = "") -> dict:
    """A row; ``knobs``: long-context knobs in the memory grid's short names (memory_rows._LC, "sp+tl")."""
    row = {"model": model, "stage": 3, "nproc": 2, "ga": 1, "mbs": mbs, "seq": seq, "ckpt": ckpt,
           "precision": precision, "cap": cap}
    if knobs:
        row["knobs"] = {k: v for name in knobs.split("+") for k, v in bench.LONG_CONTEXT_KNOBS[name].items()}
    return row


def _key(row: dict) -> tuple:
    return row["model"], row["cap"], row["ckpt"], row["precision"], bench.knob_text(row.get("knobs") or {})


def run(row: dict, work: Path) -> dict:
    """Measure ``row`` with its cap written into the job's DeepSpeed config, and predict it."""
    with capped(row["cap"]):
        model, training, hardware, strategy = bench.specs(row, work)
        cfg = ec.to_deepspeed_config(strategy, model, training, hardware)
        write = Path.write_text

        def with_config(self: Path, data: str, *a, **k):  # the worker takes the job's DeepSpeed config as given
            if self.name == "job.json":
                data = json.dumps({**json.loads(data), "deepspeed_config": cfg})
            return write(self, data, *a, **k)

        Path.write_text = with_config  # type: ignore[method-assign]
        try:
            return bench.run_row(row, work)
        finally:
            Path.write_text = write  # type: ignore[method-assign]


def predict(row: dict, work: Path) -> dict:
    """Re-predict a stored row under its cap."""
    with capped(row["cap"]):
        return bench.predict(dict(row), work)


def show(rows: list[dict]) -> None:
    for r in sorted(rows, key=lambda r: r.get("error", 0)):
        name = f"{r['model']:<18} cap {r['cap']:.0e} {r['ckpt']:<5} {r['precision']}" + (
            f" {bench.knob_text(r['knobs'])}" if r.get("knobs") else "")
        if r.get("status") != "ok":
            print(f"{name}: {r.get('status')} {r.get('reason')}")
            continue
        print(f"{name}: measured {r['measured']:>12,} B, "
              f"predicted {r['predicted']:>12,} B  {100 * r['error']:+.2f}%  "
              f"({r['measured_phase']}/{r['predicted_phase']})")
    ok = [r["error"] for r in rows if r.get("status") == "ok"]
    if ok:
        print(f"{len(ok)} rows: worst {100 * min(ok):+.2f}%, max {100 * max(ok):+.2f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="one row of this family instead of GRID")
    ap.add_argument("--cap", type=float, default=1e5, help="both stage3 settings, elements (0: autotune's)")
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ckpt", default="none")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--reuse", help="stored rows (a --json output): re-predicted, not measured again")
    ap.add_argument("--no-run", action="store_true", help="with --reuse: measure none of the rows it lacks")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="z3live_"))
    stored = json.loads(Path(args.reuse).read_text()) if args.reuse else []
    rows = [predict(r, work) if r.get("status") == "ok" else r for r in stored]
    have = {_key(r) for r in rows}
    todo = ([grid_row(args.model, args.cap, args.ckpt, args.precision, args.mbs, args.seq)] if args.model
            else [grid_row(*g) for g in GRID])
    for row in ([] if args.no_run else todo):
        if _key(row) not in have:
            rows.append(run(row, work))
            show(rows[-1:])
    show(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
