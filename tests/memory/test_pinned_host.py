"""Pinned host memory under CPU offload (``Strategy.pin_memory``, autotune's default): on CUDA every
pinned tensor is a block of torch's caching host allocator, rounded up to a power of two
(memory.common.pinned_bytes). Which tensors are pinned is DeepSpeed's and FSDP2's; their sizes are the
parameters' own (checked against transformers' modules in test_memory_partition.py). Without CUDA
here the rounding itself is read from torch's source, not measured."""

from __future__ import annotations

import math

import pytest

from autotune.engine_configs import to_deepspeed_config, to_fsdp2_config
from autotune.memory import estimate_memory
from autotune.memory.common import pinned_bytes
from autotune.memory.states import parameter_shapes
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import HardwareSpec, TrainingSpec
from autotune.strategy import Strategy

MODEL = model_from_name("llama2-7b")
HW = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8, cpu_memory_gib=4096)
TR = TrainingSpec(seq_len=2048, global_batch_size=64)


def _pow2(n: float) -> float:
    return float(2 ** math.ceil(math.log2(n)))


def _host(s: Strategy, device: str = "cuda") -> int:
    return estimate_memory(MODEL, TR, HW, s, device=device).cpu_bytes_per_node


def test_pinned_bytes_is_the_next_power_of_two():
    assert [pinned_bytes(n, True) for n in (3, 4, 5, 1000, 4096, 4097)] == [4, 4, 8, 1024, 4096, 8192]
    assert pinned_bytes(4097, False) == 4097 and pinned_bytes(0, True) == 0


def test_zero3_optimizer_offload_rounds_its_pinned_gradient_buffers():
    pinned, pageable = (Strategy(zero_stage=3, offload_optimizer="cpu", pin_memory=b) for b in (True, False))
    parts = sum(-(-n // 8) for _, n in parameter_shapes(MODEL))
    part = -(-MODEL.num_parameters // 8)
    assert parts < 1e9  # one sub group: its fp32 gradient is one pinned tensor
    # per GPU: master and moments pageable; the fp32 gradient and the 16-bit gradient buffer pinned
    expected = 8 * ((4 + 8) * part + _pow2(4 * parts) + _pow2(2 * parts))
    assert _host(pinned) == pytest.approx(expected, abs=16)
    assert _host(pageable) == 8 * (4 + 8 + 4 + 2) * part
    assert _host(pinned, device="cpu") == _host(pageable, device="cpu")  # DeepSpeed's CPU accelerator pins nothing


def test_zero3_parameter_offload_keeps_each_pinned_partition_cached():
    both = Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    opt = Strategy(zero_stage=3, offload_optimizer="cpu")
    parts = [-(-n // 8) for _, n in parameter_shapes(MODEL)]
    own = sum(_pow2(2 * n) for n, (_, full) in zip(parts, parameter_shapes(MODEL)) if full > 100_000)
    assert _host(both) - _host(opt) == pytest.approx(8 * (_pow2(2 * sum(parts)) + own), abs=16)
    assert own > 2 * sum(parts)  # the cached blocks alone are more than the partitions


def test_zero2_offload_rounds_master_gradients_and_buffers():
    s = Strategy(zero_stage=2, offload_optimizer="cpu", micro_batch_size=8)
    pageable = Strategy(zero_stage=2, offload_optimizer="cpu", micro_batch_size=8, pin_memory=False)
    part = -(-MODEL.num_parameters // 8)
    largest = MODEL.vocab_size * MODEL.hidden_size
    assert _host(s) == pytest.approx(8 * (2 * _pow2(4 * part) + _pow2(2 * part) + _pow2(2 * largest) + 8 * part),
                                     abs=16)
    assert _host(pageable) == 8 * ((4 + 4 + 2 + 8) * part + 2 * largest)


def test_fsdp2_offload_rounds_each_shard_and_gradient():
    s = Strategy(engine="fsdp2", offload_params="cpu")
    pageable = Strategy(engine="fsdp2", offload_params="cpu", pin_memory=False)
    shards = sum(_pow2(4 * -(-d0 // 8) * (n // d0)) for d0, n in parameter_shapes(MODEL))
    shard = MODEL.num_parameters / 8
    assert _host(s) == pytest.approx(8 * (2 * shards + (8 + 4) * shard), rel=1e-9)
    assert _host(pageable) == pytest.approx(8 * (4 + 4 + 8 + 4) * shard, rel=1e-9)
    assert _host(s) > _host(pageable)


@pytest.mark.parametrize("pin", [True, False])
def test_the_written_configs_carry_the_knob(pin):
    ds = to_deepspeed_config(Strategy(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", pin_memory=pin),
                             MODEL, TR, HW)
    assert ds["zero_optimization"]["offload_optimizer"]["pin_memory"] is pin
    assert ds["zero_optimization"]["offload_param"]["pin_memory"] is pin
    fs = to_fsdp2_config(Strategy(engine="fsdp2", offload_params="cpu", pin_memory=pin), MODEL, TR, HW)
    assert fs["offload_pin_memory"] is pin
    from autotune.models.fsdp2 import snippet

    assert ("CPUOffloadPolicy(pin_memory=False)" in snippet(fs)) is (not pin)


def test_trainers_that_always_pin_say_so():
    """HF Trainer, accelerate and torchtitan build CPUOffloadPolicy() (pinned): a pin_memory false FSDP2
    offload point gets one line in each; Lightning (autotune.apply with the layout) carries it."""
    import dataclasses
    import os

    from autotune.config import load_config
    from autotune.trainers import accelerate_config, hf_trainer, lightning_args, torchtitan_toml
    from autotune.trainers.common import Point
    from conftest import ROOT

    cfg = dataclasses.replace(load_config(os.path.join(ROOT, "examples/llama2-7b.yaml")), hardware=HW, training=TR)

    def point(pin):
        return Point(cfg=cfg, strategy=Strategy(engine="fsdp2", offload_params="cpu", pin_memory=pin), ds_config=None,
                     ds_config_path=None)

    for module in (hf_trainer, accelerate_config, torchtitan_toml):
        assert sum(d.startswith("pin_memory false") for d in module.differences(point(False))) == 1, module
        assert not any(d.startswith("pin_memory") for d in module.differences(point(True)))
    assert not any("pin_memory" in d for d in lightning_args.differences(point(False)))


def test_activation_offload_pins_each_checkpointed_input():
    """autotune's offload_activations copies each block's input into torch.empty(..., pin_memory=True) on
    CUDA: one power-of-two block per checkpointed block; pageable with pin_memory false (ArcticTraining's
    .to("cpu"), the ALST rows)."""
    tr = TrainingSpec(seq_len=24_000, global_batch_size=8)
    s = Strategy(zero_stage=3, checkpointing="full", activation_offload="cpu")
    pinned, pageable = (estimate_memory(MODEL, tr, HW, s.replace(pin_memory=b)).cpu_bytes_per_node for b in (True, False))
    one = 24_000 * MODEL.hidden_size * 2  # one block's input, bf16, micro-batch 1
    assert pinned - pageable == pytest.approx(8 * MODEL.num_hidden_layers * (_pow2(one) - one), abs=64)
    on_cpu = [estimate_memory(MODEL, tr, HW, s.replace(pin_memory=b), device="cpu").cpu_bytes_per_node
              for b in (True, False)]
    assert on_cpu[0] == on_cpu[1]  # the CPU accelerator pins nothing


def test_the_long_context_calls_carry_pin_memory_false():
    import dataclasses
    import os

    from autotune.config import load_config
    from autotune.models.fsdp2 import snippet
    from autotune.trainers.common import Point, long_context_call, long_context_lines
    from conftest import ROOT

    cfg = dataclasses.replace(load_config(os.path.join(ROOT, "examples/llama2-7b.yaml")), hardware=HW, training=TR)
    for pin in (True, False):
        s = Strategy(zero_stage=3, checkpointing="full", activation_offload="cpu", pin_memory=pin)
        p = Point(cfg=cfg, strategy=s, ds_config=None, ds_config_path=None)
        assert ("pin_memory=False" in long_context_call(p)) is (not pin)
        assert any(("offload_in_forward(model, pin_memory=False)" in line) is (not pin)
                   for line in long_context_lines(p, "accelerate") if "offload_in_forward" in line)
        fs = to_fsdp2_config(s.replace(engine="fsdp2"), MODEL, TR, HW)
        assert ("offload_activations(pin_memory=False)" in snippet(fs)) is (not pin)
