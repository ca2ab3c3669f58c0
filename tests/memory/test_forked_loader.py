"""A forked data loader under CPU offload (``TrainingSpec.data_loader_fork``): its workers keep the
host partitions' pages as they were at the fork, so every one the trainer rewrites is held twice
(memory.common.forked_copies). The arithmetic per engine, the screen's agreement, the job file's key,
and one measured step (copy-on-write on this machine's kernel)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autotune.config import ConfigError, load_config
from autotune.memory import _fast, estimate_memory
from autotune.presets import gpu_from_name, model_from_name
from autotune.space import load_space
from autotune.spec import BYTES_PER_ELEMENT, HardwareSpec, TrainingSpec
from autotune.strategy import Strategy, validate
from conftest import ROOT

MODEL = model_from_name("llama2-7b")
HW = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8, cpu_memory_gib=4096)


def _host(strategy: Strategy, fork: str, precision: str = "bf16") -> int:
    tr = TrainingSpec(seq_len=2048, global_batch_size=64, precision=precision, data_loader_fork=fork)  # type: ignore[arg-type]
    return estimate_memory(MODEL, tr, HW, strategy).cpu_bytes_per_node


def _part() -> int:
    return -(-MODEL.num_parameters // 8)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero3_optimizer_offload_copies_master_and_gradients_then_moments(precision):
    s = Strategy(zero_stage=3, offload_optimizer="cpu", precision=precision, pin_memory=False)
    p, part = BYTES_PER_ELEMENT[precision], _part()
    none, init, epoch = (_host(s, f, precision) for f in ("none", "after_init", "each_epoch"))
    # fp32 master, its fp32 gradient and the 16-bit gradient partition exist after deepspeed.initialize
    assert init - none == pytest.approx(8 * (4 + 4 + p) * part, abs=8)
    assert epoch - init == pytest.approx(8 * 8 * part, abs=8)  # AdamW's two moments, from the first step


def test_zero3_parameter_offload_adds_its_partitions():
    opt = Strategy(zero_stage=3, offload_optimizer="cpu", pin_memory=False)
    both = Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", pin_memory=False)
    extra = (_host(both, "after_init") - _host(both, "none")) - (_host(opt, "after_init") - _host(opt, "none"))
    assert extra == pytest.approx(8 * 2 * _part(), abs=8)


def test_zero2_offload_copies_master_gradients_and_16bit_buffer():
    s = Strategy(zero_stage=2, offload_optimizer="cpu", micro_batch_size=8, pin_memory=False)  # no accumulation
    none, init, epoch = (_host(s, f) for f in ("none", "after_init", "each_epoch"))
    assert init - none >= 8 * (4 + 4 + 2) * _part()  # + the largest parameter's pinned staging buffer
    assert epoch - init == pytest.approx(8 * 8 * _part(), abs=8)


def test_fsdp2_offload_copies_the_fp32_shards():
    s = Strategy(engine="fsdp2", offload_params="cpu", offload_optimizer="cpu", pin_memory=False)
    assert not validate(s, MODEL, TrainingSpec(seq_len=2048, global_batch_size=64), HW)
    shard = -(-MODEL.num_parameters // 8)
    assert _host(s, "after_init") - _host(s, "none") == pytest.approx(8 * 4 * shard, rel=1e-6)
    assert _host(s, "each_epoch") - _host(s, "after_init") == pytest.approx(8 * 8 * shard, rel=1e-6)


@pytest.mark.parametrize("s", [Strategy(zero_stage=3), Strategy(zero_stage=2), Strategy(engine="fsdp2")])
def test_nothing_on_the_host_nothing_copied(s):
    assert _host(s, "each_epoch") == _host(s, "none") == 0


def test_screen_gives_the_same_host_verdicts():
    """With host RAM binding, the screen's verdicts (memory._fast) equal estimate_memory's for every
    candidate of the engines space."""
    cfg = load_config(os.path.join(ROOT, "examples/llama2-7b.yaml"))
    tr = dataclasses.replace(cfg.training, data_loader_fork="each_epoch")
    hw = dataclasses.replace(cfg.hardware, cpu_memory_gib=150)
    pool = list(load_space("engines", precision=tr.precision).candidates(cfg.model))
    verdicts = _fast.verdicts(cfg.model, tr, hw, pool, headroom=0.05)
    flipped = 0
    for s, v in zip(pool, verdicts):
        if v is None or validate(s, cfg.model, tr, hw):
            continue
        est = estimate_memory(cfg.model, tr, hw, s, headroom=0.05)
        assert v == (est.fits, est.total_gpu_bytes), (s, est.reasons)
        plain = estimate_memory(cfg.model, cfg.training, hw, s, headroom=0.05)
        flipped += plain.fits and not est.fits
    assert flipped > 0  # the copies decide some candidates


def test_job_file_key_is_checked(tmp_path):
    src = open(os.path.join(ROOT, "examples/llama2-7b.yaml")).read()
    bad = tmp_path / "job.yaml"
    bad.write_text(src.replace("training:\n", "training:\n  data_loader_fork: sometimes\n", 1))
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert "training.data_loader_fork" in str(err.value) and "sometimes" in str(err.value)
    good = tmp_path / "good.yaml"
    good.write_text(src.replace("training:\n", "training:\n  data_loader_fork: after_init\n", 1))
    assert load_config(str(good)).training.data_loader_fork == "after_init"


@pytest.mark.slow
def test_measured_forked_worker_holds_the_rewritten_partitions():
    """ZeRO-3 + optimizer offload on the CPU accelerator with one data-loader worker forked after
    deepspeed.initialize (benchmarks/host_rss_offload.py's child): the physical memory only the worker
    holds (its PSS plus the trainer's, minus the trainer's RSS) is at least the copies the model
    counts, and not far above them."""
    pytest.importorskip("deepspeed")
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import host_rss_offload as h; "
            "h.SIZES['tiny'] = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8); "
            "print('RESULT ' + json.dumps(h.child('tiny', 2, 1)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-2000:]
    r = json.loads(line[0][7:])
    last = r["steps"][-1]
    assert last["children"] == 1
    only_worker = last["tree_pss"] - last["VmRSS"]
    psi = r["parameters"]
    # host: master + fp32 gradient + bf16 gradient partition (10 B); on the CPU accelerator the bf16
    # parameter partition, rewritten by every step, is host memory too (2 B)
    counted = (4 + 4 + 2 + 2) * psi
    print(f"worker-only {only_worker / psi:.2f} B/param, counted {counted / psi:.0f}")
    assert counted <= only_worker <= 1.25 * counted + (64 << 20), (only_worker / psi, r)


def test_pinned_partitions_are_copied_by_their_bytes_not_their_blocks():
    """Under pin_memory the host blocks are rounded up (test_pinned_host.py), but a forked worker keeps
    only the pages the trainer rewrites: the tensors' own bytes; the cached per-parameter blocks of
    parameter offload are never written again."""
    part = _part()
    for s, per_param in ((Strategy(zero_stage=3, offload_optimizer="cpu"), 4 + 4 + 2),
                         (Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"), 4 + 4 + 2 + 2)):
        assert s.pin_memory
        assert _host(s, "after_init") - _host(s, "none") == pytest.approx(8 * per_param * part, abs=8)
