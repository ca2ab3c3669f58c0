"""Exact parameter count of a Hugging Face config.json, without allocating (torch + transformers).

``hf_parameter_count(cfg)`` builds ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` (no storage, a few milliseconds per layer) with all its layers, so layers
that differ (DeepSeek-V3's ``first_k_dense_replace`` dense layers before the MoE ones, Qwen3-MoE's
``mlp_only_layers``, ``decoder_sparse_step``...) are counted as built. Beyond ``FULL_BUILD_LAYERS``
layers it extrapolates ``count(L) = count(1) + (L - 1) * (count(2) - count(1))``, only after the
build at ``FULL_BUILD_LAYERS`` layers shows every layer alike (the same affine law); otherwise it
builds them all. Returns None when torch or transformers is not importable (presets and explicit
fields do not need it). Imported lazily by autotune.config: the simulate path stays torch-free for
presets and explicit fields.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Optional

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
_PER_LAYER_LISTS = ("layer_types",)
FULL_BUILD_LAYERS = 256
"""Configs up to this many layers are built whole on the meta device (a few milliseconds per layer);
deeper ones are extrapolated when their layers are alike."""
_DROP = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map")


class HFCountError(Exception):
    """transformers could not build the model from this config (message: one line)."""


def _available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _count(raw: dict, layers: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(raw)
    kind = cfg.pop("model_type", None) or "llama"
    for key in _DROP:
        cfg.pop(key, None)
    for key in _LAYER_KEYS:
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
    (shared tensors once); None without torch/transformers; HFCountError if it cannot be built."""
    if not _available():
        return None
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            if num_layers <= FULL_BUILD_LAYERS:
                return _count(raw, num_layers)
            one, two, probe = _count(raw, 1), _count(raw, 2), _count(raw, FULL_BUILD_LAYERS)
            if probe != one + (FULL_BUILD_LAYERS - 1) * (two - one):  # layers not all alike
                return _count(raw, num_layers)
    except Exception as err:  # any failure of transformers on this config is the user's input
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise HFCountError(f"transformers cannot build model_type {raw.get('model_type', 'llama')!r} from it "
                           f"({type(err).__name__}: {first})") from None
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
