"""The script backend (profile.backend: script): the user's own training command per trial, its
failures (crash, no result, hang, out of memory) as failed trials with their reason, the callbacks'
result records, a bad profile.command as one line, and both example scripts profiled for real."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.backends.factory import make_backend
from autotune.backends.script_command import PLACEHOLDERS, RESULT_ENV, expand
from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.strategy import Strategy
from autotune.worker.protocol import WorkerResult

ROOT = Path(__file__).resolve().parents[2]
JOB = """\
model:
  preset: tiny-llama
training:
  seq_len: 64
  global_batch_size: 4
  precision: fp32
hardware:
  gpu: {{name: cpu, memory_gib: 4, peak_tflops_fp16: 0.2, peak_tflops_fp32: 0.1, hbm_bandwidth_gbps: 20}}
  gpus_per_node: 1
  cuda_context_gib: 0
  allocator_slack: 0
profile:
  backend: script
  command: {command}
  warmup_steps: 1
  measure_steps: 2
  timeout_s: {timeout}
"""


def job(tmp_path: Path, command: str, timeout: float = 60, script: str = "") -> Path:
    if script:
        (tmp_path / "train.py").write_text(textwrap.dedent(script))
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(command=json.dumps(command), timeout=timeout))
    return path


def evaluate(tmp_path: Path, script: str, timeout: float = 60):
    cfg = load_config(str(job(tmp_path, "{python} train.py --args {trainer_args} --out {trial_dir}", timeout,
                              script)))
    backend = make_backend("script", cfg, str(tmp_path / "run"))
    return backend.evaluate(Strategy(zero_stage=1, micro_batch_size=2), 0)


def test_a_crashing_script_is_a_failed_trial_with_its_error(tmp_path):
    m = evaluate(tmp_path, "raise RuntimeError('the data pipeline broke')\n")
    assert m.status == "crash"
    assert "exited with status 1" in m.reason and "RuntimeError: the data pipeline broke" in m.reason
    assert m.extra["loop"] == "the training script's own loop"


def test_a_script_without_the_callback_is_a_failed_trial_saying_so(tmp_path):
    m = evaluate(tmp_path, "import sys, json\njson.load(open(sys.argv[2]))\n")  # reads its args, trains, no callback
    assert m.status == "crash" and "without writing a result" in m.reason and "callback" in m.reason


def test_a_hanging_script_is_killed_at_the_timeout(tmp_path):
    import time

    t0 = time.monotonic()
    m = evaluate(tmp_path, "import time\ntime.sleep(600)\n", timeout=3)
    assert m.status == "timeout" and "process group killed" in m.reason
    assert time.monotonic() - t0 < 60


def test_an_out_of_memory_script_is_an_oom_trial(tmp_path):
    m = evaluate(tmp_path, "raise MemoryError('cannot allocate 80 GiB')\n")
    assert m.status == "oom" and "MemoryError" in m.reason


def test_the_script_gets_the_point_files_and_the_result_path(tmp_path):
    # the script checks its files with the libraries' own loaders and writes a result record by hand
    m = evaluate(tmp_path, f"""
        import json, os, sys
        args = json.load(open(sys.argv[2]))
        ds = json.load(open(args["deepspeed"]))
        assert args["per_device_train_batch_size"] == 2 and ds["zero_optimization"]["stage"] == 1
        assert ds["train_micro_batch_size_per_gpu"] == "auto"
        out = os.environ["{RESULT_ENV}"]
        assert os.path.dirname(out) == sys.argv[4] and os.environ["AUTOTUNE_MEASURED_STEPS"] == "2"
        json.dump({{"status": "ok", "peak_allocated_bytes": 1000, "step_times_s": [0.5, 0.5],
                   "tokens_per_s": 512.0, "world_size": 1}}, open(out, "w"))
    """)
    assert m.ok and m.peak_memory_bytes == 1000 and m.tokens_per_s_per_gpu == 512.0
    assert m.extra["predicted_peak_bytes"] > 0 and m.extra["memory_error_pct"] is not None


def test_a_placeholder_this_point_has_no_file_for_is_an_error_trial(tmp_path):
    cfg = load_config(str(job(tmp_path, "{python} train.py --fsdp2 {fsdp2_config}", script="pass\n")))
    m = make_backend("script", cfg, str(tmp_path / "run")).evaluate(Strategy(zero_stage=1), 0)
    assert m.status == "error" and "{fsdp2_config}" in m.reason and "deepspeed point" in m.reason


@pytest.mark.parametrize("command,message", [
    ("{python} train.py {deepspeed}", "unknown placeholder {deepspeed}"),
    ("{python} train.py {trainer_args", "bad placeholder braces"),
    ("{python} 'train.py", "cannot split"),
    ("", "non-empty"),
])
def test_a_bad_command_is_one_line_naming_profile_command(tmp_path, command, message):
    path = job(tmp_path, command)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert "profile.command" in str(err.value) and message in str(err.value)
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", str(path), "--out", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "profile.command" in proc.stderr and "Traceback" not in proc.stderr


def test_backend_script_needs_a_command(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(command='"x"', timeout=5).replace('  command: "x"\n', ""))
    with pytest.raises(ConfigError, match="profile.command"):
        load_config(str(path))


def test_expand_quotes_values_and_names_missing_ones():
    assert expand("{python} t.py --args {trainer_args}", {"python": "/usr/bin/python3", "trainer_args": "a b.json"}) \
        == ["/usr/bin/python3", "t.py", "--args", "a b.json"]
    with pytest.raises(KeyError):
        expand("{deepspeed_config}", {})
    assert "deepspeed_config" in PLACEHOLDERS and "trainer_args" in PLACEHOLDERS


def test_the_meter_writes_a_worker_result_and_stops(tmp_path):
    """The callbacks' core on a real torch loop on the CPU: the record parses with WorkerResult, its
    peak covers the model's parameters, gradients and Adam states, and it stops after 1 + 2 steps."""
    code = textwrap.dedent(f"""
        import json, sys
        from autotune.callbacks._meter import StepMeter
        import torch
        meter = StepMeter("test", result_path=sys.argv[1], warmup_steps=1, measure_steps=2, tokens_per_step=256)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
        opt = torch.optim.Adam(model.parameters())
        for step in range(10):
            meter.step_begin()
            loss = model(torch.randn(64, 256)).square().mean()
            meter.mark("backward")
            loss.backward()
            meter.mark("optimizer")
            opt.step(); opt.zero_grad(set_to_none=False)
            if meter.step_end(loss.item()):
                break
        print(step)
    """)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, RESULT_ENV: str(out)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "2"  # stopped after warm-up 1 + measured 2
    r = WorkerResult.from_json(json.loads(out.read_text()))
    assert r.status == "ok" and r.device == "cpu" and len(r.step_times_s) == 2 and r.tokens_per_s > 0
    params = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4
    assert r.peak_allocated_bytes >= 4 * params  # weights, gradients, Adam's two moments
    # plus Adam's per-parameter temporaries (at most all of them once) and the activations (under 1 MiB)
    assert r.peak_allocated_bytes < 5 * params + (1 << 20)
    assert len(r.step_peaks_bytes) == 2 and r.peak_phase in ("forward", "backward", "optimizer")
    assert not r.other


@pytest.mark.slow
# each example as the README runs it (--trials 2)
@pytest.mark.parametrize("example,engine,trials", [("hf-trainer-script", "deepspeed", 2), ("lightning-script", "fsdp2", 2)])
def test_the_example_scripts_are_profiled_for_real(tmp_path, example, engine, trials):
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", str(ROOT / "examples" / f"{example}.yaml"),
                           "--trials", str(trials), "--out", str(tmp_path), "--name", "r"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "r"
    rows = [r for r in csv.DictReader(open(run / "trials.csv")) if r["state"] == "COMPLETE"]
    assert len(rows) == trials
    for row in rows:
        m = json.loads((run / "trials" / row["number"] / "measurement.json").read_text())
        assert m["status"] == "ok" and m["extra"]["loop"] == "the training script's own loop"
        assert m["extra"]["launcher"] == "script" and m["tokens_per_s_per_gpu"] > 0
        result = WorkerResult.from_json(json.loads((run / "trials" / row["number"] / "result.json").read_text()))
        assert result.model_source in ("script:hf_trainer", "script:lightning")
        assert json.loads((run / "trials" / row["number"] / "job.json").read_text())["strategy"]["engine"] == engine
        # the memory model predicts the script's peak: never under, at most 20% over (tiny model, trainer overheads)
        error = m["extra"]["predicted_peak_bytes"] / m["peak_memory_bytes"] - 1
        assert -0.02 <= error <= 0.20, (row["strategy"], error)
    assert "measured in your script" in (run / "report.html").read_text()


def test_backend_script_on_the_command_line_needs_a_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "autotune", "run", str(ROOT / "examples" / "tiny-cpu.yaml"),
                           "--backend", "script", "--out", str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "profile.command" in proc.stderr and not list((tmp_path / "runs").glob("*"))  # no run folder
