"""The DeepSpeed measurement worker on the CPU accelerator (real engines; marked slow)."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from autotune.memory import estimate_memory
from autotune.backends.launch import WORKER_MODULE, free_port, kill_launch
from autotune.presets import gpu_from_name
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(name="tiny", num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=344, vocab_size=2048, max_position_embeddings=512)

pytest.importorskip("torch")
pytest.importorskip("deepspeed")


def _run(tmp_path: Path, job: dict, nproc: int = 1, timeout: float = 120) -> list[dict]:
    job = dict(job, result_path=str(tmp_path / "result.json"), device="cpu")
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if nproc == 1:
        cmd = [sys.executable, "-m", WORKER_MODULE, str(tmp_path / "job.json")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), "-m", WORKER_MODULE, str(tmp_path / "job.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    from autotune.worker.main import result_path_for_rank

    out = []
    for r in range(nproc):
        path = result_path_for_rank(tmp_path / "result.json", r)
        assert path.exists(), proc.stderr[-3000:]
        out.append(json.loads(path.read_text()))
    return out


def _job(stage: int, nproc: int, mbs: int, seq: int, ckpt: str = "none", precision: str = "bf16", ga: int = 1) -> dict:
    return {"model": TINY, "training": {"seq_len": seq, "global_batch_size": mbs * nproc * ga, "precision": precision},
            "strategy": Strategy(zero_stage=stage, micro_batch_size=mbs, checkpointing=ckpt,
                                 precision=precision).as_dict(),
            "warmup_steps": 2, "measure_steps": 2}


def _predicted(job: dict, nproc: int, loop: str = "keep_outputs") -> int:
    model = ModelSpec(**job["model"])
    training = TrainingSpec(**job["training"])
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=nproc)
    return estimate_memory(model, training, hw, Strategy(**job["strategy"]), device="cpu", loop=loop).gpu["peak"]


@pytest.mark.slow
def test_zero2_one_process_matches_model(tmp_path):
    """The usual loop (outputs kept), gradient accumulation 2: the worst micro-step of the measured
    optimizer steps is within 2% of the prediction; the loop that drops outputs measures less by
    the logits, and is predicted as such."""
    job = _job(stage=2, nproc=1, mbs=2, seq=256, ckpt="full", ga=2)
    (res,) = _run(tmp_path, job)
    assert res["status"] == "ok", res
    assert res["device"] == "cpu" and res["world_size"] == 1 and res["loop"] == "keep_outputs"
    assert res["optimizer"] == "DeepSpeedZeroOptimizer" and res["gradient_accumulation_steps"] == 2
    assert res["num_parameters"] == ModelSpec(**TINY).num_parameters
    assert len(res["step_times_s"]) == 2 and len(res["losses"]) == 4 and res["tokens_per_s"] > 0
    assert len(res["step_peaks_bytes"]) == 2 and res["max_step_peak_bytes"] == res["peak_allocated_bytes"]
    assert all(l == l and l < 20 for l in res["losses"])
    assert res["peak_allocated_bytes"] == max(res["phase_peaks_bytes"].values())
    pred = _predicted(job, 1)
    assert abs(pred - res["peak_allocated_bytes"]) / res["peak_allocated_bytes"] < 0.02
    drop_dir = tmp_path / "drop"
    drop_dir.mkdir()
    (drop,) = _run(drop_dir, dict(job, loop="drop_outputs"))
    assert drop["status"] == "ok" and drop["loop"] == "drop_outputs"
    pred_drop = _predicted(job, 1, "drop_outputs")
    assert abs(pred_drop - drop["peak_allocated_bytes"]) / drop["peak_allocated_bytes"] < 0.02
    logits = 2 * TINY["vocab_size"] * 2 * 256  # bf16 (b, s, V)
    assert res["peak_allocated_bytes"] - drop["peak_allocated_bytes"] == pytest.approx(logits, rel=0.05)


@pytest.mark.slow
def test_zero3_two_processes_matches_model(tmp_path):
    job = _job(stage=3, nproc=2, mbs=4, seq=256)
    results = _run(tmp_path, job, nproc=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["status"] == "ok" for r in results), results
    assert results[0]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    peaks = results[0]["all_ranks"]["peak_allocated_bytes"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    # what the job OOMs at: the worst step of the worst rank
    worst = max(results[0]["all_ranks"]["max_step_peak_bytes"])
    assert worst == max(peaks)
    pred = _predicted(job, 2)
    assert abs(pred - worst) / worst < 0.02


@pytest.mark.slow
def test_data_seed_and_fresh_batches_move_the_batches(tmp_path):
    """``data_seed`` (the memory benchmark's pilot: the same model on other batches): left out it is ``seed``;
    another value changes the batches (the first loss), as ``seed`` with the same ``data_seed`` changes the model.
    ``fresh_batches``: the first step reads the same batch, the second a new one (a data loader's)."""
    job = dict(_job(stage=0, nproc=1, mbs=1, seq=32, precision="fp32"), warmup_steps=0, measure_steps=2)
    losses = {}
    for name, extra in {"default": {}, "same": {"data_seed": 0}, "other data": {"data_seed": 5},
                        "other model": {"seed": 5, "data_seed": 0}, "fresh": {"fresh_batches": True}}.items():
        (tmp_path / name).mkdir()
        (res,) = _run(tmp_path / name, dict(job, **extra))
        assert res["status"] == "ok", res
        losses[name] = res["losses"]
    assert losses["default"] == losses["same"]
    first = {name: l[0] for name, l in losses.items()}
    assert first["other data"] != first["default"] and first["other model"] != first["default"]
    assert first["other data"] != first["other model"]
    assert first["fresh"] == first["default"] and losses["fresh"][1] != losses["default"][1]


def test_live_totals_drop_blocks_freed_on_unprofiled_threads():
    from autotune.worker.cpu_memory import live_totals as _live_totals

    # 100 B at address 1 is freed on a thread the profiler does not see (no event); the allocator
    # then hands address 1 out again: the old block must not be counted twice
    raw = [(1, 1, 100), (2, 2, 50), (3, 1, 30), (4, 2, -50), (5, 9, -7), (6, 1, -30)]
    assert _live_totals(raw) == [(1, 100), (2, 150), (3, 80), (4, 30), (5, 30), (6, 0)]


@pytest.mark.slow
def test_out_of_memory_is_data(tmp_path):
    huge = dict(TINY, name="huge", vocab_size=4_000_000, hidden_size=16_384, num_attention_heads=128,
                num_key_value_heads=128, intermediate_size=128)
    job = dict(_job(stage=0, nproc=1, mbs=1, seq=8), model=huge, memory="none")
    (res,) = _run(tmp_path, job)
    assert res["status"] == "oom", res
    assert res["phase"] == "init" and res["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["error", "oom"])
def test_failed_rank_does_not_hang_the_others(tmp_path, kind):
    """Rank 1 fails after its steps; rank 0 succeeded: both still take part in the one cross-rank
    exchange, so rank 0 returns at once (the old gather ran on ok ranks only and blocked forever)."""
    import time

    job = dict(_job(stage=0, nproc=2, mbs=1, seq=32), memory="none", exchange_timeout_s=300,
               fault={"rank": 1, "phase": "end", "kind": kind})
    t0 = time.monotonic()
    r0, r1 = _run(tmp_path, job, nproc=2, timeout=100)
    assert time.monotonic() - t0 < 150  # far below the 300 s exchange timeout
    assert r0["status"] == "ok" and r1["status"] == kind
    assert r0["all_ranks"]["status"] == ["ok", kind] == r1["all_ranks"]["status"]
    if kind == "oom":
        assert r1["reason"].startswith("OOM in optimizer:") and "MemoryError: injected" in r1["reason"]


@pytest.mark.slow
def test_snapshot_is_a_noted_no_op_on_cpu_and_oom_reason_has_the_phase(tmp_path):
    job = dict(_job(stage=1, nproc=1, mbs=1, seq=16), memory="none", snapshot=str(tmp_path / "memory_snapshot.pickle"),
               fault={"rank": 0, "phase": "init", "kind": "oom"})
    (res,) = _run(tmp_path, job)
    assert res["status"] == "oom" and res["phase"] == "init"
    assert res["reason"].startswith("OOM in init: the model states do not fit")
    assert res["snapshot_path"] is None and not (tmp_path / "memory_snapshot.pickle").exists()
    assert any("no snapshot written" in n for n in res["notes"])


def _fsdp2_job(nproc: int, mbs: int, seq: int, ga: int = 1, **knobs) -> dict:
    return {"model": TINY, "training": {"seq_len": seq, "global_batch_size": mbs * nproc * ga, "precision": "bf16"},
            "strategy": Strategy(engine="fsdp2", micro_batch_size=mbs, **knobs).as_dict(),
            "warmup_steps": 2, "measure_steps": 2}


@pytest.mark.slow
def test_fsdp2_one_process_trains_and_measures(tmp_path):
    """An fsdp2 job: no DeepSpeed engine, fully_shard per block and the root, AdamW, GAS 2, op-level
    checkpointing of every 2nd block; the same result keys as a DeepSpeed job."""
    job = _fsdp2_job(nproc=1, mbs=2, seq=128, ga=2, checkpointing="op", checkpoint_every=2)
    assert "deepspeed_config" not in job
    (res,) = _run(tmp_path, job)
    assert res["status"] == "ok", res
    assert res["optimizer"] == "AdamW" and res["gradient_accumulation_steps"] == 2
    assert res["num_parameters"] == ModelSpec(**TINY).num_parameters
    assert any("fully_shard on 2 blocks" in n for n in res["notes"])
    assert len(res["losses"]) == 4 and all(0 < v < 20 for v in res["losses"]) and res["losses"][-1] < res["losses"][0]
    assert len(res["step_peaks_bytes"]) == 2 and res["peak_allocated_bytes"] == max(res["phase_peaks_bytes"].values())
    assert res["peak_allocated_bytes"] > 0 and res["tokens_per_s"] > 0


@pytest.mark.slow
def test_fsdp2_two_processes_reshard_after_forward_keeps_the_blocks(tmp_path):
    """2 ranks over gloo. reshard_after_forward=False keeps every block's unsharded bf16 parameters
    from its forward to its backward: the forward peak (at the logits, after the last block) grows
    by exactly those bytes, L x block parameters x 2."""
    forward = {}
    for reshard in (True, False):
        out = tmp_path / str(reshard)
        out.mkdir()
        results = _run(out, _fsdp2_job(nproc=2, mbs=2, seq=128, reshard_after_forward=reshard), nproc=2)
        assert [r["status"] for r in results] == ["ok", "ok"], results
        assert all(r["optimizer"] == "AdamW" and all(v == v and v < 20 for v in r["losses"]) for r in results)
        summary = results[0]["all_ranks"]
        assert summary["status"] == ["ok", "ok"] and all(p > 0 for p in summary["peak_allocated_bytes"])
        forward[reshard] = max(p["forward"] for p in summary["phase_peaks_bytes"])
    spec = ModelSpec(**TINY)
    kept = spec.num_hidden_layers * spec.block_params() * 2
    assert forward[False] > forward[True]
    assert forward[False] - forward[True] == pytest.approx(kept, rel=0.02)


@pytest.mark.slow
def test_fsdp2_hybrid_over_two_nodes_replicates_the_states(tmp_path):
    """sharding=hybrid over 2 "nodes" of 1 rank (two torchrun agents on localhost): a (2, 1)
    (replicate, shard) mesh, so every rank keeps the whole model states; fully sharded over the
    same 2 ranks each keeps half. At the optimizer step the fp32 parameters, gradients and both
    Adam moments (16 B per parameter) are live: hybrid holds at least the other half, 8 B/param, more."""
    job = dict(_fsdp2_job(nproc=2, mbs=2, seq=64, sharding="hybrid"), result_path=str(tmp_path / "result.json"),
               device="cpu")
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A port the OS reports free (a pid-derived one can meet a lingering store), each agent's output in a
    # file (no pipe to fill while the other is waited on). The measurement is done once both ranks have
    # written their result: as for a profiled trial (launch.py), a hang after that (gloo teardown,
    # torchrun's exit barrier between the agents) is not waited for; every process is killed after it.
    port, launch_id = str(free_port()), uuid.uuid4().hex
    env["AUTOTUNE_LAUNCH_ID"] = launch_id
    logs = [tmp_path / f"agent{n}.log" for n in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
                               "-m", WORKER_MODULE, str(tmp_path / "job.json")],
                              cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
             for n, log in zip((0, 1), logs)]
    from autotune.worker.main import result_path_for_rank

    results = [result_path_for_rank(tmp_path / "result.json", r) for r in (0, 1)]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(r.exists() for r in results) \
            and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    for p in procs:
        kill_launch(p, launch_id, grace_s=2.0)
    errs = [f"exit {c}: " + log.read_text()[-1500:] for c, log in zip(codes, logs)]
    assert all(r.exists() for r in results), errs
    hybrid = json.loads((tmp_path / "result.json").read_text())
    assert hybrid["all_ranks"]["status"] == ["ok", "ok"], hybrid
    assert any("mesh (2, 1)" in n for n in hybrid["notes"])
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    full = _run(full_dir, _fsdp2_job(nproc=2, mbs=2, seq=64), nproc=2)[0]
    assert full["all_ranks"]["status"] == ["ok", "ok"] and any("mesh (2,)" in n for n in full["notes"])
    step = [min(p["optimizer"] for p in r["all_ranks"]["phase_peaks_bytes"]) for r in (hybrid, full)]
    assert step[0] - step[1] >= 8 * ModelSpec(**TINY).num_parameters


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-xl", "llama2-7b", "llama2-70b", "llama3-8b", "mistral-7b", "mpt-7b",
                                    "tiny-llama"])
def test_reference_model_parameter_count_is_exact(preset):
    """Tiny variants of every preset family: the torch model has exactly ModelSpec.num_parameters."""
    import torch

    from autotune.presets import model_from_name
    from autotune.models.reference import build_model, count_parameters, synthetic_batch

    full = model_from_name(preset)
    gqa = full.num_key_value_heads < full.num_attention_heads
    spec = full.replace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2 if gqa else 4, intermediate_size=96, vocab_size=128,
                        max_position_embeddings=64)
    model = build_model(spec)
    assert count_parameters(model) == spec.num_parameters
    x, y = synthetic_batch(spec, 2, 16)
    loss = model(x, y)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and 3 < float(loss) < 7  # ~ln(128) at init
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_checkpointing_keeps_loss_and_gradients(granularity):
    import torch

    from autotune.models.reference import build_model, synthetic_batch

    spec = ModelSpec(**TINY).replace(attn_implementation="eager")
    torch.manual_seed(0)
    ref = build_model(spec)
    ck = build_model(spec)
    ck.load_state_dict(ref.state_dict())
    ck.set_checkpointing(granularity, 1)
    x, y = synthetic_batch(spec, 2, 32)
    l0, l1 = ref(x, y)["loss"], ck(x, y)["loss"]
    l0.backward()
    l1.backward()
    assert torch.allclose(l0, l1)
    for (n, a), b in zip(ref.named_parameters(), ck.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload_params,ga,nproc", [(2, "none", 1, 1), (3, "cpu", 2, 1), (2, "none", 2, 2)])
def test_offloaded_engine_total_matches_gpu_plus_host(tmp_path, stage, offload_params, ga, nproc):
    """Real offloaded engines on the CPU accelerator, where "GPU" and host are one allocator: the
    measured peak is the predicted device peak plus the predicted host bytes (pinned partitions,
    master weights, moments, fp32 and 16-bit gradient partitions, staging buffers; with accumulation
    on 2 ranks ZeRO-2's whole-parameter accumulation buffers), the worst rank."""
    job = _job(stage=stage, nproc=nproc, mbs=2, seq=256, ga=ga)
    job["strategy"] = dict(job["strategy"], offload_optimizer="cpu", offload_params=offload_params)
    res = _run(tmp_path, job, nproc=nproc)
    assert all(r["status"] == "ok" for r in res), res
    model, training = ModelSpec(**job["model"]), TrainingSpec(**job["training"])
    hw = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=nproc)
    est = estimate_memory(model, training, hw, Strategy(**job["strategy"]), device="cpu")
    total = est.gpu["peak"] + est.cpu_bytes_per_node / nproc
    measured = max(r["peak_allocated_bytes"] for r in res)
    assert est.gpu["gradients"] == 0 and est.gpu["optimizer_states"] == 0
    assert abs(total - measured) / measured < 0.02, (total, measured)


def test_cpu_collectives_give_gloos_thread_a_moment_once_and_only_when_blocking(monkeypatch):
    """engines._yield_after_collectives wraps the named collectives of a torch.distributed-like
    namespace once (a second call does not stack sleeps), passes arguments and results through, and
    sleeps 1 ms only after a blocking call (an async one returns its work at once)."""
    import time
    import types

    from autotune.worker.engines import _yield_after_collectives

    calls, sleeps = [], []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    ns = types.SimpleNamespace(all_reduce=lambda *a, **k: calls.append((a, k)) or "done", broadcast=print)
    _yield_after_collectives(ns, ("all_reduce", "missing_op"))
    wrapped = ns.all_reduce
    _yield_after_collectives(ns, ("all_reduce",))
    assert ns.all_reduce is wrapped and ns.broadcast is print and not hasattr(ns, "missing_op")
    assert ns.all_reduce(1, op="sum") == "done"
    assert calls == [((1,), {"op": "sum"})] and sleeps == [0.001]
    ns.all_reduce(2, async_op=True)
    assert len(calls) == 2 and sleeps == [0.001]
