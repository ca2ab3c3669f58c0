"""Exact parameter count of a Hugging Face config.json, without allocating (torch + transformers).

``hf_parameter_count(cfg)`` builds ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` (no storage, a few milliseconds per layer) with all its layers, so layers
that differ (DeepSeek-V3's ``first_k_dense_replace`` dense layers before the MoE ones, Qwen3-MoE's
``mlp_only_layers``, ``decoder_sparse_step``...) are counted as built. Beyond ``FULL_BUILD_LAYERS``
layers it extrapolates ``count(L) = count(1) + (L - 1) * (count(2) - count(1))``, only after the
build at ``FULL_BUILD_LAYERS`` layers shows every layer alike (the same affine law); otherwise it
builds them all. Returns None when torch or transformers is not installed (presets and explicit
fields do not need it).

The simulate path never imports torch: a process that has not imported torch and transformers
counts in a child process (``python -m autotune.hf_count``, the config on stdin, the count or the
error as JSON on stdout) and keeps the count in a cache file (``cache_path``: one entry per config,
layer count and transformers version), so a job's next run reads it without starting torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import warnings
from typing import Any, Iterator, Optional

LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
"""The keys a config.json names its layer count by (the families transformers maps)."""
_PER_LAYER_LISTS = ("layer_types",)
FULL_BUILD_LAYERS = 256
"""Configs up to this many layers are built whole on the meta device (a few milliseconds per layer);
deeper ones are extrapolated when their layers are alike."""
DROP_KEYS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map")
"""Keys of a config.json that do not shape the model built from it (dropped before building)."""


class HFCountError(Exception):
    """transformers could not build the model from this config (message: one line)."""


CACHE_ENV = "AUTOTUNE_CACHE_DIR"
"""The folder of autotune's cache files (default ``$XDG_CACHE_HOME/autotune``, else ``~/.cache/autotune``)."""
COUNT_VERSION = 1
"""Part of each cache key: raise it when the way a count is made changes (``_count``, ``DROP_KEYS``)."""
COUNT_TIMEOUT_S = 600
"""How long the child process may take to build the model on the meta device."""


def available() -> bool:
    """torch and transformers are installed (found without importing them; a None entry in
    sys.modules blocks an import, as a light install's missing package)."""
    for name in ("torch", "transformers"):
        if name in sys.modules:
            if sys.modules[name] is None:
                return False
            continue
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def imported_here() -> bool:
    """This process has imported torch and transformers: counts and measurements run here, not in a child."""
    return sys.modules.get("torch") is not None and sys.modules.get("transformers") is not None


def cache_path() -> str:
    """The parameter-count cache file (a JSON object: key -> count)."""
    folder = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autotune")
    return os.path.join(folder, "hf_counts.json")


def count_cache_key(raw: dict, num_layers: int) -> str:
    body = json.dumps(raw, sort_keys=True, default=str)
    return (f"{hashlib.sha256(body.encode()).hexdigest()}:{num_layers}:v{COUNT_VERSION}:"
            f"transformers {importlib.metadata.version('transformers')}")


def read_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(key: str, value: Any) -> None:
    """Add one entry (an unwritable cache only costs the next run a child process)."""
    path = cache_path()
    data = {**read_cache(), key: value}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def child_answer(module: str, payload: dict, timeout_s: int, what: str) -> dict:
    """``python -m module`` with ``payload`` as JSON on stdin; its last stdout line as JSON (this process
    stays torch-free). HFCountError (one line) on a timeout, a crash or an ``error`` answer."""
    try:
        proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                              input=json.dumps(payload), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HFCountError(f"{what} took over {timeout_s} s") from None
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        raise HFCountError(f"{what}: the child process failed (exit {proc.returncode}: {tail})") from None
    if "error" in answer:
        raise HFCountError(answer["error"])
    return answer


def _count_in_child(raw: dict, num_layers: int) -> int:
    """``hf_parameter_count`` in a child process."""
    return int(child_answer("autotune.hf_count", {"raw": raw, "num_layers": num_layers}, COUNT_TIMEOUT_S,
                            "building the model on the meta device")["count"])


def _count(raw: dict, layers: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(raw)
    kind = cfg.pop("model_type", None) or "llama"
    for key in DROP_KEYS:
        cfg.pop(key, None)
    for key in LAYER_KEYS:
        if key in cfg:
            cfg[key] = layers
    for key in _PER_LAYER_LISTS:
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    config = AutoConfig.for_model(kind, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def hf_parameter_count(raw: dict, num_layers: int) -> Optional[int]:
    """Parameters of the transformers model for config dict ``raw`` with ``num_layers`` blocks
    (shared tensors once); None without torch/transformers; HFCountError if it cannot be built.
    Counted here when this process has imported torch and transformers, else read from the cache
    or counted in a child process and cached."""
    if not available():
        return None
    if imported_here():
        return _count_here(raw, num_layers)
    key = count_cache_key(raw, num_layers)
    cached = read_cache().get(key)
    if isinstance(cached, int):
        return cached
    count = _count_in_child(raw, num_layers)
    write_cache(key, count)
    return count


@contextlib.contextmanager
def transformers_quietly(what: str) -> Iterator[None]:
    """transformers' logging, warnings and prints silenced; any exception it raises (the user's config)
    becomes a one-line HFCountError ``transformers cannot {what} (Type: first line)``."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    except Exception as err:  # any failure of transformers on this config is the user's input
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise HFCountError(f"transformers cannot {what} ({type(err).__name__}: {first})") from None


def _count_here(raw: dict, num_layers: int) -> int:
    """The count in this process (imports torch and transformers)."""
    with transformers_quietly(f"build model_type {raw.get('model_type', 'llama')!r} from it"):
        if num_layers <= FULL_BUILD_LAYERS:
            return _count(raw, num_layers)
        one, two, probe = _count(raw, 1), _count(raw, 2), _count(raw, FULL_BUILD_LAYERS)
        if probe != one + (FULL_BUILD_LAYERS - 1) * (two - one):  # layers not all alike
            return _count(raw, num_layers)
    return one + (num_layers - 1) * (two - one)


def describe_difference(spec: Any, exact: int) -> str:
    """One line naming how the analytic description differs from the exact count."""
    n = spec.num_parameters
    diff = exact - n
    per_layer = ""
    if spec.num_hidden_layers and diff % spec.num_hidden_layers == 0:
        per_layer = f" ({diff // spec.num_hidden_layers:+,} per layer)"
    return (f"the analytic description has {n:,} parameters, transformers builds {exact:,} "
            f"(difference {diff:+,}{per_layer}); this model family is not described exactly, "
            f"its memory would be mis-sized")


def main() -> int:
    """The child process: ``{"raw": config, "num_layers": n}`` on stdin, ``{"count": n}`` or
    ``{"error": one line}`` on stdout."""
    job = json.load(sys.stdin)
    try:
        answer: dict = {"count": _count_here(job["raw"], int(job["num_layers"]))}
    except HFCountError as err:
        answer = {"error": str(err)}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
