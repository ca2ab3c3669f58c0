"""WorkerJob / WorkerResult: the launcher <-> worker JSON, typed, in the same format."""

import dataclasses
import re

import pytest

import autotune.worker.main as worker
from autotune.config import load_config
from autotune.backends.profiled import DeepSpeedBackend
from autotune.worker.protocol import WorkerJob, WorkerResult
from autotune.strategy import Strategy


def _documented_keys(section: str) -> set[str]:
    """The top-level keys the worker's docstring lists for its job or result JSON."""
    doc = worker.__doc__
    start = doc.index(section)
    body = doc[doc.index("{", start) + 1:doc.index("\n    }\n", start)]
    keys = set()
    for line in body.splitlines():
        if not line.startswith('      "'):
            continue  # comment continuation lines and nested values
        code = line.split("  #")[0]
        while re.search(r"\{[^{}]*\}", code):
            code = re.sub(r"\{[^{}]*\}", "", code)  # nested objects' keys are not top-level keys
        keys.update(re.findall(r'"(\w+)":', code))
    return keys


def test_every_documented_key_is_a_field():
    job_fields = {f.name for f in dataclasses.fields(WorkerJob)}
    result_fields = {f.name for f in dataclasses.fields(WorkerResult)} - {"other"}
    assert _documented_keys("Job JSON") == job_fields
    assert _documented_keys("Result JSON") == result_fields


def test_job_json_round_trips_and_leaves_defaults_to_the_worker(tmp_path):
    cfg = load_config("examples/tiny-cpu.yaml")
    backend = DeepSpeedBackend(cfg, str(tmp_path / "run"), snapshot_trial=3)
    job = backend.job_for(Strategy(zero_stage=2, micro_batch_size=2), tmp_path / "3", 3)
    assert list(job)[:3] == ["model", "training", "strategy"]
    assert "snapshot" in job and "loop" not in job and "gc_collect" not in job and "fresh_batches" not in job
    assert WorkerJob.from_json(job).to_json() == job
    with pytest.raises(ValueError, match="unknown job key"):
        WorkerJob.from_json({**job, "bogus": 1})


def test_result_keeps_unknown_keys_and_reads_partial_files():
    raw = {"status": "oom", "phase": "backward", "reason": "OutOfMemoryError", "rank": 1, "new_key": [1]}
    r = WorkerResult.from_json(raw)
    assert (r.status, r.phase, r.rank, r.tokens_per_s) == ("oom", "backward", 1, None)
    assert r.to_json() == raw
    assert WorkerResult.from_json({}).status is None


def test_a_left_out_setting_reads_as_the_workers_default():
    job = WorkerJob(model={}, training={}, strategy={}, seed=7)
    assert job.setting("seed") == 7 and job.setting("measure_steps") == 2 and job.setting("loop") == "keep_outputs"
    assert job.setting("snapshot") is None
