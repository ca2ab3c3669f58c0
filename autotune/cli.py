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


class _VersionAction(argparse.Action):
    """``--version``: argparse's version action with the version read only when the flag is given
    (``autotune.__version__`` reads the package metadata: importlib.metadata, tens of ms of every start)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show program's version number and exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: Optional[str] = None) -> None:
        from autotune import __version__

        formatter = parser._get_formatter()
        formatter.add_text(f"autotune {__version__}")
        parser._print_message(formatter.format_help(), sys.stdout)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Simulation-based training-strategy autotuner: predicts per-GPU memory and step time of "
        "DeepSpeed strategies and searches for the memory/throughput Pareto front.",
    )
    parser.add_argument("--version", action=_VersionAction)
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
