"""`autotune show`, `autotune compare`, nightly baselines (latest links, seeds) on real simulate runs."""

import csv
import json
import os

import pytest

import autotune.cli
from autotune import compare, runfiles
from autotune.errors import ConfigError

JOB = """
model: {{preset: llama2-7b}}
training: {{seq_len: 4096, global_batch_size: 64}}
hardware: {{gpu: {gpu}, gpus_per_node: 8, cpu_memory_gib: 1024}}
search: {{space: {space}, trials: {trials}, headroom: 0.05, seed: 3}}
"""


def cli(argv):
    return autotune.cli.main(argv)


def make_run(tmp, name, gpu="a100-80gb", space="default", trials=30, stem="job"):
    cfg = tmp / f"{stem}.yaml"
    cfg.write_text(JOB.format(gpu=gpu, space=space, trials=trials))
    out = tmp / "runs"
    assert autotune.cli.main(["run", str(cfg), "--out", str(out), "--name", name, "--json"]) == 0
    return str(out / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {
        "a100": make_run(tmp, "a100"),
        "a100-again": make_run(tmp, "a100-again"),
        "h100": make_run(tmp, "h100", gpu="h100-80gb"),
        "out": str(tmp / "runs"),
        "tmp": tmp,
    }


def front(run_dir):
    with open(os.path.join(run_dir, "front.json")) as fh:
        return json.load(fh)


def test_show_prints_front_and_best(runs, capsys):
    capsys.readouterr()
    assert cli(["show", runs["a100"]]) == 0
    out = capsys.readouterr().out
    f = front(runs["a100"])
    assert f["front"], "the 8 x A100 job must have a non-empty front"
    for p in f["front"]:
        assert p["strategy_text"] in out
    assert f"recommended (*): {f['best']['strategy_text']}" in out
    assert cli(["show", runs["a100"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == f


def test_same_job_twice_is_unchanged(runs, capsys):
    capsys.readouterr()
    assert cli(["compare", runs["a100"], runs["a100-again"]]) == 0
    out = capsys.readouterr().out
    assert "verdict: unchanged or better" in out
    c = compare.compare_runs(runfiles.load_run(runs["a100"]), runfiles.load_run(runs["a100-again"]), 0.05)
    assert c["left_front"] == [] and c["joined_front"] == [] and c["regressions"] == []
    assert c["recommended"]["same_strategy"] and c["recommended"]["throughput_change"] == 0


def test_slower_gpu_is_a_regression_and_faster_is_not(runs, capsys):
    capsys.readouterr()
    assert cli(["compare", runs["h100"], runs["a100"], "--max-regression", "5%"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "recommended throughput -" in out
    assert "note: hardware differs" in out
    assert cli(["compare", runs["a100"], runs["h100"]]) == 0  # faster: better
    c = compare.compare_runs(runfiles.load_run(runs["h100"]), runfiles.load_run(runs["a100"]), 0.05)
    old_tps, new_tps = front(runs["h100"])["best"]["tokens_per_s_per_gpu"], front(runs["a100"])["best"][
        "tokens_per_s_per_gpu"]
    assert c["recommended"]["throughput_change"] == pytest.approx((new_tps - old_tps) / old_tps)
    drop = -c["recommended"]["throughput_change"]
    assert drop > 0.05
    # a threshold above the drop tolerates it
    capsys.readouterr()
    assert cli(["compare", runs["h100"], runs["a100"], "--max-regression", f"{100 * drop + 1:.1f}%"]) == 0
    capsys.readouterr()
    assert cli(["compare", runs["h100"], runs["a100"], "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "regression"


def test_old_front_point_that_now_fails_is_a_regression(runs, tmp_path, capsys):
    """Edit a copy of a run as if the recommended strategy had OOMed when re-measured."""
    import shutil

    new = str(tmp_path / "new")
    shutil.copytree(runs["a100"], new)
    f = front(new)
    best = f["best"]
    f["front"] = [p for p in f["front"] if p["trial"] != best["trial"]]
    f["best"] = max(f["front"], key=lambda p: p["tokens_per_s_per_gpu"])
    with open(os.path.join(new, "front.json"), "w") as fh:
        json.dump(f, fh)
    with open(os.path.join(new, "trials.csv"), newline="") as fh:
        rows = list(csv.DictReader(fh))
        fields = list(rows[0])
    for r in rows:
        if int(r["number"]) == best["trial"]:
            r.update(state="FAIL", fail_reason="oom: CUDA out of memory in backward", on_front="False",
                     peak_memory_gib="", tokens_per_s_per_gpu="")
    with open(os.path.join(new, "trials.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    capsys.readouterr()
    assert cli(["compare", runs["a100"], new, "--max-regression", "99%"]) == 1
    out = capsys.readouterr().out
    assert f"old front point now fails: {best['strategy_text']} (oom: CUDA out of memory in backward)" in out
    assert "left the front:" in out and "now FAIL" in out


@pytest.mark.parametrize("argv, needle", [
    (["compare", "{tmp}/missing", "{a100}"], "{tmp}/missing: no such run directory"),
    (["compare", "{a100}", "{tmp}/empty"], "{tmp}/empty: not a finished autotune run: no front.json"),
    (["compare", "{a100}", "{a100}/front.json"], "{a100}/front.json: not a directory"),
    (["compare", "{a100}", "{a100}", "--max-regression", "five"], "--max-regression: expected a percentage"),
    (["compare", "{a100}", "{a100}", "--max-regression", "150%"], "--max-regression: expected a percentage in"),
    (["show", "{tmp}/missing"], "{tmp}/missing: no such run directory"),
    (["show", "{tmp}/badjson"], "{tmp}/badjson/front.json: unreadable front.json"),
])
def test_bad_input_is_one_line_and_status_2(runs, capsys, argv, needle):
    tmp = runs["tmp"]
    (tmp / "empty").mkdir(exist_ok=True)
    (tmp / "badjson").mkdir(exist_ok=True)
    (tmp / "badjson" / "front.json").write_text("{not json")
    fill = {"tmp": str(tmp), "a100": runs["a100"]}
    capsys.readouterr()
    assert cli([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert needle.format(**fill) in err


def test_compare_usage_error_is_status_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["compare", "only-one"])
    assert exc.value.code == 2


def test_latest_links_and_resolve_baseline(runs, tmp_path, capsys):
    out = str(tmp_path / "out")
    os.makedirs(out)
    cfg = "/somewhere/nightly.yaml"
    assert compare.resolve_baseline(out, cfg, "latest") is None  # first night: no baseline yet
    assert "no baseline yet" in capsys.readouterr().err
    assert compare.resolve_baseline(out, cfg, None) is None
    compare.update_latest(out, runs["a100"], "nightly")
    link = os.path.join(out, "latest-nightly")
    assert os.path.islink(link) and not os.path.isabs(os.readlink(link))
    assert compare.resolve_baseline(out, cfg, "latest") == os.path.realpath(runs["a100"])
    assert os.path.realpath(os.path.join(out, "latest")) == os.path.realpath(runs["a100"])
    # a regressed run moves `latest` but not the config's baseline
    compare.update_latest(out, runs["h100"], "nightly", accepted=False)
    assert os.path.realpath(os.path.join(out, "latest")) == os.path.realpath(runs["h100"])
    assert compare.resolve_baseline(out, cfg, "latest") == os.path.realpath(runs["a100"])
    compare.update_latest(out, runs["h100"], "nightly")
    assert compare.resolve_baseline(out, cfg, "latest") == os.path.realpath(runs["h100"])
    assert compare.resolve_baseline(out, cfg, runs["a100"]) == runs["a100"]
    with pytest.raises(ConfigError, match="no such run directory"):
        compare.resolve_baseline(out, cfg, str(tmp_path / "nope"))


def test_baseline_compare_writes_compare_json(runs, tmp_path, capsys):
    import shutil

    new = str(tmp_path / "copy")
    shutil.copytree(runs["a100"], new)
    assert compare.baseline_compare(new, runs["h100"], "5%") == 1
    with open(os.path.join(new, "compare.json")) as fh:
        saved = json.load(fh)
    assert saved["verdict"] == "regression" and saved["baseline"] == os.path.abspath(runs["h100"])
    assert compare.baseline_compare(new, runs["a100"], 0.05) == 0


def test_baseline_seeds_are_enqueued_first(runs):
    """baseline_seeds -> run_study(enqueue=...): the new study re-measures the baseline's front first."""
    import optuna

    from autotune.config import load_config
    from autotune.backends.base import SimulateBackend
    from autotune.search import run_study, trial_strategy
    from autotune.space import load_space

    seeds = compare.baseline_seeds(runs["a100"])
    f = front(runs["a100"])
    assert len(seeds) == len(f["front"])
    assert seeds[0].as_dict() == f["best"]["strategy"]  # recommended point first
    assert sorted(runfiles.strategy_key(s.as_dict()) for s in seeds) == sorted(
        runfiles.strategy_key(p["strategy"]) for p in f["front"])
    cfg = load_config(str(runs["tmp"] / "job.yaml"))
    space = load_space(cfg.search.space, str(runs["tmp"]))
    assert compare.baseline_seeds(runs["a100"], cfg) == seeds  # all in the same space
    outcome = run_study(cfg, space, SimulateBackend(cfg.model, cfg.training, cfg.hardware),
                        storage=optuna.storages.InMemoryStorage(), study_name="seeded", n_trials=len(seeds) + 3,
                        seed=0, sampler="nsga2", headroom=0.05, enqueue=seeds)
    first = [trial_strategy(t, space, cfg) for t in outcome.study.get_trials()[:len(seeds)]]
    assert first == seeds


def test_baseline_seeds_outside_a_new_space_are_dropped(runs, tmp_path):
    from autotune.config import load_config

    zero = front(runs["a100"])["best"]["strategy"]["zero_stage"]
    (tmp_path / "narrow.yaml").write_text(f"zero_stage: [{(zero + 1) % 4}]\nmicro_batch_size: [1, 2]\n")
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(gpu="a100-80gb", space="narrow.yaml", trials=5))
    kept = compare.baseline_seeds(runs["a100"], load_config(str(job)))
    assert all(s.zero_stage == (zero + 1) % 4 and s.micro_batch_size in (1, 2) for s in kept)
    assert len(kept) < len(compare.baseline_seeds(runs["a100"]))


def test_study_is_loadable_by_optuna_with_metric_names(runs, tmp_path):
    """optuna-dashboard opens the study through Optuna's storages: load it the same way."""
    import optuna

    from autotune.search import METRIC_NAMES
    from autotune.storage import make_storage

    with open(os.path.join(runs["a100"], "run.json")) as fh:
        meta = json.load(fh)
    study = optuna.load_study(study_name=meta["name"], storage=make_storage(meta["storage"]))
    assert study.metric_names == METRIC_NAMES
    with open(os.path.join(runs["a100"], "trials.csv"), newline="") as fh:
        assert len(study.trials) == sum(1 for _ in csv.DictReader(fh))
    # the SQLite URL of the README's optuna-dashboard example
    cfg = tmp_path / "job.yaml"
    cfg.write_text(JOB.format(gpu="a100-80gb", space="default", trials=5))
    db = tmp_path / "study.db"
    assert autotune.cli.main(["run", str(cfg), "--out", str(tmp_path / "r"), "--name", "sql",
                              "--storage", f"sqlite:///{db}", "--json"]) == 0
    study = optuna.load_study(study_name="sql", storage=f"sqlite:///{db}")
    assert study.metric_names == METRIC_NAMES and len(study.trials) == 5
