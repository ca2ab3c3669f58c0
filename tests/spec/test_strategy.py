"""Strategy rules and the DeepSpeed / FSDP translations."""

import pytest

from autotune import HardwareSpec, Strategy, TrainingSpec, gpu_from_name, model_from_name
from autotune.strategy import validate
from autotune.engine_configs import fsdp_equivalent, gradient_accumulation_steps, to_deepspeed_config

MODEL = model_from_name("llama2-7b")
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64)
HW8 = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=8)
HW1 = HardwareSpec(gpu=gpu_from_name("a100-80gb"), gpus_per_node=1)

STRATEGIES = [
    Strategy(zero_stage=0, micro_batch_size=1),
    Strategy(zero_stage=1, micro_batch_size=2, precision="fp16"),
    Strategy(zero_stage=2, micro_batch_size=4, offload_optimizer="cpu", checkpointing="full"),
    Strategy(zero_stage=3, micro_batch_size=1, offload_optimizer="cpu", offload_params="cpu",
             checkpointing="selective", checkpoint_layers=7),
    Strategy(zero_stage=3, micro_batch_size=2, precision="fp32"),
]


def test_gradient_accumulation():
    assert gradient_accumulation_steps(Strategy(micro_batch_size=2), TRAIN, HW8) == 4
    assert gradient_accumulation_steps(Strategy(micro_batch_size=8), TRAIN, HW8) == 1


def test_validation_rules():
    assert validate(Strategy(zero_stage=2, offload_params="cpu"), MODEL, TRAIN, HW8)
    assert validate(Strategy(zero_stage=0, offload_optimizer="cpu"), MODEL, TRAIN, HW8)
    assert validate(Strategy(micro_batch_size=3), MODEL, TRAIN, HW8)
    assert validate(Strategy(checkpointing="full", checkpoint_layers=33), MODEL, TRAIN, HW8)
    assert validate(Strategy(zero_stage=3, offload_params="nvme"), MODEL, TRAIN, HW8)
    v100 = HardwareSpec(gpu=gpu_from_name("v100-32gb"))
    assert any("bf16" in e for e in validate(Strategy(), MODEL, TRAIN, v100))
    for s in STRATEGIES:
        assert validate(s, MODEL, TRAIN, HW8) == []


def test_op_checkpointing_is_refused_under_zero3_only():
    """ZeRO-3 gathers parameters inside the checkpointed block, which torch's selective checkpoint cannot
    replay (docs/engines.md; the crash: tests/memory/test_zero3_fetch.py); ZeRO-0/1/2 and FSDP2 gather none
    there."""
    from autotune.strategy import validation_errors

    errors = validation_errors(Strategy(zero_stage=3, checkpointing="op"), MODEL, TRAIN, HW8)
    assert [key for key, _ in errors] == ["checkpointing"] and "zero_stage 3" in errors[0][1]
    for ok in (Strategy(zero_stage=2, checkpointing="op"), Strategy(engine="fsdp2", checkpointing="op"),
               Strategy(zero_stage=3, checkpointing="full"), Strategy(zero_stage=3, checkpointing="mlp")):
        assert validate(ok, MODEL, TRAIN, HW8) == [], ok.describe()


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_deepspeed_parses_generated_config(strategy):
    # DeepSpeed's own parser; outside a launched job it sees world size 1, so parse the 1-GPU config
    # and check the batch identity of the 8-GPU one arithmetically.
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = to_deepspeed_config(strategy, MODEL, TRAIN, HW1)
    ds = DeepSpeedConfig(cfg)
    assert ds.zero_optimization_stage == strategy.zero_stage
    assert ds.train_micro_batch_size_per_gpu == strategy.micro_batch_size
    assert ds.gradient_accumulation_steps == 64 // strategy.micro_batch_size
    assert ds.bfloat16_config.enabled == (strategy.precision == "bf16")
    assert ds.float16_config.enabled == (strategy.precision == "fp16")
    if strategy.offload_optimizer != "none":
        assert ds.zero_config.offload_optimizer.device == strategy.offload_optimizer
    if strategy.offload_params != "none":
        assert ds.zero_config.offload_param.device == strategy.offload_params
    if strategy.zero_stage == 3:
        assert ds.zero_config.prefetch_bucket_size == int(0.9 * MODEL.hidden_size ** 2)
    cfg8 = to_deepspeed_config(strategy, MODEL, TRAIN, HW8)
    assert cfg8["train_batch_size"] == cfg8["train_micro_batch_size_per_gpu"] * cfg8[
        "gradient_accumulation_steps"] * 8 == 64


def test_small_models_get_small_buckets():
    tiny = model_from_name("tiny-llama")
    cfg = to_deepspeed_config(Strategy(zero_stage=2), tiny, TrainingSpec(seq_len=8, global_batch_size=8), HW8)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == tiny.num_parameters


def test_fsdp_mapping():
    names = [fsdp_equivalent(Strategy(zero_stage=z), HW8)["sharding_strategy"] for z in range(4)]
    # ZeRO-1 shards optimizer states only: SHARD_GRAD_OP would also shard gradients (ZeRO-2)
    assert names == ["NO_SHARD", None, "SHARD_GRAD_OP", "FULL_SHARD"]
    assert "no optimizer-state-only sharding" in fsdp_equivalent(Strategy(zero_stage=1), HW8)["note"]
    two_nodes = HardwareSpec(gpu=HW8.gpu, gpus_per_node=8, num_nodes=2)
    assert "HYBRID_SHARD" in fsdp_equivalent(Strategy(zero_stage=3), two_nodes)["alternative"]


def test_describe():
    s = Strategy(zero_stage=3, micro_batch_size=4, checkpointing="full", checkpoint_layers=8,
                 offload_optimizer="cpu")
    assert s.describe(32) == "ZeRO-3, optimizer->cpu, mbs 4, full ckpt 8/32, bf16"
