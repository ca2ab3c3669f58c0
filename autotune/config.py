"""The job file (model.yaml): YAML sections -> typed dataclasses, with key-path errors.

Sections: ``model``, ``training``, ``hardware``, optional ``strategy`` (the default strategy for
``autotune estimate``), ``search`` and ``profile``. Unknown keys are errors. YAML is read with
``yaml.safe_load`` only: a config never runs code, except through the explicit
``model.python`` factory that the profiling backend imports.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, Optional

from autotune import presets
from autotune.checks import (Checker, bool_, check_section, choice, float_, int_, key_name, mapping, optional,
                             read_yaml, show, str_)
from autotune.backends.script_command import check_command
from autotune.errors import ConfigError
from autotune.hf_config import (check_block_bytes, check_exact_count, map_hf_config, read_hf_config, unchecked_note,
                                warm_checks)
from autotune.model_rules import (check_model_training, check_modelled, check_norm_kernel, check_stated_balance, int_tuple,
                                   norm_kernel_note)
from autotune.spec import OPTIMIZER_TYPES, GPUSpec, HardwareSpec, ModelSpec, NVMeSpec, OptimizerSpec, TrainingSpec
from autotune.knobs import getter, knob_fields, literal_choices
from autotune.strategy import Strategy, ignored_knobs, validation_errors

@dataclass(frozen=True)
class SearchSection:
    """``search:`` — what ``autotune run`` explores."""

    space: str = "default"
    """Search space: a name under search_spaces/ (default, no-offload, single-gpu) or a YAML path."""
    trials: int = 200
    """Number of Optuna trials (evaluated candidates, repeats excluded)."""
    sampler: Literal["auto", "nsga2", "tpe", "gp", "random", "ehvi", "sweep"] = "auto"
    """Optuna sampler; auto: ehvi (autotune.samplers.front) for the measuring backends (profile, replay),
    nsga2 for simulate; sweep: every candidate of the space once (Optuna's BruteForceSampler), as
    for a measured table."""
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

    backend: Literal["simulate", "profile", "replay", "script"] = "simulate"
    """simulate (throughput simulator), profile (real runs of either engine), replay (answers from a
    CSV) or script (real runs of the user's own training command, ``command``)."""
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
    command: Optional[str] = None
    """For backend script: the training command run per trial, with placeholders
    (autotune.backends.script_command.PLACEHOLDERS; docs/profiling.md)."""
    tokens: Optional[str] = None
    """A .npy array of your tokenized data's ids (numpy.save; any integer dtype, a sample is enough): the profile
    backend's trials and a point's launch script train on windows of it instead of uniform random ids, so a
    mixture of experts' router routes your data (an expert-parallel rank's memory follows it;
    autotune.models.tokens). Relative to the job file; every id below the model's vocab_size."""


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
    notes: tuple[str, ...] = ()
    """What reading the job could not check (hf_config.unchecked_note), one line each; the commands
    that size the model print them on stderr (``autotune: note: ...``)."""


SAMPLERS = literal_choices(SearchSection)["sampler"]
BACKENDS = literal_choices(ProfileSection)["backend"]
"""profile runs real measurements of either engine (deepspeed or fsdp2 strategies)."""


def check_backend(value: Any, path: str) -> str:
    """A backend name (profile.backend or ``--backend``); ``deepspeed``, natural to type since profile
    runs DeepSpeed, is refused with the name to use (the engine is the strategy's ``engine``)."""
    if value == "deepspeed":
        raise ConfigError("backend 'deepspeed' does not exist; use profile (it runs both engines; "
                          "strategy.engine picks DeepSpeed or FSDP2)", path=path)
    return choice(*BACKENDS)(value, path)
LAUNCHERS = literal_choices(ProfileSection)["launcher"]
_MODEL_CHOICES = literal_choices(ModelSpec)


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
    "hidden_act": choice(*_MODEL_CHOICES["hidden_act"]),
    "tie_word_embeddings": bool_,
    "norm": choice(*_MODEL_CHOICES["norm"]),
    "rms_norm_kernel": choice(*_MODEL_CHOICES["rms_norm_kernel"]),
    "bias": bool_,
    "qkv_bias": bool_,
    "position_embedding": choice(*_MODEL_CHOICES["position_embedding"]),
    "max_position_embeddings": int_(1, 1 << 24),
    "attn_implementation": choice(*_MODEL_CHOICES["attn_implementation"]),
    "attention_dropout": float_(0.0, 1.0),
    "hidden_dropout": float_(0.0, 1.0),
    "head_dim": optional(int_(1, 1 << 16)),
    "implementation": choice(*_MODEL_CHOICES["implementation"]),
    "mlp_gated": optional(bool_),
    "norms_per_block": int_(1, 16),
    "qk_norm": choice(*_MODEL_CHOICES["qk_norm"]),
    "parallel_residual": bool_,
    "fused_qkv": bool_,
    "rotary_concat": bool_,
    "linear_addmm": bool_,
    "num_attention_masks": int_(1, 16),
    "sliding_window": optional(int_(1, 1 << 24)),
    "sliding_window_layers": optional(int_(0, 10_000)),
    "attn_logit_softcapping": optional(float_(0.0, 1e6, low_open=True)),
    "final_logit_softcapping": optional(float_(0.0, 1e6, low_open=True)),
    "num_experts": int_(0, 1 << 16),
    "num_experts_per_tok": int_(0, 1 << 16),
    "moe_intermediate_size": optional(int_(1, 1 << 24)),
    "shared_expert_intermediate_size": int_(0, 1 << 24),
    "shared_expert_gate": bool_,
    "dense_layers": int_tuple(0, 10_000),
    "moe_load_imbalance": optional(float_(1.0, 1e6)),
    "moe_min_load": optional(float_(0.0, 1.0)),
    "ep_rank_imbalance": optional(float_(1.0, 1e6)),
    "ep_step_imbalance": optional(float_(1.0, 1e6)),
    "router_bias": bool_,
    "expert_bias": bool_,
    "q_lora_rank": optional(int_(1, 1 << 20)),
    "kv_lora_rank": optional(int_(1, 1 << 20)),
    "qk_rope_head_dim": int_(0, 1 << 16),
    "qk_nope_head_dim": int_(0, 1 << 16),
    "v_head_dim": optional(int_(1, 1 << 16)),
    "attention_sinks": bool_,
    "lm_head_bias": bool_,
}
MODEL_SCHEMA: dict[str, Checker] = {"preset": choice(*presets.model_names()), "hf_config": str_, "python": str_,
                                    **MODEL_FIELDS}
REQUIRED_MODEL = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")

_YAML11_MISSED_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""Numbers like 3e-4 that YAML 1.1 (yaml.safe_load) reads as strings (it wants 3.0e-4)."""


def _number(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Checker:
    """A number in the range, also when YAML 1.1 left an exponent form like ``3e-4`` a string."""
    check = float_(low, high, low_open=low_open)

    def number(value: Any, path: str) -> float:
        if isinstance(value, str) and _YAML11_MISSED_FLOAT.fullmatch(value.strip()):
            value = float(value)
        out = check(value, path)
        if high_open and out == high:
            raise ConfigError(f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}), but got {out:g}",
                              path=path)
        return out

    return number


_UNIT = _number(0.0, 1.0, high_open=True)


def _betas(value: Any, path: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError(f"expected a list of two numbers in [0, 1), but got {show(value)}"[:200], path=path)
    return (_UNIT(value[0], f"{path}[0]"), _UNIT(value[1], f"{path}[1]"))


OPTIMIZER_SCHEMA: dict[str, Checker] = {
    "type": choice(*OPTIMIZER_TYPES),
    "lr": _number(0.0, 1e3, low_open=True),
    "betas": _betas,
    "eps": _number(0.0, 1.0),
    "weight_decay": _number(0.0, 1e3),
    "momentum": _UNIT,
    "gradient_clipping": _number(0.0, 1e9),
}
"""``training.optimizer`` as a mapping: OptimizerSpec's fields (their docstrings say what each is)."""
_SETTINGS_OF = {"betas": ("adam", "adamw"), "eps": ("adam", "adamw"), "momentum": ("sgd",)}
"""OptimizerSpec fields that only some optimizer types have."""


def _optimizer(value: Any, path: str) -> OptimizerSpec:
    """``training.optimizer``: a type name (its defaults) or a mapping of OptimizerSpec fields."""
    if not isinstance(value, dict):
        return OptimizerSpec(type=choice(*OPTIMIZER_TYPES)(value, path))
    section = check_section(value, path, OPTIMIZER_SCHEMA)
    kind = section.get("type", OptimizerSpec.type)
    for key, types in _SETTINGS_OF.items():
        if key in section and kind not in types:
            raise ConfigError(f"{key} is a setting of {' and '.join(types)}, not of {kind}", path=f"{path}.{key}")
    return OptimizerSpec(**section)


TRAINING_SCHEMA: dict[str, Checker] = {
    "seq_len": int_(1, 1 << 24),
    "global_batch_size": int_(1, 1 << 30),
    "precision": choice(*literal_choices(TrainingSpec)["precision"]),
    "optimizer": _optimizer,
    "data_loader_fork": choice(*literal_choices(TrainingSpec)["data_loader_fork"]),
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

def strategy_checker(knob: dataclasses.Field, choices: Optional[tuple[Any, ...]]) -> Checker:
    """A strategy knob's checker: one of its Literal values (``choices``), or an integer in its
    ``int_range`` (None allowed where None is the default: autotune's choice)."""
    if choices is not None:
        return choice(*choices)
    low, high = knob.metadata["int_range"]
    check = int_(low) if high is None else int_(low, high)
    return optional(check) if knob.default is None else check


def strategy_schema(cls: type = Strategy) -> dict[str, Checker]:
    """The job file's strategy section of a Strategy class: a checker per knob field."""
    choices = literal_choices(cls)
    return {f.name: strategy_checker(f, choices[f.name]) for f in knob_fields(cls)}


STRATEGY_SCHEMA: dict[str, Checker] = strategy_schema()
"""The job file's strategy section: every Strategy field."""

SEARCH_SCHEMA: dict[str, Checker] = {
    "space": str_,
    "trials": int_(1, 1_000_000),
    "sampler": choice(*SAMPLERS),
    "headroom": float_(0.0, 0.9),
    "seed": int_(0, 2**31 - 1),
    "fidelity": choice(*literal_choices(SearchSection)["fidelity"]),
    "trace_near_limit": float_(0.0, 1.0),
}

PROFILE_SCHEMA: dict[str, Checker] = {
    "backend": check_backend,
    "warmup_steps": int_(0, 10_000),
    "measure_steps": int_(1, 10_000),
    "timeout_s": float_(0.0, 7 * 86400.0, low_open=True),
    "launcher": choice(*LAUNCHERS),
    "replay_csv": str_,
    "command": check_command,
    "tokens": str_,
}

TOP_SCHEMA = ("model", "training", "hardware", "strategy", "search", "profile")


# ---------------------------------------------------------------- loading

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
    model, factory, hf_path, notes = _model(top["model"], base_dir)
    training = _training(top["training"])
    check_model_training(model, training)
    hardware = _hardware(top["hardware"])
    given = check_section(top.get("strategy") or {}, "strategy", STRATEGY_SCHEMA)
    strategy = Strategy(**{**from_training(training), **given})
    for key, message in ignored_knobs(given, strategy):
        raise ConfigError(message, path=f"strategy.{key}")
    check_strategy(strategy, model, training, hardware, prefix="strategy.")
    search = SearchSection(**check_section(top.get("search") or {}, "search", SEARCH_SCHEMA))
    profile_raw = check_section(top.get("profile") or {}, "profile", PROFILE_SCHEMA)
    for key in ("replay_csv", "tokens"):  # files named relative to the job file
        if key in profile_raw:
            profile_raw[key] = os.path.join(base_dir, profile_raw[key])
    profile = ProfileSection(**profile_raw)
    if profile.tokens:
        from autotune.models.tokens import check_tokens

        if factory:
            raise ConfigError("model.python's factory gives its own batches (its batch_fn); leave profile.tokens out",
                              path="profile.tokens")
        why = check_tokens(profile.tokens, model.vocab_size, training.seq_len)
        if why:
            raise ConfigError(why, path="profile.tokens")
    if profile.backend == "replay" and not profile.replay_csv:
        raise ConfigError("backend replay needs profile.replay_csv", path="profile.replay_csv")
    if profile.backend == "script" and not profile.command:
        raise ConfigError("backend script needs profile.command, the training command to run", path="profile.command")
    return Config(path=path, model=model, training=training, hardware=hardware, strategy=strategy,
                  search=search, profile=profile, model_factory=factory, hf_config=hf_path, notes=notes)


def from_training(training: "TrainingSpec | Mapping[str, Any]", cls: type = Strategy) -> dict[str, Any]:
    """The knobs a job takes from its training section (a TrainingSpec, or a mapping of some of its
    fields) where it does not set them (metadata ``from_training``)."""
    get = getter(training)
    return {f.name: get(f.metadata["from_training"]) for f in knob_fields(cls)
            if f.metadata["from_training"] and get(f.metadata["from_training"]) is not None}


def check_strategy(strategy: Strategy, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                   prefix: str = "") -> None:
    """Raise ConfigError for the first rule the strategy breaks, naming the offending key."""
    for key, message in validation_errors(strategy, model, training, hardware):
        raise ConfigError(message, path=f"{prefix}{key}")


def _model(raw: Any, base_dir: str) -> tuple[ModelSpec, Optional[str], Optional[str], tuple[str, ...]]:
    """The model section: its spec, ``model.python`` factory, resolved ``model.hf_config`` path and the
    notes on what could not be checked of it (Config.notes)."""
    section = check_section(raw, "model", MODEL_SCHEMA)
    preset = section.pop("preset", None)
    hf = section.pop("hf_config", None)
    factory = section.pop("python", None)
    if preset and hf:
        raise ConfigError("give either preset or hf_config, not both", path="model.hf_config")
    if factory is not None and (":" not in factory or not all(part.strip() for part in factory.split(":", 1))):
        raise ConfigError(f"expected 'package.module:function', but got {show(factory)}"[:200], path="model.python")
    hf_path, hf_cfg = None, None
    if preset:
        base = {f.name: getattr(presets.model_from_name(preset), f.name) for f in fields(ModelSpec)}
    elif hf:
        hf_path = os.path.join(base_dir, hf)
        hf_cfg = read_hf_config(hf_path)
        base = _hf_fields(hf_cfg, hf_path)
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
    spec = ModelSpec(**merged)
    check_modelled(spec, hf_path)
    check_stated_balance(spec)
    check_norm_kernel(spec)
    notes = (unchecked_note(hf_cfg, hf_path, spec) if hf_cfg is not None else None, norm_kernel_note(spec))
    return spec, factory, hf_path, tuple(n for n in notes if n)


def hf_config_fields(path: str, exact_check: bool = True) -> dict[str, Any]:
    """Map a Hugging Face config.json onto ModelSpec fields (read as JSON), checked like explicit
    fields. ``exact_check`` (when torch and transformers are importable): refuse the file unless
    the mapped description has exactly the parameters of the transformers model
    (hf_config.check_exact_count) and, for a dense file, the memory model's per-block activations
    what its blocks keep for backward (hf_config.check_block_bytes)."""
    return _hf_fields(read_hf_config(path), path, exact_check)


def _hf_fields(cfg: dict, path: str, exact_check: bool = True) -> dict[str, Any]:
    """hf_config_fields of the config.json object ``cfg``, read from ``path``."""
    out = _checked_hf_fields(cfg, path)
    if exact_check:
        warm_checks(cfg, out, path, _checked_hf_fields)  # one child process for both, where neither is cached
        check_exact_count(cfg, out, path)
        check_block_bytes(cfg, out, path, _checked_hf_fields)
    return out


def _checked_hf_fields(cfg: dict, path: str) -> dict[str, Any]:
    """map_hf_config's fields of the config.json object ``cfg``, each checked as the explicit field."""
    try:
        mapped = map_hf_config(cfg, path)
        return {k: (MODEL_FIELDS[k](v, f"model.hf_config:{k}") if k in MODEL_FIELDS else v) for k, v in mapped.items()}
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path}: a value has the wrong type or range ({type(err).__name__}: {show(str(err))})",
                          path="model.hf_config") from None


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
