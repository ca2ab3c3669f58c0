"""The job file (model.yaml): YAML sections -> typed dataclasses, with key-path errors.

Sections: ``model``, ``training``, ``hardware``, optional ``strategy`` (the default strategy for
``autotune estimate``), ``search`` and ``profile``. Unknown keys are errors. YAML is read with
``yaml.safe_load`` only: a config never runs code, except through the explicit
``model.python`` factory that the profiling backend imports.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Optional

from autotune import presets
from autotune.errors import ConfigError
from autotune.spec import GPUSpec, HardwareSpec, ModelSpec, NVMeSpec, TrainingSpec
from autotune.strategy import CHECKPOINTINGS, OFFLOADS, PRECISIONS, Strategy, validation_errors

MAX_INT = 2**62
"""Largest integer accepted anywhere (keeps arithmetic finite and exact)."""

SAMPLERS = ("auto", "nsga2", "tpe", "gp", "random", "ehvi")
BACKENDS = ("simulate", "deepspeed", "replay")
LAUNCHERS = ("torchrun", "deepspeed")


@dataclass(frozen=True)
class SearchSection:
    """``search:`` — what ``autotune run`` explores."""

    space: str = "default"
    """Search space: a name under search_spaces/ (default, no-offload, single-gpu) or a YAML path."""
    trials: int = 200
    """Number of Optuna trials (evaluated candidates, repeats excluded)."""
    sampler: Literal["auto", "nsga2", "tpe", "gp", "random", "ehvi"] = "auto"
    """Optuna sampler; auto: ehvi (autotune.sampler) for the profiling backends (deepspeed, replay),
    nsga2 for simulate."""
    headroom: float = 0.05
    """Fraction of GPU memory kept free when deciding whether a candidate fits."""
    seed: int = 0
    """Sampler seed, for reproducible studies."""
    fidelity: Literal["analytic", "traced"] = "analytic"
    """Memory screening: analytic formulas, or activations traced from the real nn.Module under
    FakeTensorMode (one trace per micro-batch x checkpointing pair; needs torch)."""
    trace_near_limit: float = 0.0
    """In analytic mode, trace the candidates whose predicted peak is within this fraction of the
    usable GPU memory (0 = never)."""


@dataclass(frozen=True)
class ProfileSection:
    """``profile:`` — how surviving candidates are measured."""

    backend: Literal["simulate", "deepspeed", "replay"] = "simulate"
    """simulate (throughput simulator), deepspeed (real runs) or replay (answers from a CSV)."""
    warmup_steps: int = 2
    """Optimizer steps run before measuring."""
    measure_steps: int = 3
    """Optimizer steps measured."""
    timeout_s: float = 600.0
    """Wall-clock limit per candidate; the process group is killed after it."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """How worker processes are started."""
    replay_csv: Optional[str] = None
    """For backend replay: a CSV of measured results (same columns as trials.csv)."""


@dataclass(frozen=True)
class Config:
    """A whole job file, validated."""

    path: str
    """The file it was read from."""
    model: ModelSpec
    training: TrainingSpec
    hardware: HardwareSpec
    strategy: Strategy = field(default_factory=Strategy)
    """Default strategy for ``autotune estimate`` (CLI flags override it)."""
    search: SearchSection = field(default_factory=SearchSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    model_factory: Optional[str] = None
    """``package.module:function`` building the user's own nn.Module (profiling only)."""
    hf_config: Optional[str] = None
    """Resolved path of the HF config.json the model came from, if any."""


# ---------------------------------------------------------------- value checkers
# Each takes (value, key path) and returns the converted value or raises ConfigError(path=...).

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


# ---------------------------------------------------------------- sections

_POS = int_(1)
MODEL_FIELDS: dict[str, Checker] = {
    "name": str_,
    "num_hidden_layers": int_(1, 10_000),
    "hidden_size": int_(1, 1 << 20),
    "num_attention_heads": int_(1, 1 << 16),
    "num_key_value_heads": int_(1, 1 << 16),
    "intermediate_size": int_(1, 1 << 24),
    "vocab_size": int_(1, 1 << 24),
    "hidden_act": choice("silu", "swiglu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    "tie_word_embeddings": bool_,
    "norm": choice("rmsnorm", "layernorm", "rmsnorm_fp32"),
    "bias": bool_,
    "qkv_bias": bool_,
    "position_embedding": choice("rope", "learned", "alibi", "none"),
    "max_position_embeddings": int_(1, 1 << 24),
    "attn_implementation": choice("sdpa", "eager"),
    "attention_dropout": float_(0.0, 1.0),
    "hidden_dropout": float_(0.0, 1.0),
    "head_dim": optional(int_(1, 1 << 16)),
    "implementation": choice("reference", "hf"),
    "mlp_gated": optional(bool_),
    "norms_per_block": int_(1, 16),
    "qk_norm": choice("none", "head", "full"),
    "parallel_residual": bool_,
    "fused_qkv": bool_,
    "rotary_concat": bool_,
    "linear_addmm": bool_,
    "num_attention_masks": int_(1, 16),
    "attn_logit_softcapping": optional(float_(0.0, 1e6, low_open=True)),
    "final_logit_softcapping": optional(float_(0.0, 1e6, low_open=True)),
}
MODEL_SCHEMA: dict[str, Checker] = {"preset": choice(*presets.model_names()), "hf_config": str_, "python": str_,
                                    **MODEL_FIELDS}
REQUIRED_MODEL = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")

TRAINING_SCHEMA: dict[str, Checker] = {
    "seq_len": int_(1, 1 << 24),
    "global_batch_size": int_(1, 1 << 30),
    "precision": choice(*PRECISIONS),
    "optimizer": choice("adamw", "adam", "sgd"),
}

GPU_FIELDS: dict[str, Checker] = {
    "preset": choice(*presets.gpu_names()),
    "name": str_,
    "memory_gib": float_(0.0, 1 << 20, low_open=True),
    "peak_tflops_bf16": float_(0.0, 1e6),
    "peak_tflops_fp16": float_(0.0, 1e6, low_open=True),
    "peak_tflops_fp32": float_(0.0, 1e6, low_open=True),
    "hbm_bandwidth_gbps": float_(0.0, 1e6, low_open=True),
    "intra_node_bandwidth_gbps": float_(0.0, 1e6, low_open=True),
    "inter_node_bandwidth_gbps": float_(0.0, 1e6, low_open=True),
    "pcie_bandwidth_gbps": float_(0.0, 1e6, low_open=True),
}
NVME_SCHEMA: dict[str, Checker] = {
    "capacity_gib": float_(0.0, 1e9, low_open=True),
    "bandwidth_gbps": float_(0.0, 1e6, low_open=True),
    "path": str_,
}
HARDWARE_SCHEMA: dict[str, Checker] = {
    "gpu": lambda v, p: v,  # a preset name or a mapping; resolved in _hardware
    "gpus_per_node": int_(1, 1024),
    "num_nodes": int_(1, 1 << 20),
    "cpu_memory_gib": float_(0.0, 1e9, low_open=True),
    "nvme": optional(lambda v, p: check_section(v, p, NVME_SCHEMA)),
    "cpu_adam_gparams_per_s": float_(0.0, 1e6, low_open=True),
    "cuda_context_gib": float_(0.0, 1e6),
    "allocator_slack": float_(0.0, 0.9),
}

STRATEGY_SCHEMA: dict[str, Checker] = {
    "zero_stage": choice(0, 1, 2, 3),
    "micro_batch_size": int_(1, 1 << 20),
    "checkpointing": choice(*CHECKPOINTINGS),
    "checkpoint_layers": optional(int_(0, 10_000)),
    "offload_optimizer": choice(*OFFLOADS),
    "offload_params": choice(*OFFLOADS),
    "precision": choice(*PRECISIONS),
    "reduce_bucket_size": optional(int_(1)),
    "allgather_bucket_size": optional(int_(1)),
    "prefetch_bucket_size": optional(int_(1)),
    "param_persistence_threshold": optional(int_(0)),
}

SEARCH_SCHEMA: dict[str, Checker] = {
    "space": str_,
    "trials": int_(1, 1_000_000),
    "sampler": choice(*SAMPLERS),
    "headroom": float_(0.0, 0.9),
    "seed": int_(0, 2**31 - 1),
    "fidelity": choice("analytic", "traced"),
    "trace_near_limit": float_(0.0, 1.0),
}

PROFILE_SCHEMA: dict[str, Checker] = {
    "backend": choice(*BACKENDS),
    "warmup_steps": int_(0, 10_000),
    "measure_steps": int_(1, 10_000),
    "timeout_s": float_(0.0, 7 * 86400.0, low_open=True),
    "launcher": choice(*LAUNCHERS),
    "replay_csv": str_,
}

TOP_SCHEMA = ("model", "training", "hardware", "strategy", "search", "profile")


# ---------------------------------------------------------------- loading

def read_yaml(path: str) -> Any:
    """Read a YAML file with the safe loader; any failure is a one-line ConfigError naming the file."""
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
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"malformed YAML{where}: {problem}", file=path) from None
    except RecursionError:
        raise ConfigError("malformed YAML: nesting too deep", file=path) from None
    except (ValueError, TypeError, OverflowError) as err:  # e.g. an integer of > 4300 digits
        raise ConfigError(f"malformed YAML: {show(str(err))}", file=path) from None


def load_config(path: str) -> Config:
    """Load and validate a job file. Raises ConfigError with file and key path on bad input."""
    try:
        return _load(path)
    except ConfigError as err:
        raise err.in_file(path) from None


def _load(path: str) -> Config:
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError("empty file; expected a mapping with model, training and hardware sections")
    top = mapping(raw, "")
    for key in top:
        if key not in TOP_SCHEMA:
            raise ConfigError(f"unknown section {show(key)}; expected one of: {', '.join(TOP_SCHEMA)}"[:300],
                              path=key_name(key))
    for required in ("model", "training", "hardware"):
        if required not in top:
            raise ConfigError(f"missing required section {required!r}", path=required)
    base_dir = os.path.dirname(os.path.abspath(path))
    model, factory, hf_path = _model(top["model"], base_dir)
    training = _training(top["training"])
    hardware = _hardware(top["hardware"])
    strategy = Strategy(**check_section(top.get("strategy") or {}, "strategy", STRATEGY_SCHEMA))
    if "precision" not in (top.get("strategy") or {}):
        strategy = strategy.replace(precision=training.precision)
    check_strategy(strategy, model, training, hardware, prefix="strategy.")
    search = SearchSection(**check_section(top.get("search") or {}, "search", SEARCH_SCHEMA))
    profile_raw = check_section(top.get("profile") or {}, "profile", PROFILE_SCHEMA)
    if "replay_csv" in profile_raw:
        profile_raw["replay_csv"] = os.path.join(base_dir, profile_raw["replay_csv"])
    profile = ProfileSection(**profile_raw)
    if profile.backend == "replay" and not profile.replay_csv:
        raise ConfigError("backend replay needs profile.replay_csv", path="profile.replay_csv")
    return Config(path=path, model=model, training=training, hardware=hardware, strategy=strategy,
                  search=search, profile=profile, model_factory=factory, hf_config=hf_path)


def check_strategy(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                   prefix: str = "") -> None:
    """Raise ConfigError for the first rule the strategy breaks, naming the offending key."""
    for key, message in validation_errors(strategy, model, training, hardware):
        raise ConfigError(message, path=f"{prefix}{key}")


def _model(raw: Any, base_dir: str) -> tuple[ModelSpec, Optional[str], Optional[str]]:
    section = check_section(raw, "model", MODEL_SCHEMA)
    preset = section.pop("preset", None)
    hf = section.pop("hf_config", None)
    factory = section.pop("python", None)
    if preset and hf:
        raise ConfigError("give either preset or hf_config, not both", path="model.hf_config")
    if factory is not None and (":" not in factory or not all(part.strip() for part in factory.split(":", 1))):
        raise ConfigError(f"expected 'package.module:function', but got {show(factory)}"[:200], path="model.python")
    hf_path = None
    if preset:
        base = {f.name: getattr(presets.model_from_name(preset), f.name) for f in fields(ModelSpec)}
    elif hf:
        hf_path = os.path.join(base_dir, hf)
        base = hf_config_fields(hf_path)
    else:
        missing = [k for k in REQUIRED_MODEL if k not in section]
        if missing:
            raise ConfigError(
                f"missing {', '.join(missing)}; give model.preset, model.hf_config or all explicit fields",
                path=f"model.{missing[0]}",
            )
        base = {"name": "custom"}
    merged = {**base, **section}
    merged.setdefault("num_key_value_heads", merged["num_attention_heads"])
    if merged["num_attention_heads"] % merged["num_key_value_heads"]:
        raise ConfigError(
            f"num_attention_heads ({merged['num_attention_heads']}) must be a multiple of "
            f"num_key_value_heads ({merged['num_key_value_heads']})", path="model.num_key_value_heads")
    if merged.get("head_dim") is None and merged["hidden_size"] % merged["num_attention_heads"]:
        raise ConfigError(
            f"hidden_size ({merged['hidden_size']}) must be a multiple of num_attention_heads "
            f"({merged['num_attention_heads']}) unless head_dim is given", path="model.hidden_size")
    return ModelSpec(**merged), factory, hf_path


def hf_config_fields(path: str, exact_check: bool = True) -> dict[str, Any]:
    """Map a Hugging Face config.json onto ModelSpec fields (read as JSON). ``exact_check`` (when
    torch and transformers are importable): refuse the file unless the mapped description has
    exactly the parameters of the transformers model (``_check_exact_count``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"file not found: {path}", path="model.hf_config") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"cannot read {path} as JSON ({type(err).__name__})", path="model.hf_config") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} must hold a JSON object", path="model.hf_config")
    try:
        out = _hf_fields(cfg, path)
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path}: a value has the wrong type or range ({type(err).__name__}: {show(str(err))})",
                          path="model.hf_config") from None
    if exact_check:
        _check_exact_count(cfg, out, path)
    return out


def _check_exact_count(cfg: dict, fields_: dict, path: str) -> None:
    """With torch + transformers: the analytic description must reproduce the parameter count of
    the transformers model built from the file on the meta device (autotune.hf_count), or the file
    is refused in one line naming the difference; never silently mis-sized."""
    from autotune.hf_count import HFCountError, describe_difference, hf_parameter_count

    spec = ModelSpec(**{"name": "hf", **fields_})
    try:
        exact = hf_parameter_count(cfg, spec.num_hidden_layers)
    except HFCountError as err:
        raise ConfigError(f"{path}: {err}", path="model.hf_config") from None
    if exact is not None and exact != spec.num_parameters:
        kind = cfg.get("model_type", "llama")
        raise ConfigError(f"{path}: model_type {show(kind)}: {describe_difference(spec, exact)}",
                          path="model.hf_config")


def _hf_fields(cfg: dict, path: str) -> dict[str, Any]:
    kind = str(cfg.get("model_type", "llama"))

    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ConfigError(f"{path} has none of {', '.join(keys)} (model_type {kind})", path="model.hf_config")
        return default

    name = str(cfg.get("_name_or_path") or kind)
    if kind == "gpt2":
        d = get("n_embd", "hidden_size")
        out = dict(name=name, num_hidden_layers=get("n_layer"), hidden_size=d, num_attention_heads=get("n_head"),
                   intermediate_size=cfg.get("n_inner") or 4 * d, vocab_size=get("vocab_size"),
                   hidden_act=get("activation_function", default="gelu_new"),
                   tie_word_embeddings=get("tie_word_embeddings", default=True), norm="layernorm", bias=True,
                   position_embedding="learned", max_position_embeddings=get("n_positions", default=1024),
                   attention_dropout=float(get("attn_pdrop", default=0.1)),
                   hidden_dropout=float(max(get("resid_pdrop", default=0.1), get("embd_pdrop", default=0.1))))
        out["num_key_value_heads"] = out["num_attention_heads"]
        out["linear_addmm"] = True  # Conv1D: torch.addmm(bias, x, weight)
    elif kind == "mpt":
        d = get("d_model")
        attn = cfg.get("attn_config") or {}
        out = dict(name=name, num_hidden_layers=get("n_layers"), hidden_size=d, num_attention_heads=get("n_heads"),
                   intermediate_size=int(get("expansion_ratio", default=4) * d), vocab_size=get("vocab_size"),
                   hidden_act="gelu", tie_word_embeddings=True, norm="layernorm", bias=not get("no_bias", default=True),
                   position_embedding="alibi" if attn.get("alibi") else "learned",
                   max_position_embeddings=get("max_seq_len", default=2048))
        out["num_key_value_heads"] = attn.get("kv_n_heads") or out["num_attention_heads"]
    elif kind == "gpt_neox":
        # transformers models/gpt_neox: LayerNorms with bias, biased fused qkv / dense / MLP,
        # plain GELU MLP, partial rotary (no parameters), untied embed_out, parallel residual
        heads = get("num_attention_heads")
        out = dict(name=name, num_hidden_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"),
                   num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=get("intermediate_size"),
                   vocab_size=get("vocab_size"), hidden_act=get("hidden_act", default="gelu"), mlp_gated=False,
                   tie_word_embeddings=bool(get("tie_word_embeddings", default=False)), norm="layernorm",
                   bias=bool(get("attention_bias", default=True)), position_embedding="rope",
                   max_position_embeddings=get("max_position_embeddings", default=2048),
                   parallel_residual=bool(get("use_parallel_residual", default=True)), fused_qkv=True,
                   rotary_concat=True,
                   attention_dropout=float(cfg.get("attention_dropout") or 0.0),
                   hidden_dropout=float(cfg.get("hidden_dropout") or 0.0))
    else:  # llama, mistral, qwen2/3, gemma/2, phi3, olmo2 and other Llama-shaped decoders
        # (transformers models/<kind>/modeling_<kind>.py: gate/up/down MLP whatever the activation)
        heads = get("num_attention_heads")
        act = get("hidden_activation", "hidden_act", default="silu")
        attn_bias = bool(cfg.get("attention_bias"))
        out = dict(name=name, num_hidden_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"),
                   num_attention_heads=heads, num_key_value_heads=get("num_key_value_heads", default=heads),
                   intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                   hidden_act=act, mlp_gated=True,
                   tie_word_embeddings=bool(get("tie_word_embeddings",
                                                default=kind in ("gemma", "gemma2", "gemma3_text"))),
                   norm="rmsnorm", bias=bool(attn_bias and cfg.get("mlp_bias")),
                   qkv_bias=kind == "qwen2" or attn_bias,
                   position_embedding="rope", max_position_embeddings=get("max_position_embeddings", default=4096),
                   attention_dropout=float(cfg.get("attention_dropout") or 0.0),
                   hidden_dropout=float(max(cfg.get("resid_pdrop") or 0.0, cfg.get("embd_pdrop") or 0.0)))
        if kind in ("gemma", "gemma2", "olmo2"):
            out["norm"] = "rmsnorm_fp32"  # GemmaRMSNorm / Olmo2RMSNorm: weight applied in fp32
        if kind == "phi3":
            out["fused_qkv"] = True  # qkv_proj, sliced
            out["rotary_concat"] = True  # apply_rotary_pos_emb: torch.cat([rotated, q_pass])
        if kind == "gemma2":
            out["norms_per_block"] = 4  # input, post_attention, pre_feedforward, post_feedforward
            out["attn_implementation"] = "eager"  # transformers has no sdpa path for Gemma2
            out["num_attention_masks"] = 2  # sliding_attention and full_attention layers alternate
            if cfg.get("attn_logit_softcapping", 50.0):  # Gemma2Config's default
                out["attn_logit_softcapping"] = float(cfg.get("attn_logit_softcapping", 50.0))
            if cfg.get("final_logit_softcapping", 30.0):
                out["final_logit_softcapping"] = float(cfg.get("final_logit_softcapping", 30.0))
        if kind in ("qwen3", "gemma3_text"):
            out["qk_norm"] = "head"  # q_norm / k_norm: RMSNorm(head_dim)
        if kind == "olmo2":
            out["qk_norm"] = "full"  # q_norm: RMSNorm(heads * head_dim), k_norm: RMSNorm(kv_heads * head_dim)
        if cfg.get("head_dim"):
            out["head_dim"] = cfg["head_dim"]
        elif kind in ("gemma", "gemma2"):
            out["head_dim"] = 256  # GemmaConfig / Gemma2Config default
    out["implementation"] = "hf"  # trained as the transformers class of this model_type
    # Re-check the mapped values with the same rules as explicit fields.
    return {k: (MODEL_FIELDS[k](v, f"model.hf_config:{k}") if k in MODEL_FIELDS else v) for k, v in out.items()}


def _training(raw: Any) -> TrainingSpec:
    section = check_section(raw, "training", TRAINING_SCHEMA)
    for key in ("seq_len", "global_batch_size"):
        if key not in section:
            raise ConfigError(f"missing required key {key!r}", path=f"training.{key}")
    return TrainingSpec(**section)


def _gpu(raw: Any) -> GPUSpec:
    if isinstance(raw, str):
        return presets.gpu_from_name(choice(*presets.gpu_names())(raw, "hardware.gpu"))
    section = check_section(raw, "hardware.gpu", GPU_FIELDS)
    preset = section.pop("preset", None)
    if "memory_gib" in section:
        section["memory_bytes"] = int(section.pop("memory_gib") * (1 << 30))
    if preset:
        return presets.gpu_from_name(preset, **section)
    missing = [k for k in ("memory_gib", "peak_tflops_fp16", "peak_tflops_fp32", "hbm_bandwidth_gbps")
               if k.replace("memory_gib", "memory_bytes") not in section]
    if missing:
        raise ConfigError(f"missing {missing[0]} (give hardware.gpu.preset or all explicit numbers)",
                          path=f"hardware.gpu.{missing[0]}")
    section.setdefault("name", "custom-gpu")
    section.setdefault("peak_tflops_bf16", 0.0)
    section.setdefault("intra_node_bandwidth_gbps", 24.0)
    section.setdefault("inter_node_bandwidth_gbps", 12.5)
    section.setdefault("pcie_bandwidth_gbps", 24.0)
    return GPUSpec(**section)


def _hardware(raw: Any) -> HardwareSpec:
    section = check_section(raw, "hardware", HARDWARE_SCHEMA)
    if "gpu" not in section:
        raise ConfigError("missing required key 'gpu' (a preset name or a mapping)", path="hardware.gpu")
    section["gpu"] = _gpu(section["gpu"])
    if section.get("nvme") is not None:
        if "capacity_gib" not in section["nvme"]:
            raise ConfigError("missing required key 'capacity_gib'", path="hardware.nvme.capacity_gib")
        section["nvme"] = NVMeSpec(**section["nvme"])
    return HardwareSpec(**section)
