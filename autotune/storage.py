"""Optuna storages for run directories.

The default is a journal file. Optuna's JournalFileBackend fsyncs every log line and takes a
symlink lock around it (about 3 ms + 1 ms each here, ~12 lines per trial), which alone would take
~8 s for a 200-trial simulate run. This backend writes the same lines in the same format under an
``fcntl.flock`` lock, flushed to the kernel but not fsynced: a crashed or killed process loses
nothing (the data is in the page cache); only a power loss can drop the tail. Other processes
(workers, optuna-dashboard) see every line as soon as it is appended. flock works on local file
systems; for studies shared across machines use an RDB URL (PostgreSQL).
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import Any

from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.storages.journal._file import BaseJournalFileLock


class FlockLock(BaseJournalFileLock):
    """An exclusive flock on ``<journal>.lock`` (released by the kernel if the holder dies)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class UnsyncedJournalFileBackend(JournalFileBackend):
    """JournalFileBackend with a flock and without the per-append fsync (same file format)."""

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path, lock_obj=FlockLock(file_path + ".lock"))

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
        self._lock.acquire()
        try:
            with open(self._file_path, "ab") as fh:
                fh.write(text.encode("utf-8"))
                fh.flush()
        finally:
            self._lock.release()


def make_storage(url: str) -> Any:
    """An Optuna storage from a URL: RDB URLs (sqlite:///, postgresql://...) or a journal file path."""
    import optuna

    if "://" in url:
        return optuna.storages.RDBStorage(url)
    return JournalStorage(UnsyncedJournalFileBackend(url))
