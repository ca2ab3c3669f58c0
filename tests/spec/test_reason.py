"""Reasons carry their kind: code acts on the kind, never on the words."""

import dataclasses
import json

from autotune.memory import estimate_memory
from autotune.presets import gpu_from_name, model_from_name
from autotune.reason import Reason, kind_of
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.trace.combine import combine
from autotune.trace.run import TraceResult

MODEL = model_from_name("llama2-7b")
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=16)
ONE_GPU = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=1, cpu_memory_gib=8)


def _trace(activation_peak: int) -> TraceResult:
    return TraceResult(model_name="m", source="reference", micro_batch_size=1, seq_len=4096, precision="bf16",
                       checkpointing="full", checkpoint_layers=32, activation_peak=activation_peak,
                       saved_activations=activation_peak, peak=activation_peak, phase_peaks={}, states={},
                       at_activation_peak={"phase": "backward"}, flops={"total": 0}, parameters=0, wall_s=0.0)


def test_each_reason_says_its_kind():
    gpu = estimate_memory(MODEL, TRAIN, ONE_GPU, Strategy(checkpointing="full"))
    assert not gpu.fits and {kind_of(r) for r in gpu.reasons} == {"gpu_memory"}
    host = estimate_memory(MODEL, TRAIN, ONE_GPU, Strategy(zero_stage=3, offload_optimizer="cpu",
                                                            offload_params="cpu", checkpointing="full"))
    assert "host_memory" in {kind_of(r) for r in host.reasons}
    rule = estimate_memory(MODEL, TRAIN, ONE_GPU, Strategy(offload_params="cpu"))
    assert "rule" in {kind_of(r) for r in rule.reasons}
    assert json.dumps(gpu.reasons) == json.dumps([str(r) for r in gpu.reasons])  # JSON sees the text


def test_combine_redecides_gpu_reasons_by_kind_and_keeps_the_others():
    est = estimate_memory(MODEL, TRAIN, ONE_GPU, Strategy(zero_stage=3, offload_optimizer="cpu",
                                                           offload_params="cpu", checkpointing="full"))
    big = dataclasses.replace(est, reasons=[Reason("anything at all", "gpu_memory"), *est.reasons], fits=False)
    mem, _ = combine(_trace(1), big, capacity_bytes=10 * est.gpu["peak"], model=MODEL, training=TRAIN)
    assert all(kind_of(r) != "gpu_memory" for r in mem.reasons)
    assert [str(r) for r in mem.reasons] == [str(r) for r in est.reasons if kind_of(r) != "gpu_memory"]
    tight, _ = combine(_trace(1), big, capacity_bytes=1, model=MODEL, training=TRAIN)
    assert kind_of(tight.reasons[0]) == "gpu_memory" and tight.reasons[0].startswith("traced peak")
