"""Reading and checking job-file values: the safe YAML reader and the value checkers.

Each checker takes (value, key path) and returns the converted value or raises
ConfigError(path=...); ``check_section`` applies a schema (key -> checker) to a mapping. The job
file (autotune.config) and search spaces (autotune.space) are both read with these.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Callable

from autotune.errors import ConfigError

MAX_INT = 2**62
"""Largest integer accepted anywhere (keeps arithmetic finite and exact)."""

Checker = Callable[[Any, str], Any]


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40


def show(value: Any) -> str:
    """A bounded repr for error messages: YAML alias bombs and huge values print in O(1)."""
    try:
        return _REPR.repr(value)
    except Exception:  # pragma: no cover - exotic objects from YAML tags are rejected earlier
        return f"<{type(value).__name__}>"


def key_name(key: Any) -> str:
    """A key as it appears in a key path: printable keys as they are, others escaped (one line)."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else show(key)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def int_(low: int = 1, high: int = MAX_INT) -> Checker:
    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) < MAX_INT:
                value = int(value)
            else:
                raise ConfigError(f"expected an integer, but got {_type_name(value)} {show(value)}"[:200], path=path)
        if not low <= value <= high:
            raise ConfigError(f"expected an integer in [{low}, {high}], but got {value}", path=path)
        return value

    return check


def float_(low: float = 0.0, high: float = 1e18, *, low_open: bool = False) -> Checker:
    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, but got {_type_name(value)} {show(value)}"[:200], path=path)
        value = float(value)
        if math.isnan(value) or math.isinf(value):
            raise ConfigError(f"expected a finite number, but got {value}", path=path)
        if value < low or value > high or (low_open and value == low):
            lo = "(" if low_open else "["
            raise ConfigError(f"expected a number in {lo}{low:g}, {high:g}], but got {value:g}", path=path)
        return value

    return check


def bool_(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, but got {_type_name(value)} {show(value)}"[:200], path=path)
    return value


def str_(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 4096 or "\x00" in value:
        raise ConfigError(f"expected a non-empty string, but got {_type_name(value)} {show(value)}"[:200], path=path)
    return value


def choice(*options: Any) -> Checker:
    def check(value: Any, path: str) -> Any:
        # bool/int mix-ups (True == 1) are rejected by comparing types too.
        if not any(value == o and type(value) is type(o) for o in options):
            shown = ", ".join(str(o) for o in options)
            raise ConfigError(f"expected one of {shown}, but got {show(value)}"[:200], path=path)
        return value

    return check


def optional(check: Checker) -> Checker:
    return lambda value, path: None if value is None else check(value, path)


def mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping, but got {_type_name(value)}", path=path or None)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, but got {_type_name(key)} {show(key)}"[:200], path=path or None)
    return value


def check_section(raw: Any, path: str, schema: dict[str, Checker]) -> dict[str, Any]:
    """Validate a mapping against ``schema`` (key -> checker); unknown keys are errors."""
    raw = mapping(raw, path)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        sub = f"{path}.{key_name(key)}" if path else key_name(key)
        if key not in schema:
            allowed = ", ".join(sorted(schema))
            raise ConfigError(f"unknown key {show(key)}; expected one of: {allowed}"[:400], path=sub)
        out[key] = schema[key](value, sub)
    return out


def _unique_key_loader() -> Any:
    """yaml's SafeLoader refusing a key given twice in one mapping (the safe loader keeps the last silently: a
    second ``model:`` section pasted below the first would drop every key of the first); merge keys (``<<``)
    may still be overridden."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[tuple, int] = {}
                for key, _ in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                        if (key.tag, key.value) in seen:
                            raise yaml.constructor.ConstructorError(
                                None, None, f"key {key.value!r} given twice (first at line "
                                f"{seen[key.tag, key.value] + 1}): merge the two into one", key.start_mark)
                        seen[key.tag, key.value] = key.start_mark.line
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read_yaml(path: str) -> Any:
    """Read a YAML file with the safe loader, a key given twice in one mapping refused; any failure is a
    one-line ConfigError naming the file."""
    import yaml

    try:
        with open(path, "rb") as fh:
            data = fh.read(16 << 20)
    except FileNotFoundError:
        raise ConfigError("file not found", file=path) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, expected a YAML file", file=path) from None
    except OSError as err:
        raise ConfigError(f"cannot read file ({err.strerror})", file=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("not a UTF-8 text file", file=path) from None
    if "\x00" in text:
        raise ConfigError("not a text file (contains NUL bytes)", file=path)
    try:
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"malformed YAML{where}: {problem}", file=path) from None
    except RecursionError:
        raise ConfigError("malformed YAML: nesting too deep", file=path) from None
    except (ValueError, TypeError, OverflowError) as err:  # e.g. an integer of > 4300 digits
        raise ConfigError(f"malformed YAML: {show(str(err))}", file=path) from None
