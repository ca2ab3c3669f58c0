"""The profiling worker with issue 24's long-context knobs on a tiny Hugging Face Llama (real
DeepSpeed / FSDP2 engines on the CPU over gloo): Ulysses with the tiled MLP on 2 ranks, the tiled
loss with activation offload on 1, and the one-line refusals (context parallel on the CPU, a model
that is not a Hugging Face one)."""

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from autotune.config import hf_config_fields  # noqa: E402
from autotune.spec import ModelSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402
from test_worker import _run as run_job  # noqa: E402  (the worker launched as the profile backend does)

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024}


def _hf(tmp_path: Path) -> tuple[str, ModelSpec]:
    cfg = json.loads((ROOT / "tests" / "data" / "hf" / "llama-3.2-1b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, **SMALL}))
    return str(path), ModelSpec(**hf_config_fields(str(path)))


def _run(tmp_path: Path, nproc: int, seq: int, mbs: int, **knobs) -> list[dict]:
    hf, model = _hf(tmp_path)
    s = Strategy(micro_batch_size=mbs, **knobs)
    job = {"model": dataclasses.asdict(model), "hf_config": hf, "strategy": s.as_dict(),
           "training": {"seq_len": seq, "global_batch_size": mbs * nproc // s.sequence_parallel_size,
                        "precision": s.precision},
           "warmup_steps": 1, "measure_steps": 1}
    return run_job(tmp_path, job, nproc, timeout=240)


@pytest.mark.slow
def test_ulysses_with_tiled_mlp_on_two_ranks(tmp_path):
    r0, r1 = _run(tmp_path, 2, 256, 1, zero_stage=2, sequence_parallel_size=2, tiled_mlp=True, precision="bf16")
    assert r0["status"] == r1["status"] == "ok", (r0.get("reason"), r1.get("reason"))
    assert r0["all_ranks"]["status"] == ["ok", "ok"]
    assert any("Ulysses sequence parallel 2" in n and "128 tokens" in n for n in r0["notes"])
    assert any("tiled MLP: 2 MLPs" in n for n in r0["notes"])
    assert r0["losses"] == r1["losses"]  # one sample shared by the SP group: the same loss on both ranks
    assert r0["tokens_per_s"] > 0


@pytest.mark.slow
def test_tiled_loss_with_activation_offload_on_one_rank(tmp_path):
    (r,) = _run(tmp_path, 1, 256, 2, zero_stage=3, tiled_loss=True, checkpointing="full",
                activation_offload="cpu", precision="fp32")
    assert r["status"] == "ok", r.get("reason")
    assert any("tiled loss: 1 tile(s)" in n for n in r["notes"])
    # every block's input hidden states, fp32 [mbs, seq, hidden], in host memory
    assert r["host_offload_peak_bytes"] == 2 * (2 * 256 * 64 * 4)
    assert all(v == v and v < 10 for v in r["losses"])


def _ctx(use_cuda: bool = False):
    from autotune.worker.engines import Context
    from autotune.worker.protocol import WorkerJob

    job = WorkerJob(model={}, training={}, strategy={})
    return Context(job, {"notes": []}, None, 0, 2, 0, use_cuda, "profiler")


def test_context_parallel_on_the_cpu_is_refused_in_one_line():
    from autotune.worker.engines import CP_ON_CPU, context_parallel_mesh

    with pytest.raises(RuntimeError) as err:
        context_parallel_mesh(_ctx(), 2)
    assert str(err.value) == CP_ON_CPU and "\n" not in CP_ON_CPU
    assert "_scaled_dot_product_flash_attention_for_cpu" in CP_ON_CPU


def test_long_context_knobs_need_a_hugging_face_model():
    from autotune.models.sources import BuiltModel, UserModelError
    from autotune.worker.engines import apply_long_context

    built = BuiltModel(module=None, batch_fn=lambda *a: {}, source="reference")
    assert apply_long_context(_ctx(), built, Strategy(), 256) is None  # nothing asked: nothing touched
    with pytest.raises(UserModelError) as err:
        apply_long_context(_ctx(), built, Strategy(tiled_loss=True, tiled_mlp=True), 256)
    assert str(err.value).startswith("tiled_loss, tiled_mlp: ") and "reference" in str(err.value)
