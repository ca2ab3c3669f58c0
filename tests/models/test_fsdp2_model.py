"""The fsdp2 engine in the analytic models: memory (autotune.memory.fsdp2) and step time."""

from __future__ import annotations

import pytest

from autotune.memory import estimate_memory
from autotune.presets import gpu_from_name, model_from_name
from autotune.simulate import simulate
from autotune.spec import BYTES_PER_ELEMENT, HardwareSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.engine_configs import shard_group_size

MODEL = model_from_name("llama2-7b")
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64, precision="bf16")
HW8 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8, num_nodes=1)
HW16 = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=8, num_nodes=2)
FSDP2 = Strategy(engine="fsdp2", micro_batch_size=1, checkpointing="full")


def test_sharded_states_are_fp32_params_and_adam_moments_over_the_shard_group():
    est = estimate_memory(MODEL, TRAIN, HW8, FSDP2)
    shard = MODEL.num_parameters / 8
    assert est.gpu["parameters"] == pytest.approx(4 * shard, rel=1e-9)
    assert est.gpu["optimizer_states"] == pytest.approx(8 * shard, rel=1e-9)
    assert est.cpu_bytes_per_node == 0


def test_keeping_gathered_blocks_after_forward_costs_about_the_unsharded_blocks():
    keep = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(reshard_after_forward=False))
    reshard = estimate_memory(MODEL, TRAIN, HW8, FSDP2)
    blocks = BYTES_PER_ELEMENT["bf16"] * MODEL.block_params() * MODEL.num_hidden_layers
    extra = keep.gpu["peak"] - reshard.gpu["peak"]
    assert 0.8 * blocks < extra <= blocks


def test_hybrid_sharding_shards_over_one_node_only():
    hybrid = FSDP2.replace(sharding="hybrid")
    assert shard_group_size(hybrid, HW16) == 8 and shard_group_size(FSDP2, HW16) == 16
    full = estimate_memory(MODEL, TRAIN, HW16, FSDP2)
    hsdp = estimate_memory(MODEL, TRAIN, HW16, hybrid)
    assert hsdp.gpu["parameters"] == pytest.approx(2 * full.gpu["parameters"], rel=1e-9)
    assert "more than one node" in " ".join(estimate_memory(MODEL, TRAIN, HW8, hybrid).reasons)


def test_cpu_offload_moves_the_sharded_states_to_the_host():
    est = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(offload_params="cpu"))
    assert est.gpu["parameters"] == est.gpu["optimizer_states"] == 0
    assert est.cpu_bytes_per_node >= 16 * MODEL.num_parameters  # params, grads, moments of 8 shards
    nvme = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(offload_params="nvme"))
    assert not nvme.fits and "NVMe" in " ".join(nvme.reasons)


def test_fsdp2_ignores_the_deepspeed_knobs_and_deepspeed_the_fsdp2_ones():
    a = Strategy(engine="fsdp2", zero_stage=1, offload_optimizer="cpu", reduce_bucket_size=5)
    assert a == Strategy(engine="fsdp2") and a.key() == Strategy(engine="fsdp2").key()
    assert Strategy(reshard_after_forward=False, sharding="hybrid") == Strategy()


def test_every_kth_block_checkpointing_sits_between_none_and_all():
    none = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(checkpointing="none"))
    every2 = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(checkpoint_every=2))
    full = estimate_memory(MODEL, TRAIN, HW8, FSDP2)
    assert full.gpu["peak"] < every2.gpu["peak"] < none.gpu["peak"]
    assert FSDP2.replace(checkpoint_every=2).checkpointed_blocks(6) == [1, 3, 5]
    # the first half checkpointed saves the same activations as every second block
    half = estimate_memory(MODEL, TRAIN, HW8, FSDP2.replace(checkpoint_layers=16))
    assert every2.gpu["activations"] == pytest.approx(half.gpu["activations"], rel=0.05)


def test_fsdp2_communication_follows_resharding_and_the_reduce_dtype():
    base = simulate(MODEL, TRAIN, HW16, FSDP2).breakdown["exposed_communication"]
    no_reshard = simulate(MODEL, TRAIN, HW16, FSDP2.replace(reshard_after_forward=False)).breakdown
    bf16 = simulate(MODEL, TRAIN, HW16, FSDP2.replace(reduce_dtype="bf16")).breakdown
    assert no_reshard["exposed_communication"] < base and bf16["exposed_communication"] < base
    offload = simulate(MODEL, TRAIN, HW8, FSDP2.replace(offload_params="cpu")).breakdown
    assert offload["offload"] > 0 and offload["optimizer"] == 0
