"""The throughput simulator against the published long-context throughput: torchtitan's FSDP2 + context
parallel table (Llama-3.1-8B, 8 x H100, 32K-256K tokens, CP 1-8), rows of data/reference/long-context.csv
(source, licence and how each column was read: data/reference/long-context.md).

    python benchmarks/long_context_throughput.py

Each torchtitan row's ``source_section`` carries its published TPS/GPU; the row's model, hardware and
Strategy are built as benchmarks/long_context_published.py builds them, the global batch is the table's
local batch 1 x the FSDP degree (8 / CP), and ``simulate`` predicts tokens/s per GPU with the H100 preset's
fitted efficiency. Printed per row: published, predicted, error, the exposed communication's share of the
step; then the mean absolute error. Not modelled (so the simulator predicts bf16 GEMMs where the runs had
Float8 linears and torch.compile, on 500 W parts): see the rows' ``not_modelled`` column.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_context_published import hardware_of, rows, strategy_of  # noqa: E402

from autotune.presets import model_from_name  # noqa: E402
from autotune.simulate import simulate  # noqa: E402
from autotune.spec import TrainingSpec  # noqa: E402
from autotune.strategy import batch_ranks, validate  # noqa: E402


def published_tps(row: dict) -> float | None:
    """The TPS/GPU a row's source_section quotes (torchtitan's table), or None."""
    m = re.search(r"TPS/GPU ([0-9.]+)", row.get("source_section", ""))
    return float(m.group(1)) if m else None


def main() -> int:
    errors = []
    print(f"{'run':28s} {'cp':>2s} {'seq':>7s} {'published':>9s} {'predicted':>9s} {'error':>7s} {'comm %':>6s}")
    for row in rows():
        tps = published_tps(row)
        if tps is None:
            continue
        model, hardware, strategy = model_from_name(row["model"]), hardware_of(row), strategy_of(row)
        seq = int(row["published_max_seq"])
        training = TrainingSpec(seq_len=seq, global_batch_size=int(row["micro_batch_size"] or 1)
                                * batch_ranks(hardware, strategy))
        broken = validate(strategy, model, training, hardware)
        if broken:
            print(f"{row['run']}: {broken[0]}")
            return 1
        r = simulate(model, training, hardware, strategy)
        err = r.tokens_per_s_per_gpu / tps - 1.0
        errors.append(abs(err))
        comm = r.breakdown["exposed_communication"] / r.step_time_s
        print(f"{row['run']:28s} {strategy.context_parallel_size:2d} {seq:7d} {tps:9.0f} "
              f"{r.tokens_per_s_per_gpu:9.0f} {100 * err:+6.1f}% {100 * comm:5.1f}%")
    if errors:
        print(f"mean absolute error {100 * sum(errors) / len(errors):.1f}% over {len(errors)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
