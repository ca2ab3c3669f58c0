"""Targets (issue 23): `autotune run examples/llama2-7b.yaml` (simulate backend, default space) in
<= 1.5 s wall including interpreter start (median of 5), without importing torch/deepspeed; its
screen (every candidate through the memory model, the feasible ones through the simulator) at
>= 50,000 candidates/s.

    python benchmarks/run_speed.py [--repeat 5] [--config examples/llama2-7b.yaml]

Runs the real console command in fresh processes (cold interpreter each time) and prints wall and
CPU times, the number of candidates screened and evaluated, and the modules imported; then the
screen alone in this process (``autotune.screen.screen``, median of the repeats, wall and CPU) and
one ``estimate_memory`` / ``simulate`` call. The machine's load average is printed with them.
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


def estimate_per_call_us(n: int = 500) -> float:
    """Mean wall time of one estimate_memory() call (llama2-7b, 8 x A100: ZeRO-0/1/3 mixes, the screen's
    per-candidate path before the grid, and what a trial's estimate still costs)."""
    sys.path.insert(0, ROOT)
    from autotune.memory import estimate_memory
    from autotune.presets import gpu_from_name, model_from_name
    from autotune.spec import HardwareSpec, TrainingSpec
    from autotune.strategy import Strategy

    model, training = model_from_name("llama2-7b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    hardware = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8)
    strategies = [Strategy(zero_stage=0, micro_batch_size=1, checkpointing="full"),
                  Strategy(zero_stage=1, micro_batch_size=2, checkpointing="selective", offload_optimizer="cpu"),
                  Strategy(zero_stage=3, micro_batch_size=4, checkpointing="op")]
    t0 = time.perf_counter()
    for _ in range(n):
        for s in strategies:
            estimate_memory(model, training, hardware, s, headroom=0.05)
    return (time.perf_counter() - t0) / (n * len(strategies)) * 1e6


def screen_speed(config: str, repeat: int) -> tuple[int, float, float]:
    """The screen of ``config``'s space in this process: candidates, median wall and CPU seconds."""
    sys.path.insert(0, ROOT)
    from autotune.config import load_config
    from autotune.screen import screen
    from autotune.space import space_for

    cfg = load_config(config)
    space = space_for(cfg)
    screen(cfg, space, cfg.search.headroom)  # imports and first-call caches out of the figure
    walls, cpus, n = [], [], 0
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        n = len(screen(cfg, space, cfg.search.headroom))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return n, statistics.median(walls), statistics.median(cpus)


def _timed_run(config: str, out: str, name: str, env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    """One cold ``autotune run`` in a fresh process: the process, its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", config, "--out", out, "--name", name, "--json"],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    walls, cpus, cached = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.repeat):
            proc, wall, cpu = _timed_run(args.config, out, f"r{i}", os.environ)
            walls.append(wall)
            cpus.append(cpu)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
        if sys.dont_write_bytecode and not sys.pycache_prefix:  # also as an installed wheel runs: bytecode cached
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = os.path.join(out, "pycache")
            for i in range(args.repeat + 1):  # the first run writes the bytecode, unmeasured
                proc, wall, _ = _timed_run(args.config, out, f"b{i}", env)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                cached += [wall] if i else []
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
    print(f"load average during the runs: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    if cached:  # each run above compiled autotune/ and its dependencies from source
        print("bytecode: PYTHONDONTWRITEBYTECODE is set, so every run above compiled autotune's modules (an "
              "installed wheel does not; docs/accuracy.md, Run speed); with bytecode cached (PYTHONPYCACHEPREFIX, "
              f"after one unmeasured run): wall s min {min(cached):.2f}, median {statistics.median(cached):.2f}, "
              f"max {max(cached):.2f}")
    n, wall, cpu = screen_speed(args.config, args.repeat)
    print(f"screen alone: {n} candidates, median of {args.repeat}: wall {wall:.3f} s ({n / wall:,.0f} candidates/s), "
          f"cpu {cpu:.3f} s ({n / cpu:,.0f} candidates/s)")
    print(f"estimate_memory() per call: {estimate_per_call_us():.0f} us (a trial's estimate; the screen computes "
          f"the space at once)")
    print(f"simulate() per call: {simulate_per_call_us():.0f} us (the screen simulates each feasible candidate)")
    print(f"load average now: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
