"""A front point's files for the trainers people train with, written next to its engine config:
``trainers/<k>/`` in the run directory (docs/run-directory.md lists them, docs/trainers.md uses them).

- ``hf_trainer_args.json``: ``TrainingArguments(**json)`` (autotune.trainers.hf_trainer), plus for a
  DeepSpeed point ``hf_ds_config.json``, its DeepSpeed config with "auto" where Trainer fills values;
- ``accelerate.yaml``: ``accelerate launch --config_file`` (autotune.trainers.accelerate_config);
- ``lightning.json``: strategy and Trainer arguments (autotune.trainers.lightning_args);
- ``torchtitan.toml`` (fsdp2 points): torchtitan's job file (autotune.trainers.torchtitan_toml);
- ``checkpointing.json``: the point's checkpointing as ``autotune.apply_checkpointing`` takes it
  and, for a long-context point, its knobs as ``autotune.models.long_context.apply_long_context``
  takes them (``long_context``; autotune.examples.train_deepspeed reads both);
- ``README.md``: how to use each, and what a trainer cannot express.

Everything is derived from the strategy, the job and the engine config (pure: no torch)."""

from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from autotune.config import Config
from autotune.engine_configs import to_deepspeed_config
from autotune.runfiles import write_json
from autotune.strategy import Strategy
import autotune.trainers.accelerate_config as accelerate_config
import autotune.trainers.hf_trainer as hf_trainer
import autotune.trainers.lightning_args as lightning_args
import autotune.trainers.torchtitan_toml as torchtitan_toml
from autotune.trainers.common import (Point, checkpointing_call, checkpointing_spec, long_context_call,
                                      model_side_long_context)

TRAINERS_DIR = "trainers"
EXAMPLE_MODULE = "autotune.examples.train_deepspeed"
"""The plain-DeepSpeed example script the launch line runs (``deepspeed --module``: shipped with autotune,
so the line runs from any directory)."""
FSDP2_EXAMPLE_MODULE = "autotune.examples.train_fsdp2"
"""The FSDP2 example script an fsdp2 point's torchrun line runs (``torchrun -m``)."""
FILES = {"hf_args": "hf_trainer_args.json", "hf_ds_config": "hf_ds_config.json", "accelerate": "accelerate.yaml",
         "lightning": "lightning.json", "torchtitan": "torchtitan.toml", "checkpointing": "checkpointing.json",
         "readme": "README.md"}
"""The files of one point's folder (hf_ds_config: DeepSpeed points only; torchtitan: fsdp2 points only)."""

__all__ = ["FILES", "TRAINERS_DIR", "Point", "checkpointing_call", "deepspeed_launch", "trainer_files",
           "write_trainer_files"]


def deepspeed_launch(run_dir: str, cfg: Config, ds_config_rel: str, trainers_rel: str) -> str:
    """The plain-DeepSpeed launch line: the example script as a module, with absolute paths of the job
    file, the DeepSpeed config and the point's checkpointing.json (so it runs from any directory)."""
    hw = cfg.hardware
    run = os.path.abspath(run_dir)
    args = (f"--module {EXAMPLE_MODULE} --job {os.path.abspath(cfg.path)} "
            f"--deepspeed {os.path.join(run, ds_config_rel)} "
            f"--checkpointing {os.path.join(run, trainers_rel, FILES['checkpointing'])}")
    if hw.num_nodes > 1:
        return f"deepspeed --hostfile hostfile --num_nodes {hw.num_nodes} --num_gpus {hw.gpus_per_node} {args}"
    return f"deepspeed --num_gpus {hw.gpus_per_node} {args}"


def fsdp2_launch(run_dir: str, cfg: Config, layout_rel: str) -> str:
    """An fsdp2 point's torchrun line (several nodes: a c10d rendezvous): the example script as a
    module, with absolute paths of the job file and the point's layout (so it runs from any directory)."""
    hw = cfg.hardware
    args = (f"-m {FSDP2_EXAMPLE_MODULE} --job {os.path.abspath(cfg.path)} "
            f"--fsdp2 {os.path.join(os.path.abspath(run_dir), layout_rel)}")
    if hw.num_nodes > 1:
        return (f"torchrun --nnodes {hw.num_nodes} --nproc_per_node {hw.gpus_per_node} --rdzv_backend c10d "
                f"--rdzv_endpoint $MASTER_ADDR:29500 {args}")
    return f"torchrun --nproc_per_node {hw.gpus_per_node} {args}"


def trainer_files(point: Point) -> dict[str, Any]:
    """File name -> content (a JSON object, or text) of the point's folder."""
    s = point.strategy
    out: dict[str, Any] = {FILES["checkpointing"]: checkpointing_spec(point)}
    hf_ds_path = None
    if s.engine == "deepspeed":
        out[FILES["hf_ds_config"]] = hf_trainer.hf_deepspeed_config(point)
        hf_ds_path = os.path.join(point.folder, FILES["hf_ds_config"])
    out[FILES["hf_args"]] = hf_trainer.training_arguments(point, hf_ds_path)
    out[FILES["accelerate"]] = yaml.safe_dump(accelerate_config.accelerate_config(point), sort_keys=False)
    out[FILES["lightning"]] = lightning_args.lightning_args(point)
    if s.engine == "fsdp2":
        out[FILES["torchtitan"]] = torchtitan_toml.toml_text(
            torchtitan_toml.torchtitan_sections(point),
            [f"autotune front point: {s.describe(point.layers)}"]
            + [f"not expressible: {d}" for d in torchtitan_toml.differences(point)] + [torchtitan_toml.YOURS])
    out[FILES["readme"]] = _readme(point, out)
    return out


def write_trainer_files(run_dir: str, cfg: Config, strategy: Strategy, k: int, engine_rel: str) -> dict[str, Any]:
    """Write front point ``k``'s folder; the keys its front.json point gets (``trainers``, for a
    DeepSpeed point the ``launch`` line, for a long-context point its ``long_context`` call).
    ``engine_rel``: its engine config in the run directory."""
    rel = os.path.join(TRAINERS_DIR, str(k))
    folder = os.path.join(run_dir, rel)
    os.makedirs(folder, exist_ok=True)
    ds = strategy.engine == "deepspeed"
    point = Point(cfg, strategy,
                  to_deepspeed_config(strategy, cfg.model, cfg.training, cfg.hardware) if ds else None,
                  os.path.abspath(os.path.join(run_dir, engine_rel)) if ds else None,
                  None if ds else os.path.abspath(os.path.join(run_dir, engine_rel)), os.path.abspath(folder))
    for name, content in trainer_files(point).items():
        path = os.path.join(folder, name)
        if isinstance(content, str):
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(content)
        else:
            write_json(path, content)
    keys: dict[str, Any] = {"trainers": rel}
    if ds:
        keys["launch"] = deepspeed_launch(run_dir, cfg, engine_rel, rel)
    if model_side_long_context(strategy):  # front.json's point: the long-context call next to the checkpointing
        keys["long_context"] = long_context_call(point)
    return keys


def _readme(p: Point, files: dict[str, Any]) -> str:
    s = p.strategy
    folder = "this folder"
    lines = [f"# Front point: {s.describe(p.layers)}", "",
             f"Files in {folder}, each as its library takes it (docs/trainers.md shows them in use).", ""]
    hf_ds = FILES["hf_ds_config"] in files
    lines += ["## Hugging Face Trainer", "",
              f"`TrainingArguments(**json.load(open(\"{FILES['hf_args']}\")), output_dir=...)`"
              + (f"; its `deepspeed` is `{FILES['hf_ds_config']}` (\"auto\" where Trainer fills the value)." if hf_ds
                 else "; FSDP2 through `fsdp` / `fsdp_config`.")]
    lines += [f"- {d}" for d in hf_trainer.differences(p)] + [""]
    lines += ["## accelerate", "", f"`accelerate launch --config_file {FILES['accelerate']} train.py`"]
    lines += [f"- {d}" for d in accelerate_config.differences(p)] + [""]
    lines += ["## Lightning", "", f"`Trainer(strategy=<strategy>(**strategy_args), **trainer_args)` from "
              f"`{FILES['lightning']}`"]
    lines += [f"- {d}" for d in lightning_args.differences(p)] + [""]
    if FILES["torchtitan"] in files:
        lines += ["## torchtitan", "", f"`torchrun ... -m torchtitan.train --job.config_file {FILES['torchtitan']}`"]
        lines += [f"- {d}" for d in (*torchtitan_toml.differences(p), torchtitan_toml.YOURS)] + [""]
    if s.engine == "deepspeed":
        lines += ["## Plain DeepSpeed", "", f"`python -m {EXAMPLE_MODULE}` (front.json `launch`): "
                  "`deepspeed.initialize` with the point's config, its checkpointing from checkpointing.json"
                  + (" and its long-context calls (checkpointing.json `long_context`)." if model_side_long_context(s)
                     else ".")]
    else:
        lines += ["## Plain PyTorch (FSDP2)", "", f"`python -m {FSDP2_EXAMPLE_MODULE}` (front.json `launch`): "
                  "`autotune.apply` with the point's layout (fsdp2_configs/<k>.json: checkpointing, then fully_shard), "
                  "its optimizer and clipping; fsdp2_configs/<k>.py is the same layout as plain torch code"
                  + (" (the one to use for context parallel)." if s.context_parallel_size > 1 else ".")]
    lines += ["", f"Checkpointing in the model: `{checkpointing_call(p.cfg, s)}`"]
    if model_side_long_context(s):
        lines += ["", f"Long context in the model (a Hugging Face causal LM), after the checkpointing: "
                  f"`{long_context_call(p)}`"]
    if s.context_parallel_size > 1:
        lines += ["", f"Context parallel {s.context_parallel_size}: the FSDP2 snippet (fsdp2_configs/<k>.py) builds "
                  "the dp_shard x cp mesh and runs each micro-batch in torch's context_parallel."]
    return "\n".join(lines) + "\n"
