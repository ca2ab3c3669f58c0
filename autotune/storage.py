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

import contextlib
import fcntl
import json
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

from optuna.storages.journal import JournalFileBackend, JournalStorage

from autotune._optuna_compat import (BaseJournalFileLock, heartbeat_enabled, journal_backend, journal_file_path,
                                     journal_lock, journal_offsets, study_storage)

if TYPE_CHECKING:
    from optuna import Study
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial


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
        self._held: Optional[list[tuple[dict[str, Any], bytes]]] = None
        """Inside ``batched()``: the logs appended and their lines, not yet written."""
        self._file_end = 0
        """Inside ``batched()``: the number of logs in the file."""

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        if self._held is not None:
            self._held += [(log, _line(log)) for log in logs]
            return
        lock = journal_lock(self)
        lock.acquire()
        try:
            self._write(b"".join(_line(log) for log in logs))
        finally:
            lock.release()

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        if self._held is None:
            yield from super().read_logs(log_number_from)
            return
        # in a batch the lock is held: the file ends at log _file_end and the batch's logs follow it
        if log_number_from < self._file_end:
            yield from super().read_logs(log_number_from)
        for log, _ in self._held[max(0, log_number_from - self._file_end):]:
            yield log

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Hold the journal's lock while the block runs and write every log it appends with one
        write at the end (also on an error). Reads inside the block see those logs after the file's,
        as they would have without the batch: the file's lines and their order are the same."""
        if self._held is not None:  # nested: the outer batch writes
            yield
            return
        lock = journal_lock(self)
        lock.acquire()
        try:
            offsets = journal_offsets(self)
            for _ in super().read_logs(max(offsets)):  # learn where the file's last line ends
                pass
            self._file_end = max(offsets)
            self._held = []
            try:
                yield
            finally:
                held, self._held = self._held, None
                self._write(b"".join(line for _, line in held))
                for k, (_, line) in enumerate(held):  # the next read starts after them
                    offsets[self._file_end + k + 1] = offsets[self._file_end + k] + len(line)
        finally:
            lock.release()

    def _write(self, data: bytes) -> None:
        with open(journal_file_path(self), "ab") as fh:
            fh.write(data)
            fh.flush()


def _line(log: dict[str, Any]) -> bytes:
    return (json.dumps(log, separators=(",", ":")) + "\n").encode("utf-8")


def add_trials(study: Study, trials: Iterable[FrozenTrial]) -> None:
    """``study.add_trials(trials)``; on this module's journal file the trials' lines are written with
    one append instead of one per trial (Optuna's JournalStorage writes and re-reads the file for
    every trial it creates)."""
    backend = journal_backend(study_storage(study))
    with backend.batched() if isinstance(backend, UnsyncedJournalFileBackend) else contextlib.nullcontext():
        study.add_trials(trials)


HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"
"""Heartbeat interval in seconds (default 10; tests use 1). The grace period is 3 intervals."""
MAX_RETRY = 3
"""A trial whose process died is re-queued at most this many times (then it stays FAIL)."""


def heartbeat_interval() -> int:
    raw = os.environ.get(HEARTBEAT_ENV, "")
    return max(1, int(raw)) if raw.isdigit() else 10


def make_storage(url: str, heartbeat: bool = False) -> Any:
    """An Optuna storage from a URL: RDB URLs (sqlite:///, postgresql://...) or a journal file path.

    ``heartbeat=True`` (slow backends, workers) turns on Optuna's trial heartbeat for RDB storages:
    every running trial's process records a heartbeat every ``heartbeat_interval()`` seconds; a
    RUNNING trial whose heartbeat is older than the grace period (its process was SIGKILLed, its
    node died) is set to FAIL by ``optuna.storages.fail_stale_trials`` and re-queued as a WAITING
    copy with the same parameters by ``RetryHeartbeatStaleTrialCallback`` (Optuna 5's name for
    RetryFailedTrialCallback, which 5.0 deprecates). Optuna 5's JournalStorage does not implement
    heartbeats (it is not a BaseHeartbeat), which is why slow backends default to SQLite.
    """
    import optuna

    if "://" not in url:
        return JournalStorage(UnsyncedJournalFileBackend(url))
    url = _postgres_driver(url)
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several worker processes on one SQLite file: wait for the write lock instead of failing.
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 120}}
    else:
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    if heartbeat:
        import warnings

        interval = heartbeat_interval()
        with warnings.catch_warnings():  # experimental since 2.8, still the API in 5.0
            warnings.simplefilter("ignore")
            callback = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
        kwargs.update(heartbeat_interval=interval, grace_period=3 * interval,
                      heartbeat_stale_trial_callback=callback)
    for attempt in range(20):
        try:
            with _quiet():
                storage = optuna.storages.RDBStorage(url, **kwargs)
            if url.startswith("sqlite"):
                _serialize_sqlite(storage.engine)
            return storage
        except Exception as err:
            # Several processes opening a fresh database at once race on creating Optuna's tables
            # (UNIQUE constraint on alembic_version, "table already exists"): the loser retries.
            if attempt == 19 or type(err).__name__ not in ("IntegrityError", "OperationalError", "ProgrammingError"):
                raise
            import time

            time.sleep(0.1 + 0.05 * attempt)
    raise AssertionError("unreachable")


def _serialize_sqlite(engine: Any) -> None:
    """Make every SQLite transaction take the write lock when it begins (``BEGIN IMMEDIATE``).

    Optuna's RDB storage does read-check-write in one session (``set_trial_state_values`` reads the
    state ``FOR UPDATE``, then writes it). SQLite ignores ``FOR UPDATE`` and pysqlite only opens the
    transaction at the first write, so two processes can both read a WAITING trial and both move it
    to RUNNING: ``ask()`` hands the same enqueued trial to two workers (tests/search/test_storage.py; the
    figure is in docs/accuracy.md, "Figures moved from code"). With the lock
    taken at ``BEGIN`` the read and the write are one atomic step, as with PostgreSQL's row locks.
    Recipe: SQLAlchemy docs, "Serializable isolation / Savepoints / Transactional DDL" (pysqlite).
    """
    from sqlalchemy import event

    engine.dispose()  # connections opened during RDBStorage() predate the hooks

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # pysqlite emits no BEGIN of its own

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _postgres_driver(url: str) -> str:
    """``postgresql://`` means psycopg (v3) to SQLAlchemy 2.1; use psycopg2 when only it is installed."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql+psycopg2://{rest}"
    return f"postgresql://{rest}"


def has_heartbeat(storage: BaseStorage) -> bool:
    """Whether ``storage`` records trial heartbeats (make_storage with heartbeat=True, RDB only)."""
    return heartbeat_enabled(storage)


class _quiet:
    """Silence Optuna's ExperimentalWarning for heartbeat arguments."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
