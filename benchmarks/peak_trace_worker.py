"""A benchmark row's worker with the allocation trace around its measured peak written out, per rank: what
docs/moe.md's expert-parallel instants were read from (which tensors are live at the peak, and the events
before it, each with the ops that allocated or freed it).

    python benchmarks/peak_trace_worker.py JOB.json [OUT_DIR]   # as benchmarks/ep_rows_worker.py JOB.json

JOB.json: a job folder of ``memory_vs_deepspeed.run_row`` (its work dir is printed first; the job stays
there); run it under ``torchrun --nproc_per_node 2`` for 2-rank rows. Writes ``OUT_DIR/peak.<rank>.txt``
(default: beside the job): the peak, the allocations recorded since the first measured step still live at
it (a tensor freed by another thread, gloo's, has no free event: it shows as live; c10's tally, the
peak, counts it), and the 150 events before the peak and 20 after, with the running total.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def main() -> None:
    import autotune.worker.cpu_memory as cm

    job, out_dir = Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else Path(sys.argv[1]).parent
    analyse = cm.CpuMemoryProbe.analyse

    def traced(self):
        out = analyse(self)
        from torch._C._profiler import _EventType

        raw, marks, stack = [], [], list(self.prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.typed[0] == _EventType.Allocation and str(node.typed[1].device).startswith("cpu"):
                ops, p = [], node.parent
                while p is not None and len(ops) < 4:
                    ops.append(p.name)
                    p = p.parent
                f = node.typed[1]
                raw.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, "<".join(ops)))
            elif node.name.startswith(cm.MEASURED_MARK):
                marks.append((node.name.rsplit(":", 1)[-1], node.start_time_ns, node.end_time_ns))
            stack.extend(node.children)
        if not raw or not marks:
            return out
        raw.sort(key=lambda r: r[0])
        t0, t1 = min(m[1] for m in marks), max(m[2] for m in marks)
        k = max((i for i, r in enumerate(raw) if t0 <= r[0] <= t1), key=lambda i: raw[i][3])
        live: dict[int, tuple] = {}
        for r in raw[:k + 1]:
            if r[2] > 0:
                live[r[1]] = r
            else:
                live.pop(r[1], None)
        phase = [m[0] for m in marks if m[1] <= raw[k][0] <= m[2]]
        lines = [f"peak {raw[k][3]} in {phase}", f"live, allocated since the first measured step: "
                 f"{sum(r[2] for r in live.values())}"]
        lines += [f"  {r[0] - t0:>14} {r[2]:>10} {r[4]}" for r in sorted(live.values())]
        lines += ["events before and after the peak (time, bytes, running total, ops):"]
        lines += [f"  {r[0] - t0:>14} {r[2]:>+10} {r[3]:>10} {r[4]}" for r in raw[max(0, k - 150):k + 20]]
        (out_dir / f"peak.{os.environ.get('RANK', '0')}.txt").write_text("\n".join(lines) + "\n")
        return out

    cm.CpuMemoryProbe.analyse = traced
    sys.argv = [sys.argv[0], str(job)]
    runpy.run_path(str(Path(__file__).with_name("ep_rows_worker.py")), run_name="__main__")


if __name__ == "__main__":
    main()
