"""``profile.command``: the user's own training command the ``script`` backend runs per trial, its
placeholders (the one list of them) and the environment the script's autotune callback reads.
Pure (no torch): the job file's checker (autotune.config) reads it."""

from __future__ import annotations

import shlex
import string
from typing import Any, Mapping

from autotune.errors import ConfigError

PLACEHOLDERS: dict[str, str] = {
    "python": "this interpreter (sys.executable)",
    "nproc": "ranks per node (hardware.gpus_per_node)",
    "trainer_args": "the point's HF TrainingArguments JSON (its `deepspeed` names hf_deepspeed_config)",
    "hf_deepspeed_config": "the point's DeepSpeed config with \"auto\" where HF Trainer fills values (DeepSpeed points)",
    "deepspeed_config": "the point's full DeepSpeed config (DeepSpeed points)",
    "fsdp2_config": "the point's FSDP2 layout, as autotune.apply takes it (fsdp2 points)",
    "accelerate_config": "the point's accelerate config YAML",
    "lightning_args": "the point's Lightning strategy and Trainer arguments (JSON)",
    "torchtitan_toml": "the point's torchtitan job TOML (fsdp2 points)",
    "checkpointing": "the point's checkpointing.json (autotune.apply_checkpointing's arguments)",
    "model_config": "the job's model.hf_config (absolute path)",
    "job_file": "the job file (absolute path)",
    "trial_dir": "the trial's folder (write outputs there)",
    "max_steps": "profile.warmup_steps + profile.measure_steps",
    "seq_len": "training.seq_len",
}
"""``{name}`` -> what it is replaced with (each value shell-quoted; the command runs without a shell,
in the job file's folder)."""

RESULT_ENV = "AUTOTUNE_RESULT"
"""Rank 0's result file (rank r > 0: ``<stem>.rank<r>.json``); the callback writes a WorkerResult there."""
WARMUP_ENV = "AUTOTUNE_WARMUP_STEPS"
MEASURED_ENV = "AUTOTUNE_MEASURED_STEPS"
TOKENS_ENV = "AUTOTUNE_TOKENS_PER_STEP"
"""Tokens of one optimizer step over all ranks (global batch x sequence length), for tokens/s."""


def placeholders(command: str) -> list[str]:
    """The placeholder names ``command`` uses (ValueError for a malformed brace)."""
    return [name for _, name, _, _ in string.Formatter().parse(command) if name is not None]


def check_command(value: Any, path: str) -> str:
    """A profile.command: a non-empty string whose placeholders are all known (one-line ConfigError)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("expected the training command as a non-empty string", path=path)
    try:
        names = placeholders(value)
    except ValueError as err:
        raise ConfigError(f"bad placeholder braces ({err}); write {{name}}, or {{{{ for a literal brace",
                          path=path) from None
    for name in names:
        if name not in PLACEHOLDERS:
            raise ConfigError(f"unknown placeholder {{{name}}}; expected one of: "
                              + ", ".join(f"{{{n}}}" for n in PLACEHOLDERS), path=path)
    try:
        shlex.split(value)
    except ValueError as err:
        raise ConfigError(f"cannot split the command into arguments: {err}", path=path) from None
    return value


def expand(command: str, values: Mapping[str, str]) -> list[str]:
    """The argument list of ``command`` with its placeholders replaced; KeyError names a placeholder
    this point has no value for (e.g. {deepspeed_config} for an fsdp2 point)."""
    quoted = {name: shlex.quote(str(values[name])) for name in placeholders(command)}
    return shlex.split(command.format(**quoted))
