"""runfiles: the run directory's files, read and written in one place."""

import csv

from autotune.cli import main
from autotune.runfiles import CSV_COLUMNS, TrialRecord, fail_status_of, load_run, strategy_from_record, strategy_key
from autotune.strategy import KNOBS, Strategy


def test_trial_records_round_trip_the_written_rows(tmp_path):
    assert main(["run", "examples/tiny-cpu.yaml", "--backend", "simulate", "--out", str(tmp_path),
                 "--name", "r", "--json"]) == 0
    run = load_run(str(tmp_path / "r"))
    with open(tmp_path / "r" / "trials.csv", newline="") as fh:
        assert next(csv.reader(fh)) == CSV_COLUMNS
    assert run.trials and len(run.records) == len(run.trials)
    for row, rec in zip(run.trials, run.records):
        again = {k: "" if v is None else str(v) for k, v in rec.to_row().items()}
        assert again == row
    front = {rec.number for rec in run.records if rec.on_front}
    assert {p["trial"] for p in run.front["front"]} <= front


def test_a_recorded_strategy_has_the_identity_of_the_strategy():
    s = Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full", checkpoint_layers=3, reduce_bucket_size=500)
    as_csv = {k: "" if getattr(s, k) is None else str(getattr(s, k)) for k in KNOBS}
    assert strategy_from_record(as_csv) == s
    assert strategy_key(as_csv) == strategy_key(s.as_dict()) == s.key()
    assert strategy_key({**s.as_dict(), "micro_batch_size": 4.0}) == s.key()  # JSON may carry 4.0
    assert strategy_key({**as_csv, "zero_stage": "3"}) != s.key()


def test_partial_rows_read_as_missing_values():
    rec = TrialRecord.from_row({"number": "7", "state": "PRUNED", "prune_reason": "too big"})
    assert (rec.number, rec.state, rec.prune_reason, rec.fail_reason) == (7, "PRUNED", "too big", "")
    assert rec.peak_memory_gib is None and rec.predicted_fits is None and not rec.is_repeat
    assert TrialRecord.from_row({"number": "3", "state": "COMPLETE", "duplicate_of": "0"}).is_repeat


def test_fail_status_is_read_from_its_column():
    rec = TrialRecord.from_row({"number": "2", "state": "FAIL", "fail_status": "nan", "fail_reason": "oom: words"})
    assert (rec.fail_status, rec.fail_reason) == ("nan", "oom: words")  # the text is never parsed
    blank = TrialRecord.from_row({"number": "3", "state": "FAIL", "fail_status": "", "fail_reason": "oom: x"})
    assert blank.fail_status == ""
    assert TrialRecord.to_row(rec)["fail_status"] == "nan"


def test_files_without_the_fail_status_column_still_read():
    """trials.csv written before the column existed: the status is the known prefix of the reason."""
    assert fail_status_of({"state": "FAIL", "fail_reason": "oom: rank 0 in backward: CUDA out of memory"}) == "oom"
    assert fail_status_of({"state": "FAIL", "fail_reason": "timeout"}) == "timeout"
    assert fail_status_of({"state": "FAIL", "fail_reason": "weird: not a status"}) == ""
    assert fail_status_of({"state": "FAIL"}) == ""  # lost before it had a result
    assert fail_status_of({"state": "PRUNED", "prune_reason": "oom: not a failure"}) == ""


def test_a_failed_trial_keeps_its_status_through_trials_csv(tmp_path):
    """Failed evaluations (an OOM answered by a replay table written in the old format): the study
    holds the status as data, trials.csv has it in its own column and the reason text unchanged, and
    the file replays to the same answers."""
    import dataclasses

    from autotune.config import load_config
    from autotune.output import collect_rows, failure_summary, write_outputs
    from autotune.backends.replay import ReplayBackend
    from autotune.search import run_study
    from autotune.space import load_space

    cfg = load_config("examples/tiny-cpu.yaml")
    (tmp_path / "space.yaml").write_text("zero_stage: [0]\nmicro_batch_size: [1, 2]\ncheckpointing: [none]\n")
    space = load_space(str(tmp_path / "space.yaml"), precision=cfg.training.precision)
    ok, big = space.candidates(cfg.model)
    columns = ["number", "state", *KNOBS, "peak_memory_gib", "tokens_per_s_per_gpu", "fail_reason"]
    with open(tmp_path / "old.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerow({"number": 0, "state": "COMPLETE", **ok.as_dict(), "peak_memory_gib": 0.01,
                    "tokens_per_s_per_gpu": 9.0})
        w.writerow({"number": 1, "state": "FAIL", **big.as_dict(), "fail_reason": "oom: rank 1 in backward"})
    cfg = dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, replay_csv=str(tmp_path / "old.csv")))
    out = run_study(cfg, space, ReplayBackend(str(tmp_path / "old.csv")), storage=None, study_name="f", n_trials=2,
                    seed=0, sampler="nsga2", headroom=cfg.search.headroom, enqueue=[ok, big])
    (failed,) = [t for t in out.study.get_trials() if t.state.name == "FAIL"]
    assert (failed.user_attrs["fail_status"], failed.user_attrs["fail_reason"]) == ("oom", "oom: rank 1 in backward")
    assert failure_summary(collect_rows(out.study, space, cfg))["by_status"] == {"oom": 1}
    write_outputs(str(tmp_path / "run"), cfg, space, out.study, "replay")
    run = load_run(str(tmp_path / "run"))
    assert {(r.state, r.fail_status, r.fail_reason) for r in run.records} == {
        ("COMPLETE", "", ""), ("FAIL", "oom", "oom: rank 1 in backward")}
    again = ReplayBackend(str(tmp_path / "run" / "trials.csv")).evaluate(big)
    assert (again.status, again.reason) == ("oom", "rank 1 in backward")


def test_measured_routing_summary_covers_every_ep_trial_and_flags_an_under_stated_job():
    """front.json's measured_routing: the worst factors over the measured EP trials (largest upper factors,
    smallest least load), their error spans, and each factor measured beyond what the job sizes that trial's
    layout with; repeats, failures and trials without a routing do not count; none without an EP trial."""
    import os

    from autotune.config import load_config
    from autotune.output import TrialRow, measured_routing_lines, measured_routing_summary

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = load_config(os.path.join(root, "examples", "tiny-cpu-moe.yaml")).model

    def row(n, routing, err=6.0, at=-0.1, state="COMPLETE", dup=None):
        extra = {"memory_error_pct": err, "memory_error_at_routing_pct": at, **({"routing": routing} if routing else {})}
        return TrialRow(number=n, state=state, strategy=Strategy(engine="fsdp2", expert_parallel_size=2),
                        peak_memory_gib=1.0, tokens_per_s_per_gpu=1.0, step_time_s=1.0, mfu=None, prune_reason="",
                        fail_reason="", duplicate_of=dup, measured=extra)

    a = {"moe_load_imbalance": 1.4, "moe_min_load": 0.5, "ep_rank_imbalance": 1.1, "ep_step_imbalance": 1.05}
    b = {"moe_load_imbalance": 1.5, "moe_min_load": 0.6, "ep_rank_imbalance": 1.2, "ep_step_imbalance": 1.0}
    rows = [row(0, a, 5.0, -0.2), row(1, b, 7.0, 0.3), row(2, {**b, "ep_rank_imbalance": 9.0}, dup=1),
            row(3, {**b, "ep_rank_imbalance": 9.0}, state="FAIL"), row(4, None)]
    s = measured_routing_summary(rows, model)
    assert s["trials"] == [0, 1] and s["memory_error_pct"] == [5.0, 7.0] and s["memory_error_at_routing_pct"] == [-0.2, 0.3]
    assert s["factors"] == {"moe_load_imbalance": 1.5, "moe_min_load": 0.5, "ep_rank_imbalance": 1.2,
                            "ep_step_imbalance": 1.05}
    assert s["exceeds"] == {}  # the defaults (every token: 2 / 0 / 2 / 2 with 4 experts, top-2, EP 2) bound them
    stated = model.replace(moe_load_imbalance=1.45, moe_min_load=0.55, ep_rank_imbalance=1.2, ep_step_imbalance=1.1)
    assert measured_routing_summary(rows, stated)["exceeds"] == {
        "moe_load_imbalance": {"measured": 1.5, "sized": 1.45}, "moe_min_load": {"measured": 0.5, "sized": 0.55}}
    lines = measured_routing_lines(measured_routing_summary(rows, stated))
    assert "WARNING" in lines[1] and "moe_load_imbalance 1.5 against 1.45" in lines[1]
    assert lines[-5:] == ["    model:", "      moe_load_imbalance: 1.5", "      moe_min_load: 0.5",
                          "      ep_rank_imbalance: 1.2", "      ep_step_imbalance: 1.05"]
    assert measured_routing_summary([row(4, None)], model) is None and measured_routing_lines(None) == []


def test_a_front_with_expert_parallel_points_at_the_default_routing_says_so():
    """front.json's assumed_routing: the front's EP points, with the factors the job leaves unstated; none
    without an EP point on the front or once every factor is stated; its line names the unstated keys."""
    import os

    from autotune.config import load_config
    from autotune.output import assumed_routing_lines, assumed_routing_summary

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = load_config(os.path.join(root, "examples", "tiny-cpu-moe.yaml")).model
    points = [{"trial": 3, "strategy": {"expert_parallel_size": 1}}, {"trial": 5, "strategy": {"expert_parallel_size": 2}}]
    s = assumed_routing_summary(points, model)
    assert s["trials"] == [5] and s["unstated"] == ["moe_load_imbalance", "moe_min_load", "ep_rank_imbalance",
                                                    "ep_step_imbalance"]
    (line,) = assumed_routing_lines(s)
    assert line.startswith("expert-parallel points (1 on the front) are sized at autotune's default routing") and (
        "(moe_load_imbalance, moe_min_load, ep_rank_imbalance, ep_step_imbalance)" in line)
    partly = model.replace(moe_load_imbalance=1.5, ep_rank_imbalance=1.2)
    assert assumed_routing_summary(points, partly)["unstated"] == ["moe_min_load", "ep_step_imbalance"]
    assert assumed_routing_summary(points, partly.replace(moe_min_load=0.5, ep_step_imbalance=1.1)) is None
    assert assumed_routing_summary(points[:1], model) is None and assumed_routing_lines(None) == []
