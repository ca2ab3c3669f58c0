"""Reasons as data: a verdict's reason in words that also carries its kind, so code acts on the kind
and never reads the words (a Reason is a ``str``: JSON, joins and messages see the text)."""

from __future__ import annotations

from typing import Literal

ReasonKind = Literal["rule", "gpu_memory", "host_memory", "nvme"]
"""rule: the strategy breaks a validity rule; gpu_memory / host_memory / nvme: it does not fit there."""


class Reason(str):
    """The text of a reason, with ``kind`` (a ReasonKind)."""

    kind: str

    def __new__(cls, text: str, kind: ReasonKind = "rule") -> "Reason":
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj


def kind_of(reason: str) -> str:
    """A reason's kind ("rule" for a plain string: the rules are the only other source)."""
    return getattr(reason, "kind", "rule")
