"""profile.tokens: a job's own token ids (a .npy) feed the profiled trials and the launch scripts in place of
uniform random ids (autotune.models.tokens); bad files are one line naming profile.tokens."""

import json
import os

import numpy as np
import pytest
import yaml

from autotune.cli import main
from autotune.config import load_config
from autotune.models.tokens import check_tokens
from conftest import EXAMPLES, ROOT


def _job(tmp_path, example="tiny-cpu.yaml", **profile):
    """An example job copied into tmp_path (its relative files beside it) with ``profile`` keys set."""
    with open(os.path.join(EXAMPLES, example)) as fh:
        job = yaml.safe_load(fh)
    hf = job["model"].get("hf_config")
    if hf:
        job["model"]["hf_config"] = os.path.join(EXAMPLES, hf)
    space = (job.get("search") or {}).get("space", "")
    if space.endswith(".yaml"):
        job["search"]["space"] = os.path.join(EXAMPLES, space)
    job.setdefault("profile", {}).update(profile)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_check_tokens_states_each_rule(tmp_path):
    ok = tmp_path / "ok.npy"
    np.save(ok, np.arange(300, dtype=np.uint16).reshape(3, 100))
    assert check_tokens(str(ok), 300, 128) is None
    cases = {"floats.npy": (np.zeros(500, np.float32), "holds float32 values"),
             "short.npy": (np.zeros(100, np.int64), "holds 100 token ids; a sequence of training.seq_len 128 needs 129"),
             "big.npy": (np.arange(500, dtype=np.int32), "holds token id 499, outside the model's vocabulary [0, 300)"),
             "neg.npy": (np.array([-1] + [0] * 300, np.int64), "holds token id -1")}
    for name, (ids, needle) in cases.items():
        np.save(tmp_path / name, ids)
        assert needle in check_tokens(str(tmp_path / name), 300, 128), name
    (tmp_path / "text.npy").write_text("not numpy")
    assert "is not a .npy file" in check_tokens(str(tmp_path / "text.npy"), 300, 128)
    assert "file not found" in check_tokens(str(tmp_path / "none.npy"), 300, 128)
    assert "expected a .npy file" in check_tokens(str(tmp_path / "ids.bin"), 300, 128)


@pytest.mark.parametrize("name, ids, needle", [
    ("t.npy", np.arange(70_000, dtype=np.int64), "outside the model's vocabulary"),
    ("t.npy", np.zeros(10, np.int64), "a sequence of training.seq_len"),
    ("t.bin", None, "expected a .npy file"),
])
def test_a_bad_tokens_file_is_one_line_naming_the_key(tmp_path, capsys, name, ids, needle):
    if ids is not None:
        np.save(tmp_path / name, ids)
    assert main(["estimate", _job(tmp_path, tokens=name)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "profile.tokens" in err and needle in err, err


def test_a_factory_with_tokens_is_refused(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.zeros(1000, np.int64))
    job = _job(tmp_path, example="custom-model.yaml", tokens="t.npy")
    with open(job) as fh:
        raw = yaml.safe_load(fh)
    assert raw["model"]["python"]
    assert main(["estimate", job]) == 2
    err = capsys.readouterr().err
    assert "profile.tokens" in err and "its own batches" in err and len(err.strip().splitlines()) == 1


def test_the_profiled_job_and_the_routing_lines_name_the_tokens(tmp_path):
    """The path resolves against the job file; the profile backend's worker job carries it (absolute); the
    measured-routing lines say which batches the router saw."""
    from autotune.backends.profiled import DeepSpeedBackend
    from autotune.output import measured_routing_lines
    from autotune.strategy import Strategy

    np.save(tmp_path / "t.npy", np.arange(50_000, dtype=np.int32) % 512)
    cfg = load_config(_job(tmp_path, example="tiny-cpu-moe.yaml", tokens="t.npy"))
    assert cfg.profile.tokens == str(tmp_path / "t.npy")
    job = DeepSpeedBackend(cfg, str(tmp_path / "run")).job_for(Strategy(engine="fsdp2", micro_batch_size=2),
                                                               tmp_path / "0", 0)
    assert job["tokens"] == str(tmp_path / "t.npy")
    summary = {"trials": [0], "factors": {"moe_load_imbalance": 1.5, "moe_min_load": 0.5, "ep_rank_imbalance": 1.2,
                                          "ep_step_imbalance": 1.1}, "tokens": cfg.profile.tokens}
    assert f"on {cfg.profile.tokens} (profile.tokens)" in "\n".join(measured_routing_lines(summary))
    assert "uniform random ids, not your data" in "\n".join(measured_routing_lines({**summary, "tokens": None}))


def test_batches_are_windows_of_the_tokens(tmp_path):
    """The built-in sources' batch functions draw windows of the file at seeded offsets (labels the next ids for
    the reference decoder, the ids for an HF model, which shifts them itself); without a file, uniform ids as
    before; an id the model cannot embed is the worker's one line."""
    pytest.importorskip("torch")
    from autotune.models.sources import UserModelError, build_for_job
    from autotune.spec import ModelSpec, TrainingSpec

    ids = np.arange(10_000, dtype=np.int64) % 1000  # a window of it is consecutive ids, mod 1000
    np.save(tmp_path / "t.npy", ids)
    spec = ModelSpec(name="t", num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=64,
                     vocab_size=1000, max_position_embeddings=64)
    training = TrainingSpec(seq_len=16, global_batch_size=2)
    built = build_for_job({"tokens": str(tmp_path / "t.npy")}, spec, training, seed=3)
    b1, b2 = built.batch_fn(2, 16, "cpu"), built.batch_fn(2, 16, "cpu")
    for b in (b1, b2):
        x, y = b["input_ids"].numpy(), b["labels"].numpy()
        assert x.shape == (2, 16) and ((np.diff(x, axis=1) % 1000) == 1).all() and ((y - x) % 1000 == 1).all()
    assert not np.array_equal(b1["input_ids"].numpy(), b2["input_ids"].numpy())
    again = build_for_job({"tokens": str(tmp_path / "t.npy")}, spec, training, seed=3).batch_fn(2, 16, "cpu")
    assert np.array_equal(again["input_ids"].numpy(), b1["input_ids"].numpy())
    uniform = build_for_job({}, spec, training, seed=3).batch_fn(2, 16, "cpu")["input_ids"].numpy()
    assert not ((np.diff(uniform, axis=1) % 1000) == 1).all()
    np.save(tmp_path / "big.npy", np.arange(5000, dtype=np.int64))
    with pytest.raises(UserModelError, match="profile.tokens: .* outside the model's vocabulary"):
        build_for_job({"tokens": str(tmp_path / "big.npy")}, spec, training)
    pytest.importorskip("transformers")
    hf_config = os.path.join(ROOT, "examples", "tiny-mixtral-hf.json")
    with pytest.raises(UserModelError, match="outside the model's vocabulary \\[0, 512\\)"):  # the HF model's own
        build_for_job({"hf_config": hf_config, "tokens": str(tmp_path / "t.npy")}, spec, training)
    np.save(tmp_path / "small.npy", ids % 512)
    hf = build_for_job({"hf_config": hf_config, "tokens": str(tmp_path / "small.npy")}, spec, training)
    batch = hf.batch_fn(2, 16, "cpu")
    assert batch["labels"] is batch["input_ids"] and ((np.diff(batch["input_ids"].numpy(), axis=1) % 512) == 1).all()


@pytest.mark.slow
def test_a_profiled_moe_run_reads_the_tokens(tmp_path, capsys):
    """`autotune run` of the tiny MoE example with profile.tokens (the UTF-8 bytes of this repository's docs):
    its expert-parallel trials' worker jobs carry the file and a new batch every micro-step, and the run's
    measured routing says which batches it was measured on."""
    pytest.importorskip("transformers")
    text = b"".join(open(os.path.join(ROOT, "docs", name), "rb").read() for name in ("moe.md", "config.md"))
    np.save(tmp_path / "t.npy", np.frombuffer(text, dtype=np.uint8))
    out = tmp_path / "runs" / "run"
    assert main(["run", _job(tmp_path, example="tiny-cpu-moe.yaml", tokens="t.npy"), "--out", str(out.parent),
                 "--name", "run"]) == 0
    printed = capsys.readouterr().out
    jobs = [json.loads(p.read_text()) for p in (out / "trials").glob("*/job.json")]
    ep = [j for j in jobs if j["strategy"].get("expert_parallel_size", 1) > 1]
    assert ep and all(j["tokens"] == str(tmp_path / "t.npy") and j["fresh_batches"] for j in ep)
    assert all(j["tokens"] == str(tmp_path / "t.npy") and "fresh_batches" not in j for j in jobs if j not in ep)
    routing = json.loads((out / "front.json").read_text())["measured_routing"]
    assert routing["tokens"] == str(tmp_path / "t.npy") and f"on {tmp_path / 't.npy'} (profile.tokens)" in printed
