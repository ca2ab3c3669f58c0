"""Model sources of the profiling worker: the user factory contract, HF from_config, reference.

Fast tests build the modules in-process (torch, no DeepSpeed). The slow ones profile the example
factory (examples/custom-model.yaml) and a tiny HF Llama through the real profile backend (gloo).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from autotune.config import load_config  # noqa: E402
from autotune.models.sources import (  # noqa: E402
    UserModelError, build_factory_model, build_for_job, is_oom, load_factory, loss_of, set_checkpointing)
from autotune.spec import ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "custom-model.yaml")
SPEC = ModelSpec(name="t", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=100, max_position_embeddings=64)
TRAIN = TrainingSpec(seq_len=16, global_batch_size=2, precision="fp32")


def factory_module(tmp_path, body: str, name: str = "userfac") -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    sys.modules.pop(name, None)
    return str(tmp_path)


def test_example_factory_builds_and_trains_one_step():
    cfg = load_config(EXAMPLE)
    built = build_factory_model(cfg.model_factory, cfg.model, cfg.training,
                                python_path=[os.path.dirname(EXAMPLE)])
    assert built.source == "factory:custom_model:build_model"
    set_checkpointing(built, "full", 1, cfg.model.num_hidden_layers)
    batch = built.batch_fn(2, cfg.training.seq_len, "cpu")
    assert set(batch) == {"tokens", "targets"} and batch["tokens"].shape == (2, cfg.training.seq_len)
    loss = loss_of(built.module(**batch))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in built.module.parameters())


@pytest.mark.parametrize("body, match", [
    ("def build_model(spec, training):\n    return torch.nn.Linear(2, 2)\nimport torch\n",
     "must return \\(nn.Module, batch_fn\\), got Linear"),
    ("def build_model(spec, training):\n    return 1, 2\n", "instead of an nn.Module"),
    ("import torch\ndef build_model(spec, training):\n    return torch.nn.Linear(2, 2), 5\n", "non-callable batch_fn"),
    ("def build_model(spec, training):\n    raise ValueError('no such size')\n", "raised ValueError: no such size"),
    ("raise ImportError('missing dep')\n", "cannot import model factory module 'userfac': ImportError: missing dep"),
    ("x = 1\n", "has no attribute 'build_model'"),
    ("build_model = 3\n", "is not callable"),
])
def test_factory_contract_errors_are_short(tmp_path, body, match):
    path = factory_module(tmp_path, body)
    with pytest.raises(UserModelError, match=match) as err:
        build_factory_model("userfac:build_model", SPEC, TRAIN, python_path=[path])
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_missing_module_and_bad_path():
    with pytest.raises(UserModelError, match="cannot import model factory module 'no_such_mod_xyz'"):
        load_factory("no_such_mod_xyz:build_model")
    with pytest.raises(UserModelError, match="package.module:function"):
        load_factory("no_colon")


def test_batch_fn_and_loss_contract(tmp_path):
    path = factory_module(tmp_path, """
        import torch
        def build_model(spec, training):
            return torch.nn.Linear(4, 4), lambda mbs, seq, device: [torch.zeros(mbs, 4)]
    """)
    built = build_factory_model("userfac:build_model", SPEC, TRAIN, python_path=[path])
    with pytest.raises(UserModelError, match="must return a dict of keyword arguments, got a list of 1"):
        built.batch_fn(2, 8, "cpu")
    with pytest.raises(UserModelError, match="scalar loss tensor or an object with .loss, got a tensor of shape"):
        loss_of(torch.zeros(3, 4), "factory")
    assert float(loss_of({"loss": torch.tensor(2.0)})) == 2.0

    class Out:
        loss = torch.tensor([3.0])

    assert loss_of(Out()).shape == ()


def test_is_oom_is_the_one_out_of_memory_test():
    """The worker's status (oom or error) and the builders' pass-through both ask is_oom."""
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError())
    for text in ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB",
                 "[enforce fail at alloc_cpu.cpp] not enough memory", "HIP out of memory"):
        assert is_oom(RuntimeError(text)), text
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # only a RuntimeError's words count
    assert is_oom(UserModelError("model factory raised RuntimeError: not enough memory"))


def test_an_oom_in_the_factory_is_not_wrapped(tmp_path):
    path = factory_module(tmp_path, """
        def build_model(spec, training):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
    """, name="oomfac")
    with pytest.raises(RuntimeError, match="can't allocate memory") as err:
        build_factory_model("oomfac:build_model", SPEC, TRAIN, python_path=[path])
    assert type(err.value) is RuntimeError


def test_loss_of_reads_every_form_of_the_contract():
    """A scalar tensor, a dict or an object with ``loss`` (an HF ModelOutput is both): the one loss
    extraction of the profiler and the traced memory tier."""
    CausalLMOutput = pytest.importorskip("transformers.modeling_outputs").CausalLMOutput

    loss = torch.tensor(1.5)
    for out in (loss, {"loss": loss, "logits": torch.zeros(2)}, CausalLMOutput(loss=loss, logits=torch.zeros(2))):
        got = loss_of(out)
        assert got.shape == () and float(got) == 1.5
    with pytest.raises(UserModelError, match="model forward must return a scalar loss"):
        loss_of((loss, torch.zeros(2)))
    with pytest.raises(UserModelError, match="got dict"):
        loss_of({"logits": torch.zeros(2)})


def test_checkpointing_without_support_is_an_error(tmp_path):
    path = factory_module(tmp_path, """
        import torch
        def build_model(spec, training):
            return torch.nn.Linear(4, 4), lambda mbs, seq, device: {"input": torch.zeros(mbs, 4)}
    """)
    built = build_factory_model("userfac:build_model", SPEC, TRAIN, python_path=[path])
    set_checkpointing(built, "none", 0, 2)  # no checkpointing asked: fine
    with pytest.raises(UserModelError, match="cannot apply full checkpointing"):
        set_checkpointing(built, "full", 2, 2)


def test_reference_source_matches_the_spec():
    built = build_for_job({}, SPEC, TRAIN, seed=3)
    assert built.source == "reference"
    batch = built.batch_fn(2, 16, "cpu")
    assert set(batch) == {"input_ids", "labels"}
    assert loss_of(built.module(**batch)).ndim == 0


def test_reference_source_refuses_what_it_does_not_build():
    """A spec the reference decoder cannot build (Qwen3's per-head q/k norms) is not profiled as another
    model: one sentence naming the fields (the worker records it as status error)."""
    from autotune.presets import model_from_name

    with pytest.raises(UserModelError, match="does not build qk_norm of model 'qwen3-32b'"):
        build_for_job({}, model_from_name("qwen3-32b", num_hidden_layers=1), TRAIN)


def test_hf_source_from_config_with_partial_checkpointing(tmp_path):
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    built = build_for_job({"hf_config": str(path)}, SPEC, TRAIN)
    assert built.source == "hf" and os.environ["HF_HUB_OFFLINE"] == "1"
    set_checkpointing(built, "full", 2, 3)
    flags = [layer.gradient_checkpointing for layer in built.module.model.layers]
    assert flags == [True, True, False]
    built.module.train()
    loss = loss_of(built.module(**built.batch_fn(2, 16, "cpu")), built.source)
    loss.backward()
    assert torch.isfinite(loss)
    # selective: the attention function checkpointed through transformers' AttentionInterface
    built = build_for_job({"hf_config": str(path)}, SPEC, TRAIN)
    set_checkpointing(built, "selective", [0, 2], 3)
    assert built.module.config._attn_implementation == "autotune_selective_sdpa"
    assert [getattr(layer.self_attn, "_autotune_recompute_core", False) for layer in built.module.model.layers] == [
        True, False, True]
    assert any("attention core of the blocks 0, 2 of 3" in n for n in built.notes)
    built.module.train()
    loss = loss_of(built.module(**built.batch_fn(2, 16, "cpu")), built.source)
    loss.backward()
    assert torch.isfinite(loss)


# ---------------------------------------------------------------- slow: through the profile backend


def _backend(cfg, tmp_path, **kw):
    pytest.importorskip("deepspeed")
    from autotune.backends.profiled import DeepSpeedBackend

    cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, timeout_s=120, warmup_steps=1,
                                                               measure_steps=2))
    return DeepSpeedBackend(cfg, str(tmp_path / "run"), device="cpu", **kw)


@pytest.mark.slow
def test_example_factory_end_to_end_through_deepspeed(tmp_path):
    cfg = load_config(EXAMPLE)
    be = _backend(cfg, tmp_path)
    m = be.evaluate(Strategy(zero_stage=2, micro_batch_size=2, checkpointing="selective", precision="fp32"),
                    trial_number=0)
    assert m.status == "ok", m.reason
    assert m.extra["model_source"] == "factory:custom_model:build_model"
    assert m.peak_memory_bytes > 0 and m.tokens_per_s_per_gpu > 0
    assert all(v == v for v in m.extra["losses"])
    job = json.loads((tmp_path / "run" / "trials" / "0" / "job.json").read_text())
    assert job["model_factory"] == "custom_model:build_model"
    assert os.path.dirname(EXAMPLE) in job["python_path"]


@pytest.mark.slow
def test_bad_factory_is_an_error_not_a_hang(tmp_path):
    cfg = dataclasses.replace(load_config(EXAMPLE), model_factory="custom_model:no_such_function")
    m = _backend(cfg, tmp_path).evaluate(Strategy(micro_batch_size=2, precision="fp32"))
    assert m.status == "error"
    assert "has no attribute 'no_such_function'" in m.reason and m.extra["elapsed_s"] < 60


@pytest.mark.slow
def test_hf_llama_from_config_through_deepspeed(tmp_path):
    pytest.importorskip("transformers")
    raw = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "job.yaml").write_text(open(os.path.join(ROOT, "examples", "tiny-cpu.yaml")).read()
                                       .replace("preset: tiny-llama", "hf_config: config.json"))
    cfg = load_config(str(tmp_path / "job.yaml"))
    assert cfg.hf_config
    m = _backend(cfg, tmp_path).evaluate(Strategy(zero_stage=1, micro_batch_size=2, checkpointing="full",
                                                  checkpoint_layers=1, precision="fp32"))
    assert m.status == "ok", m.reason
    assert m.extra["model_source"] == "hf"
    assert any("first 1 of 2 layers" in n for n in m.extra["notes"])


def test_job_for_carries_model_source_and_snapshot_only_for_the_chosen_trial(tmp_path):
    from autotune.backends.profiled import DeepSpeedBackend

    cfg = load_config(EXAMPLE)
    be = DeepSpeedBackend(cfg, str(tmp_path / "run"), device="cpu", snapshot_trial=3)
    s = Strategy(micro_batch_size=2, precision="fp32")
    job3 = be.job_for(s, tmp_path / "3", 3)
    assert job3["snapshot"] == str(tmp_path / "3" / "memory_snapshot.pickle")
    assert "snapshot" not in be.job_for(s, tmp_path / "2", 2)
    assert job3["model_factory"] == "custom_model:build_model" and "hf_config" not in job3
    hf = dataclasses.replace(cfg, model_factory=None, hf_config="/x/config.json")
    job = DeepSpeedBackend(hf, str(tmp_path / "run")).job_for(s, tmp_path / "0", 0)
    assert job["hf_config"] == "/x/config.json" and "model_factory" not in job and "snapshot" not in job


@pytest.mark.slow
def test_cli_run_snapshot_option_reaches_the_trial_worker(tmp_path):
    """`autotune run --backend profile --snapshot 0`: trial 0's job asks for the snapshot; on the
    CPU the worker notes that it wrote none (the CUDA path is autotune.worker.snapshot.memory_snapshot)."""
    import subprocess

    cmd = [sys.executable, "-m", "autotune.cli", "run", EXAMPLE, "--backend", "profile", "--trials", "1",
           "--snapshot", "0", "--out", str(tmp_path), "--name", "snap", "--json"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trial = tmp_path / "snap" / "trials" / "0"
    assert json.loads((trial / "job.json").read_text())["snapshot"] == str(trial / "memory_snapshot.pickle")
    meas = json.loads((trial / "measurement.json").read_text())
    assert meas["extra"]["snapshot_path"] is None
    assert any("no snapshot written" in n for n in meas["extra"]["notes"])
