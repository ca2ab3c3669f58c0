"""Command line: ``autotune estimate | run | show | compare | worker``. ``main(argv) -> int``.

Each command lives in autotune/commands/ (``add_parser`` + ``run``); this module builds the parser
and turns a ConfigError into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from autotune.commands import COMMANDS as _MODULES
from autotune.errors import ConfigError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {name: m.run for name, m in _MODULES.items()}
"""Command name -> the function that runs it."""


def build_parser() -> argparse.ArgumentParser:
    from autotune import __version__

    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Simulation-based training-strategy autotuner: predicts per-GPU memory and step time of "
        "DeepSpeed strategies and searches for the memory/throughput Pareto front.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _MODULES.values():
        module.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as err:
        print(f"autotune: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
