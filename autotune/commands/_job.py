"""The job file as the commands that size its model read it: loaded and validated (config.load_config),
and what could not be checked of it said on stderr, one ``autotune: note:`` line each (Config.notes)."""

from __future__ import annotations

import sys

from autotune.config import Config, load_config


def load_job(path: str) -> Config:
    """``load_config(path)``, its notes printed on stderr."""
    cfg = load_config(path)
    for note in cfg.notes:
        print(f"autotune: note: {note}", file=sys.stderr)
    return cfg
