"""Search spaces (search_spaces/*.yaml): which strategy knobs to explore and over which values.

A space file maps knob -> values (the knobs are strategy.KNOBS; docs/config.md lists them). Values
are a list, or for integer knobs a range ``{low, high}`` with ``powers_of_two: true`` or
``step: N``. A number-of-blocks knob may also be ``all`` or ``{fractions: [0.25, 0.5, 1.0]}`` of the
model's layers. Buffer-size knobs accept ``auto`` (autotune's own choice, see
engine_configs.default_buckets). The schema and the defaults are read off Strategy's field metadata.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from autotune import knobs
from autotune.checks import check_section, choice, int_, mapping, read_yaml, show
from autotune.config import Config, from_training
from autotune.errors import ConfigError
from autotune.knobs import literal_choices
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import KNOBS, Strategy, knob_applies

if TYPE_CHECKING:
    from optuna.trial import FixedTrial, FrozenTrial, Trial

SPACES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "search_spaces")
"""Shipped spaces (default, no-offload, single-gpu, ...): search_spaces/ at the repository root, which
autotune/search_spaces links to and the wheel carries as package data."""

_MAX_VALUES = 4096


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take."""

    name: str
    """Space name (file stem)."""
    path: str
    """File it was read from."""
    values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Knob -> its values, for every knob of strategy.KNOBS (one the space does not give takes
    its space default, autotune.knobs.space_default). A number-of-blocks knob (``of_layers``)
    holds block counts (ints), ("fractions", f1, f2, ...) or ("all",)."""
    sections: Mapping[str, Mapping[str, tuple[Any, ...]]] = field(default_factory=dict)
    """The file's conditional sections (``long_context``, ``moe``: SECTIONS): section -> knob -> the
    values it takes instead for a job its condition holds for (``for_job``)."""

    def __post_init__(self) -> None:
        unknown = set(self.values) - set(KNOBS)
        if unknown:
            raise ValueError(f"not strategy knobs: {', '.join(sorted(unknown))}")
        object.__setattr__(self, "values", {k: tuple(self.values[k]) if k in self.values else SPACE_DEFAULTS[k]
                                            for k in KNOBS})
        object.__setattr__(self, "sections", {name: {k: tuple(v) for k, v in knobs_.items()}
                                              for name, knobs_ in self.sections.items()})

    def __hash__(self) -> int:
        return hash((self.name, self.path, tuple(self.values.items())))

    def for_job(self, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> "SearchSpace":
        """This space with the values of each section whose condition (SECTIONS) holds for the job, in
        SECTIONS' order (itself when none does)."""
        on = [name for name, holds in SECTIONS.items() if name in self.sections and holds(model, training, hardware)]
        if not on:
            return self
        values = dict(self.values)
        for name in on:
            values.update(self.sections[name])
        return dataclasses.replace(self, values=values, sections={k: v for k, v in self.sections.items() if k not in on})

    def choices(self, knob: str, model: ModelSpec) -> list[Any]:
        """The values of ``knob`` for ``model`` (a number of blocks resolved against its layers)."""
        if knob in _OF_LAYERS:
            return block_counts(self.values[knob], model.num_hidden_layers)
        return list(self.values[knob])

    def candidates(self, model: ModelSpec) -> Iterator[Strategy]:
        """Every distinct strategy of the space (a knob varies only where it applies, see
        strategy.knob_applies; elsewhere it keeps its default), the innermost knob varying fastest."""
        order = _ENUMERATION_ORDER
        options = [self.choices(knob, model) for knob in order]
        # what is chosen from level j inwards depends on the knobs chosen before only through the
        # knobs those levels' conditions read: the same suffixes serve every prefix that agrees on them
        inner_reads = [tuple(sorted({r for knob in order[j:] for r in _READS[knob]})) for j in range(len(order))]
        memo: dict[tuple, list[tuple[tuple[str, Any], ...]]] = {}

        def suffixes(j: int, values: dict[str, Any]) -> list[tuple[tuple[str, Any], ...]]:
            """The (knob, value) pairs of levels j... for the knobs ``values`` chosen before."""
            if j == len(order):
                return [()]
            key = (j, *map(values.get, inner_reads[j]))
            if key not in memo:
                knob = order[j]
                if knob_applies(knob, values):
                    memo[key] = [((knob, value),) + rest for value in options[j]
                                 for rest in suffixes(j + 1, {**values, knob: value})]
                else:  # left at its default
                    memo[key] = suffixes(j + 1, values)
            return memo[key]

        return map(_strategy, suffixes(0, {}))

    def searched_knobs(self, strategy: "Strategy | dict[str, Any]") -> Iterator[str]:
        """The knobs, in suggestion order, that apply to ``strategy`` (a Strategy or the values chosen
        so far: a knob is only judged once the knobs it depends on are chosen)."""
        for knob in KNOBS:
            if knob_applies(knob, strategy):
                yield knob

    def suggest(self, trial: "Trial | FixedTrial", model: ModelSpec) -> Strategy:
        """Ask an Optuna trial for one strategy (define-by-run; conditional knobs only when they apply)."""
        values: dict[str, Any] = {}
        for knob in self.searched_knobs(values):
            options = self.choices(knob, model)
            values[knob] = options[0] if len(options) == 1 else trial.suggest_categorical(knob, options)
        return Strategy(**values)

    def contains(self, strategy: Strategy, model: ModelSpec) -> bool:
        """Whether the space can produce ``strategy``: every knob that applies takes one of the space's
        values (buffer knobs the space leaves on ``auto`` are not checked)."""
        return all(getattr(strategy, knob) in choices for knob in self.searched_knobs(strategy)
                   if (choices := self.choices(knob, model)) != [None])


_ENUMERATION_ORDER = knobs.nesting(Strategy)
"""The nesting of ``candidates`` (outermost first); each knob comes after the knobs it depends on."""
_READS = {f.name: (("engine",) if f.metadata["engine"] else ()) + (f.metadata["applies"].reads if f.metadata["applies"]
                                                                   else ()) for f in knobs.knob_fields(Strategy)}
"""Knob -> the knobs whether it applies reads (its engine, its condition's; autotune.knobs.applies)."""
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Strategy)}
_PLAIN_INIT = (all(f.init and f.default is not dataclasses.MISSING for f in dataclasses.fields(Strategy))
               and "__slots__" not in vars(Strategy) and hasattr(Strategy, "__post_init__"))


def _strategy(pairs: tuple[tuple[str, Any], ...]) -> Strategy:
    """``Strategy(**dict(pairs))``, without its generated __init__ where that only sets the fields
    (every field has a plain default): the fields are set and ``__post_init__`` runs, which is what
    that __init__ does, at about two thirds of its cost (a screen makes one per candidate)."""
    if not _PLAIN_INIT:
        return Strategy(**dict(pairs))
    s = object.__new__(Strategy)
    d = s.__dict__
    d.update(_FIELD_DEFAULTS)
    d.update(pairs)
    s.__post_init__()
    return s


_OF_LAYERS = {f.name for f in knobs.knob_fields(Strategy) if f.metadata["of_layers"]}
SPACE_DEFAULTS: dict[str, tuple[Any, ...]] = {f.name: knobs.space_default(f) for f in knobs.knob_fields(Strategy)
                                              if f.name in KNOBS}
"""The values of a knob a space does not list (Strategy's ``space`` metadata, else the default)."""


def block_counts(values: tuple[Any, ...], num_layers: int) -> list[int]:
    """Concrete block counts for a model with ``num_layers`` blocks (ascending, unique) of a
    number-of-blocks knob's space values: ("all",), ("fractions", f, ...) or counts."""
    if values == ("all",):
        return [num_layers]
    if values and values[0] == "fractions":
        counts = {max(1, min(num_layers, round(f * num_layers))) for f in values[1:]}
    else:
        counts = {min(num_layers, int(v)) for v in values}
    return sorted(counts)


def strategy_params(strategy: Strategy, space: SearchSpace, model: ModelSpec) -> dict[str, Any]:
    """The Optuna params that make ``space.suggest`` return ``strategy`` (for enqueue_trial)."""
    return {knob: getattr(strategy, knob) for knob in space.searched_knobs(strategy)
            if len(space.choices(knob, model)) > 1}


def trial_strategy(trial: "Trial | FrozenTrial", space: SearchSpace, cfg: Config) -> Strategy:
    """The strategy a finished trial evaluated (rebuilt from its params)."""
    import optuna

    return space.suggest(optuna.trial.FixedTrial(trial.params), cfg.model)


# ---------------------------------------------------------------- loading

def resolve_space_path(name_or_path: str, base_dir: str = ".") -> str:
    """A space name (search_spaces/NAME.yaml) or a path, absolute or relative to the job file."""
    candidates = [name_or_path, os.path.join(base_dir, name_or_path), os.path.join(SPACES_DIR, name_or_path + ".yaml")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    names = sorted(f[:-5] for f in os.listdir(SPACES_DIR) if f.endswith(".yaml")) if os.path.isdir(SPACES_DIR) else []
    raise ConfigError(f"search space {name_or_path!r} not found; expected a file or one of: {', '.join(names)}",
                      path="search.space")


def load_space(name_or_path: str, base_dir: str = ".", precision: str = "bf16") -> SearchSpace:
    """Load a space; ``precision`` is the job's training precision, which the knobs taken from
    the training section (``from_training``) take when the file does not list them."""
    path = resolve_space_path(name_or_path, base_dir)
    try:
        return _parse(read_yaml(path), path, from_training({"precision": precision}))
    except ConfigError as err:
        raise err.in_file(path) from None


LONG_SEQUENCE_SHARE = 0.5
"""A job's sequence is long when one sequence at micro-batch 1, every block checkpointed, takes more
than this share of a GPU in activations and logits (``memory.sequence_bytes``): then the space's
``long_context`` values (sequence / context parallel, tiling, activation offload) are searched."""


def long_sequence(model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec) -> bool:
    """Whether the job's sequence is long enough for the long-context knobs (LONG_SEQUENCE_SHARE)."""
    from autotune.memory import sequence_bytes

    return sequence_bytes(model, training) > LONG_SEQUENCE_SHARE * hardware.gpu.memory_bytes


SECTIONS: dict[str, Callable[[ModelSpec, TrainingSpec, HardwareSpec], bool]] = {
    "moe": lambda model, training, hardware: model.is_moe,  # expert parallelism, for mixtures of experts
    "long_context": long_sequence,
}
"""A space file's conditional sections and when each applies (``SearchSpace.for_job``)."""


def space_for(cfg: Config) -> SearchSpace:
    """The search space a job file names (resolved next to the file), at the job's precision
    unless the space lists precisions itself, with the sections that apply to the job (SECTIONS)."""
    space = load_space(cfg.search.space, os.path.dirname(os.path.abspath(cfg.path)), cfg.training.precision)
    return space.for_job(cfg.model, cfg.training, cfg.hardware)


def _values(check: Any, *, integer_range: bool = False, allow_auto: bool = False) -> Any:
    def parse(raw: Any, path: str) -> tuple:
        if integer_range and isinstance(raw, dict):
            spec = check_section(raw, path, {"low": int_(0), "high": int_(0), "step": int_(1),
                                             "powers_of_two": choice(True, False)})
            if "low" not in spec or "high" not in spec:
                raise ConfigError("a range needs low and high", path=path)
            if spec["low"] > spec["high"]:
                raise ConfigError(f"`low <= high` must hold, but got low={spec['low']}, high={spec['high']}",
                                  path=path)
            if spec.get("powers_of_two"):
                values = [v for v in (1 << k for k in range(63)) if spec["low"] <= v <= spec["high"]]
            else:
                values = range(spec["low"], spec["high"] + 1, spec.get("step", 1))  # never materialised if huge
            if not values or len(values) > _MAX_VALUES:
                raise ConfigError(f"range must give 1..{_MAX_VALUES} values, but gives {len(values)}", path=path)
            values = list(values)
            raw = values
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"expected a non-empty list of values, but got {type(raw).__name__}", path=path)
        if len(raw) > _MAX_VALUES:
            raise ConfigError(f"at most {_MAX_VALUES} values, but got {len(raw)}", path=path)
        out = []
        for i, value in enumerate(raw):
            if allow_auto and value == "auto":
                out.append(None)
                continue
            if allow_auto and isinstance(value, float) and value.is_integer():
                value = int(value)
            out.append(check(value, f"{path}[{i}]"))
        if len(set(out)) != len(out):
            raise ConfigError(f"values must be unique, but got {show(raw)}"[:200], path=path)
        return tuple(out)

    return parse


def _layers(check: Any) -> Any:
    """A number-of-blocks knob's values: ``all``, ``{fractions: [...]}`` or block counts."""
    def parse(raw: Any, path: str) -> tuple:
        if raw == "all":
            return ("all",)
        if isinstance(raw, dict) and "fractions" in raw:
            spec = check_section(raw, path, {"fractions": lambda v, p: v})
            fractions = spec.get("fractions")
            if not isinstance(fractions, list) or not fractions:
                raise ConfigError("expected a non-empty list of fractions in (0, 1]", path=f"{path}.fractions")
            for i, f in enumerate(fractions):
                if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
                    raise ConfigError(f"expected a fraction in (0, 1], but got {show(f)}"[:200],
                                      path=f"{path}.fractions[{i}]")
            return ("fractions", *fractions)
        return _values(check, integer_range=True)(raw, path)

    return parse


def space_schema(cls: type = Strategy) -> dict[str, Any]:
    """The checkers of a space file for a Strategy class: per searched knob a list of its Literal
    values, or of integers in its ``int_range`` (also as a range; ``auto`` for a buffer size;
    ``all`` or fractions for a number of blocks, whose counts start at 1)."""
    choices = literal_choices(cls)
    fields_ = {f.name: f for f in knobs.knob_fields(cls)}
    schema: dict[str, Any] = {}
    for name in knobs.searched(cls):
        f = fields_[name]
        if choices[name] is not None:
            schema[name] = _values(choice(*choices[name]))
            continue
        low, high = f.metadata["int_range"]
        if f.metadata["of_layers"]:
            schema[name] = _layers(int_(max(1, low)) if high is None else int_(max(1, low), high))
            continue
        check = int_(low) if high is None else int_(low, high)
        schema[name] = _values(check, integer_range=True, allow_auto=f.metadata["buffer"])
    return schema


SPACE_SCHEMA = space_schema()


def _parse(raw: Any, path: str, job_values: dict[str, Any]) -> SearchSpace:
    if raw is None:
        raise ConfigError("empty search space; expected a mapping of knob -> values")
    mapping(raw, "")
    raw = dict(raw)
    conditional = {name: raw.pop(name) for name in SECTIONS if name in raw}
    section = check_section(raw, "", SPACE_SCHEMA)
    for knob, value in job_values.items():
        section.setdefault(knob, (value,))
    sections = {name: check_section(value, name, SPACE_SCHEMA) for name, value in conditional.items()}
    name = os.path.splitext(os.path.basename(path))[0]
    return SearchSpace(name=name, path=path, values=section, sections=sections)
