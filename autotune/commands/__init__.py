"""One module per ``autotune`` command, each with ``add_parser(subparsers)`` and ``run(args) -> int``."""

from autotune.commands import compare, estimate, run, show, worker

COMMANDS = {"estimate": estimate, "run": run, "show": show, "compare": compare, "worker": worker}
"""Command name -> its module, in the order ``autotune --help`` lists them."""
