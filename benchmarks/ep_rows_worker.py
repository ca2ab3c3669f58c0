"""``autotune.worker.main`` with the rows each expert-parallel dispatch delivers recorded, for the memory
benchmark's EP rows (memory_vs_deepspeed.py MOE_EP_ROWS): the memory model sizes a rank's received rows
at stated factors x the mean (autotune's defaults where a job states none); this records what the routing of the measured step
gave, so the benchmark can also predict at the measured routing (the mechanism's own error).

    python benchmarks/ep_rows_worker.py JOB.json     # as python -m autotune.worker.main JOB.json

Each rank writes ``received_rows.<rank>.json`` beside the job's result: the largest output of an
``all_to_all_single`` whose input has the rank's tokens x top-k rows (the dispatch;
autotune/models/expert_parallel.py ``exchange``), over every call, warm-up included. The measured
micro-steps' splits of every dispatch are the worker's own record (its result's ``routing``,
autotune.worker.routing), which the benchmark reads as the profile backend does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import torch.distributed.nn.functional as fn

    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["result_path"]).parent / f"received_rows.{os.environ.get('RANK', '0')}.json"
    seen: dict[int, int] = {}  # input rows -> largest output rows
    original = fn.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        rows_in, rows_out = int(input.shape[0]), int(output.shape[0])
        if rows_out > seen.get(rows_in, -1):
            seen[rows_in] = rows_out
            out.write_text(json.dumps(seen))
        return original(output, input, output_split_sizes, input_split_sizes, group=group)

    fn.all_to_all_single = recording  # expert_parallel imports it at call time
    from autotune.worker.main import main as worker_main

    sys.argv = [sys.argv[0]] + sys.argv[1:]
    return worker_main()


if __name__ == "__main__":
    sys.exit(main())
