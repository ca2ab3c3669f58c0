"""The knob mechanism: a strategy knob is a dataclass field whose metadata says everything else.

``knob(...)`` makes a field of autotune.strategy.Strategy; its metadata holds the knob's help text,
when it applies, its place in the search, its CLI flag, integer range, search-space default and
how old records without it read. Every list derived from the knobs (the job file's checkers,
the search space's schema and defaults, the CLI flags and help, the trials.csv columns, the
docs/config.md table) is read off a dataclass with these functions, which take the class, so a
copy of Strategy with one more field yields artefacts with one more knob.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

Feature = tuple[Literal["levels", "switch", "set", "log2", "blocks"], float]
"""How the search's residual model sees a knob (``features``): (kind, weight). levels: weight per
Literal level (one-hot); switch: weight when not the default; set: weight when not None; log2: the
value's log2 over the space's span; blocks: the fraction of blocks checkpointed, per non-default level."""

ONE_HOT = 1 / math.sqrt(2)
"""The one-hot weight that puts two levels of a knob at unit distance."""

MemoryTerm = Literal["rules", "activations", "states", "units"]
"""A term of the memory model the screen computes once per distinct key (memory/_fast.py): rules =
``strategy.validate``; activations = ``activation_breakdown``; states = a DeepSpeed candidate's model
states and buckets; units = an FSDP2 candidate's units and accumulation."""
MEMORY_TERMS: tuple[MemoryTerm, ...] = typing.get_args(MemoryTerm)

Getter = Callable[[str], Any]
"""Reads one knob's value from a strategy or from the values chosen so far (None: not chosen)."""


@dataclass(frozen=True)
class When:
    """A condition on other knobs (the knobs named in ``reads`` must be chosen first)."""

    text: str
    """The condition in words, for the docs table."""
    reads: tuple[str, ...]
    test: Callable[[Getter], bool]

    def __and__(self, other: "When") -> "When":
        return When(f"{self.text}, {other.text}", self.reads + other.reads,
                    lambda get: self.test(get) and other.test(get))


def knob(default: Any, *, help: str, search_order: Optional[int], nest: Optional[int] = None, flag: bool,
         engine: Optional[str] = None, applies: Optional[When] = None,
         int_range: Optional[tuple[int, Optional[int]]] = None, buffer: bool = False,
         space: Optional[tuple[Any, ...]] = None, of_layers: bool = False, added: bool = False,
         from_training: Optional[str] = None, feature: Optional[Feature] = None,
         memory: Optional[tuple[MemoryTerm, ...]] = None, long_context: bool = False) -> Any:
    """A strategy field. ``help``: what it does (CLI help, docs). ``search_order``: its place in
    the knobs a search space varies (the order Optuna is asked and the trials.csv columns; None:
    not searched); ``nest``: its place in the nesting of the space's candidates (outermost first,
    after the knobs it reads; default search_order). ``flag``: ``autotune estimate`` has a
    ``--flag`` for it. ``engine``: the one engine it belongs to (fixed for the other); ``applies``:
    the further condition under which it has an effect. ``int_range``: (low, high) an integer
    knob accepts (high None: no bound). ``buffer``: a DeepSpeed buffer size (None: autotune's
    choice; a space writes it ``auto``). ``space``: the values a search space that omits it
    takes (default: the field's default alone). ``of_layers``: a number of blocks (a space may
    give ``all`` or fractions of the model's blocks). ``added``: added after the first trials.csv
    format (a record without it means the default). ``from_training``: a job file (strategy
    section, search space) that omits it takes this field of its training section instead.
    ``feature``: how the search's residual model sees it (None: not at all, or through another knob).
    ``memory``: the memory terms whose value it changes (the screen's cache keys, ``memory_key``;
    None: every term, so a new knob can make no cached term stale). ``long_context``: a model-side
    long-context knob (autotune.models.long_context applies it; no engine config has a key for it)."""
    return dataclasses.field(default=default, metadata={
        "help": " ".join(help.split()), "search_order": search_order,
        "nest": search_order if nest is None else nest, "flag": flag, "engine": engine, "applies": applies,
        "int_range": int_range, "buffer": buffer, "space": space, "of_layers": of_layers, "added": added,
        "from_training": from_training, "feature": feature,
        "memory": MEMORY_TERMS if memory is None else memory, "long_context": long_context})


def knob_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The class's knob fields (those made by ``knob``), in field order."""
    return tuple(f for f in dataclasses.fields(cls) if "search_order" in f.metadata)


def _ordered(cls: type, key: str) -> tuple[str, ...]:
    chosen = [f for f in knob_fields(cls) if f.metadata[key] is not None]
    return tuple(f.name for f in sorted(chosen, key=lambda f: f.metadata[key]))


def searched(cls: type) -> tuple[str, ...]:
    """The knobs a search space varies, in suggestion order (``search_order``)."""
    return _ordered(cls, "search_order")


def nesting(cls: type) -> tuple[str, ...]:
    """The searched knobs in the nesting of a space's candidates (outermost first); each knob comes
    after the knobs its condition reads (checked)."""
    order = _ordered(cls, "nest")
    meta = {f.name: f.metadata for f in knob_fields(cls)}
    for i, name in enumerate(order):
        reads = (("engine",) if meta[name]["engine"] else ()) + (meta[name]["applies"].reads
                                                                 if meta[name]["applies"] else ())
        late = [r for r in reads if r in order and order.index(r) > i]
        assert not late, f"{name} is nested before {late}, which it reads"
    return order


def memory_key(cls: type, term: MemoryTerm) -> tuple[str, ...]:
    """The knobs whose value changes the memory term ``term`` (field order): the screen computes the
    term once per distinct tuple of their values."""
    return tuple(f.name for f in knob_fields(cls) if term in f.metadata["memory"])


def long_context_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The model-side long-context knobs (field order)."""
    return tuple(f for f in knob_fields(cls) if f.metadata["long_context"])


def flagged(cls: type) -> tuple[str, ...]:
    """The knobs ``autotune estimate`` takes as ``--flags`` (field order)."""
    return tuple(f.name for f in knob_fields(cls) if f.metadata["flag"])


def literal_choices(cls: type) -> dict[str, Optional[tuple[Any, ...]]]:
    """Field name -> the values of its ``Literal`` type (None for other types)."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(hint) if typing.get_origin(hint) is Literal else None
            for name, hint in hints.items()}


def applies(field: dataclasses.Field, get: Getter) -> bool:
    """Whether the knob has an effect given the other knobs (a missing engine is deepspeed)."""
    engine = field.metadata["engine"]
    if engine is not None and (get("engine") or "deepspeed") != engine:
        return False
    condition = field.metadata["applies"]
    return condition is None or condition.test(get)


def applies_text(field: dataclasses.Field) -> str:
    """When the knob applies, in words."""
    parts = ([f"engine {field.metadata['engine']}"] if field.metadata["engine"] else []) + \
        ([field.metadata["applies"].text] if field.metadata["applies"] else [])
    return ", ".join(parts) or "always"


def space_default(field: dataclasses.Field) -> tuple[Any, ...]:
    """The values of a search space that does not list the knob."""
    space = field.metadata["space"]
    return space if space is not None else (field.default,)


def feature_spans(cls: type, strategies: "list[Any]") -> dict[str, tuple[float, float]]:
    """knob -> (low, high) over ``strategies`` of every ``log2`` knob (``features``' spans)."""
    names = [name for name, kind, *_ in _feature_plan(cls) if kind == "log2"]
    return {k: (min(v), max(v)) for k in names for v in [[getattr(s, k) for s in strategies] or [1]]}


@functools.lru_cache(maxsize=None)
def _feature_plan(cls: type) -> tuple[tuple[str, str, float, Any, tuple[Any, ...]], ...]:
    """(name, kind, weight, default, Literal choices) of each searched knob with a ``feature``, field
    order: read once per class (features runs for every candidate the sampler scores)."""
    choices = literal_choices(cls)
    return tuple((f.name, *f.metadata["feature"], f.default, choices[f.name] or ()) for f in knob_fields(cls)
                 if f.metadata["search_order"] is not None and f.metadata["feature"] is not None)


def features(cls: type, strategy: Any, num_blocks: int, spans: Mapping[str, tuple[float, float]]) -> list[float]:
    """A strategy's numeric features for the residual model, read off the searched knobs' ``feature``
    (field order); ``spans``: knob -> (low, high) of the ``log2`` knobs over the candidates."""
    out: list[float] = []
    for name, kind, w, default, levels in _feature_plan(cls):
        v = getattr(strategy, name)
        if kind == "levels":
            out += [w * (v == level) for level in levels]
        elif kind == "switch":
            out.append(w * (v != default))
        elif kind == "set":
            out.append(w * (v is not None))
        elif kind == "log2":
            lo, hi = spans[name]
            out.append(w * (math.log2(v) - math.log2(lo)) / max(1e-9, math.log2(hi) - math.log2(lo)))
        else:  # blocks
            frac = strategy.num_checkpointed(num_blocks) / max(1, num_blocks)
            out += [w * frac * (v == level) for level in levels if level != default]
    return out


def getter(values: "Mapping[str, Any] | Any") -> Getter:
    """A Getter over a mapping (missing: None) or an object's attributes."""
    return values.get if isinstance(values, Mapping) else (lambda k: getattr(values, k))


# ---------------------------------------------------------------- the docs table

def _show(value: Any, unset: str = "unset") -> str:
    if value is None:
        return unset
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def knob_table(cls: type) -> str:
    """The markdown table of the knobs (docs/config.md, between the knobs markers): values,
    default (a job file's), what a search space that omits the knob takes, when it applies."""
    choices = literal_choices(cls)
    rows = ["| knob | values | default | space default | applies when | what it does |",
            "|---|---|---|---|---|---|"]
    for f in knob_fields(cls):
        low, high = f.metadata["int_range"] or (None, None)
        unset = "auto" if f.metadata["buffer"] else "unset"
        values = (", ".join(_show(c) for c in choices[f.name]) if choices[f.name] is not None
                  else f"integer >= {low}" if high is None else f"integer {low}..{high}")
        source = f.metadata["from_training"]
        default = f"training.{source}" if source else _show(f.default, unset)
        space = ("not searched" if f.metadata["search_order"] is None else f"training.{source}" if source
                 else ", ".join(_show(v, unset) for v in space_default(f)))
        flag = f" (`--{f.name.replace('_', '-')}`)" if f.metadata["flag"] else ""
        rows.append(f"| `{f.name}`{flag} | {values} | {default} | {space} | {applies_text(f)} | "
                    f"{f.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"
