"""The files of a run directory, read and written in one place.

``runs/<name>/`` holds run.json (written by rundir), trials.csv and front.json (written by output),
best.json, ds_configs/ and summary.md. This module owns their names, the trials.csv columns, the
atomic JSON writer, and the reader every consumer uses (``load_run``: show, compare, report,
nightly baselines). It reads only files, so it works for any finished run wherever it was copied,
without re-running anything or importing torch.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from autotune.errors import ConfigError
from autotune.memory import GPU_COMPONENTS
from autotune.backends.base import FAIL_STATUSES
from autotune import knobs
from autotune.strategy import KNOBS, Strategy, knob_choices

RUN_FILE = "run.json"
FRONT_FILE = "front.json"
TRIALS_FILE = "trials.csv"



def csv_columns(cls: type = Strategy) -> list[str]:
    """trials.csv columns, in file order, for a Strategy class: its searched knobs after the
    number and state (autotune.knobs.searched), then the prediction and the outcome."""
    return (["number", "state"] + list(knobs.searched(cls))
            + [f"pred_{k}_gib" for k in (*GPU_COMPONENTS, "peak")]
            + ["pred_cpu_gib", "pred_fits", "peak_memory_gib", "gpu_memory_gib", "tokens_per_s_per_gpu", "step_time_s",
               "mfu", "on_front", "prune_reason", "fail_status", "fail_reason", "duplicate_of", "strategy"])


STRATEGY_COLUMNS = list(KNOBS)
"""The strategy columns of trials.csv (strategy.KNOBS)."""
CSV_COLUMNS = csv_columns()
"""trials.csv columns, in file order."""


# ---------------------------------------------------------------- a failed trial's status

def fail_status_of(row: Mapping[str, Any]) -> str:
    """The ``fail_status`` cell of a trials.csv row ("" for a trial that did not fail)."""
    if "fail_status" in row:
        return row.get("fail_status") or ""
    # Old format: trials.csv written before the fail_status column existed. There the status only
    # shows as the prefix of the reason text (backend.fail_reason_text); this is the one place that reads it.
    head = (row.get("fail_reason") or "").partition(":")[0].strip()
    return head if row.get("state") == "FAIL" and head in FAIL_STATUSES else ""


# ---------------------------------------------------------------- writing

def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def _cell(value: Any) -> Any:
    return "" if value is None else value  # floats keep full precision (replay reads them back)


def write_trials_csv(path: str, records: Iterable["TrialRecord"]) -> None:
    """Write trials.csv atomically (None -> empty cell)."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for rec in records:
            writer.writerow({k: _cell(v) for k, v in rec.to_row().items()})
    os.replace(tmp, path)


# ---------------------------------------------------------------- trials.csv rows

@dataclass(frozen=True)
class TrialRecord:
    """One row of trials.csv: a trial's strategy, the memory model's prediction and the outcome."""

    number: int
    state: str
    """COMPLETE, PRUNED or FAIL."""
    strategy: Strategy
    """Its KNOBS (other fields at their defaults)."""
    predicted_gib: dict[str, Optional[float]]
    """The memory model's GPU breakdown (GPU_COMPONENTS and ``peak``), GiB."""
    predicted_cpu_gib: Optional[float]
    predicted_fits: Optional[bool]
    peak_memory_gib: Optional[float]
    """Measured (or simulated) allocated peak; None unless COMPLETE."""
    gpu_memory_gib: Optional[float]
    """Peak + context and allocator: what ``fits`` compares with the usable memory."""
    tokens_per_s_per_gpu: Optional[float]
    step_time_s: Optional[float]
    mfu: Optional[float]
    on_front: bool
    prune_reason: str
    fail_status: str
    """How a failed evaluation ended (one of FAIL_STATUSES); "" unless FAIL (and for a trial lost
    before it had a result)."""
    fail_reason: str
    """For people: fail_reason_text of the status and the backend's reason."""
    duplicate_of: Optional[int]
    """The trial whose result this repeat reuses."""
    strategy_text: str
    """Strategy.describe (the ``strategy`` column)."""

    @property
    def is_repeat(self) -> bool:
        return self.duplicate_of is not None

    def to_row(self) -> dict[str, Any]:
        """The record as trials.csv columns (CSV_COLUMNS order; values as the csv module writes them)."""
        row: dict[str, Any] = {"number": self.number, "state": self.state,
                               **{k: getattr(self.strategy, k) for k in STRATEGY_COLUMNS}}
        row.update({f"pred_{k}_gib": self.predicted_gib.get(k) for k in (*GPU_COMPONENTS, "peak")})
        row.update(pred_cpu_gib=self.predicted_cpu_gib, pred_fits=self.predicted_fits,
                   peak_memory_gib=self.peak_memory_gib, gpu_memory_gib=self.gpu_memory_gib,
                   tokens_per_s_per_gpu=self.tokens_per_s_per_gpu, step_time_s=self.step_time_s, mfu=self.mfu,
                   on_front=self.on_front, prune_reason=self.prune_reason, fail_status=self.fail_status,
                   fail_reason=self.fail_reason, duplicate_of=self.duplicate_of, strategy=self.strategy_text)
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "TrialRecord":
        """A record from a trials.csv row (strings); missing or unreadable cells read as None / "".
        ``number`` and ``state`` must be there (load_run checks the columns). Files written before
        the ``fail_status`` column existed read too (fail_status_of)."""
        def number_or_none(key: str) -> Optional[int]:
            value = to_float(row.get(key))
            return None if value is None else int(value)

        fits = row.get("pred_fits")
        return cls(
            number=int(row["number"]), state=row["state"], strategy=strategy_from_record(row),
            predicted_gib={k: to_float(row.get(f"pred_{k}_gib")) for k in (*GPU_COMPONENTS, "peak")},
            predicted_cpu_gib=to_float(row.get("pred_cpu_gib")),
            predicted_fits=None if fits in (None, "") else fits == "True",
            peak_memory_gib=to_float(row.get("peak_memory_gib")), gpu_memory_gib=to_float(row.get("gpu_memory_gib")),
            tokens_per_s_per_gpu=to_float(row.get("tokens_per_s_per_gpu")), step_time_s=to_float(row.get("step_time_s")),
            mfu=to_float(row.get("mfu")), on_front=row.get("on_front") == "True",
            prune_reason=row.get("prune_reason") or "", fail_status=fail_status_of(row),
            fail_reason=row.get("fail_reason") or "",
            duplicate_of=number_or_none("duplicate_of"), strategy_text=row.get("strategy") or "",
        )


# ---------------------------------------------------------------- reading

@dataclass
class RunData:
    """The files of one finished run directory."""

    run_dir: str
    front: dict[str, Any]
    """front.json"""
    trials: list[dict[str, str]]
    """trials.csv rows (strings, as written)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """run.json ({} when absent)."""

    @functools.cached_property
    def records(self) -> list[TrialRecord]:
        """trials.csv rows as typed records (read once)."""
        return [TrialRecord.from_row(r) for r in self.trials]

    @property
    def name(self) -> str:
        return self.meta.get("name") or os.path.basename(os.path.normpath(self.run_dir))

    @property
    def best(self) -> Optional[dict[str, Any]]:
        return self.front.get("best") or None


def read_json(path: str, what: str) -> Any:
    """A JSON file; unreadable or malformed is a one-line ConfigError naming the file."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as err:
        raise ConfigError(f"unreadable {what} (invalid JSON at line {err.lineno}: {err.msg})", file=path) from None
    except OSError as err:
        raise ConfigError(f"cannot read {what}: {err.strerror}", file=path) from None


def load_run(run_dir: str) -> RunData:
    """Read a finished run directory; a missing or malformed one is a one-line ConfigError."""
    if not run_dir:
        raise ConfigError("expected a run directory, but got an empty path")
    if not os.path.exists(run_dir):
        raise ConfigError("no such run directory", file=run_dir)
    if not os.path.isdir(run_dir):
        raise ConfigError("not a directory; expected a run directory (runs/<name>/)", file=run_dir)
    front_path = os.path.join(run_dir, FRONT_FILE)
    if not os.path.isfile(front_path):
        hint = " (interrupted before its outputs were written?)" if os.path.isfile(
            os.path.join(run_dir, RUN_FILE)) else ""
        raise ConfigError(f"not a finished autotune run: no front.json{hint}", file=run_dir)
    front = read_json(front_path, FRONT_FILE)
    if not isinstance(front, dict) or not isinstance(front.get("front"), list):
        raise ConfigError("unexpected front.json: expected an object with a 'front' list", file=front_path)
    trials_path = os.path.join(run_dir, TRIALS_FILE)
    if not os.path.isfile(trials_path):
        raise ConfigError("not a finished autotune run: no trials.csv", file=run_dir)
    try:
        with open(trials_path, newline="") as fh:
            reader = csv.DictReader(fh)
            trials = list(reader)
            columns = reader.fieldnames or []
    except (OSError, csv.Error) as err:
        raise ConfigError(f"cannot read trials.csv: {err}", file=trials_path) from None
    missing = [c for c in ("number", "state") if c not in columns]
    if missing:
        raise ConfigError(f"unexpected trials.csv: missing column(s) {', '.join(missing)}", file=trials_path)
    meta_path = os.path.join(run_dir, RUN_FILE)
    meta = read_json(meta_path, RUN_FILE) if os.path.isfile(meta_path) else {}
    return RunData(run_dir=run_dir, front=front, trials=trials, meta=meta if isinstance(meta, dict) else {})


def to_float(text: Any) -> Optional[float]:
    """A number cell of a run file, or None (empty, missing or not a number)."""
    if text is None or text == "":
        return None
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


ADDED_KNOBS = tuple(f.name for f in knobs.knob_fields(Strategy) if f.metadata["added"])
"""Knobs added after the first trials.csv format (metadata ``added``): a record written before
lacks them and meant their default (deepspeed)."""


def knob_value(knob: str, value: Any) -> Any:
    """One knob of a front.json strategy or a trials.csv cell, typed as Strategy holds it
    (integers written as "2" or 2.0 read back as 2; "True"/"False" as booleans; empty as None;
    anything unreadable kept as is)."""
    if isinstance(value, str):
        value = value.strip()
    if value is None or value in ("", "None"):
        return None
    choices = knob_choices(knob)
    if choices is not None and isinstance(choices[0], bool):
        return {"True": True, "False": False, "true": True, "false": False}.get(value, value) \
            if isinstance(value, str) else value
    if choices is None or isinstance(choices[0], int):  # bools handled above
        try:
            number = float(value)
        except (TypeError, ValueError):
            return value
        return int(number) if number.is_integer() else number
    return value


def strategy_from_record(record: Mapping[str, Any]) -> Strategy:
    """The strategy a front.json point's ``strategy`` or a trials.csv row describes (its KNOBS;
    a knob it lacks is None, so a record is never taken for one that states the default, except
    the ADDED_KNOBS, which an older record lacks and means at their defaults)."""
    return Strategy(**{k: knob_value(k, record.get(k)) for k in KNOBS
                       if k in record or k not in ADDED_KNOBS})


def strategy_key(record: Mapping[str, Any]) -> tuple:
    """Identity of a recorded strategy across runs: Strategy.key of strategy_from_record."""
    return strategy_from_record(record).key()


def point_memory_gib(p: dict[str, Any]) -> float:
    """A front point's GPU memory as ``fits`` counts it, the one memory figure run, show, compare and
    the report print (older front.json files: the allocated peak)."""
    return p.get("gpu_memory_gib", p["peak_memory_gib"])
