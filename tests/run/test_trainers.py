"""Every front point's trainer files (autotune.trainers) load in the libraries themselves, without a
mismatch: HF Trainer (TrainingArguments + HfTrainerDeepSpeedConfig's own process/finalize), accelerate
(its config loader, launch-argument validation and launch environment, then the plugin built from
that environment), Lightning (DeepSpeedStrategy / ModelParallelStrategy and Trainer, DeepSpeedStrategy's
own config formatting) and torchtitan (its ConfigManager parsing the TOML). Checked on the
recommended point and every front point of every shipped example job, and on a grid of strategies."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import itertools
import json
import os
import sys
import types
import typing
from pathlib import Path

import pytest

from autotune.cli import main as cli_main
from autotune.config import load_config
from autotune.engine_configs import gradient_accumulation_steps, to_deepspeed_config, to_fsdp2_config
from autotune.strategy import CHECKPOINTINGS, Strategy, validate
from autotune.trainers import FILES, write_trainer_files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if "\nmodel:" in "\n" + p.read_text())
"""The shipped example jobs (search-space files beside them have no model section)."""
IGNORED = ("steps_per_print",)
"""Keys the libraries overwrite whatever the file says (accelerate and HF: logging off)."""


# ---------------------------------------------------------------- the library checks


def _plain(cfg, s):
    return to_deepspeed_config(s, cfg.model, cfg.training, cfg.hardware)


def _strip(cfg: dict, *keys: str) -> dict:
    out = copy.deepcopy(cfg)
    for k in (*IGNORED, *keys):
        out.pop(k, None)
    return out


def check_hf(folder: Path, cfg, s: Strategy, tmp: Path) -> None:
    """TrainingArguments(**json) and, for DeepSpeed, HfTrainerDeepSpeedConfig's own mismatch check:
    the config Trainer fills is the point's DeepSpeed config (train batch for this world size)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    kwargs = json.loads((folder / FILES["hf_args"]).read_text())
    try:
        args = TrainingArguments(output_dir=str(tmp / "hf"), use_cpu=True, **kwargs)  # use_cpu: bf16 on this CPU
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps == \
            s.micro_batch_size * gradient_accumulation_steps(s, cfg.training, cfg.hardware)
        opt = cfg.training.optimizer  # the job's optimizer settings
        assert (args.learning_rate, args.weight_decay, args.max_grad_norm) == (opt.lr, opt.weight_decay,
                                                                               opt.gradient_clipping)
        if opt.type != "sgd":
            assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (*opt.betas, opt.eps)
        if s.engine == "fsdp2":
            plugin = args.fsdp_plugin_args
            assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] == s.reshard_after_forward
            assert plugin.get("cpu_offload", False) == (s.offload_params == "cpu")
            return
        hf = args.hf_deepspeed_config
        assert not hf.mismatches, hf.mismatches
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=cfg.model.hidden_size))
        hf.trainer_config_finalize(args, model, 10)  # raises on any mismatch
        plain = _plain(cfg, s)
        plain["train_batch_size"] = s.micro_batch_size * plain["gradient_accumulation_steps"] * args.world_size
        assert _strip(hf.config) == _strip(json.loads(json.dumps(plain))), "Trainer's filled config differs"
        assert "auto" not in json.dumps(hf.config)
        if args.activation_checkpointing:  # Trainer's own checkpointing = the point's
            assert s.checkpointing == "full" and cfg.model.implementation == "hf"
    finally:
        unset_hf_deepspeed_config()  # Trainer's global ZeRO-3 flag must not leak into other tests


def check_accelerate(folder: Path, cfg, s: Strategy, monkeypatch) -> None:
    """``accelerate launch --config_file``'s own steps: load_config_from_file, _validate_launch_command,
    the launch environment, then the plugin the training process builds from it."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    path = str(folder / FILES["accelerate"])
    loaded = load_config_from_file(path)
    assert loaded.num_processes == cfg.hardware.num_gpus and loaded.num_machines == cfg.hardware.num_nodes
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    with monkeypatch.context() as m:
        if s.engine == "deepspeed":
            assert args.use_deepspeed
            # as accelerate.commands.launch.launch_command does before deepspeed_launcher
            fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
            for k, v in env.items():
                m.setenv(k, v)
            plugin = DeepSpeedPlugin()  # raises when the YAML sets what the file owns
            assert _strip(plugin.deepspeed_config) == _strip(json.loads(json.dumps(_plain(cfg, s))))
            assert plugin.zero_stage == s.zero_stage
            assert plugin.zero3_init_flag == (s.zero_stage == 3)
        else:
            assert args.use_fsdp
            env = prepare_multi_gpu_env(args)
            for k, v in env.items():
                m.setenv(k, v)
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == s.reshard_after_forward
            assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == (s.offload_params == "cpu")
            assert env["ACCELERATE_MIXED_PRECISION"] == {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[s.precision]


def check_lightning(folder: Path, cfg, s: Strategy) -> None:
    """The strategy's constructor, the Trainer (on this CPU: accelerator, devices and nodes replaced),
    and DeepSpeedStrategy's own config formatting with a LightningModule attached (it refuses
    gradient_accumulation_steps in the config and fills it from accumulate_grad_batches)."""
    import lightning.pytorch as pl

    spec = json.loads((folder / FILES["lightning"]).read_text())
    module, name = spec["strategy"].rsplit(".", 1)
    strategy = getattr(importlib.import_module(module), name)(**spec["strategy_args"])
    trainer = pl.Trainer(strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         **{**spec["trainer_args"], "accelerator": "cpu", "devices": 1, "num_nodes": 1})
    gas = gradient_accumulation_steps(s, cfg.training, cfg.hardware)
    assert trainer.accumulate_grad_batches == gas
    assert spec["trainer_args"]["devices"] * spec["trainer_args"]["num_nodes"] == cfg.hardware.num_gpus
    if s.engine == "fsdp2":
        assert name == "ModelParallelStrategy" and spec["strategy_args"]["data_parallel_size"] == cfg.hardware.num_gpus
        return
    lm = pl.LightningModule()
    lm.trainer = trainer
    strategy._lightning_module = lm
    strategy._format_config()
    plain = _plain(cfg, s)
    # the config DeepSpeed gets (Lightning passes no mpu: no Ulysses keys, its README says so)
    assert _strip(strategy.config) == _strip(plain, "train_batch_size", "sequence_parallel_size",
                                             "seq_parallel_communication_data_type")


def torchtitan_config_manager():
    """torchtitan's ConfigManager. Its package __init__ imports the float8 converters, which need
    triton (a GPU-only wheel, absent here); the config modules do not, so on a machine without triton
    the package is entered without its __init__."""
    try:
        import torchtitan  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "triton":
            raise
        spec = importlib.util.find_spec("torchtitan")
        for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
            del sys.modules[name]
        pkg = types.ModuleType("torchtitan")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec  # importlib.util.find_spec("torchtitan") still answers (another test file reads it)
        sys.modules["torchtitan"] = pkg
    from torchtitan.config import ConfigManager

    return ConfigManager


def _literal_ok(cls, key: str, value) -> bool:
    hint = typing.get_type_hints(cls)[key]
    if typing.get_origin(hint) is typing.Literal:
        return value in typing.get_args(hint)
    return True


def check_torchtitan(folder: Path, cfg, s: Strategy) -> None:
    """ConfigManager.parse_args(["--job.config_file", toml]) (unknown keys refused by its
    _dict_to_dataclass), every Literal field within its choices, and the parsed job = the point."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: torchtitan's own dependency
        import tomli as tomllib

    path = folder / FILES["torchtitan"]
    job = torchtitan_config_manager()().parse_args(["--job.config_file", str(path)])
    raw = tomllib.loads(path.read_text())
    for section, body in raw.items():
        obj = getattr(job, section)
        for key, value in body.items():
            assert getattr(obj, key) == value, (section, key)
            assert _literal_ok(type(obj), key, value), (section, key, value)
    par, tr = job.parallelism, job.training
    hw = cfg.hardware
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert dp * par.context_parallel_degree == hw.num_gpus and par.context_parallel_degree == s.context_parallel_size
    assert (par.data_parallel_replicate_degree > 1) == (s.sharding == "hybrid")
    assert par.fsdp_reshard_after_forward == ("always" if s.reshard_after_forward else "never")
    assert tr.local_batch_size == s.micro_batch_size and tr.seq_len == cfg.training.seq_len
    # torchtitan/train.py: gradient_accumulation_steps = global_batch_size // (local_batch_size * dp degree)
    assert tr.global_batch_size // (tr.local_batch_size * dp) == gradient_accumulation_steps(
        s, cfg.training, hw)
    assert tr.enable_cpu_offload == (s.offload_params == "cpu")
    opt, o = cfg.training.optimizer, job.optimizer  # the job's optimizer settings
    assert (o.lr, o.eps, o.weight_decay, tr.max_norm) == (opt.lr, opt.eps, opt.weight_decay, opt.gradient_clipping)
    assert (o.beta1, o.beta2) == opt.betas
    assert o.name == {"adamw": "AdamW", "adam": "Adam"}.get(opt.type) or "optimizer sgd" in path.read_text()
    ac = job.activation_checkpoint
    n = s.num_checkpointed(cfg.model.num_hidden_layers)
    if n == 0:
        assert ac.mode == "none"
    elif ac.mode == "selective" and ac.selective_ac_option.isdigit():  # _apply_layer_sac: blocks k-1, 2k-1, ...
        k = int(ac.selective_ac_option)
        assert [i for i in range(cfg.model.num_hidden_layers) if (i + 1) % k == 0] == \
            s.checkpointed_blocks(cfg.model.num_hidden_layers)
    elif ac.mode == "full" and not (s.checkpointing == "full" and n == cfg.model.num_hidden_layers):
        assert "not expressible" in path.read_text()  # the nearest setting, said so


def check_point(folder: Path, cfg, s: Strategy, tmp: Path, monkeypatch) -> None:
    names = {p.name for p in folder.iterdir()}
    expected = {FILES[k] for k in ("hf_args", "accelerate", "lightning", "checkpointing", "readme")}
    expected |= {FILES["hf_ds_config"]} if s.engine == "deepspeed" else {FILES["torchtitan"]}
    assert names == expected, names
    check_hf(folder, cfg, s, tmp)
    check_accelerate(folder, cfg, s, monkeypatch)
    check_lightning(folder, cfg, s)
    if s.engine == "fsdp2":
        check_torchtitan(folder, cfg, s)


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """`autotune run EXAMPLE` (simulate, 40 trials) for every shipped example job."""
    out = tmp_path_factory.mktemp("runs")
    runs = {}
    for path in EXAMPLES:
        assert cli_main(["run", str(path), "--out", str(out / path.stem), "--backend", "simulate",
                         "--trials", "40", "--seed", "0"]) in (0, None)
        runs[path.stem] = out / path.stem / f"latest-{path.stem}"
    return runs


@pytest.mark.parametrize("example", [p.stem for p in EXAMPLES])
def test_every_front_point_of_every_example_loads_in_each_trainer(example, example_runs, tmp_path, monkeypatch):
    run = example_runs[example]
    front = json.loads((run / "front.json").read_text())
    cfg = load_config(front["config"])
    assert front["best"] and front["best"]["trainers"]
    best = json.loads((run / "best.json").read_text())
    assert best["trainers"] == front["best"]["trainers"]
    for point in front["front"]:
        s = Strategy(**point["strategy"])
        check_point(run / point["trainers"], cfg, s, tmp_path, monkeypatch)
        if s.engine == "deepspeed":  # the plain-DeepSpeed launch line: the example script, absolute paths
            launch = point["launch"].split()
            assert launch[launch.index("--deepspeed") + 1] == str((run / point["ds_config"]).resolve())
            module = launch[launch.index("--module") + 1]  # shipped with autotune: importable anywhere
            assert importlib.util.find_spec(module) is not None and module.startswith("autotune.examples.")
            assert "activation_checkpointing" not in json.loads((run / point["ds_config"]).read_text())


def _grid() -> list[Strategy]:
    """DeepSpeed: every stage, offload and precision, the checkpointing cycled through none, full,
    full every 3rd block and selective; fsdp2: every granularity with and without every-3rd, the
    sharding, resharding, offload, precision and reduce dtype cycled through their values."""
    ds_ckpt = [("none", None), ("full", None), ("full", 3), ("selective", None)]
    out = [Strategy(zero_stage=z, offload_optimizer=oo, offload_params=op, precision=pr, micro_batch_size=2,
                    checkpointing=ds_ckpt[i % 4][0], checkpoint_every=ds_ckpt[i % 4][1])
           for i, (z, oo, op, pr) in enumerate(itertools.product((0, 1, 2, 3), ("none", "cpu"), ("none", "cpu"),
                                                                 ("bf16", "fp16")))]
    for i, (ck, every) in enumerate(itertools.product(CHECKPOINTINGS, (None, 3))):
        out.append(Strategy(engine="fsdp2", checkpointing=ck, checkpoint_every=None if ck == "none" else every,
                            sharding=("full", "hybrid")[i % 2], reshard_after_forward=bool(i // 2 % 2),
                            offload_params=("none", "cpu")[i // 4 % 2], precision=("bf16", "fp32", "fp16")[i % 3],
                            reduce_dtype=("fp32", "bf16")[i // 3 % 2], micro_batch_size=1))
    return out


JOB = """model:
  {model}
training:
  seq_len: 4096
  global_batch_size: 64
  precision: bf16
  optimizer: {optimizer}
hardware:
  gpu: a100-80gb
  gpus_per_node: 8
  num_nodes: 2
"""


OPTIMIZERS = {"adamw": "{type: adamw, lr: 3.0e-4, betas: [0.9, 0.99], eps: 1.0e-6, weight_decay: 0.05, "
                       "gradient_clipping: 0.5}",
              "sgd": "{type: sgd, lr: 0.02, momentum: 0.9, weight_decay: 0.0, gradient_clipping: 2.0}"}


@pytest.mark.parametrize("job", ["llama2-7b", "qwen-hf", "llama2-7b-sgd"])
def test_a_grid_of_strategies_loads_in_each_trainer(job, tmp_path, monkeypatch, write):
    """Every engine, ZeRO stage, offload, precision and checkpointing granularity (fsdp2: sharding,
    resharding, reduce dtype, every-k-th checkpointing), 2 nodes x 8 GPUs, for a preset and for a
    Hugging Face model (Trainer's own checkpointing)."""
    model = ("preset: llama2-7b" if job.startswith("llama2-7b") else
             f"hf_config: {ROOT / 'tests' / 'data' / 'hf' / 'qwen2-0.5b.json'}")
    path = write(JOB.format(model=model, optimizer=OPTIMIZERS["sgd" if job.endswith("sgd") else "adamw"]))
    cfg = load_config(str(path))
    assert cfg.hardware.num_nodes == 2 and cfg.training.optimizer.lr in (3e-4, 0.02)
    run = tmp_path / "run"
    checked = 0
    for k, s in enumerate(_grid()):
        if validate(s, cfg.model, cfg.training, cfg.hardware):
            continue
        if s.engine == "deepspeed":
            rel = f"ds_configs/{k}.json"
            os.makedirs(run / "ds_configs", exist_ok=True)
            (run / rel).write_text(json.dumps(_plain(cfg, s)))
        else:
            rel = f"fsdp2_configs/{k}.json"
            os.makedirs(run / "fsdp2_configs", exist_ok=True)
            (run / rel).write_text(json.dumps(to_fsdp2_config(s, cfg.model, cfg.training, cfg.hardware)))
        keys = write_trainer_files(str(run), cfg, s, k, rel)
        check_point(run / keys["trainers"], cfg, s, tmp_path, monkeypatch)
        checked += 1
    assert checked >= 30


def test_the_plain_configs_are_what_the_libraries_refuse(tmp_path, monkeypatch):
    """The checks can fail: the point's plain DeepSpeed config with default TrainingArguments is the
    issue's mismatch list, and in Lightning the gradient_accumulation_steps refusal."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    cfg = load_config(str(ROOT / "examples" / "llama2-7b.yaml"))
    s = Strategy(zero_stage=3, micro_batch_size=2, checkpointing="full")
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps(_plain(cfg, s)))
    try:
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, deepspeed=str(plain))
        joined = "\n".join(args.hf_deepspeed_config.mismatches)
        assert "optimizer.params.lr" in joined and "optimizer.params.betas" in joined
    finally:
        unset_hf_deepspeed_config()
    strategy = DeepSpeedStrategy(config=_plain(cfg, s))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    lm = pl.LightningModule()
    lm.trainer = trainer
    strategy._lightning_module = lm
    with pytest.raises(MisconfigurationException, match="gradient_accumulation_steps"):
        strategy._format_config()


def test_trainer_files_are_pure(tmp_path):
    """Writing them imports no torch (the simulate path never does)."""
    import subprocess

    code = ("import sys, autotune.output, autotune.trainers; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


@pytest.mark.slow
def test_an_fsdp2_launch_line_trains_with_the_example_script(example_runs, tmp_path):
    """The recommended point of examples/tiny-cpu-fsdp2.yaml: its torchrun line's module and arguments
    run from another directory (one process here, as ``python -m``: the mesh is built over the processes
    at hand)."""
    import subprocess

    best = json.loads((example_runs["tiny-cpu-fsdp2"] / "best.json").read_text())
    launch = best["launch"].split()
    assert launch[0] == "torchrun" and Path(launch[launch.index("--fsdp2") + 1]).is_file()
    script = launch.index("-m")  # torchrun -m autotune.examples.train_fsdp2: any directory, as python -m
    assert launch[script + 1] == "autotune.examples.train_fsdp2"
    proc = subprocess.run([sys.executable, *launch[script:], "--steps", "2"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fully_shard on" in proc.stdout and "step 1: loss" in proc.stdout


@pytest.mark.slow
def test_the_launch_line_trains_with_the_example_script(example_runs, tmp_path):
    """The recommended point of examples/tiny-cpu.yaml: its launch line runs as written, DeepSpeed's
    launcher and all, from another directory (one process on the CPU)."""
    import subprocess

    run = example_runs["tiny-cpu"]
    best = json.loads((run / "best.json").read_text())
    launch = best["launch"].split()
    assert launch[:5] == ["deepspeed", "--num_gpus", "1", "--module", "autotune.examples.train_deepspeed"]
    # verbatim, through DeepSpeed's own launcher (this interpreter's), from another directory
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([launcher, *launch[1:], "--steps", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout
