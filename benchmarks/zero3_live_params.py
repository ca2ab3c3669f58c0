"""ZeRO-3's gathered parameters when stage3_max_live_parameters / stage3_max_reuse_distance are smaller than a
module: one memory-benchmark row measured with both set to CAP (the job's DeepSpeed config written here) beside
the memory model's prediction under the same settings. At autotune's 1e9 the tiny CPU rows never reach the cap;
a module larger than it (a Mixtral-8x7B experts module, 1.41e9 parameters; a 70B model's 1.05e9 head) does.

    python benchmarks/zero3_live_params.py                       # hf-mixtral-sv, ZeRO-3, 2 gloo ranks, CAP 1e5
    python benchmarks/zero3_live_params.py --cap 0               # autotune's settings (1e9), for comparison
    python benchmarks/zero3_live_params.py --model hf-llama --precision bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_vs_deepspeed as bench  # noqa: E402

import autotune.engine_configs as ec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf-mixtral-sv")
    ap.add_argument("--cap", type=float, default=1e5, help="both stage3 settings, elements (0: autotune's)")
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ckpt", default="none")
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args(argv)
    if args.cap:
        ec.DEEPSPEED_BUFFERS = dataclasses.replace(ec.DEEPSPEED_BUFFERS, max_live_parameters=int(args.cap),
                                                   max_reuse_distance=int(args.cap))
    row = {"model": args.model, "stage": 3, "nproc": 2, "ga": 1, "mbs": args.mbs, "seq": args.seq,
           "ckpt": args.ckpt, "precision": args.precision}
    work = Path(tempfile.mkdtemp(prefix="z3live_"))
    model, training, hardware, strategy = bench.specs(row, work)
    cfg = ec.to_deepspeed_config(strategy, model, training, hardware)
    write = Path.write_text

    def with_config(self: Path, data: str, *a, **k):  # the worker takes the job's DeepSpeed config as given
        if self.name == "job.json":
            data = json.dumps({**json.loads(data), "deepspeed_config": cfg})
        return write(self, data, *a, **k)

    Path.write_text = with_config  # type: ignore[method-assign]
    try:
        out = bench.run_row(row, work)
    finally:
        Path.write_text = write  # type: ignore[method-assign]
    z = cfg["zero_optimization"]
    print(f"{args.model} ZeRO-3 2 ranks mbs {args.mbs} seq {args.seq} {args.ckpt} {args.precision}: "
          f"stage3_max_live_parameters {z['stage3_max_live_parameters']:.0e}, "
          f"stage3_max_reuse_distance {z['stage3_max_reuse_distance']:.0e}, {model.num_parameters:,} parameters")
    if out.get("status") != "ok":
        print(f"status {out.get('status')}: {out.get('reason')}")
        return 1
    print(f"measured {out['measured']:,} B, predicted {out['predicted']:,} B: {100 * out['error']:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
