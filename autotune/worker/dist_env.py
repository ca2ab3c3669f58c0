"""torch.distributed's environment for a process started without a launcher (torch-free): a free
local port, torchrun's variables for a plain ``python`` run, and the example training scripts' entry
(``run_script``). The launcher (autotune.backends.launch), the worker's engines and the example
training scripts use these one definitions."""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Callable

from autotune.errors import ConfigError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_env() -> None:
    """torchrun's variables for a plain ``python`` run (DeepSpeed otherwise looks for MPI): a
    1-process group on a free local port; nothing when a launcher has set them (RANK)."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def run_script(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s status; a missing or unreadable file named on the command line (the job,
    a config or layout) is one line, ``<script>: error: ...``, and exit 1, not a traceback."""
    try:
        sys.exit(main())
    except (OSError, ConfigError, json.JSONDecodeError) as err:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {err}")
