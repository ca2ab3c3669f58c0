"""MoE models with dense-MLP blocks among the sparse ones (autotune/memory/mixed.py): the published
DeepSeek-V2-Lite (first_k_dense_replace 1) is sized; each block is walked as its own kind, which for
blocks of one kind gives the uniform walk's bytes; ZeRO's flat order has each block's own feed-forward."""

import json
import os

import pytest

from autotune.hf_config import map_hf_config
from autotune.memory import estimate_memory, mixed, moe
from autotune.memory import activations, estimate, fsdp2, states
from autotune.memory.states import parameter_order
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.presets import gpu_from_name
from autotune.strategy import Strategy, validate

MOE_DIR = os.path.join(os.path.dirname(__file__), "..", "data", "hf", "moe")
STRATEGIES = [Strategy(zero_stage=0, micro_batch_size=1, precision="bf16"),
              Strategy(zero_stage=1, micro_batch_size=2, precision="fp32", checkpointing="full"),
              Strategy(zero_stage=2, micro_batch_size=1, precision="bf16", checkpointing="selective"),
              Strategy(zero_stage=3, micro_batch_size=1, precision="bf16", checkpointing="full", checkpoint_layers=1),
              Strategy(engine="fsdp2", micro_batch_size=1, precision="bf16"),
              Strategy(engine="fsdp2", micro_batch_size=2, precision="fp32", reshard_after_forward=False,
                       checkpointing="full")]


def _spec(name: str, **changes) -> ModelSpec:
    cfg = {**json.load(open(os.path.join(MOE_DIR, name + ".json"))), **changes}
    return ModelSpec(**map_hf_config(cfg, "c.json"))


def _small(name: str, **changes) -> ModelSpec:
    return _spec(name, num_hidden_layers=3, hidden_size=128, intermediate_size=344, vocab_size=2048, **changes)


TRAINING = TrainingSpec(seq_len=256, global_batch_size=8)


def _hw(gpus: int) -> HardwareSpec:
    return HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=gpus)


def test_published_deepseek_v2_lite_is_sized_with_its_dense_block():
    """DeepSeek-V2-Lite as published: block 0 a DeepseekV2MLP (10944 wide), 26 MoE blocks; sized, and
    its dense block changes the bytes (against the same model with every block routed)."""
    m = _spec("deepseek-v2-lite")
    assert m.dense_layers == (0,) and moe.not_sized(m, "deepseek_v2") is None
    assert sum(parameter_order(m)) == m.num_parameters
    routed = m.replace(dense_layers=())
    for s in STRATEGIES:
        for gpus in (1, 8):
            a = estimate_memory(m, TRAINING, _hw(gpus), s, device="cpu").gpu["peak"]
            b = estimate_memory(routed, TRAINING, _hw(gpus), s, device="cpu").gpu["peak"]
            assert a > 0 and a != b


@pytest.mark.parametrize("name,changes", [("deepseek-v2-lite", dict(first_k_dense_replace=1, n_routed_experts=4)),
                                          ("qwen1.5-moe-a2.7b", dict(mlp_only_layers=[1], num_experts=4))])
def test_flat_order_has_each_blocks_own_feed_forward(name, changes):
    m = _small(name, **changes)
    assert m.num_dense_layers == 1
    order = parameter_order(m)
    assert sum(order) == m.num_parameters
    dense_mlp = m.hidden_size * m.intermediate_size
    per_block = [order.count(dense_mlp)]  # the dense MLP's three weights appear once, in its block
    assert per_block[0] == 3


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_walk_by_block_kind_gives_the_uniform_bytes_for_one_kind(monkeypatch, gpus):
    """Every block marked routed but walked block by block (mixed.py's path) = the uniform walk, for
    ZeRO 0-3 and FSDP2 (reshard and keep), none / full / partial / selective checkpointing, CPU and CUDA."""
    m = _small("deepseek-v2-lite", first_k_dense_replace=0, n_routed_experts=4)
    assert mixed.layer_kinds(m) is None
    want = {(i, d): estimate_memory(m, TRAINING, _hw(gpus), s, device=d).gpu
            for i, s in enumerate(STRATEGIES) for d in ("cpu", "cuda")}
    kinds = lambda spec: (False,) * spec.num_hidden_layers if spec.is_moe else None  # noqa: E731
    for mod in (activations, estimate, fsdp2, states):
        monkeypatch.setattr(mod, "layer_kinds", kinds)
    activations._breakdown.cache_clear()
    states._persistent_params.cache_clear()
    got = {(i, d): estimate_memory(m, TRAINING, _hw(gpus), s, device=d).gpu
           for i, s in enumerate(STRATEGIES) for d in ("cpu", "cuda")}
    assert got == want


def test_the_screen_sizes_blocks_of_two_kinds_to_the_byte():
    """The screen's grid walks blocks of two kinds, each of its kind, for both engines: the bytes
    estimate_memory gives (tests/search/test_screen_fast.py checks the default space's)."""
    from autotune.memory import _fast

    m = _small("deepseek-v2-lite", first_k_dense_replace=1, n_routed_experts=4)
    hw = _hw(2)
    computed = 0
    for s, v in zip(STRATEGIES, _fast.verdicts(m, TRAINING, hw, STRATEGIES)):
        if validate(s, m, TRAINING, hw):  # a broken rule: never fits, no figures
            assert v == (False, None), s
            continue
        est = estimate_memory(m, TRAINING, hw, s)
        assert v == (est.fits, est.total_gpu_bytes), s
        computed += 1
    assert computed >= 4
    assert {s.engine for s in STRATEGIES} == {"deepspeed", "fsdp2"}
