"""``autotune compare OLD_RUN NEW_RUN``: what changed between two runs; exit 1 on a regression."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.compare import DEFAULT_MAX_REGRESSION


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="what changed between two runs; exit 1 on a regression",
                       description="Compare two finished runs: points that left or joined the front (matched "
                       "by strategy), the recommended point's throughput/memory change, and old front points "
                       "that now fail or are pruned. Exit status: 0 unchanged or better, 1 regression beyond "
                       "--max-regression, 2 usage or input error.")
    p.add_argument("old_run", metavar="OLD_RUN", help="baseline run directory")
    p.add_argument("new_run", metavar="NEW_RUN", help="run directory to judge")
    p.add_argument("--max-regression", default=DEFAULT_MAX_REGRESSION, metavar="PCT",
                   help="tolerated loss of the recommended point's tokens/s (and memory growth of the same "
                   "strategy), e.g. 5%% (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    from autotune.compare import run_compare

    return run_compare(args.old_run, args.new_run, args.max_regression, as_json=args.json)
