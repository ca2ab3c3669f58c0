"""The profile backend for real: launched process groups, real DeepSpeed engines on the CPU (gloo).

Slow tests (each a few seconds to ~15 s on 2 cores). Fast ones check the pure parts: command
lines, failure precedence, bounded logs, make_backend without torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from autotune.config import load_config
from autotune.backends.factory import make_backend
from autotune.backends.launch import LaunchResult, _BoundedPump, alive, build_command, failure_of, launch
from autotune.strategy import Strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny-cpu.yaml")


def tiny_cfg(nproc: int = 1, *, timeout_s: float = 120.0, launcher: str = "torchrun", **training):
    cfg = load_config(TINY)
    return dataclasses.replace(
        cfg, hardware=dataclasses.replace(cfg.hardware, gpus_per_node=nproc),
        training=dataclasses.replace(cfg.training, **training),
        profile=dataclasses.replace(cfg.profile, timeout_s=timeout_s, launcher=launcher, warmup_steps=1,
                                    measure_steps=2))


def backend(cfg, tmp_path, **kw):
    from autotune.backends.profiled import DeepSpeedBackend

    return DeepSpeedBackend(cfg, str(tmp_path / "run"), device="cpu", **kw)


def script(tmp_path, body: str) -> str:
    path = tmp_path / "fake_worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def assert_nothing_left(m_or_res) -> None:
    launch_id = getattr(m_or_res, "launch_id", None) or m_or_res.extra["launch_id"]
    pid = getattr(m_or_res, "pid", None) or m_or_res.extra["launcher_pid"]
    assert alive(launch_id, pid) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


# ---------------------------------------------------------------- fast


def test_make_backend_profile_does_not_import_torch():
    code = ("import sys, autotune.cli, autotune.backends.factory as b; from autotune.config import load_config; "
            f"b.make_backend('profile', load_config({TINY!r}), '/tmp/x'); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_make_backend_unknown_and_replay_without_csv():
    from autotune.errors import ConfigError

    cfg = load_config(TINY)
    with pytest.raises(ConfigError, match="expected one of simulate, profile, replay"):
        make_backend("magic", cfg, "/tmp/x")
    with pytest.raises(ConfigError, match="replay_csv"):
        make_backend("replay", cfg, "/tmp/x")


def test_profile_is_the_engine_neutral_name_and_an_fsdp2_job_has_no_deepspeed_config(tmp_path):
    from autotune.config import BACKENDS
    from autotune.backends.profiled import DeepSpeedBackend

    assert BACKENDS == ("simulate", "profile", "replay", "script")
    cfg = load_config(TINY)
    assert type(make_backend("profile", cfg, str(tmp_path))) is DeepSpeedBackend
    b = DeepSpeedBackend(cfg, str(tmp_path))
    fsdp2 = b.job(Strategy(engine="fsdp2", micro_batch_size=2), tmp_path)
    assert fsdp2.deepspeed_config is None and fsdp2.strategy["engine"] == "fsdp2"
    assert "deepspeed_config" not in fsdp2.to_json()
    assert b.job(Strategy(zero_stage=2, micro_batch_size=2), tmp_path).deepspeed_config["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("command", ["run", "worker"])
def test_backend_deepspeed_is_refused_in_one_line_with_the_name_to_use(command, capsys):
    """``deepspeed`` is an engine and a launcher, not a backend: one line naming --backend, exit 2."""
    from autotune.cli import main

    argv = ([command, TINY] if command == "run" else [command, "--storage", "sqlite:///x.db", "--study", "s"])
    assert main(argv + ["--backend", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autotune: error: --backend: "), err
    assert "use profile" in err[0]


def test_profile_backend_deepspeed_in_a_job_file_is_refused_naming_the_key(tmp_path):
    from autotune.errors import ConfigError

    text = open(TINY).read().replace("backend: profile", "backend: deepspeed")
    assert "backend: deepspeed" in text
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(job))
    assert "profile.backend" in str(err.value) and "use profile" in str(err.value)
    assert "\n" not in str(err.value)


def test_capabilities_not_names_decide(tmp_path):
    """The auto sampler, the in-memory study, the outputs' 'predicted' and the install check read the
    backend's class attributes: a backend of another name that measures gets ehvi."""
    from autotune.backends.base import Backend, SimulateBackend
    from autotune.backends.factory import backend_class
    from autotune.search import run_study
    from autotune.space import space_for

    cfg = load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))

    class Measuring(SimulateBackend):
        name = "lab-bench"
        measures = True

    class Predicting(Backend):
        name = "profile"  # the name of a measuring backend, but it predicts
        measures = False

        def __init__(self):
            self.inner = SimulateBackend(cfg.model, cfg.training, cfg.hardware)

        def evaluate(self, strategy, trial_number=None):
            return self.inner.evaluate(strategy, trial_number)

    def sampler_of(backend):
        out = run_study(cfg, space_for(cfg), backend, storage=None, study_name="c", n_trials=2, seed=0,
                        sampler="auto", headroom=0.05)
        return type(out.study.sampler).__name__

    assert sampler_of(Measuring(cfg.model, cfg.training, cfg.hardware)) == "FrontSampler"
    assert sampler_of(Predicting()) == "NSGAIISampler"
    assert [backend_class(n).measures for n in ("simulate", "profile", "replay")] == [False, True, True]
    assert [backend_class(n).in_memory_study for n in ("simulate", "profile", "replay")] == [True, False, True]
    assert [backend_class(n).launches_workers for n in ("simulate", "profile", "replay")] == [False, True, False]
    names = ("simulate", "profile", "replay", "script")
    assert [backend_class(n).builds_model for n in names] == [False, True, False, False]


def test_build_command_launchers():
    cmd = build_command("torchrun", 2, "/j/job.json")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert cmd[-3:] == ["-m", "autotune.backends.launch", "/j/job.json"]
    ds = build_command("deepspeed", 4, "/j/job.json", master_port=1234)
    assert ["--num_gpus", "4"] == ds[ds.index("--num_gpus"):ds.index("--num_gpus") + 2]
    assert ds[ds.index("--hostfile") + 1] == os.devnull  # one node: never /job/hostfile, no ssh
    multi = build_command("deepspeed", 8, "/j/job.json", num_nodes=2, hostfile="/h", master_addr="n0")
    assert multi[multi.index("--hostfile") + 1] == "/h" and multi[multi.index("--num_nodes") + 1] == "2"
    with pytest.raises(ValueError, match="hostfile"):
        build_command("deepspeed", 8, "/j", num_nodes=2)
    with pytest.raises(ValueError, match="unknown launcher"):
        build_command("mpirun", 1, "/j")


def _res(**kw) -> LaunchResult:
    base = dict(nproc=2, returncode=1, timed_out=False, elapsed_s=3.0, log_dir="/x")
    base.update(kw)
    return LaunchResult(**base)


def test_failure_precedence():
    ok = {"status": "ok"}
    assert failure_of(_res(returncode=0, results={0: ok, 1: ok})) is None
    # a structured OOM beats the timeout it caused on the other rank
    r = _res(timed_out=True, results={1: {"status": "oom", "phase": "backward", "reason": "OutOfMemoryError: x"}})
    assert failure_of(r) == ("oom", "rank 1 in backward: OutOfMemoryError: x")
    # the rank that segfaulted is the cause, not the one the launcher then terminated
    r = _res(exits={0: {"returncode": -15, "signal": "SIGTERM"}, 1: {"returncode": -11, "signal": "SIGSEGV"}})
    assert failure_of(r) == ("crash", "rank 1 killed by SIGSEGV before writing a result")
    r = _res(exits={0: {"returncode": 3, "signal": None}})
    assert failure_of(r)[1] == "rank 0 exited with status 3 without a result"
    r = _res(timed_out=True, elapsed_s=7.2, exits={0: {"returncode": -15, "signal": "SIGTERM"}})
    assert failure_of(r) == ("timeout", "no result after 7 s; process group killed")
    assert failure_of(_res(returncode=-9))[1] == "launcher killed by SIGKILL; no result from rank(s) 0, 1"


def test_an_ep_measurement_states_its_ranks_routing(tmp_path):
    """An expert-parallel trial's Measurement: both ranks' measured dispatches pooled into the factors a job
    states (memory.expert_parallel.measured_routing), the peak predicted with them stated (below the
    defaults' bounds here) and its error; a rank without a routing adds none, a non-EP trial no key."""
    from autotune.backends.base import MEMORY_ERROR_AT_ROUTING_KEY, PREDICTED_AT_ROUTING_KEY, PREDICTED_PEAK_KEY, ROUTING_KEY
    from autotune.memory.expert_parallel import measured_routing

    pytest.importorskip("transformers")
    cfg = load_config(os.path.join(ROOT, "examples", "tiny-cpu-moe.yaml"))
    sent = 2 * cfg.training.seq_len * cfg.model.num_experts_per_tok  # mbs 2
    steps = {0: [[[140, 120, 132, 120], [128, 128, 128, 116]]], 1: [[[100, 160, 140, 124], [132, 120, 132, 124]]]}
    ok = {"status": "ok", "device": "cpu", "world_size": 2, "tokens_per_s": 100.0, "step_times_s": [1.0],
          "peak_allocated_bytes": 7_000_000}
    results = {r: {**ok, "rank": r, "routing": {"sent": sent, "steps": st}} for r, st in steps.items()}
    s = Strategy(engine="fsdp2", expert_parallel_size=2, micro_batch_size=2)
    m = backend(cfg, tmp_path).measurement(s, _res(returncode=0, results=results))
    assert m.ok, m.reason
    want = measured_routing(cfg.model, sent, steps[0] + steps[1])
    assert m.extra[ROUTING_KEY] == want._asdict() and want.ep_rank_imbalance == 1.0235  # 524 / 512, up
    assert m.extra[PREDICTED_AT_ROUTING_KEY] < m.extra[PREDICTED_PEAK_KEY]
    assert m.extra[MEMORY_ERROR_AT_ROUTING_KEY] == round(100 * (m.extra[PREDICTED_AT_ROUTING_KEY] / 7_000_000 - 1), 2)
    one = backend(cfg, tmp_path).measurement(s, _res(returncode=0, results={0: results[0], 1: ok}))
    assert one.extra[ROUTING_KEY] == measured_routing(cfg.model, sent, steps[0])._asdict()
    plain = backend(cfg, tmp_path).measurement(dataclasses.replace(s, expert_parallel_size=1),
                                               _res(returncode=0, results=results))
    assert ROUTING_KEY not in plain.extra
    # an EP trial reads a new batch every micro-step (its peak the worst of their routings); a non-EP one does not
    assert backend(cfg, tmp_path).job(s, tmp_path).fresh_batches is True
    assert backend(cfg, tmp_path).job(dataclasses.replace(s, expert_parallel_size=1), tmp_path).fresh_batches is None


def test_bounded_log_keeps_head_and_tail(tmp_path):
    r, w = os.pipe()
    pump = _BoundedPump(os.fdopen(r, "rb"), str(tmp_path / "out.log"), 1000)
    pump.start()
    with os.fdopen(w, "wb") as fh:
        fh.write(b"H" * 1000 + b"m" * 50_000 + b"T" * 1000)
    pump.join(5)
    data = (tmp_path / "out.log").read_bytes()
    assert data.startswith(b"H" * 1000) and data.endswith(b"T" * 1000)
    assert b"[... 50000 bytes truncated by autotune ...]" in data and len(data) < 2100


# ---------------------------------------------------------------- slow: real DeepSpeed


@pytest.mark.slow
def test_zero3_two_ranks_full_checkpointing(tmp_path):
    cfg = tiny_cfg(2)
    be = backend(cfg, tmp_path)
    s = Strategy(zero_stage=3, micro_batch_size=2, checkpointing="full", precision="fp32")
    m = be.evaluate(s, trial_number=7)
    assert m.status == "ok", m.reason
    trial = tmp_path / "run" / "trials" / "7"
    job = json.loads((trial / "job.json").read_text())
    assert job["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert job["deepspeed_config"]["train_batch_size"] == 8  # mbs 2 x GAS 2 x 2 ranks
    assert m.extra["world_size"] == 2 and len(m.extra["per_rank_peak_bytes"]) == 2
    assert m.peak_memory_bytes == max(m.extra["per_rank_peak_bytes"]) > 0
    assert m.extra["gradient_accumulation_steps"] == 2
    assert m.step_time_s > 0 and m.tokens_per_s_per_gpu == pytest.approx(2 * 64 * 2 / m.step_time_s, rel=1e-6)
    assert m.mfu is None  # CPU: no GPU peak to compare with
    assert m.extra["tokens_error_pct"] == pytest.approx(
        100 * (m.extra["predicted_tokens_per_s_per_gpu"] / m.tokens_per_s_per_gpu - 1), abs=0.01)
    assert (trial / "logs" / "stderr.log").exists() and (trial / "measurement.json").exists()
    assert_nothing_left(m)


@pytest.mark.slow
def test_zero1_torchrun_and_zero2_deepspeed_launcher_one_rank(tmp_path):
    m1 = backend(tiny_cfg(1), tmp_path).evaluate(Strategy(zero_stage=1, micro_batch_size=4, precision="fp32"))
    assert m1.status == "ok", m1.reason
    cfg2 = tiny_cfg(1, launcher="deepspeed")
    m2 = backend(cfg2, tmp_path).evaluate(Strategy(zero_stage=2, micro_batch_size=2, checkpointing="selective",
                                                   precision="fp32"))
    assert m2.status == "ok", m2.reason
    assert m2.extra["launcher"] == "deepspeed"
    # the trial directories count up and never overwrite each other
    assert sorted(os.listdir(tmp_path / "run" / "trials")) == ["0", "1"]
    # twice the micro-batch: more activation memory at the peak (same model, same optimizer state)
    assert m1.peak_memory_bytes > m2.peak_memory_bytes
    assert all(v == v for v in m1.extra["losses"])


@pytest.mark.slow
def test_real_out_of_memory_from_address_space_limit(tmp_path):
    # logits of 16 x 256 x 32000 fp32 = 500 MiB: no room under a 1.5 GiB address-space limit.
    cfg = tiny_cfg(1, seq_len=256, global_batch_size=16)
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=32000))
    m = backend(cfg, tmp_path, memory_limit_bytes=3 << 29).evaluate(
        Strategy(zero_stage=1, micro_batch_size=16, precision="fp32"))
    assert m.status == "oom", (m.status, m.reason)
    assert m.extra["oom_phase"] in ("forward", "backward", "optimizer")
    assert "allocate" in m.reason or "MemoryError" in m.reason
    assert m.peak_memory_bytes is None and m.tokens_per_s_per_gpu is None


@pytest.mark.slow
def test_nan_loss_is_reported_as_nan(tmp_path):
    # Adam moves every weight by ~lr per step: with lr 1e30 the next forward overflows to inf/NaN.
    be = backend(tiny_cfg(1), tmp_path, ds_config_overrides={"optimizer": {"params": {"lr": 1e30}}})
    m = be.evaluate(Strategy(zero_stage=0, micro_batch_size=4, precision="fp32"))
    assert m.status == "nan", (m.status, m.reason)
    assert "non-finite loss" in m.reason


def test_relative_run_dir_from_another_working_directory(tmp_path, monkeypatch):
    """`autotune run --out runs` (relative) while the workers run in the trial folder: the worker
    writes result_path as it reads it, relative to its own working directory, and it is found."""
    entry = script(tmp_path, """
        import json, sys
        job = json.load(open(sys.argv[1]))
        with open(job["result_path"], "w") as fh:
            json.dump({"status": "error", "reason": "fake worker reached its result path"}, fh)
    """)
    monkeypatch.chdir(tmp_path)
    from autotune.backends.profiled import DeepSpeedBackend

    m = DeepSpeedBackend(tiny_cfg(1, timeout_s=60), "runs/rel", device="cpu", worker_entry=entry).evaluate(
        Strategy(micro_batch_size=4))
    assert (m.status, m.reason) == ("error", "rank 0: fake worker reached its result path")
    assert (tmp_path / "runs" / "rel" / "trials" / "0" / "result.json").is_file()


@pytest.mark.slow
def test_crashing_rank_reports_its_signal(tmp_path):
    entry = script(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(600)   # rank 0 would wait forever for its peer
    """)
    t0 = time.monotonic()
    m = backend(tiny_cfg(2, timeout_s=300), tmp_path, worker_entry=entry).evaluate(Strategy(micro_batch_size=4))
    assert m.status == "crash", (m.status, m.reason)
    assert m.reason == "rank 1 killed by SIGSEGV before writing a result"
    assert time.monotonic() - t0 < 150  # the launcher stopped the survivor long before the timeout
    assert_nothing_left(m)


@pytest.mark.slow
def test_hang_is_killed_with_its_whole_process_tree(tmp_path):
    # The fake worker starts a grandchild in a session of its own (as torchrun does with its
    # workers), then hangs: neither may survive the timeout.
    entry = script(tmp_path, """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        time.sleep(600)
    """)
    t0 = time.monotonic()
    m = backend(tiny_cfg(1, timeout_s=4), tmp_path, worker_entry=entry).evaluate(Strategy(micro_batch_size=8))
    assert m.status == "timeout", (m.status, m.reason)
    assert time.monotonic() - t0 < 60  # the timeout (4 s) plus the kill grace, not the worker's 600 s
    assert_nothing_left(m)


@pytest.mark.slow
def test_launch_timeout_kill_on_plain_job(tmp_path):
    # launch() directly: the result files of an earlier attempt are not read as this one's.
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"result_path": str(tmp_path / "result.json")}))
    (tmp_path / "result.json").write_text(json.dumps({"status": "ok"}))
    entry = script(tmp_path, "import time; time.sleep(600)\n")
    res = launch(str(job), nproc=1, log_dir=str(tmp_path / "logs"), timeout_s=2, worker_entry=entry,
                 kill_grace_s=2)
    assert res.timed_out and failure_of(res)[0] == "timeout" and 0 not in res.results
    assert_nothing_left(res)


@pytest.mark.slow
def test_results_in_then_teardown_hang_counts_as_measured(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"result_path": str(tmp_path / "result.json")}))
    entry = script(tmp_path, """
        import json, sys, time
        job = json.load(open(sys.argv[1]))
        open(job["result_path"], "w").write(json.dumps({"status": "ok", "tokens_per_s": 1.0}))
        time.sleep(600)   # e.g. stuck in destroy_process_group
    """)
    # a hang after the result must not run into the timeout: the launch ends well before it
    res = launch(str(job), nproc=1, log_dir=str(tmp_path / "logs"), timeout_s=300, worker_entry=entry,
                 abort_grace_s=1, kill_grace_s=1)
    assert not res.timed_out and res.elapsed_s < 300
    assert failure_of(res) is None and res.results[0]["status"] == "ok"
    assert_nothing_left(res)


# `autotune run examples/tiny-cpu-fsdp2.yaml --backend profile --trials 2` end to end (real FSDP2 trials
# on 2 CPU ranks, the run's FSDP2 files) is checked on docs/profiling.md's run of that command:
# tests/cli/test_readme.py, check_fsdp2_profile_run.
