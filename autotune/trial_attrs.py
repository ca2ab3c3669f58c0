"""What a study and its trials carry in Optuna's user attributes: each key is defined once, as a field
of ``TrialAttrs`` or ``StudyAttrs``; ``put`` writes them (refusing a name that is not a field) and
``TrialAttrs.of`` / ``StudyAttrs.of`` read them back typed (None: not set)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial, Trial


@dataclass(frozen=True)
class TrialAttrs:
    """One trial's attributes."""

    measurement: Optional[dict[str, Any]] = None
    """The backend's result (``Measurement.as_dict()``, JSON-safe); absent for pruned and repeated trials."""
    prune_reason: Optional[str] = None
    """Why the candidate was pruned before any measurement (the memory model's reasons, an OOM bound)."""
    fail_status: Optional[str] = None
    """A failed measurement's status (oom, timeout, crash, error)."""
    fail_reason: Optional[str] = None
    """A failed measurement's reason, one line."""
    duplicate_of: Optional[int] = None
    """The trial number whose result this trial repeats (its strategy was evaluated there)."""
    interrupted: Optional[str] = None
    """The exception type that cut the trial short while its knobs were being chosen (nothing ran)."""
    retry_of: Optional[int] = None
    """A re-queued trial: the number of the trial it retries (lost or interrupted)."""
    strategy_key: Optional[str] = None
    """Strategy.key as text, recorded right after ask() in shared studies (autotune.claim)."""

    @classmethod
    def of(cls, trial: "Union[FrozenTrial, Trial]") -> "TrialAttrs":
        return _read(cls, trial.user_attrs)


@dataclass(frozen=True)
class StudyAttrs:
    """A study's attributes, set when it is initialised (``front_confidence`` when a search ends)."""

    space: Optional[str] = None
    """The search space's file."""
    headroom: Optional[float] = None
    """The fraction of GPU memory kept free (search.headroom)."""
    config: Optional[str] = None
    """The job file's path (a joining worker loads it)."""
    num_feasible: Optional[int] = None
    """Candidates the memory model says fit."""
    num_candidates: Optional[int] = None
    """Candidates screened; set last, so a study that has it is initialised."""
    front_confidence: Optional[str] = None
    """The stopping rule's statement about the front when the search ended."""

    @classmethod
    def of(cls, study: "Study") -> "StudyAttrs":
        return _read(cls, study.user_attrs)


_KEYS = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in (TrialAttrs, StudyAttrs)}
"""Each record's keys: its fields."""


def _read(cls: type, attrs: dict[str, Any]) -> Any:
    return cls(**{k: v for k, v in attrs.items() if k in _KEYS[cls]})

OUTCOME_KEYS = ("prune_reason", "fail_status", "fail_reason")
"""The TrialAttrs that say how a trial ended (copied to the trials that repeat its strategy)."""


def encode(cls: type, **values: Any) -> dict[str, Any]:
    """``values`` as user attributes of ``cls`` (TrialAttrs or StudyAttrs); a name that is not one of
    its fields is a programming error."""
    unknown = sorted(set(values) - _KEYS[cls])
    if unknown:
        raise KeyError(f"not {cls.__name__} fields: {', '.join(unknown)}")
    return values


def put(target: Any, **values: Any) -> None:
    """Set user attributes on a trial (TrialAttrs fields) or a study (StudyAttrs fields)."""
    from optuna import Study

    for name, value in encode(StudyAttrs if isinstance(target, Study) else TrialAttrs, **values).items():
        target.set_user_attr(name, value)
