"""Every preset, every shipped YAML: exact parameter counts and clean loading."""

import glob
import os

import pytest

from autotune import presets
from autotune.config import load_config
from conftest import EXAMPLES

# Published parameter counts (HF model cards / sum over the safetensors index of each source config).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mpt-7b": 6_649_286_656,
    "qwen3-32b": 32_762_123_264,  # transformers 5.24 on the meta device (the model card: 32.8B)
}


@pytest.mark.parametrize("name", presets.model_names())
def test_model_preset(name):
    spec = presets.model_from_name(name)
    assert spec.source, "every preset cites its source"
    assert spec.num_attention_heads % spec.num_key_value_heads == 0
    if name in PUBLISHED:
        assert spec.num_parameters == PUBLISHED[name]


def test_all_required_presets_present():
    assert set(PUBLISHED) <= set(presets.model_names())
    assert {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l40s", "rtx4090"} <= set(
        presets.gpu_names())


@pytest.mark.parametrize("name", presets.gpu_names())
def test_gpu_preset(name):
    gpu = presets.gpu_from_name(name)
    assert gpu.source and gpu.memory_bytes > 16 << 30
    assert gpu.peak_flops("fp16") > gpu.peak_flops("fp32") > 0
    assert gpu.intra_node_bandwidth_gbps > 0 and gpu.pcie_bandwidth_gbps > 0


def test_overrides_and_unknown():
    assert presets.model_from_name("llama2-7b", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        presets.model_from_name("nope")


def test_qwen2_style_bias_count():
    # Qwen2-7B (Qwen/Qwen2-7B config.json): q/k/v biases only; 7,615,616,512 parameters.
    spec = presets.model_from_name("llama2-7b", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                                   num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, qkv_bias=True)
    assert spec.num_parameters == 7_615_616_512


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))))
def test_shipped_examples_load(path):
    cfg = load_config(path)
    assert cfg.model.num_parameters > 0 and cfg.hardware.num_gpus >= 1
