"""`autotune run` on the simulate backend: a real Optuna study on real storage."""

import csv
import json
import os
import re
import subprocess
import sys

import optuna
import pytest

from autotune.cli import main
from autotune.config import load_config
from autotune.pareto import dominates, hypervolume, pareto_front
from autotune.search import predicted_front, screen
from autotune.space import load_space
from autotune.storage import make_storage
from autotune.strategy import Strategy
from autotune.output import EQUIVALENCE_TOLERANCE
from conftest import EXAMPLES

LLAMA = os.path.join(EXAMPLES, "llama2-7b.yaml")
LLAMA_1GPU = os.path.join(EXAMPLES, "llama2-7b-1gpu.yaml")


def run(args, capsys=None):
    code = main(["run", *args])
    return code


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["run", LLAMA, "--out", str(out), "--name", "a", "--json"]) == 0
    return out / "a"


def load_front(run_dir):
    with open(run_dir / "front.json") as fh:
        return json.load(fh)


def test_outputs_written(llama_run):
    for name in ("study.journal", "run.json", "trials.csv", "front.json", "summary.md", "best.json",
                 "best_ds_config.json"):
        assert (llama_run / name).is_file(), name
    front = load_front(llama_run)
    assert front["front"], "llama2-7b fits on 8 x A100-80GB with ZeRO"
    engines = set()
    for k, point in enumerate(front["front"]):
        engines.add(point["strategy"]["engine"])
        if point["strategy"]["engine"] == "fsdp2":  # the FSDP2 layout and its snippet
            assert point["ds_config"] is None and point["fsdp2_config"] == f"fsdp2_configs/{k}.json"
            layout = json.loads((llama_run / point["fsdp2_config"]).read_text())
            assert layout["micro_batch_size"] == point["strategy"]["micro_batch_size"]
            assert (llama_run / point["fsdp2_snippet"]).is_file() and point["launch"].startswith("torchrun")
            continue
        assert point["ds_config"] == f"ds_configs/{k}.json"
        ds = json.loads((llama_run / point["ds_config"]).read_text())
        assert ds["train_micro_batch_size_per_gpu"] == point["strategy"]["micro_batch_size"]
        assert f"--deepspeed {os.path.abspath(llama_run / point['ds_config'])} " in point["launch"]  # absolute
    # one front over both engines: the default space's FSDP2 candidates were evaluated and each is
    # on the front or matched there (memory the GPU must hold, tokens/s) within the 1% resolution
    rows = list(csv.DictReader(open(llama_run / "trials.csv")))
    fsdp2 = [(float(r["gpu_memory_gib"]), float(r["tokens_per_s_per_gpu"])) for r in rows
             if r["state"] == "COMPLETE" and r["engine"] == "fsdp2"]
    assert len(fsdp2) >= 10 and "deepspeed" in engines
    pts = [(p["gpu_memory_gib"], p["tokens_per_s_per_gpu"]) for p in front["front"]]
    tol = EQUIVALENCE_TOLERANCE
    assert all(any(q[0] <= m * (1 + tol) and q[1] >= t * (1 - tol) for q in pts) for m, t in fsdp2)
    mems = [p["gpu_memory_gib"] for p in front["front"]]
    assert mems == sorted(mems)
    speeds = [p["tokens_per_s_per_gpu"] for p in front["front"]]
    assert speeds == sorted(speeds), "no listed point needs more memory than a faster one"
    best = json.loads((llama_run / "best.json").read_text())
    assert best["tokens_per_s_per_gpu"] == max(p["tokens_per_s_per_gpu"] for p in front["front"])


def test_front_is_true_pareto_front_and_matches_brute_force(llama_run):
    front = load_front(llama_run)["front"]
    # drawn on what the GPU must hold (gpu_memory_gib, the figure fits checks and users read)
    pts = [(p["gpu_memory_gib"], p["tokens_per_s_per_gpu"]) for p in front]
    assert not any(dominates(a, b) for a in pts for b in pts)
    # Every completed trial is dominated by (or equal to) some front point, at measurement resolution.
    rows = list(csv.DictReader(open(llama_run / "trials.csv")))
    done = [(float(r["gpu_memory_gib"]), float(r["tokens_per_s_per_gpu"])) for r in rows if r["state"] == "COMPLETE"]
    tol = EQUIVALENCE_TOLERANCE
    for p in done:
        assert any(q[0] <= p[0] * (1 + tol) and q[1] >= p[1] * (1 - tol) for q in pts), p
    # Brute force over the whole default space with the same models: the study found every point of
    # the exact front (the strict front of its trials), and front.json keeps them at 1% resolution.
    cfg = load_config(LLAMA)
    brute = predicted_front(screen(cfg, load_space("default"), cfg.search.headroom))
    brute_pts = [(s.memory.total_gpu_bytes / 2**30, s.tokens_per_s_per_gpu) for s in brute]
    ref = (cfg.hardware.gpu.memory_bytes / 2**30, 0.0)
    assert hypervolume(pts, ref) >= 0.99 * hypervolume(brute_pts, ref)
    strict = [done[i] for i in pareto_front(done)]
    assert sorted(strict) == sorted(brute_pts)
    listed = {json.dumps(q["strategy"], sort_keys=True) for p in front for q in (p, *p["equivalents"])}
    assert listed <= {json.dumps(s.strategy.as_dict(), sort_keys=True) for s in brute}
    assert len(front) < len(brute)  # near-identical points were merged or dropped


def test_collapse_front_merges_and_drops_only_unresolvable_differences():
    from autotune.output import TrialRow, collapse_front

    def row(n, mem, tps):
        return TrialRow(n, "COMPLETE", Strategy(micro_batch_size=n + 1), mem, tps, None, None, "", "", None)

    a, twin = row(0, 10.0, 100.0), row(1, 10.05, 100.5)          # within 1% in both: one point
    b, b_bucket = row(2, 20.0, 150.0), row(3, 20.9, 150.6)        # +4.5% memory for +0.4% speed: dropped
    c_sel, c = row(4, 29.99, 160.0), row(5, 30.0, 170.0)          # -0.03% memory for -6% speed: dropped
    d, d_more = row(6, 40.0, 180.0), row(7, 50.0, 181.0)         # +6% speed: kept; then +0.6% for 25%: dropped
    groups = collapse_front([a, twin, b, b_bucket, c_sel, c, d, d_more])
    assert [(rep.number, [e.number for e in eq]) for rep, eq in groups] == [(1, [0]), (2, []), (5, []), (6, [])]


def test_study_is_real_and_consistent(llama_run):
    meta = json.loads((llama_run / "run.json").read_text())
    study = optuna.load_study(study_name=meta["name"], storage=make_storage(meta["storage"]))
    assert study.metric_names == ["peak_memory_gib", "tokens_per_s_per_gpu"]
    trials = study.get_trials(deepcopy=False)
    evaluated = [t for t in trials if t.state.name in ("COMPLETE", "FAIL") and "duplicate_of" not in t.user_attrs]
    assert len(evaluated) == 200  # --trials counts evaluations; pruned candidates and repeats are extra
    assert len(trials) > 200
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned and all(t.user_attrs["prune_reason"] for t in pruned)
    # the memory constraint is set on every trial, and is violated on memory-pruned ones
    assert all("constraints:gpu_memory" in t.system_attrs for t in trials)
    assert any(t.system_attrs["constraints:gpu_memory"] > 0 for t in pruned)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert all(t.system_attrs["constraints:gpu_memory"] <= 0 for t in complete)
    # no strategy evaluated twice: repeats carry duplicate_of and reuse the first result
    rows = list(csv.DictReader(open(llama_run / "trials.csv")))
    firsts = [r for r in rows if not r["duplicate_of"]]
    assert len({r["strategy"] + r["reduce_bucket_size"] for r in firsts}) == len(firsts)
    for r in rows:
        if r["duplicate_of"]:
            first = rows[int(r["duplicate_of"])]
            assert (r["state"], r["tokens_per_s_per_gpu"]) == (first["state"], first["tokens_per_s_per_gpu"])
    assert study.user_attrs["num_candidates"] >= 1000


def test_same_name_is_never_overwritten_and_resume_continues(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["run", LLAMA, "--out", out, "--name", "r", "--trials", "15", "--json"]) == 0
    before = (tmp_path / "r" / "study.journal").stat().st_size
    assert main(["run", LLAMA, "--out", out, "--name", "r", "--trials", "5"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "r" / "study.journal").stat().st_size == before
    assert main(["run", LLAMA, "--out", out, "--name", "r", "--trials", "25", "--resume", "--json"]) == 0  # the new total
    study = optuna.load_study(study_name="r", storage=make_storage(str(tmp_path / "r" / "study.journal")))
    evaluated = [t for t in study.trials if t.state.name == "COMPLETE" and "duplicate_of" not in t.user_attrs]
    assert len(evaluated) == 25
    first15 = [t.params for t in evaluated[:15]]
    assert len({str(p) for p in first15 + [t.params for t in evaluated[15:]]}) == 25  # resumed, not repeated
    assert main(["run", LLAMA, "--out", out, "--name", "nope", "--resume"]) == 2


def test_seeded_runs_are_reproducible(tmp_path):
    fronts = []
    for name in ("s1", "s2"):
        assert main(["run", LLAMA, "--out", str(tmp_path), "--name", name, "--trials", "40", "--seed", "3",
                     "--json"]) == 0
        rows = list(csv.DictReader(open(tmp_path / name / "trials.csv")))
        fronts.append([(r["strategy"], r["state"]) for r in rows])
    assert fronts[0] == fronts[1]


def test_seed_examples(tmp_path):
    """The seed's point: 7B full fine-tuning does not fit one A100-80GB without offload."""
    cfg = load_config(LLAMA_1GPU)
    screened = screen(cfg, load_space("default"), cfg.search.headroom)
    no_offload = [s for s in screened if s.strategy.offload_optimizer == "none" and
                  s.strategy.offload_params == "none"]
    assert no_offload and not any(s.memory.fits for s in no_offload)
    assert all(s.memory.reasons for s in no_offload)
    offloaded = [s for s in screened if s.memory.fits]
    assert offloaded and all(s.strategy.offload_optimizer != "none" for s in offloaded)
    assert any(s.strategy.zero_stage == 3 and s.strategy.offload_params == "cpu" for s in offloaded)
    # on 8 GPUs, ZeRO without any offload fits
    cfg8 = load_config(LLAMA)
    assert any(s.memory.fits and s.strategy.zero_stage > 0 and s.strategy.offload_optimizer == "none"
               for s in screen(cfg8, load_space("no-offload"), cfg8.search.headroom))


def test_simulate_path_does_not_import_torch(tmp_path):
    code = ("import sys; from autotune.cli import main; "
            f"rc = main(['run', {LLAMA!r}, '--out', {str(tmp_path)!r}, '--trials', '5', '--json']); "
            "assert rc == 0; bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_failed_trial_status_is_read_as_data():
    """claim.fail_status reads the fail_status attr, or a study written before that attr existed (the
    measurement's status), never the reason text; a trial lost after its measurement has no result."""
    from optuna.trial import TrialState, create_trial

    from autotune.claim import fail_status, has_result

    def trial(state, **attrs):
        return create_trial(state=state, values=[1.0, 2.0] if state == TrialState.COMPLETE else None, user_attrs=attrs)

    new = trial(TrialState.FAIL, fail_status="nan", fail_reason="oom: words are for people")
    old = trial(TrialState.FAIL, fail_reason="timeout: no step", measurement={"status": "timeout"})
    lost = trial(TrialState.FAIL, measurement={"status": "oom"})
    assert [fail_status(t) for t in (new, old, lost)] == ["nan", "timeout", "oom"]
    assert [has_result(t) for t in (new, old, lost)] == [True, True, False]
    assert fail_status(trial(TrialState.FAIL, fail_reason="oom: a repeat of an old trial")) == ""
    assert fail_status(trial(TrialState.COMPLETE, measurement={"status": "ok"})) == ""


def test_sweep_sampler_evaluates_every_fitting_candidate_once(tmp_path):
    """--sampler sweep (how the measured tables are made): each candidate that fits is evaluated
    exactly once, then the run ends by itself however large --trials is."""
    src = os.path.join(os.path.dirname(EXAMPLES), "data", "measured", "tiny-llama-1rank")
    text = open(os.path.join(src, "config.yaml")).read()
    text = re.sub(r"memory_gib: [0-9.]+", "memory_gib: 0.014", text)
    (tmp_path / "c.yaml").write_text(text)
    (tmp_path / "space.yaml").write_text(open(os.path.join(src, "space.yaml")).read())
    cfg = load_config(str(tmp_path / "c.yaml"))
    screened = screen(cfg, load_space(str(tmp_path / "space.yaml")), cfg.search.headroom)
    fits = {s.strategy.key() for s in screened if s.memory.fits}
    assert 0 < len(fits) < len(screened)  # some candidates are pruned, some run
    assert main(["run", str(tmp_path / "c.yaml"), "--backend", "simulate", "--trials", "500", "--sampler", "sweep",
                 "--out", str(tmp_path), "--name", "sw", "--json"]) == 0
    rows = [r for r in csv.DictReader(open(tmp_path / "sw" / "trials.csv")) if r["state"] == "COMPLETE"]
    assert len(rows) == len({r["strategy"] for r in rows}) == len(fits)


def test_an_fsdp2_only_front_writes_no_deepspeed_folder(tmp_path, capsys):
    """The run's config folders are those its front uses: an FSDP2-only space leaves no empty ds_configs/."""
    example = os.path.join(EXAMPLES, "tiny-cpu-fsdp2.yaml")
    assert main(["run", example, "--backend", "simulate", "--out", str(tmp_path), "--name", "f"]) == 0
    files = [line for line in capsys.readouterr().out.splitlines() if line.startswith("files:")]
    assert files and "fsdp2_configs/" in files[0] and "ds_configs/" not in files[0]
    assert (tmp_path / "f" / "fsdp2_configs").is_dir() and not (tmp_path / "f" / "ds_configs").exists()
    assert "fsdp2_configs/," in (tmp_path / "f" / "report.html").read_text()
