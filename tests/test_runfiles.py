"""runfiles: the run directory's files, read and written in one place."""

import csv

from autotune.cli import main
from autotune.runfiles import CSV_COLUMNS, TrialRecord, load_run, strategy_from_record, strategy_key
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
