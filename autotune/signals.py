"""Signals during a study: the first SIGINT finishes the trial in flight, a second SIGINT or a
SIGTERM aborts it (``Terminated``)."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM (or a second SIGINT) while a trial runs: abort it, persist the study, exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopFlag:
    """First SIGINT: finish the current trial, then stop. Second SIGINT or SIGTERM: stop now
    (raise Terminated; the trial in flight is recorded as interrupted and re-queued, the study is
    persisted, the backend's launch is killed by its own cleanup)."""

    def __init__(self) -> None:
        self.stop = False
        self._old: dict[int, Any] = {}
        self._deferring = False
        self._pending: int | None = None

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop or signum == signal.SIGTERM:
            if self._deferring:
                self._pending = signum
                return
            raise Terminated(signum)
        self.stop = True
        print("\nautotune: stopping after the current trial (Ctrl-C again to abort it)", file=sys.stderr)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """An abort that arrives inside is raised when the block ends: a trial being created (Optuna's
        ask writes it RUNNING before it returns) becomes the caller's to abandon first."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            signum, self._pending = self._pending, None
            if signum is not None:
                raise Terminated(signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
