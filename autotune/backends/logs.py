"""Reading what a launch left in its logs (stderr.log beside each trial): the cause of a rank that died
without writing a result."""

from __future__ import annotations

import os
import re

_ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b:? ?.*$")
"""The last line of a Python traceback: ``ModuleNotFoundError: No module named 'torch'``."""


def last_error_line(log_dir: str, tail_bytes: int = 65536) -> str:
    """The last exception line in the launch's stderr.log (the cause of a rank that died without a
    result, e.g. a missing package), or ""."""
    try:
        with open(os.path.join(log_dir, "stderr.log"), "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail_bytes))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        line = re.sub(r"^\[[^\]]*\]:?\s*", "", line.strip())  # torchrun's "[rank0]: " prefix
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:  # not the launcher's own summary
            return line[:200]
    return ""
