"""``autotune show RUN_DIR``: a finished run's front and recommended point, read back from its files."""

from __future__ import annotations

import argparse
import json
from typing import Any



def add_parser(sub: Any) -> None:
    p = sub.add_parser("show", help="print a finished run's front and recommended point again",
                       description="Print the Pareto front table and the recommended point of a finished "
                       "run directory (read from its files; nothing is re-run).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/llama2-7b-20250101T000000Z "
                   "or runs/latest")
    p.add_argument("--json", action="store_true", help="print front.json instead of the table")
    p.add_argument("--report", action="store_true", help="(re)write report.html and front.png first")


def run(args: argparse.Namespace) -> int:
    from autotune.output import format_show
    from autotune.runfiles import load_run

    data = load_run(args.run_dir)
    if getattr(args, "report", False):
        from autotune.report import write_report

        write_report(data.run_dir)
    if args.json:
        print(json.dumps(data.front, indent=2))
    else:
        print(format_show(data))
    return 0
