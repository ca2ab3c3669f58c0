"""User-facing errors: one line naming the file, the key path and what was expected."""

from __future__ import annotations

from typing import Optional


class ConfigError(ValueError):
    """Bad user input. ``str(err)`` is the one line the CLI prints before exiting with status 2."""

    def __init__(self, message: str, *, file: Optional[str] = None, path: Optional[str] = None) -> None:
        self.file = file
        self.path = path
        self.message = message
        super().__init__(self._render())

    def _render(self) -> str:
        where = ": ".join(p for p in (self.file, self.path) if p)
        return f"{where}: {self.message}" if where else self.message

    def in_file(self, file: str) -> "ConfigError":
        """The same error, attributed to ``file`` when it has no file yet."""
        return self if self.file else ConfigError(self.message, file=file, path=self.path)
