"""``model.rms_norm_kernel: liger`` where a job is run: the model sources swap Liger's RMSNorm into a Hugging
Face model as HF Trainer's ``use_liger_kernel`` does (or refuse in one line), the worker and the example
scripts refuse it on the CPU (Triton has no CPU driver), and the trainers' files carry it."""

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from autotune.config import hf_config_fields, load_config  # noqa: E402
from autotune.model_rules import LIGER_KERNEL_CONFIG  # noqa: E402
from autotune.models.sources import (LIGER_ON_CPU, BuiltModel, UserModelError, apply_norm_kernel,  # noqa: E402
                                     build_hf_model)
from autotune.spec import ModelSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402
from test_worker import _run as run_job  # noqa: E402  (the worker launched as the profile backend does)

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024}
LIGER = importlib.util.find_spec("liger_kernel") is not None


def _hf(tmp_path: Path) -> tuple[str, ModelSpec]:
    cfg = json.loads((ROOT / "tests" / "data" / "hf" / "llama-3.2-1b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, **SMALL}))
    return str(path), ModelSpec(**hf_config_fields(str(path))).replace(rms_norm_kernel="liger")


def _norm_forwards(module) -> list:
    """The class each norm's forward comes from (Liger binds its own forward to the module)."""
    return [m.forward.__func__.__qualname__.split(".")[0] for m in module.modules()
            if type(m).__name__.endswith("RMSNorm")]


def test_torchs_norm_is_left_alone_and_the_other_sources_refuse_or_say_so(tmp_path):
    path, spec = _hf(tmp_path)
    built = build_hf_model(path)
    before = [m.forward for m in built.module.modules() if type(m).__name__.endswith("RMSNorm")]
    apply_norm_kernel(built, spec.replace(rms_norm_kernel="torch"))
    assert [m.forward for m in built.module.modules() if type(m).__name__.endswith("RMSNorm")] == before
    assert len(before) == 2 * 2 + 1 and not built.notes
    with pytest.raises(UserModelError) as err:  # the reference decoder has no Liger norm
        apply_norm_kernel(BuiltModel(module=None, batch_fn=lambda *a: {}, source="reference"), spec)
    assert str(err.value).startswith("model.rms_norm_kernel liger: ") and "\n" not in str(err.value)
    factory = BuiltModel(module=None, batch_fn=lambda *a: {}, source="factory:pkg.mod:build")
    apply_norm_kernel(factory, spec)  # the user's model keeps the norms it was built with
    assert any("factory's model runs the norms it was built with" in n for n in factory.notes)


@pytest.mark.skipif(LIGER, reason="liger-kernel is installed here")
def test_a_hugging_face_model_without_liger_kernel_installed_is_refused_in_one_line(tmp_path):
    path, spec = _hf(tmp_path)
    with pytest.raises(UserModelError) as err:
        apply_norm_kernel(build_hf_model(path), spec)
    assert str(err.value) == "model.rms_norm_kernel liger: liger-kernel is not installed (pip install liger-kernel)"


@pytest.mark.skipif(not LIGER, reason="liger-kernel (and triton) not installed")
def test_liger_replaces_every_rmsnorm_and_nothing_else(tmp_path):
    path, spec = _hf(tmp_path)
    built = build_hf_model(path)
    mlp = [type(layer.mlp).__name__ for layer in built.module.model.layers]
    apply_norm_kernel(built, spec)
    assert set(_norm_forwards(built.module)) == {"LigerRMSNorm"}  # every norm's forward is Liger's
    assert [type(layer.mlp).__name__ for layer in built.module.model.layers] == mlp  # its SwiGLU is not swapped
    assert any("Liger's RMSNorm" in n for n in built.notes)


def test_the_worker_refuses_liger_on_the_cpu_in_one_line(tmp_path):
    path, spec = _hf(tmp_path)
    s = Strategy(micro_batch_size=1, zero_stage=2)
    job = {"model": dataclasses.asdict(spec), "hf_config": path, "strategy": s.as_dict(),
           "training": {"seq_len": 64, "global_batch_size": 1, "precision": s.precision},
           "warmup_steps": 1, "measure_steps": 1}
    (r,) = run_job(tmp_path, job, 1, timeout=120)
    assert r["status"] == "error" and r["reason"] == f"RuntimeError: {LIGER_ON_CPU}", r["reason"]
    assert "\n" not in LIGER_ON_CPU and "0 active drivers" in LIGER_ON_CPU


@pytest.mark.parametrize("script", ["train_deepspeed", "train_fsdp2"])
def test_the_example_scripts_refuse_liger_on_the_cpu_before_any_process_group(script, tmp_path):
    import importlib

    path, _ = _hf(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  hf_config: {path}\n  rms_norm_kernel: liger\ntraining:\n  seq_len: 64\n"
                   "  global_batch_size: 8\nhardware:\n  gpu: h100-80gb\n  gpus_per_node: 8\n")
    assert load_config(str(job)).model.rms_norm_kernel == "liger"
    main = importlib.import_module(f"autotune.examples.{script}").main
    engine_file = tmp_path / "engine.json"
    engine_file.write_text("{}")
    flag = "--deepspeed" if script == "train_deepspeed" else "--fsdp2"
    before = dict(os.environ)
    with pytest.raises(SystemExit) as err:
        main(["--job", str(job), flag, str(engine_file)])
    assert str(err.value.code) == LIGER_ON_CPU
    assert dict(os.environ) == before  # refused before torchrun's variables are set (they would leak to other tests)


def test_the_trainers_files_carry_liger(tmp_path):
    """HF Trainer's arguments turn Liger on for the RMSNorm alone (TrainingArguments takes them; Trainer hands
    liger_kernel_config to transformers' apply_liger_kernel, as the worker does); accelerate's, Lightning's and
    torchtitan's READMEs say what they cannot carry; a torch-norm job's files say nothing of it."""
    from transformers import TrainingArguments

    from autotune.engine_configs import to_deepspeed_config
    from autotune.trainers import FILES, trainer_files
    from autotune.trainers.common import Point
    from autotune.trainers.hf_trainer import training_arguments

    path, _ = _hf(tmp_path)
    for kernel in ("liger", "torch"):
        job = tmp_path / f"{kernel}.yaml"
        job.write_text(f"model:\n  hf_config: {path}\n  rms_norm_kernel: {kernel}\ntraining:\n  seq_len: 64\n"
                       "  global_batch_size: 8\nhardware:\n  gpu: h100-80gb\n  gpus_per_node: 8\n")
        cfg = load_config(str(job))
        for s in (Strategy(micro_batch_size=1, zero_stage=3), Strategy(engine="fsdp2", micro_batch_size=1)):
            ds = s.engine == "deepspeed"
            p = Point(cfg, s, to_deepspeed_config(s, cfg.model, cfg.training, cfg.hardware) if ds else None,
                      str(tmp_path / "ds.json") if ds else None,
                      None if s.engine == "deepspeed" else str(tmp_path / "layout.json"), str(tmp_path))
            args = training_arguments(p, str(tmp_path / "ds.json"))
            if kernel == "liger":
                loaded = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                           **{k: args[k] for k in ("use_liger_kernel", "liger_kernel_config")})
                assert loaded.use_liger_kernel and loaded.liger_kernel_config == LIGER_KERNEL_CONFIG
            else:
                assert "use_liger_kernel" not in args
            readme = trainer_files(p)[FILES["readme"]]
            said = readme.count("apply_liger_kernel(model, ")
            assert said == (2 if kernel == "liger" else 0), readme  # accelerate and Lightning
            titan = kernel == "liger" and s.engine == "fsdp2"  # torchtitan's file: fsdp2 points only
            assert ("torchtitan builds its own model with torch's RMSNorm" in readme) == titan, readme
