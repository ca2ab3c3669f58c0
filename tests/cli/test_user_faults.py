"""The faults a new user hits around `run`, `--resume`, `compare` and `worker`: each one line and exit 2,
or a statement of why, never a traceback or a silent mix-up."""

import json
import os
import shutil

import pytest

from autotune.cli import main
from autotune.errors import ConfigError
from conftest import EXAMPLES

TINY = os.path.join(EXAMPLES, "tiny-cpu.yaml")
LLAMA = os.path.join(EXAMPLES, "llama2-7b.yaml")


def _job(tmp_path, name="job.yaml", **changes):
    """tiny-cpu.yaml copied into tmp_path with top-level ``section.key`` values replaced."""
    import yaml

    with open(TINY) as fh:
        job = yaml.safe_load(fh)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        job.setdefault(section, {})[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _one_line_error(capsys, needle):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert needle in err, err
    return err


@pytest.mark.parametrize("knob,value,engine", [("reshard_after_forward", False, "deepspeed"),
                                               ("context_parallel_size", 2, "deepspeed"),
                                               ("zero_stage", 1, "fsdp2"), ("sequence_parallel_size", 2, "fsdp2")])
def test_a_knob_the_engine_ignores_is_refused_not_dropped(tmp_path, capsys, knob, value, engine):
    """A knob of the other engine, set in the job file or as an estimate flag, would be replaced by the
    engine's fixed value (Strategy.__post_init__) without a word: one line naming the key, exit 2."""
    job = _job(tmp_path, **{"strategy.engine": engine, f"strategy.{knob}": value})
    assert main(["estimate", job]) == 2
    _one_line_error(capsys, f"strategy.{knob}: {knob} {value!r} has no effect under engine {engine}")
    flag = "--" + knob.replace("_", "-")
    assert main(["estimate", _job(tmp_path, "ok.yaml", **{"strategy.engine": engine}), flag, str(value).lower()]) == 2
    _one_line_error(capsys, f"{flag}: {knob} {value!r} has no effect under engine {engine}")
    fixed = {"zero_stage": 3}.get(knob)  # the value the engine fixes is accepted
    if fixed is not None:
        assert main(["estimate", _job(tmp_path, "same.yaml", **{"strategy.engine": engine,
                                                                f"strategy.{knob}": fixed})]) == 0


@pytest.mark.parametrize("out", ["a-file", "/proc/autotune-x"])
def test_bad_out_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    assert main(["run", TINY, "--backend", "simulate", "--trials", "1", "--out", out]) == 2
    _one_line_error(capsys, "--out")
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_resume_refuses_a_changed_job_and_names_the_keys(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path)
    assert main(["run", job, "--backend", "simulate", "--trials", "2", "--name", "r"]) == 0
    capsys.readouterr()
    _job(tmp_path, **{"training.global_batch_size": 16})  # the same file, edited
    assert main(["run", job, "--name", "r", "--resume"]) == 2
    err = _one_line_error(capsys, "training.global_batch_size 8 -> 16")
    assert "--resume" in err
    _job(tmp_path, **{"search.space": "default"})  # another search space (the ValueError before)
    assert main(["run", job, "--name", "r", "--resume"]) == 2
    _one_line_error(capsys, "search.space")
    _job(tmp_path, **{"search.trials": 50})  # the budget alone may change
    assert main(["run", job, "--name", "r", "--resume"]) == 0


def test_resume_of_a_run_recorded_before_a_job_field_existed(tmp_path, capsys, monkeypatch):
    """A run.json written by an earlier release lacks the job fields added since (here
    training.data_loader_fork): at their default they are no change, at another value they are."""
    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path)
    assert main(["run", job, "--backend", "simulate", "--trials", "2", "--name", "r"]) == 0
    meta_path = tmp_path / "runs" / "r" / "run.json"
    meta = json.loads(meta_path.read_text())
    assert meta["job"].pop("training.data_loader_fork") == "none"
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["run", job, "--name", "r", "--resume", "--trials", "3"]) == 0
    capsys.readouterr()
    _job(tmp_path, **{"training.data_loader_fork": "after_init"})
    assert main(["run", job, "--name", "r", "--resume", "--trials", "3"]) == 2
    _one_line_error(capsys, 'training.data_loader_fork "none" -> "after_init"')


def _evaluations(run_dir):
    from autotune.rundir import evaluations_done

    meta = json.loads((run_dir / "run.json").read_text())
    return evaluations_done(meta["storage"], meta["name"])


def test_resume_continues_the_runs_budget_and_the_hint_reproduces_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path, **{"search.space": "default"})
    assert main(["run", job, "--backend", "simulate", "--trials", "3", "--name", "r"]) == 0
    run_dir = tmp_path / "runs" / "r"
    assert _evaluations(run_dir) == 3
    assert json.loads((run_dir / "run.json").read_text())["trials"] == 3
    capsys.readouterr()
    assert main(["run", job, "--name", "r", "--resume"]) == 0  # budget spent: outputs only
    assert "3 of its 3 evaluations done, 0 to go" in capsys.readouterr().err
    assert _evaluations(run_dir) == 3
    assert main(["run", job, "--name", "r", "--resume", "--trials", "5"]) == 0  # a new total, not 5 more
    assert _evaluations(run_dir) == 5
    assert json.loads((run_dir / "run.json").read_text())["trials"] == 5


def test_interrupted_runs_resume_hint_carries_the_budget(tmp_path, capsys, monkeypatch):
    import autotune.rundir as rundir

    monkeypatch.chdir(tmp_path)

    def interrupted(self, progress=True, enqueue=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir.Run, "execute", interrupted)
    assert main(["run", TINY, "--backend", "simulate", "--trials", "7", "--name", "r"]) == 130
    assert "--name r --out runs --resume --trials 7" in capsys.readouterr().err


def test_profile_backend_without_torch_names_it(monkeypatch):
    import importlib.util

    from autotune.config import load_config
    from autotune.rundir import _check_before_creating

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        _check_before_creating(load_config(TINY), "profile")
    assert "needs torch" in str(err.value) and "pip install" in str(err.value) and err.value.path == "--backend"


def test_profiling_a_preset_the_reference_decoder_does_not_build_is_refused_before_any_trial(tmp_path, capsys):
    """qwen3-32b sets qk_norm: refused up front when profiled (before, every trial failed with the
    worker's line); nothing is written."""
    job = _job(tmp_path, **{"model.preset": "qwen3-32b", "model.num_hidden_layers": 1})
    out = tmp_path / "runs"
    assert main(["run", job, "--backend", "profile", "--trials", "2", "--out", str(out)]) == 2
    err = _one_line_error(capsys, "does not build qk_norm of model 'qwen3-32b'")
    assert err.startswith(f"autotune: error: {job}: model: ") and "model.hf_config" in err
    assert not out.exists()
    # the script backend trains the user's own model: nothing of the reference decoder to refuse
    from autotune.config import load_config
    from autotune.rundir import _check_before_creating

    assert _check_before_creating(load_config(job), "script") is not None


def test_a_crash_names_the_exception_from_the_log(tmp_path):
    from autotune.backends.launch import LaunchResult, failure_of

    (tmp_path / "stderr.log").write_text(
        "Traceback (most recent call last):\n  File \"<frozen runpy>\", line 189, in _run_module_as_main\n"
        "[rank0]: ModuleNotFoundError: No module named 'torch'\n")
    res = LaunchResult(nproc=1, returncode=1, timed_out=False, elapsed_s=1.0, log_dir=str(tmp_path))
    status, reason = failure_of(res)
    assert status == "crash" and "ModuleNotFoundError: No module named 'torch'" in reason
    (tmp_path / "stderr.log").write_text(
        "ModuleNotFoundError: No module named 'torch'\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")  # torchrun's summary comes last
    assert failure_of(res)[1].endswith("(ModuleNotFoundError: No module named 'torch')")
    (tmp_path / "stderr.log").write_text("nothing useful\n")
    assert "No module" not in failure_of(res)[1]


def test_compare_refuses_a_run_with_itself_and_shows_one_memory_figure(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", LLAMA, "--name", "a"]) == 0
    assert main(["run", LLAMA, "--name", "b"]) == 0
    capsys.readouterr()
    os.symlink("b", "runs/latest-b-link")
    assert main(["compare", "runs/latest-b-link", "runs/b"]) == 2
    _one_line_error(capsys, "same run")
    assert main(["compare", "runs/a", "runs/b", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    best = json.loads((tmp_path / "runs" / "b" / "front.json").read_text())["best"]
    assert c["recommended"]["new"]["gpu_memory_gib"] == best["gpu_memory_gib"]
    assert best["gpu_memory_gib"] > best["peak_memory_gib"]  # the two figures differ: compare shows the first
    assert main(["compare", "runs/a", "runs/b"]) == 0
    text = capsys.readouterr().out
    gib = f"{best['gpu_memory_gib']:.2f} GiB"
    assert gib in text
    assert main(["show", "runs/b"]) == 0
    assert gib in capsys.readouterr().out


def test_worker_says_why_it_stopped(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "four.yaml"
    space.write_text("zero_stage: [0]\nmicro_batch_size: [1, 2]\ncheckpointing: [none, full]\n")
    job = _job(tmp_path, **{"search.space": str(space)})  # 4 candidates
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    assert main(["worker", "--storage", url, "--study", "s", "--config", job, "--create", "--trials", "500",
                 "--backend", "simulate", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["evaluations"] < 500
    assert summary["stopped"].startswith("every one of the") and "candidates that fit" in summary["stopped"]
    assert main(["worker", "--storage", url, "--study", "s", "--config", job, "--trials", "3",
                 "--backend", "simulate"]) == 0
    line = capsys.readouterr().out
    assert "0 evaluations, stopped because every one of the" in line
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


MIXTRAL = os.path.join(EXAMPLES, "mixtral-8x7b.yaml")


def _model_job(tmp_path, base: str, **model):
    """``base`` copied into tmp_path with ``model`` keys added (its hf_config made absolute)."""
    import yaml

    with open(base) as fh:
        job = yaml.safe_load(fh)
    if "hf_config" in job["model"]:
        job["model"]["hf_config"] = os.path.normpath(os.path.join(EXAMPLES, job["model"]["hf_config"]))
    job["model"].update(model)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


@pytest.mark.parametrize("model,needle", [
    (dict(moe_load_imbalance=4.5), "model.moe_load_imbalance: moe_load_imbalance 4.5 is above experts / top-k = 4"),
    (dict(moe_load_imbalance=1.2, ep_rank_imbalance=1.3), "model.ep_rank_imbalance: ep_rank_imbalance 1.3 is above"),
    (dict(moe_load_imbalance=0.9), "model.moe_load_imbalance"),
    (dict(moe_min_load=1.5), "model.moe_min_load"),
    (dict(ep_rank_imbalance=1.1, ep_step_imbalance=1.2), "model.ep_step_imbalance: ep_step_imbalance 1.2 is above"),
    (dict(ep_step_imbalance=4.5), "model.ep_step_imbalance: ep_step_imbalance 4.5 is above the busiest rank's "
                                  "dispatch factor 4 (moe_load_imbalance)"),
    (dict(ep_step_imbalance=0.9), "model.ep_step_imbalance"),
])
def test_a_stated_load_imbalance_the_model_cannot_have_is_one_line(tmp_path, capsys, model, needle):
    """The stated factors (ModelSpec.moe_load_imbalance, ep_rank_imbalance) are checked against the model:
    one line naming the key, exit 2; a factor that fits changes the EP points' bytes, not the others'."""
    assert main(["estimate", _model_job(tmp_path, MIXTRAL, **model)]) == 2
    _one_line_error(capsys, needle)


@pytest.mark.parametrize("key,value", [("moe_load_imbalance", 1.2), ("moe_min_load", 0.5), ("ep_step_imbalance", 1.1)])
def test_a_stated_load_imbalance_on_a_dense_model_is_one_line(tmp_path, capsys, key, value):
    assert main(["estimate", _model_job(tmp_path, LLAMA, **{key: value})]) == 2
    _one_line_error(capsys, f"model.{key}: {key} is stated for a model without routed experts")


def test_a_stated_load_imbalance_moves_the_ep_points_only(tmp_path):
    from autotune.config import load_config
    from autotune.memory import estimate_memory
    from autotune.strategy import Strategy

    default, stated = (load_config(_model_job(tmp_path, MIXTRAL, **model))
                       for model in ({}, dict(moe_load_imbalance=1.2, ep_rank_imbalance=1.1)))
    m, tr, hw = default.model, default.training, default.hardware
    ep, plain = (Strategy(engine="fsdp2", expert_parallel_size=e, micro_batch_size=1, checkpointing="full")
                 for e in (8, 1))
    backward = {s: [estimate_memory(x, tr, hw, s).phases["backward"] for x in (stated.model, m)] for s in (ep, plain)}
    assert backward[ep][0] < backward[ep][1] and backward[plain][0] == backward[plain][1], backward
