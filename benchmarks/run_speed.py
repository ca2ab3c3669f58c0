"""Target: `autotune run examples/llama2-7b.yaml` (simulate backend, default space) in <= 3 s
wall including interpreter start, screening >= 1000 candidates, without importing torch/deepspeed.

    python benchmarks/run_speed.py [--repeat 5] [--config examples/llama2-7b.yaml]

Runs the real console command in fresh processes (cold interpreter each time) and prints wall and
CPU times, the number of candidates screened and evaluated, and the modules imported.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def simulate_per_call_us(n: int = 2000) -> float:
    """Mean wall time of one simulate() call (ZeRO-3, optimizer offload, full checkpointing, llama2-7b)."""
    sys.path.insert(0, ROOT)
    from autotune.presets import gpu_from_name, model_from_name
    from autotune.simulate import simulate
    from autotune.spec import HardwareSpec, TrainingSpec
    from autotune.strategy import Strategy

    model, training = model_from_name("llama2-7b"), TrainingSpec(seq_len=4096, global_batch_size=512)
    hardware = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8)
    s = Strategy(zero_stage=3, micro_batch_size=2, checkpointing="full", offload_optimizer="cpu")
    simulate(model, training, hardware, s)
    t0 = time.perf_counter()
    for _ in range(n):
        simulate(model, training, hardware, s)
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "autotune", "run", args.config, "--out", out,
                                   "--name", f"r{i}", "--json"], capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
        summary = open(os.path.join(out, "r0", "summary.md")).read()
        probe = ("import sys, runpy; sys.argv = ['autotune', 'run', %r, '--out', %r, '--name', 'probe', '--json'];"
                 "import autotune.cli as c; rc = c.main(sys.argv[1:]);"
                 "print('IMPORTED', [m for m in ('torch', 'deepspeed') if m in sys.modules])") % (args.config, out)
        imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    screened = [line for line in summary.splitlines() if "screened" in line or "evaluated" in line]
    print(f"config: {os.path.relpath(args.config, ROOT)}, {args.repeat} cold runs")
    print(f"wall s: min {min(walls):.2f}, median {statistics.median(walls):.2f}, max {max(walls):.2f}")
    print(f"cpu s (user+sys): min {min(cpus):.2f}, median {statistics.median(cpus):.2f}")
    for line in screened:
        print(line.lstrip("- "))
    print("torch/deepspeed imported:", imported.strip().split("IMPORTED", 1)[-1].strip())
    print(f"simulate() per call: {simulate_per_call_us():.0f} us (the search calls it once per feasible candidate)")
    print(f"load average during the run: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
