"""How long does one re-fit of the simulator take inside the profiling loop? (target: < 0.2 s on 2 cores)

A Calibrator (autotune.calibration.loop) is fed 60 "measurements" one by one, as the profiling loop
feeds it: llama2-7b on 8 x A100-80GB, candidates of the default space in a fixed random order, their
throughput simulated with efficiency parameters unlike the preset's (GEMM x0.8, attention x0.7,
communication x0.6, overlap x0.7) times seeded 5% log-normal noise. After every measurement the
calibrator re-fits incrementally (autotune.calibration.loop.FAST_NFEV trust-region steps from the
previous fit). Reported: wall and CPU seconds per re-fit (the first, which imports scipy, excluded),
and the out-of-sample |error| of the predictions before / after, so speed is not bought with accuracy.
The full multi-start fit on the same 60 runs is timed for comparison.

Run: ``python benchmarks/calibration_speed.py``
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from autotune.config import load_config  # noqa: E402
from autotune.backends.base import Measurement  # noqa: E402
from autotune.calibration.loop import FAST_NFEV, Calibrator  # noqa: E402
from autotune.search import screen  # noqa: E402
from autotune.simulate import efficiency_params, simulate  # noqa: E402
from autotune.space import space_for  # noqa: E402
from search_cost import _noise  # noqa: E402


def main() -> int:
    cfg = load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    feasible = [s for s in screen(cfg, space_for(cfg), cfg.search.headroom) if s.memory.fits]
    truth = efficiency_params(cfg.hardware.gpu)[0]
    truth.update(gemm_eff=truth["gemm_eff"] * 0.8, attn_eff=truth["attn_eff"] * 0.7,
                 comm_eff=truth["comm_eff"] * 0.6, overlap=truth["overlap"] * 0.7)
    order = random.Random(0).sample(feasible, 60)
    held = [s for s in feasible if s not in order][:200]

    def true_tps(s):
        return simulate(cfg.model, cfg.training, cfg.hardware, s.strategy, truth).tokens_per_s_per_gpu * \
            _noise(s.strategy.key(), "tps", 0.05)

    def held_err(params):
        return statistics.median(abs(simulate(cfg.model, cfg.training, cfg.hardware, s.strategy, params)
                                     .tokens_per_s_per_gpu / true_tps(s) - 1) for s in held)

    cal = Calibrator(cfg, None, autosave=False)
    before = held_err(cal.current_params())
    walls, cpus = [], []
    for s in order:
        m = Measurement(status="ok", peak_memory_bytes=int(s.memory.gpu["peak"]), tokens_per_s_per_gpu=true_tps(s))
        w0, c0 = time.perf_counter(), time.process_time()
        cal.add(s.strategy, m)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    after = held_err(cal.current_params())
    w0, c0 = time.perf_counter(), time.process_time()
    cal.refit(full=True)
    full_wall, full_cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"# calibration re-fit per measurement (incremental, {FAST_NFEV} trust-region steps), "
          f"llama2-7b / a100-80gb, 60 measurements (first excluded: scipy import)")
    for lo, hi in ((1, 20), (20, 40), (40, 60), (1, 60)):
        w, c = walls[lo:hi], cpus[lo:hi]
        print(f"measurements {lo + 1:>2}-{hi:<2}: wall median {statistics.median(w) * 1e3:6.1f} ms, max "
              f"{max(w) * 1e3:6.1f} ms; CPU median {statistics.median(c) * 1e3:6.1f} ms, max {max(c) * 1e3:6.1f} ms")
    print(f"full multi-start fit on 60 runs: wall {full_wall:.2f} s, CPU {full_cpu:.2f} s")
    print(f"held-out |error| of tokens/s (200 candidates, median): preset {100 * before:.1f}%, "
          f"after 60 incremental re-fits {100 * after:.1f}%, after the full fit "
          f"{100 * held_err(cal.current_params()):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
