"""Search spaces (search_spaces/*.yaml): which strategy knobs to explore and over which values.

A space file maps knob -> values. Values are a list, or for integer knobs a range
``{low, high}`` with ``powers_of_two: true`` or ``step: N``. ``checkpoint_layers`` may also be
``{fractions: [0.25, 0.5, 1.0]}`` of the model's layers. Bucket-size knobs accept ``auto``
(autotune's own choice, see strategy.default_buckets).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from autotune.checks import check_section, choice, int_, mapping, read_yaml, show
from autotune.config import Config
from autotune.errors import ConfigError
from autotune.spec import ModelSpec
from autotune.strategy import (BUCKET_KNOBS, CHECKPOINTINGS, ENGINES, KNOBS, OFFLOADS, PRECISIONS, REDUCE_DTYPES,
                               SHARDINGS, ZERO_STAGES, Strategy, knob_applies)

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
    engine: tuple[str, ...] = ("deepspeed",)
    zero_stage: tuple[int, ...] = (0, 1, 2, 3)
    offload_optimizer: tuple[str, ...] = ("none",)
    offload_params: tuple[str, ...] = ("none",)
    micro_batch_size: tuple[int, ...] = (1, 2, 4, 8)
    checkpointing: tuple[str, ...] = ("none", "full")
    checkpoint_every: tuple[Optional[int], ...] = (None,)
    """Every-k-th-block checkpointing periods (None: the first checkpoint_layers blocks)."""
    checkpoint_layers: tuple[Any, ...] = ("all",)
    """Absolute block counts (ints), or ("fractions", f1, f2, ...), or ("all",)."""
    precision: tuple[str, ...] = ("bf16",)
    """Omitted in the file: the job's training.precision (see load_space)."""
    reshard_after_forward: tuple[bool, ...] = (True,)
    sharding: tuple[str, ...] = ("full",)
    reduce_dtype: tuple[str, ...] = ("fp32",)
    reduce_bucket_size: tuple[Optional[int], ...] = (None,)
    allgather_bucket_size: tuple[Optional[int], ...] = (None,)
    prefetch_bucket_size: tuple[Optional[int], ...] = (None,)

    def layer_choices(self, num_layers: int) -> list[int]:
        """Concrete checkpointed-block counts for a model with ``num_layers`` blocks (ascending, unique)."""
        if self.checkpoint_layers == ("all",):
            return [num_layers]
        if self.checkpoint_layers and self.checkpoint_layers[0] == "fractions":
            values = {max(1, min(num_layers, round(f * num_layers))) for f in self.checkpoint_layers[1:]}
        else:
            values = {min(num_layers, int(v)) for v in self.checkpoint_layers}
        return sorted(values)

    def choices(self, knob: str, model: ModelSpec) -> list[Any]:
        if knob == "checkpoint_layers":
            return self.layer_choices(model.num_hidden_layers)
        return list(getattr(self, knob))

    def candidates(self, model: ModelSpec) -> Iterator[Strategy]:
        """Every distinct strategy of the space (a knob varies only where it applies, see
        strategy.knob_applies: checkpoint_layers with checkpointing on, bucket knobs at the ZeRO
        stages that use them, the ZeRO knobs with deepspeed, the fsdp2 knobs with fsdp2)."""
        def expand(values: dict[str, Any], rest: tuple[str, ...]) -> Iterator[Strategy]:
            if not rest:
                yield Strategy(**values)
                return
            knob, rest = rest[0], rest[1:]
            if not knob_applies(knob, values):  # left at its default
                yield from expand(values, rest)
                return
            for value in self.choices(knob, model):
                yield from expand({**values, knob: value}, rest)

        yield from expand({}, _ENUMERATION_ORDER)

    def searched_knobs(self, strategy: "Strategy | dict[str, Any]") -> Iterator[str]:
        """The knobs, in suggestion order, that apply to ``strategy`` (a Strategy or the values chosen
        so far: a knob is only judged once the knobs it depends on are chosen)."""
        for knob in KNOBS:
            if knob_applies(knob, strategy):
                yield knob

    def suggest(self, trial: Any, model: ModelSpec) -> Strategy:
        """Ask an Optuna trial for one strategy (define-by-run; conditional knobs only when they apply)."""
        values: dict[str, Any] = {}
        for knob in self.searched_knobs(values):
            options = self.choices(knob, model)
            values[knob] = options[0] if len(options) == 1 else trial.suggest_categorical(knob, options)
        return Strategy(**values)

    def contains(self, strategy: Strategy, model: ModelSpec) -> bool:
        """Whether the space can produce ``strategy``: every knob that applies takes one of the space's
        values (bucket knobs the space leaves on ``auto`` are not checked)."""
        return all(getattr(strategy, knob) in choices for knob in self.searched_knobs(strategy)
                   if (choices := self.choices(knob, model)) != [None])


_ENUMERATION_ORDER = ("engine", "zero_stage", "offload_optimizer", "offload_params", "micro_batch_size",
                      "checkpointing", "precision", "checkpoint_every", "checkpoint_layers",
                      "reshard_after_forward", "sharding", "reduce_dtype", *BUCKET_KNOBS)
"""The nesting of ``candidates`` (outermost first); each knob comes after the knobs it depends on."""
assert sorted(_ENUMERATION_ORDER) == sorted(KNOBS)


def strategy_params(strategy: Strategy, space: SearchSpace, model: ModelSpec) -> dict[str, Any]:
    """The Optuna params that make ``space.suggest`` return ``strategy`` (for enqueue_trial)."""
    return {knob: getattr(strategy, knob) for knob in space.searched_knobs(strategy)
            if len(space.choices(knob, model)) > 1}


def trial_strategy(trial: Any, space: SearchSpace, cfg: Config) -> Strategy:
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
    """Load a space; ``precision`` fills the precision knob when the file does not list it."""
    path = resolve_space_path(name_or_path, base_dir)
    try:
        return _parse(read_yaml(path), path, precision)
    except ConfigError as err:
        raise err.in_file(path) from None


def space_for(cfg: Config) -> SearchSpace:
    """The search space a job file names (resolved next to the file), at the job's precision
    unless the space lists precisions itself."""
    return load_space(cfg.search.space, os.path.dirname(os.path.abspath(cfg.path)), cfg.training.precision)


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


def _layers(raw: Any, path: str) -> tuple:
    if raw == "all":
        return ("all",)
    if isinstance(raw, dict):
        spec = check_section(raw, path, {"fractions": lambda v, p: v})
        fractions = spec.get("fractions")
        if not isinstance(fractions, list) or not fractions:
            raise ConfigError("expected a non-empty list of fractions in (0, 1]", path=f"{path}.fractions")
        for i, f in enumerate(fractions):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
                raise ConfigError(f"expected a fraction in (0, 1], but got {show(f)}"[:200], path=f"{path}.fractions[{i}]")
        return ("fractions", *fractions)
    return _values(int_(1, 10_000))(raw, path)


SPACE_SCHEMA = {
    "engine": _values(choice(*ENGINES)),
    "zero_stage": _values(choice(*ZERO_STAGES)),
    "offload_optimizer": _values(choice(*OFFLOADS)),
    "offload_params": _values(choice(*OFFLOADS)),
    "micro_batch_size": _values(int_(1, 1 << 20), integer_range=True),
    "checkpointing": _values(choice(*CHECKPOINTINGS)),
    "checkpoint_every": _values(int_(1, 10_000)),
    "checkpoint_layers": _layers,
    "precision": _values(choice(*PRECISIONS)),
    "reshard_after_forward": _values(choice(True, False)),
    "sharding": _values(choice(*SHARDINGS)),
    "reduce_dtype": _values(choice(*REDUCE_DTYPES)),
    "reduce_bucket_size": _values(int_(1), allow_auto=True),
    "allgather_bucket_size": _values(int_(1), allow_auto=True),
    "prefetch_bucket_size": _values(int_(1), allow_auto=True),
}


def _parse(raw: Any, path: str, precision: str) -> SearchSpace:
    if raw is None:
        raise ConfigError("empty search space; expected a mapping of knob -> values")
    mapping(raw, "")
    section = check_section(raw, "", SPACE_SCHEMA)
    section.setdefault("precision", (precision,))
    name = os.path.splitext(os.path.basename(path))[0]
    return SearchSpace(name=name, path=path, **section)
