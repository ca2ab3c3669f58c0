"""The job's optimizer (``training.optimizer``, autotune.spec.OptimizerSpec) everywhere: the memory
model's optimizer state, every DeepSpeed config (parsed by DeepSpeed), every FSDP2 layout and
snippet (executed), the tracer and the profiling worker's engines (read back from the optimizer
they built); bad values are one line and exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.config import load_config
from autotune.memory import estimate_memory
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import HardwareSpec, ModelSpec, OptimizerSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.backends.launch import WORKER_MODULE
from autotune.engine_configs import to_deepspeed_config, to_fsdp2_config
from conftest import BASE, ROOT

CUSTOM = {"type": "adamw", "lr": 3.0e-4, "betas": [0.8, 0.99], "eps": 1.0e-6, "weight_decay": 0.01,
          "gradient_clipping": 0.5}
SGD = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "gradient_clipping": 2.0}
MODEL = model_from_name("llama2-7b")
HW8 = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8)
HW1 = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=1)
DS_STRATEGIES = [Strategy(zero_stage=0), Strategy(zero_stage=1, precision="fp16"),
                 Strategy(zero_stage=2, offload_optimizer="cpu"),
                 Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"),
                 Strategy(zero_stage=3, precision="fp32")]


def _job(write, optimizer) -> str:
    text = BASE.replace("global_batch_size: 64}", f"global_batch_size: 64, optimizer: {json.dumps(optimizer)}}}")
    assert "optimizer" in text
    return write(text)


def _training(optimizer) -> TrainingSpec:
    return TrainingSpec(seq_len=4096, global_batch_size=64, optimizer=OptimizerSpec(**optimizer))


def test_defaults_are_the_values_autotune_always_configured(write):
    """Before the optimizer could be set, every config said AdamW, lr 1e-4, betas [0.9, 0.95],
    eps 1e-8, weight decay 0.1, gradient clipping 1.0: the defaults."""
    assert OptimizerSpec() == OptimizerSpec(type="adamw", lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                            momentum=0.0, gradient_clipping=1.0)
    cfg = load_config(write(BASE))
    assert cfg.training.optimizer == OptimizerSpec()
    ds = to_deepspeed_config(Strategy(), MODEL, cfg.training, HW8)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.1}}
    assert ds["gradient_clipping"] == 1.0
    assert load_config(_job(write, "sgd")).training.optimizer == OptimizerSpec(type="sgd")


@pytest.mark.parametrize("strategy", DS_STRATEGIES, ids=lambda s: s.describe())
@pytest.mark.parametrize("optimizer", [CUSTOM, SGD], ids=["adamw", "sgd"])
def test_every_deepspeed_config_carries_the_jobs_optimizer(strategy, optimizer):
    from deepspeed.runtime.config import DeepSpeedConfig

    training = _training(optimizer)
    ds = DeepSpeedConfig(to_deepspeed_config(strategy, MODEL, training, HW1))
    params = {k: v for k, v in optimizer.items() if k not in ("type", "gradient_clipping")}
    assert ds.optimizer_name == ("adamw" if optimizer["type"] == "adamw" else "SGD")
    assert ds.optimizer_params == params
    assert ds.gradient_clipping == optimizer["gradient_clipping"]
    # SGD is not among ZeRO's tested optimizers: the config says so wherever ZeRO runs
    assert ds.zero_allow_untested_optimizer == (optimizer["type"] == "sgd" and strategy.zero_stage >= 1)


def test_adam_means_adam_in_deepspeed():
    """DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (runtime/engine.py)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(to_deepspeed_config(Strategy(), MODEL, _training({"type": "adam"}), HW1))
    assert ds.optimizer_name == "adam" and ds.optimizer_params["adam_w_mode"] is False
    layout = to_fsdp2_config(Strategy(engine="fsdp2"), MODEL, _training({"type": "adam"}), HW8)
    assert layout["optimizer"]["type"] == "Adam" and "adam_w_mode" not in layout["optimizer"]["params"]


def test_the_cli_estimate_writes_the_jobs_optimizer(write, capsys):
    assert main(["estimate", _job(write, CUSTOM), "--json"]) == 0
    ds = json.loads(capsys.readouterr().out)["deepspeed_config"]
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01}
    assert ds["gradient_clipping"] == 0.5


@pytest.mark.parametrize("strategy", DS_STRATEGIES + [Strategy(engine="fsdp2"),
                                                      Strategy(engine="fsdp2", offload_params="cpu")],
                         ids=lambda s: s.describe())
def test_sgd_changes_the_memory_model_as_it_changes_the_state(strategy):
    """Optimizer state per parameter: AdamW 8 bytes (two moments), SGD with momentum 4 (its
    buffer), plain SGD 0, on top of the same fp32 master; on the GPU or, offloaded, on the host."""
    est = {name: estimate_memory(MODEL, _training(opt), HW8, strategy)
           for name, opt in (("adamw", {}), ("momentum", {"type": "sgd", "momentum": 0.9}), ("sgd", {"type": "sgd"}))}
    shards = 1 if strategy.engine == "deepspeed" and strategy.zero_stage == 0 else 8
    per_state_byte = MODEL.num_parameters / shards
    offloaded = strategy.offload_optimizer != "none" or (strategy.engine == "fsdp2" and strategy.offload_params != "none")
    for a, b, diff in (("adamw", "momentum", 4), ("momentum", "sgd", 4)):
        if offloaded:
            assert est[a].gpu["optimizer_states"] == est[b].gpu["optimizer_states"]
            assert est[a].cpu_bytes_per_node - est[b].cpu_bytes_per_node == pytest.approx(8 * diff * per_state_byte,
                                                                                          rel=1e-6)
        else:
            assert est[a].gpu["optimizer_states"] - est[b].gpu["optimizer_states"] == pytest.approx(
                diff * per_state_byte, abs=64)
            assert est[a].gpu["peak"] > est[b].gpu["peak"]


def test_fsdp2_layout_carries_the_jobs_optimizer():
    for optimizer, cls in ((CUSTOM, "AdamW"), (SGD, "SGD")):
        layout = to_fsdp2_config(Strategy(engine="fsdp2"), MODEL, _training(optimizer), HW8)
        assert layout["optimizer"]["type"] == cls and layout["optimizer"]["foreach"] is True
        assert layout["optimizer"]["params"] == {k: v for k, v in optimizer.items()
                                                 if k not in ("type", "gradient_clipping")}
        assert layout["gradient_clipping"] == optimizer["gradient_clipping"]


# ---------------------------------------------------------------- torch: the snippet, the tracer

TINY = ModelSpec(name="tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=172, vocab_size=512, max_position_embeddings=128)


@pytest.mark.parametrize("optimizer", [CUSTOM, SGD, dict(CUSTOM, type="adam", gradient_clipping=0.0)],
                         ids=["adamw", "sgd", "adam-noclip"])
def test_fsdp2_snippet_builds_and_clips_with_the_jobs_optimizer(group, optimizer):
    import torch

    from autotune.models import fsdp2
    from autotune.models.reference import build_model, synthetic_batch

    training = TrainingSpec(seq_len=16, global_batch_size=2, optimizer=OptimizerSpec(**optimizer))
    layout = to_fsdp2_config(Strategy(engine="fsdp2", micro_batch_size=2), TINY, training,
                             HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=1))
    text = fsdp2.snippet(layout)
    ns: dict = {}
    exec(compile(text, "fsdp2_snippet.py", "exec"), ns)
    torch.manual_seed(0)
    model = build_model(TINY)
    opt = ns["shard"](model)
    assert type(opt) is getattr(torch.optim, {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[optimizer["type"]])
    group0 = opt.param_groups[0]
    for key, value in optimizer.items():
        if key not in ("type", "gradient_clipping"):
            assert group0[key] == (tuple(value) if isinstance(value, list) else value), key
    clip = optimizer["gradient_clipping"]
    assert (f"clip_grad_norm_(model.parameters(), {clip!r})" in text) == (clip > 0)
    assert ("clip_grad_norm_" in text) == (clip > 0)
    x, y = synthetic_batch(TINY, 2, 16, seed=0)
    ns["train_step"](model, opt, [{"input_ids": x, "labels": y}])
    state = opt.state[next(iter(model.parameters()))]
    assert sorted(state) == (["momentum_buffer"] if optimizer["type"] == "sgd" else ["exp_avg", "exp_avg_sq", "step"])


def test_layout_with_a_foreign_optimizer_is_refused():
    from autotune.models import fsdp2

    layout = to_fsdp2_config(Strategy(engine="fsdp2"), MODEL, _training({}), HW8)
    with pytest.raises(ValueError, match="optimizer type"):
        fsdp2.snippet(dict(layout, optimizer={"type": "os.system('x') or AdamW", "params": {}}))
    with pytest.raises(ValueError, match="parameter"):
        fsdp2.snippet(dict(layout, optimizer={"type": "AdamW", "params": {"lr": "__import__('os')"}}))


@pytest.mark.parametrize("optimizer,state_bytes", [({}, 8), ({"type": "sgd", "momentum": 0.9}, 4),
                                                   ({"type": "sgd"}, 0)])
def test_traced_optimizer_state_is_the_jobs(optimizer, state_bytes):
    pytest.importorskip("torch")
    from autotune.trace import trace_memory

    training = TrainingSpec(seq_len=32, global_batch_size=2, optimizer=OptimizerSpec(**optimizer))
    assert training.optimizer.state_bytes_per_parameter == state_bytes
    r = trace_memory(TINY, training, Strategy(micro_batch_size=1))
    n = TINY.num_parameters
    assert state_bytes * n <= r.states["optimizer"] < state_bytes * n + 4096  # (+ Adam's step scalars)


# ---------------------------------------------------------------- the worker's engines

WORKER_TINY = dict(name="tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=172, vocab_size=512, max_position_embeddings=128)


def _run_worker(tmp_path: Path, strategy: Strategy, optimizer: dict) -> dict:
    training = {"seq_len": 16, "global_batch_size": 2, "precision": strategy.precision, "optimizer": optimizer}
    job = {"model": WORKER_TINY, "training": training, "strategy": strategy.as_dict(), "warmup_steps": 1,
           "measure_steps": 1, "result_path": str(tmp_path / "result.json"), "device": "cpu", "memory": "none"}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", WORKER_MODULE, str(tmp_path / "job.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert (tmp_path / "result.json").exists(), proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok", result.get("reason")
    return result


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [Strategy(zero_stage=1, micro_batch_size=2), Strategy(engine="fsdp2",
                                                                                           micro_batch_size=2)],
                         ids=["deepspeed-zero1", "fsdp2"])
@pytest.mark.parametrize("optimizer", [CUSTOM, SGD], ids=["adamw", "sgd"])
def test_worker_engines_train_with_the_jobs_optimizer(tmp_path, strategy, optimizer):
    pytest.importorskip("deepspeed")
    got = _run_worker(tmp_path, strategy, optimizer)["optimizer_settings"]
    assert got["class"] == {"adamw": "AdamW", "sgd": "SGD"}[optimizer["type"]]
    for key, value in optimizer.items():
        if key != "type":
            assert got[key] == pytest.approx(value), key


@pytest.mark.parametrize("optimizer", [CUSTOM, SGD, {"type": "adam"}], ids=["adamw", "sgd", "adam"])
def test_the_deepspeed_workers_torch_optimizer_reads_the_configs_section(optimizer):
    """On CPU the DeepSpeed engine gets a torch optimizer built from the config's optimizer section
    (which a profile's ds_config_overrides may change): the job's, as DeepSpeed itself reads it."""
    from autotune.worker.engines import torch_optimizer_of

    spec = OptimizerSpec(**optimizer)
    ds = to_deepspeed_config(Strategy(zero_stage=1), MODEL, _training(optimizer), HW8)
    assert torch_optimizer_of(ds["optimizer"]) == (spec.torch_class, spec.torch_kwargs())
    assert torch_optimizer_of({"type": "Adam", "params": {"lr": 1.0}}) == ("AdamW", {"lr": 1.0})  # DeepSpeed's rule


# ---------------------------------------------------------------- bad values

@pytest.mark.parametrize("optimizer,path", [
    ({"lr": -1.0e-4}, "training.optimizer.lr"),
    ({"lr": 0}, "training.optimizer.lr"),
    ({"betas": [0.9, 1.0]}, "training.optimizer.betas[1]"),
    ({"betas": [-0.1, 0.95]}, "training.optimizer.betas[0]"),
    ({"betas": [0.9]}, "training.optimizer.betas"),
    ({"eps": -1}, "training.optimizer.eps"),
    ({"weight_decay": -0.1}, "training.optimizer.weight_decay"),
    ({"gradient_clipping": -1}, "training.optimizer.gradient_clipping"),
    ({"type": "lion"}, "training.optimizer.type"),
    ("rmsprop", "training.optimizer"),
    ({"type": "sgd", "momentum": 1.0}, "training.optimizer.momentum"),
    ({"type": "sgd", "betas": [0.9, 0.99]}, "training.optimizer.betas"),
    ({"momentum": 0.9}, "training.optimizer.momentum"),
    ({"learning_rate": 0.1}, "training.optimizer.learning_rate"),
])
def test_bad_optimizer_values_are_one_line_exit_2(write, capsys, optimizer, path):
    job = _job(write, optimizer)
    assert main(["estimate", job]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autotune: error: {job}: {path}: "), err


def test_yaml_exponent_numbers_are_numbers(write):
    """YAML 1.1 reads 3e-4 as a string; an optimizer setting means the number."""
    job = write(BASE.replace("global_batch_size: 64}", "global_batch_size: 64, optimizer: {lr: 3e-4, eps: 1e-6}}"))
    opt = load_config(job).training.optimizer
    assert (opt.lr, opt.eps) == (3e-4, 1e-6)
