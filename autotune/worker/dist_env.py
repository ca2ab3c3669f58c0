"""torch.distributed's environment for a process started without a launcher (torch-free): a free
local port, and torchrun's variables for a plain ``python`` run. The launcher (autotune.backends.launch),
the worker's engines and the example training scripts use these one definitions."""

from __future__ import annotations

import os
import socket


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
