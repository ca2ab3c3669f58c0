"""The ``replay`` backend: answers trials from a CSV of measured results (same columns as trials.csv).

Rows are matched on the strategy columns: every Strategy field present in the header (trials.csv
has all of them but ``param_persistence_threshold``); the core knobs in REQUIRED_COLUMNS must be
there. A COMPLETE row answers
``ok`` with its peak memory, tokens/s, step time and MFU; a FAIL row answers with its ``fail_status``
(tables written before that column existed: see runfiles.fail_status_of) and the backend's reason
from its ``fail_reason``; PRUNED rows and rows marked ``duplicate_of`` were
never measured and are skipped. A strategy with no measured row answers
``Measurement(status="error", reason="not in replay table")``. The first measured row of a strategy
wins, so the answers are deterministic. An optional ``tokens_per_s_spread`` column (relative
step-to-step spread of the measured throughput, see autotune.calibration.loop.throughput_spread)
is passed on in ``extra``.

Replay is the profiling loop's test double: ``make_backend("replay", ...)`` gives it the same
``Calibrator`` the profile backend has, fed with every answer, so a replayed run re-fits the
simulator, corrects the memory model per family, re-predicts and re-seeds exactly as a profiled
run does; only the source of the measurements differs.
"""

from __future__ import annotations

import csv
import dataclasses
from typing import Any, Optional

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.backends.base import FAIL_STATUSES, Backend, Measurement, fail_detail
from autotune.runfiles import ADDED_KNOBS, fail_status_of, knob_value
from autotune.spec import GIB
from autotune.strategy import Strategy, knob_choices

_FIELDS = dataclasses.fields(Strategy)
STRATEGY_FIELDS = tuple(f.name for f in _FIELDS)
REQUIRED_COLUMNS = tuple(f.name for f in _FIELDS if f.default is not None and f.name not in ADDED_KNOBS)
"""The knobs without an automatic value (None): a table must state them (a table older than the
ADDED_KNOBS lacks those: deepspeed strategies)."""


def _cell(column: str, raw: Optional[str]) -> Any:
    value = knob_value(column, raw)
    choices = knob_choices(column)
    integer = choices is None or all(type(c) is int for c in choices)
    if value is not None and integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{column} must be an integer, but got {raw!r}")
    return value


def _float(raw: Optional[str]) -> Optional[float]:
    raw = (raw or "").strip()
    return float(raw) if raw not in ("", "None") else None


def strategy_key(values: dict[str, Any], columns: list[str]) -> tuple:
    """Strategy.key of the strategy with only ``columns`` taken from ``values`` (the other fields at
    their defaults): a table matches on the columns it has."""
    return Strategy(**{c: values.get(c) for c in columns}).key()


class ReplayBackend(Backend):
    """Measurements looked up in a table (see the module docstring)."""

    name = "replay"
    in_memory_study = True
    evaluated_as = "replayed measurement"

    def __init__(self, csv_path: str, cfg: Optional[Config] = None, calibrator: Any = None) -> None:
        self.csv_path = csv_path
        self.cfg = cfg
        self.calibrator = calibrator
        """Optional autotune.calibration.loop.Calibrator fed with every answer (as DeepSpeedBackend)."""
        self.columns: list[str] = list(REQUIRED_COLUMNS)
        self.table: dict[tuple, Measurement] = {}
        self.calls = 0
        self._load()

    def _load(self) -> None:
        where = "profile.replay_csv"
        try:
            fh = open(self.csv_path, newline="", encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"cannot read replay table {self.csv_path} ({err.strerror})", path=where) from None
        with fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            self.columns = [c for c in STRATEGY_FIELDS if c in header]
            need = [*REQUIRED_COLUMNS, "state", "peak_memory_gib", "tokens_per_s_per_gpu"]
            missing = [c for c in need if c not in header]
            if missing:
                raise ConfigError(f"replay table {self.csv_path} lacks column(s) {', '.join(missing)}", path=where)
            for line, row in enumerate(reader, start=2):
                if (row.get("duplicate_of") or "").strip() or row["state"] not in ("COMPLETE", "FAIL"):
                    continue
                try:
                    key = strategy_key({c: _cell(c, row[c]) for c in self.columns}, self.columns)
                    m = self._measurement(row)
                except (TypeError, ValueError) as err:
                    raise ConfigError(f"replay table {self.csv_path} line {line}: bad value ({err})"[:300],
                                      path=where) from None
                self.table.setdefault(key, m)

    @staticmethod
    def _measurement(row: dict[str, str]) -> Measurement:
        if row["state"] == "COMPLETE":
            mem, tps = _float(row["peak_memory_gib"]), _float(row["tokens_per_s_per_gpu"])
            if mem is None or tps is None:
                raise ValueError("COMPLETE row without peak_memory_gib / tokens_per_s_per_gpu")
            extra: dict[str, Any] = {"replayed": True}
            spread = _float(row.get("tokens_per_s_spread"))
            if spread is not None:
                extra["tokens_per_s_spread"] = spread
            return Measurement(status="ok", peak_memory_bytes=int(round(mem * GIB)), tokens_per_s_per_gpu=tps,
                               step_time_s=_float(row.get("step_time_s")), mfu=_float(row.get("mfu")),
                               extra=extra)
        status = fail_status_of(row).strip()
        if status not in FAIL_STATUSES:
            status = "error"
        reason = fail_detail(status, (row.get("fail_reason") or "").strip())
        return Measurement(status=status, reason=reason, extra={"replayed": True})  # type: ignore[arg-type]

    def key_of(self, strategy: Strategy) -> tuple:
        return strategy_key({c: getattr(strategy, c) for c in self.columns}, self.columns)

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        self.calls += 1
        found = self.table.get(self.key_of(strategy))
        if found is None:
            found = Measurement(status="error", reason="not in replay table")
        if self.calibrator is not None:
            self.calibrator.add(strategy, found)
        return found
