"""What a new user meets on a first run: loud failures, nothing left behind by a refused run, run
names that never collide, one-line errors, a front at measurement resolution, the progress line."""

import json
import os
import subprocess
import sys

import pytest

from autotune.cli import main
from conftest import BASE, EXAMPLES, ROOT

TINY = os.path.join(EXAMPLES, "tiny-cpu.yaml")


def autotune(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.slow  # launches autotune processes
def test_everything_pruned_exits_1_with_its_own_message_and_keeps_latest(tmp_path, write, capsys):
    ok = write(BASE, "job.yaml")
    assert main(["run", ok, "--out", str(tmp_path / "runs"), "--name", "good"]) == 0
    assert os.readlink(tmp_path / "runs" / "latest-job") == "good"
    nofit = write(BASE.replace("gpus_per_node: 8", "gpus_per_node: 1") + "search: {space: no-offload}\n", "job.yaml")
    capsys.readouterr()
    assert main(["run", nofit, "--out", str(tmp_path / "runs"), "--name", "bad"]) == 1
    err = capsys.readouterr().err
    assert "no candidate fits" in err and "pruned by the memory model" in err and "failed" not in err
    # it names the smallest candidate and what dominates it (front.json says the same)
    small = json.loads((tmp_path / "runs" / "bad" / "front.json").read_text())["smallest_pruned"]
    assert f"the smallest, trial {small['trial']} ({small['strategy_text']}), needs" in err
    assert f"most of it {small['largest_part'].replace('_', ' ')}" in err and small["gpu_memory_gib"] > 16
    # the links still point at the run that produced a front: --baseline latest compares against it
    assert os.readlink(tmp_path / "runs" / "latest-job") == "good"
    assert os.readlink(tmp_path / "runs" / "latest") == "good"
    assert json.loads((tmp_path / "runs" / "bad" / "front.json").read_text())["front"] == []


def test_a_space_of_rule_breaking_candidates_says_so(tmp_path, write, capsys):
    """Every candidate breaks a strategy rule (ZeRO-3 with op checkpointing): the line says rules, not memory."""
    space = write("zero_stage: [3]\ncheckpointing: [op]\nmicro_batch_size: [1, 2]\n", "space.yaml")
    job = write(BASE + f"search: {{space: {space}}}\n", "job.yaml")
    assert main(["run", job, "--out", str(tmp_path / "runs"), "--name", "rules"]) == 1
    err = capsys.readouterr().err
    assert "all 2 candidates were pruned by strategy rules" in err and "memory model" not in err, err
    assert "checkpointing op is not available with zero_stage 3" in (tmp_path / "runs" / "rules" / "summary.md").read_text()


@pytest.mark.slow
def test_all_evaluations_failing_exits_1_counting_failures_by_status(tmp_path):
    """Fault injection as the issue asks: profile.timeout_s 1, every launch times out."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(open(TINY).read().replace("timeout_s: 300", "timeout_s: 1"))
    proc = autotune("run", str(cfg), "--trials", "2", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "every evaluation failed (2 timeout)" in last and "no candidate fits" not in last
    assert "first: trial 0: timeout" in last and "logs in" in last
    log_dir = last.split("logs in ")[1].split(" (run folder")[0]
    assert os.path.isfile(os.path.join(log_dir, "stderr.log"))
    assert not (tmp_path / "runs" / "latest").exists() and not (tmp_path / "runs" / "latest-tiny").exists()


@pytest.mark.slow  # launches autotune processes
def test_refused_run_leaves_nothing_behind_and_the_fixed_command_works(tmp_path, write):
    bad = write(BASE + "search: {space: no-such-space}\n", "job.yaml")
    out = tmp_path / "runs"
    proc = autotune("run", bad, "--out", str(out), "--name", "n", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "search.space" in proc.stderr
    assert not (out / "n").exists()
    good = write(BASE, "job.yaml")
    proc = autotune("run", good, "--out", str(out), "--name", "n", "--storage", "sqlite:////nonexistent/dir/x.db",
                    cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("autotune: error: --storage: cannot open storage")
    assert not (out / "n").exists()
    proc = autotune("run", good, "--out", str(out), "--name", "n", "--resume", cwd=tmp_path)
    assert proc.returncode == 2 and "no run to resume" in proc.stderr and proc.stderr.count("\n") == 1
    assert autotune("run", good, "--out", str(out), "--name", "n", cwd=tmp_path).returncode == 0


@pytest.mark.slow  # launches autotune processes
def test_default_names_never_collide(tmp_path, write):
    job = write(BASE, "job.yaml")
    procs = [subprocess.Popen([sys.executable, "-m", "autotune", "run", job, "--json"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0], [p.stderr.read() for p in procs]
    runs = sorted(d for d in os.listdir(tmp_path / "runs") if d.startswith("job-"))
    assert len(runs) == 3, runs
    assert all((tmp_path / "runs" / d / "front.json").is_file() for d in runs)


@pytest.mark.slow  # imports transformers and torch (the run itself is in-process)
def test_hf_selective_checkpointing_is_searched_and_says_how_to_apply_it(tmp_path, write):
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "vocab_size": 1024, "max_position_embeddings": 512, "tie_word_embeddings": False,
                              "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    job = write("model: {hf_config: config.json}\ntraining: {seq_len: 256, global_batch_size: 8}\n"
                "hardware: {gpu: a100-80gb, gpus_per_node: 1}\nsearch: {space: no-offload, trials: 40}\n")
    assert main(["run", job, "--out", str(tmp_path / "runs"), "--name", "hf", "--json"]) == 0
    front = json.loads((tmp_path / "runs" / "hf" / "front.json").read_text())
    import csv

    rows = list(csv.DictReader(open(tmp_path / "runs" / "hf" / "trials.csv")))
    selective = [r for r in rows if r["checkpointing"] == "selective"]
    # Hugging Face models take selective checkpointing (autotune.models.checkpointing.checkpoint_attention_core)
    assert selective and any(r["state"] == "COMPLETE" for r in selective)
    assert not any("Hugging Face" in (r["prune_reason"] or "") for r in rows)
    listed = [q for p in front["front"] for q in (p, *p["equivalents"])]
    assert all("apply_checkpointing(model, 'selective'" in q["checkpointing"] or "autotune.apply(" in q["checkpointing"]
               for q in listed if q["strategy"]["checkpointing"] == "selective"
               and q["strategy"]["checkpoint_layers"] != 0)
    full = [p for p in front["front"] if p["strategy"]["checkpointing"] == "full"]
    assert all("gradient_checkpointing_enable" in p["checkpointing"] or "apply_checkpointing" in p["checkpointing"]
               for p in full)


def test_front_points_say_how_to_reproduce_them(tmp_path):
    assert main(["run", os.path.join(EXAMPLES, "llama2-7b.yaml"), "--out", str(tmp_path), "--name", "r",
                 "--json"]) == 0
    front = json.loads((tmp_path / "r" / "front.json").read_text())
    for p in front["front"]:
        if p["strategy"]["engine"] == "fsdp2":  # the FSDP2 layout, its snippet and autotune.apply
            layout = json.loads((tmp_path / "r" / p["fsdp2_config"]).read_text())
            assert p["ds_config"] is None and layout["micro_batch_size"] == p["strategy"]["micro_batch_size"]
            assert (tmp_path / "r" / p["fsdp2_snippet"]).is_file() and p["launch"].startswith("torchrun ")
            assert p["checkpointing"].startswith(f'autotune.apply(model, json.load(open("{p["fsdp2_config"]}")))')
            continue
        ds = json.loads((tmp_path / "r" / p["ds_config"]).read_text())
        assert ds["train_micro_batch_size_per_gpu"] == p["strategy"]["micro_batch_size"]
        n = p["strategy"]["checkpoint_layers"]
        if p["strategy"]["checkpointing"] == "none":
            assert p["checkpointing"] == "none"
        else:
            assert p["checkpointing"].startswith("autotune.apply_checkpointing(model, ")
            assert f"num_layers={n if n is not None else 32}" in p["checkpointing"]
    # the front shows the figure fits compares with the usable memory (estimate's GPU memory needed)
    from autotune.config import load_config
    from autotune.memory import estimate_memory
    from autotune.strategy import Strategy

    cfg = load_config(os.path.join(EXAMPLES, "llama2-7b.yaml"))
    for p in front["front"]:
        mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, Strategy(**p["strategy"]))
        assert p["gpu_memory_gib"] == pytest.approx(mem.total_gpu_bytes / 2**30, rel=1e-12)
        assert p["gpu_memory_gib"] <= front["usable_gpu_memory_gib"]
    best = front["best"]
    assert best["why"].startswith("fastest configuration that fits") and best["why"].endswith(".")
    assert best["tokens_per_s_per_gpu"] == max(p["tokens_per_s_per_gpu"] for p in front["front"])


@pytest.mark.slow  # launches autotune processes
def test_progress_line_per_profiled_trial_when_not_a_terminal(tmp_path):
    """A nightly log gets one line per evaluation: trial k of N, strategy, status, elapsed, ETA."""
    env = {"AUTOTUNE_SLOW_BACKEND_S": "0.01"}  # a slow (profiled-like) backend without a GPU
    proc = autotune("run", os.path.join(EXAMPLES, "llama2-7b.yaml"), "--trials", "3", "--out", str(tmp_path),
                    cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("trial ")]
    assert [ln.split(" (")[0] for ln in lines] == ["trial 1 of 3", "trial 2 of 3", "trial 3 of 3"]
    assert all(": ok in " in ln and "elapsed" in ln and "ETA" in ln and ("ZeRO-" in ln or "FSDP2" in ln)
               for ln in lines)
    assert lines[-1].endswith("ETA 0 s")


def test_no_user_visible_text_speaks_project_jargon():
    from autotune.cli import build_parser

    texts = [build_parser().format_help()]
    for sub in build_parser()._subparsers._group_actions[0].choices.values():
        texts.append(sub.format_help())
    from autotune.worker import snapshot

    texts += [cause + remedy for cause, remedy in snapshot.OOM_ADVICE.values()]
    assert not any("the seed" in t.lower() for t in texts)
    import glob

    for page in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        assert "the seed" not in open(page).read().lower(), page


def test_version_matches_the_package_metadata():
    from importlib.metadata import version

    assert autotune("--version", cwd=ROOT).stdout.strip() == f"autotune {version('autotune')}"


def test_replayed_profiling_run_says_how_sure_its_front_is(tmp_path):
    proc = autotune("run", os.path.join(ROOT, "data", "measured", "tiny-gpt2-2rank", "config.yaml"), "--backend",
                    "replay", "--name", "r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    front = json.loads((tmp_path / "runs" / "r" / "front.json").read_text())
    assert front["front_confidence"] and "feasible candidates profiled" in front["front_confidence"]
    assert front["front_confidence"] in proc.stdout.splitlines()
    show = autotune("show", "runs/r", cwd=tmp_path)
    assert front["front_confidence"] in show.stdout.splitlines()


def test_discard_never_removes_a_run_whose_study_has_trials(tmp_path, write):
    import optuna

    from autotune.config import load_config
    from autotune.rundir import open_run, open_storage

    cfg = load_config(write(BASE, "job.yaml"))
    run = open_run(cfg, out=str(tmp_path), name=None, resume=False, storage=None, backend=None, seed=None,
                   trials=None)
    assert run.created and os.path.isfile(os.path.join(run.run_dir, "run.json"))
    study = optuna.create_study(study_name=run.name, storage=open_storage(run.storage_url),
                                directions=["minimize", "maximize"])
    study.add_trial(optuna.trial.create_trial(values=[1.0, 2.0]))
    assert run.discard() is False and os.path.isdir(run.run_dir)
    empty = open_run(cfg, out=str(tmp_path), name=None, resume=False, storage=None, backend=None, seed=None,
                     trials=None)
    assert empty.name != run.name  # same second, same config: a fresh name
    assert empty.discard() is True and not os.path.exists(empty.run_dir)


def test_outputs_skip_a_trial_interrupted_while_its_knobs_were_chosen(tmp_path):
    """SIGTERM can land between two suggest calls: that trial is FAIL with part of its knobs and
    nothing evaluated; writing the outputs (e.g. on --resume) must not trip over it."""
    import optuna

    from autotune.config import load_config
    from autotune.output import collect_rows
    from autotune.space import space_for

    cfg = load_config(os.path.join(EXAMPLES, "llama2-7b.yaml"))
    space = space_for(cfg)
    study = optuna.create_study(directions=["minimize", "maximize"])
    trial = study.ask()
    trial.suggest_categorical("zero_stage", [0, 1, 2, 3])  # the signal arrives here
    trial.set_user_attr("interrupted", "Terminated")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert collect_rows(study, space, cfg) == []
    other = study.ask()
    other.suggest_categorical("zero_stage", [0, 1, 2, 3])
    study.tell(other, state=optuna.trial.TrialState.FAIL)  # not interrupted: a real inconsistency
    with pytest.raises(ValueError):
        collect_rows(study, space, cfg)
