"""``python -m autotune.knob_docs [FILE]``: the strategy knob table of docs/config.md, generated.

Without FILE it prints the table (autotune.knobs.knob_table of Strategy); with FILE it rewrites
the part of FILE between the markers ``<!-- knobs:begin -->`` and ``<!-- knobs:end -->``.
tests/spec/test_knobs.py checks that the committed docs/config.md holds the table verbatim.
"""

from __future__ import annotations

import sys
from typing import Optional

from autotune.knobs import knob_table
from autotune.strategy import Strategy

BEGIN, END = "<!-- knobs:begin -->", "<!-- knobs:end -->"
"""The markers around the generated table."""


def with_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"expected the markers {BEGIN} and {END}")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(knob_table(Strategy), end="")
        return 0
    with open(args[0]) as fh:
        text = fh.read()
    try:
        new = with_table(text, knob_table(Strategy))
    except ValueError as err:
        print(f"{args[0]}: {err}", file=sys.stderr)
        return 2
    with open(args[0], "w") as fh:
        fh.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
