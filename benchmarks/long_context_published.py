"""Held-out check: the longest sequence autotune says fits vs the longest published long-context runs.

    python benchmarks/long_context_published.py          # the rows the test checks
    python benchmarks/long_context_published.py --all    # every row, the unpredictable ones listed apart

Each row of data/reference/long-context.csv is one published run (ALST's ArcticTraining recipes, torchtitan's
context-parallel table; sources, licences and how each column was read: data/reference/long-context.md). For a
row, the model (an autotune preset), the hardware and the row's Strategy are built, and the longest seq_len for
which ``estimate_memory(...).fits`` holds is found by bisection, in steps the strategy's rules allow (a multiple
of sequence_parallel_size, of 2 x context_parallel_size), with the headroom ``autotune run`` keeps by default
(``search.headroom``) and the row's training loop. Printed: published max, predicted max, their ratio
(predicted / published; the issue's target: 0.8-1.35), what stops the model one step further, worst ratio
first; then, at the published length, what the model says the GPU and the host need, next to the memory
the source reports. Figures: docs/long-context.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.checks import check_section  # noqa: E402
from autotune.config import STRATEGY_SCHEMA, SearchSection, check_strategy  # noqa: E402
from autotune.memory import GPU_COMPONENTS, MemoryEstimate, estimate_memory  # noqa: E402
from autotune.presets import gpu_from_name, model_from_name  # noqa: E402
from autotune.reason import kind_of  # noqa: E402
from autotune.spec import GIB, HardwareSpec, ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy, batch_ranks  # noqa: E402

TABLE = ROOT / "data" / "reference" / "long-context.csv"
HEADROOM = SearchSection.headroom
"""The headroom ``autotune run`` keeps by default (job file ``search.headroom``)."""
BAND = (0.8, 1.35)
"""Issue 24's bound on predicted / published max sequence."""
STRATEGY_FIELDS = tuple(f.name for f in fields(Strategy))
MAX_SEQ = 1 << 34
"""Bisection ceiling (tokens): a row that still fits here is reported as at least this."""


def rows(path: Path = TABLE) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cell(text: str):
    """A CSV cell as the job file's YAML would give it: true/false, an integer, or the text."""
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return text


def strategy_of(row: dict) -> Strategy:
    """The row's Strategy, through the job file's strategy checkers (a bad cell: one line naming it);
    an empty cell is the knob's default."""
    raw = {k: _cell(row[k]) for k in STRATEGY_FIELDS if row.get(k, "") != ""}
    return Strategy(**check_section(raw, f"{row['run']}.strategy", STRATEGY_SCHEMA))


def hardware_of(row: dict) -> HardwareSpec:
    over = {"memory_bytes": int(row["gpu_memory_mib"]) << 20} if row.get("gpu_memory_mib") else {}
    extra = {"cpu_memory_gib": float(row["cpu_memory_gib"])} if row.get("cpu_memory_gib") else {}
    return HardwareSpec(gpu=gpu_from_name(row["gpu"], **over), gpus_per_node=int(row["gpus_per_node"]),
                        num_nodes=int(row["num_nodes"]), **extra)


def predictable(row: dict) -> bool:
    """Whether autotune can build the row's model (a preset name in ``model``)."""
    return bool(row.get("model"))


def step_of(strategy: Strategy) -> int:
    """The sequence lengths the strategy's rules allow are the multiples of this (strategy.py
    _sequence_split_errors: Ulysses' equal shards, context parallel's 2 x degree chunks)."""
    cp = strategy.context_parallel_size
    return math.lcm(strategy.sequence_parallel_size, 2 * cp if cp > 1 else 1)


@dataclass(frozen=True)
class Job:
    """One row, built: everything but the sequence length."""

    run: str
    model: ModelSpec
    hardware: HardwareSpec
    strategy: Strategy
    loop: str
    data_loader_fork: str = "none"

    @classmethod
    def of(cls, row: dict) -> "Job":
        model = model_from_name(row["model"]).replace(rms_norm_kernel=row.get("rms_norm_kernel") or "torch")
        return cls(row["run"], model, hardware_of(row), strategy_of(row), row["loop"],
                   row.get("data_loader_fork") or "none")

    def training(self, seq: int) -> TrainingSpec:
        # one micro-batch per batch rank, no accumulation (both ALST and torchtitan ran so)
        gbs = self.strategy.micro_batch_size * batch_ranks(self.hardware, self.strategy)
        return TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=self.strategy.precision,
                            data_loader_fork=self.data_loader_fork)  # type: ignore[arg-type]

    def check(self, seq: int) -> None:
        """Raise ConfigError naming the key of the first rule the strategy breaks at ``seq``."""
        check_strategy(self.strategy, self.model, self.training(seq), self.hardware, prefix=f"{self.run}.strategy.")

    def estimate(self, seq: int) -> MemoryEstimate:
        return estimate_memory(self.model, self.training(seq), self.hardware, self.strategy, headroom=HEADROOM,
                               loop=self.loop)  # type: ignore[arg-type]

    def longest(self) -> int:
        """The longest allowed sequence whose estimate fits (0: not even one step), by bisection over
        multiples of step_of (fits assumed monotone in the sequence)."""
        step = step_of(self.strategy)
        if not self.estimate(step).fits:
            return 0
        lo, hi = 1, 2  # in steps: lo fits, hi unknown until it does not
        while self.estimate(hi * step).fits:
            lo, hi = hi, hi * 2
            if hi * step > MAX_SEQ:
                return lo * step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.estimate(mid * step).fits else (lo, mid)
        return lo * step


def predict(row: dict) -> dict:
    job = Job.of(row)
    published = int(row["published_max_seq"])
    job.check(published)
    memory_seq = int(row["published_memory_seq"] or published)  # where the source read its memory
    at_published = job.estimate(memory_seq)
    seq = job.longest()
    beyond = job.estimate(seq + step_of(job.strategy))
    gpu = beyond.gpu
    largest = max(GPU_COMPONENTS[:-1], key=lambda k: gpu[k])
    limits = sorted({kind_of(r) for r in beyond.reasons}) or ["none"]
    return {"run": row["run"], "published": published, "predicted": seq, "ratio": seq / published,
            "in_test": row["in_test"] == "true", "limit": "+".join(limits),
            "largest": f"{largest} {gpu[largest] / GIB:.1f}", "need_gib": beyond.total_gpu_bytes / GIB,
            "host_gib": beyond.cpu_bytes_per_node / GIB, "phase": beyond.peak_phase,
            "published_need_gib": at_published.total_gpu_bytes / GIB,
            "published_host_gib": at_published.cpu_bytes_per_node / GIB, "published_memory": row["published_memory"],
            "memory_seq": memory_seq, **failed_check(job, row)}


def failed_check(job: "Job", row: dict) -> dict:
    """Where the source reports a longer run out of memory (``failed_seq``): whether the model says it
    fits there (it must not: that is under-prediction) and, if it does, what it says is needed."""
    if not row.get("failed_seq"):
        return {"failed_seq": None}
    failed = int(row["failed_seq"])
    est = job.estimate(failed - failed % step_of(job.strategy))
    return {"failed_seq": failed, "fits_at_failed": est.fits, "failed_need_gib": est.total_gpu_bytes / GIB,
            "failed_host_gib": est.cpu_bytes_per_node / GIB, "failed_evidence": row["failed_evidence"]}


LIMIT_WORDS = {"host_memory": "host RAM", "gpu_memory": "GPU", "nvme": "NVMe"}


def markdown(results: list[dict]) -> str:
    """The ratio table, the memory at the published length and the failed lengths, as markdown."""
    out = ["| run | published | predicted | ratio | in test | what stops the model one step further |",
           "|---|---:|---:|---:|---|---|"]
    for x in results:
        inside = BAND[0] <= x["ratio"] <= BAND[1]
        limit = "+".join(LIMIT_WORDS.get(k, k) for k in x["limit"].split("+"))
        out.append(f"| {x['run']} | {x['published']:,} | {x['predicted']:,} | {x['ratio']:.2f}"
                   f"{'' if inside or not x['in_test'] else ' **outside**'} | {'yes' if x['in_test'] else 'no'} | "
                   f"{limit}: needs {x['need_gib']:.1f} GiB GPU, {x['host_gib']:.0f} GiB host/node; largest part "
                   f"{x['largest']} GiB ({x['phase']}) |")
    out += ["", "| run | seq | model: GPU need (GiB) | model: host/node (GiB) | published memory |",
            "|---|---:|---:|---:|---|"]
    out += [f"| {x['run']} | {x['memory_seq']:,} | {x['published_need_gib']:.1f} | {x['published_host_gib']:.0f} | "
            f"{x['published_memory']} |" for x in results if x["published_memory"]]
    out += ["", "| run | failed at | model | GPU need GiB | host GiB/node | the recipe |", "|---|---:|---|---:|---:|---|"]
    out += [f"| {x['run']} | {x['failed_seq']:,} | {'**fits**' if x['fits_at_failed'] else 'does not fit'} | "
            f"{x['failed_need_gib']:.1f} | {x['failed_host_gib']:.1f} | {x['failed_evidence']} |"
            for x in results if x["failed_seq"] and x["in_test"]]
    return "\n".join(out)


def _log_distance(ratio: float) -> float:
    return abs(math.log(ratio)) if ratio > 0 else math.inf


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="every row, not only those the test checks")
    ap.add_argument("--csv", type=Path, default=TABLE, help="the published runs (default: %(default)s)")
    ap.add_argument("--markdown", action="store_true", help="the tables as docs/long-context.md quotes them")
    args = ap.parse_args(argv)
    table = rows(args.csv)
    chosen = [r for r in table if args.all or r["in_test"] == "true"]
    results = sorted((predict(r) for r in chosen if predictable(r)), key=lambda x: -_log_distance(x["ratio"]))
    if args.markdown:
        print(markdown(results))
        return 0
    print(f"headroom {HEADROOM:.0%} (search.headroom default); ratio = predicted / published, target "
          f"{BAND[0]}-{BAND[1]}; 'one step further': what the estimate says at predicted + one step")
    print(f"{'run':<34}{'published':>11}{'predicted':>11}{'ratio':>7}  {'test':<5}{'limit':<13}"
          f"{'need GiB':>9}{'host GiB':>10}  largest part (GiB), phase")
    for x in results:
        print(f"{x['run']:<34}{x['published']:>11,}{x['predicted']:>11,}{x['ratio']:>7.2f}  "
              f"{'yes' if x['in_test'] else 'no':<5}{x['limit']:<13}{x['need_gib']:>9.1f}{x['host_gib']:>10.1f}  "
              f"{x['largest']}, {x['phase']}")
    print("\nat the published length (published_memory_seq where the memory was read at another one): what the "
          "model says the GPU needs (peak + overhead) and host RAM per node, next to the memory the source reports")
    print(f"{'run':<34}{'seq':>11}{'need GiB':>9}{'host GiB':>10}  published memory")
    for x in results:
        print(f"{x['run']:<34}{x['memory_seq']:>11,}{x['published_need_gib']:>9.1f}{x['published_host_gib']:>10.1f}  "
              f"{x['published_memory'] or '-'}")
    failed = [x for x in results if x["failed_seq"]]
    print("\nat the shortest length the source reports out of memory (failed_seq): the model must say it does not "
          "fit; 'FITS' is under-prediction")
    print(f"{'run':<34}{'failed':>11}  {'verdict':<14}{'need GiB':>9}{'host GiB':>10}  evidence")
    for x in failed:
        print(f"{x['run']:<34}{x['failed_seq']:>11,}  {'FITS' if x['fits_at_failed'] else 'does not fit':<14}"
              f"{x['failed_need_gib']:>9.1f}{x['failed_host_gib']:>10.1f}  {x['failed_evidence']}")
    skipped = [r["run"] for r in chosen if not predictable(r)]
    if skipped:
        print(f"not predicted (no model autotune can build; note column): {', '.join(skipped)}")
    tested = [x for x in results if x["in_test"]]
    outside = [x["run"] for x in tested if not BAND[0] <= x["ratio"] <= BAND[1]]
    if tested:
        worst = max(tested, key=lambda x: _log_distance(x["ratio"]))
        print(f"{len(tested)} tested rows: worst {worst['run']} {worst['ratio']:.2f}; "
              f"outside {BAND[0]}-{BAND[1]}: {', '.join(outside) if outside else 'none'}")
        wrong = [x["run"] for x in tested if x["failed_seq"] and x["fits_at_failed"]]
        print(f"{sum(1 for x in tested if x['failed_seq'])} tested rows with a reported out-of-memory length; "
              f"said to fit there: {', '.join(wrong) if wrong else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
