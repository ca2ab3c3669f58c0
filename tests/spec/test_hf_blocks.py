"""A dense config.json, or a MoE one of a sized family, is sized only if its blocks keep for backward what
the memory model says (autotune.hf_blocks, hf_config.check_block_bytes): shrinking keeps the family's
switches, a family whose forward differs is refused in one line, one that matches is sized, one the
measurement cannot run is refused, a proven family's file with an untested switch is refused (a MoE
family's too), and a torch-free process measures in a child and caches it."""

import json
import os
import subprocess
import sys

import pytest

from autotune.config import hf_config_fields
from autotune.errors import ConfigError
from autotune.hf_blocks import BLOCKS, shrink
from autotune.hf_config import EXACT_FAMILIES
from conftest import ROOT


def test_shrink_sets_the_sizes_and_keeps_the_switches():
    cfg = {"model_type": "glm", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
           "intermediate_size": 13696, "num_hidden_layers": 40, "vocab_size": 151552, "head_dim": 128,
           "partial_rotary_factor": 0.5, "attention_bias": True, "eos_token_id": 151329, "pad_token_id": 3,
           "torch_dtype": "bfloat16", "layer_types": ["full_attention"] * 40, "rms_norm_eps": 1e-5}
    small = shrink(cfg)
    assert (small["hidden_size"], small["num_attention_heads"], small["num_key_value_heads"]) == (128, 4, 2)
    assert small["num_hidden_layers"] == BLOCKS and len(small["layer_types"]) == BLOCKS
    assert small["head_dim"] == 32 and small["vocab_size"] == 512 and small["eos_token_id"] == 0
    assert small["pad_token_id"] == 3 and "torch_dtype" not in small
    assert {k: small[k] for k in ("partial_rotary_factor", "attention_bias", "rms_norm_eps")} == \
        {"partial_rotary_factor": 0.5, "attention_bias": True, "rms_norm_eps": 1e-5}
    assert shrink({**cfg, "num_key_value_heads": 32})["num_key_value_heads"] == 4  # multi-head stays so
    assert shrink({**cfg, "num_key_value_heads": 1})["num_key_value_heads"] == 1  # multi-query too


def _family_file(tmp_path, kind: str) -> str:
    """transformers' default config of ``kind`` as a config.json."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(kind).to_dict()
    cfg["model_type"] = kind
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(cfg, default=str))
    return str(path)


def test_a_family_whose_blocks_differ_is_refused_in_one_line(tmp_path):
    """GLM has Llama's parameters (its count matches) but another forward (its partial rotary on
    interleaved pairs): its blocks keep about 5% more than the memory model says."""
    pytest.importorskip("torch")
    assert "glm" not in EXACT_FAMILIES
    with pytest.raises(ConfigError) as err:
        hf_config_fields(_family_file(tmp_path, "glm"))
    text = str(err.value)
    assert "\n" not in text and err.value.path == "model.hf_config" and "model_type 'glm'" in text
    assert "block activations are -" in text and "mis-sized" in text


def test_a_family_whose_blocks_match_is_sized(tmp_path):
    pytest.importorskip("torch")
    assert "granite" not in EXACT_FAMILIES
    fields = hf_config_fields(_family_file(tmp_path, "granite"))
    assert fields["hidden_size"] > 128  # the file's own size: only the check shrinks it


def test_a_family_the_measurement_cannot_run_is_refused(tmp_path):
    """MPT has no sdpa attention in transformers: what the memory model would size cannot run."""
    pytest.importorskip("torch")
    with pytest.raises(ConfigError) as err:
        hf_config_fields(_family_file(tmp_path, "mpt"))
    assert "\n" not in str(err.value) and "cannot be checked" in str(err.value)


def test_a_torch_free_process_measures_in_a_child_and_caches(tmp_path):
    """The CLI's process never imports torch: the parameter count and the measurement run in one
    ``python -m autotune.hf_blocks`` child (hf_config.warm_checks) and land in the cache file, which a
    second load reads (no child)."""
    pytest.importorskip("transformers")
    path = _family_file(tmp_path, "granite")
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import subprocess, sys\nfrom autotune.config import hf_config_fields\nruns = []\n"
            "real = subprocess.run\nsubprocess.run = lambda *a, **k: runs.append(a) or real(*a, **k)\n"
            f"hf_config_fields({path!r})\nassert len(runs) == 1, runs\n"
            "subprocess.run = None\n"  # a second load must not start a child
            f"hf_config_fields({path!r})\nassert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cache = json.loads((tmp_path / "cache" / "hf_counts.json").read_text())
    blocks = [v for k, v in cache.items() if k.startswith("blocks:")]
    assert len(blocks) == 1 and set(blocks[0]) == {"bf16", "fp32"} and len(blocks[0]["bf16"]) == BLOCKS - 1


def test_a_proven_familys_file_with_an_untested_switch_is_refused(tmp_path):
    """A family the tests prove (EXACT_FAMILIES) is measured too: its file can set a switch no test
    covers (GPT-2 with activation_function relu: the memory model counts the GELU's saved tensors);
    the published file passes."""
    pytest.importorskip("torch")
    gpt2 = os.path.join(ROOT, "tests", "data", "hf", "gpt2.json")
    assert "gpt2" in EXACT_FAMILIES and hf_config_fields(gpt2)["hidden_act"] == "gelu_new"
    relu = tmp_path / "relu.json"
    relu.write_text(json.dumps({**json.load(open(gpt2)), "activation_function": "relu"}))
    with pytest.raises(ConfigError) as err:
        hf_config_fields(str(relu))
    assert "\n" not in str(err.value) and "block activations are +" in str(err.value)


MOE_DIR = os.path.join(ROOT, "tests", "data", "hf", "moe")
SIZED_MOE = ("deepseek-v2-lite.json", "deepseek-v3.json", "granite-3.0-1b-a400m.json", "mixtral-8x7b-v0.1.json",
             "olmoe-1b-7b-0924.json", "qwen1.5-moe-a2.7b.json", "qwen2-57b-a14b.json", "qwen3-30b-a3b.json",
             "gpt-oss-20b.json", "phi-3.5-moe.json")


@pytest.mark.parametrize("name", SIZED_MOE)
def test_sized_moe_files_are_measured_to_the_byte(name):
    """A MoE / latent-attention file of a sized family is measured too (4 experts, top-2, MLA ranks shrunk;
    DeepSeek's dense first blocks and the MoE one each as its kind): every compared block, bf16 and fp32,
    is what the memory model says to the byte."""
    pytest.importorskip("torch")
    from autotune import hf_blocks, hf_config
    from autotune.config import _checked_hf_fields

    path = os.path.join(MOE_DIR, name)
    cfg = json.load(open(path))
    small_cfg, small = hf_config._shrunk(cfg, path, _checked_hf_fields)
    assert small.is_moe and small.num_experts == 4 and small.num_experts_per_tok == 2
    measured = hf_blocks.saved_bytes_of_blocks(small_cfg, small.attn_implementation)
    for precision in ("bf16", "fp32"):
        assert measured[precision] == [int(b) for b in hf_config._block_bytes(small, precision)], precision


def test_longrope_factors_are_cut_to_the_shrunk_head(tmp_path):
    """Phi-3.5-MoE as Microsoft publishes it scales its rotary by longrope, one long and one short factor per pair
    of the head's 128 dims: the shrink cuts both lists to the 32-wide head's 16 (else transformers cannot build
    the shrunk model and the file is refused as not checkable), and the blocks are measured to the byte."""
    pytest.importorskip("torch")
    from autotune import hf_blocks, hf_config
    from autotune.config import _checked_hf_fields

    rope = {"type": "longrope", "long_factor": [1.0 + i / 64 for i in range(64)], "short_factor": [1.0] * 64,
            "long_mscale": 1.243, "short_mscale": 1.243, "original_max_position_embeddings": 4096}
    path = tmp_path / "phi-3.5-moe-longrope.json"
    path.write_text(json.dumps({**json.load(open(os.path.join(MOE_DIR, "phi-3.5-moe.json"))), "rope_scaling": rope}))
    small_cfg, small = hf_config._shrunk(json.load(open(path)), str(path), _checked_hf_fields)
    assert [len(small_cfg["rope_scaling"][k]) for k in ("long_factor", "short_factor")] == [16, 16]
    assert hf_blocks.shrink({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
                             "partial_rotary_factor": 0.75})["rope_scaling"]["long_factor"] == [1.0] * 12
    measured = hf_blocks.saved_bytes_of_blocks(small_cfg, small.attn_implementation)
    for precision in ("bf16", "fp32"):
        assert measured[precision] == [int(b) for b in hf_config._block_bytes(small, precision)], precision
    hf_config_fields(str(path))


def test_a_sized_moe_familys_file_with_an_untested_switch_is_refused(tmp_path, monkeypatch):
    """Mixtral with router_jitter_noise (a uniform draw multiplies the block input in training), were it
    not refused by name (hf_moe.training_noise): its measured blocks keep more than the model says; a
    MoE layout the memory model does not size (phimoe at top-4) is not measured (model_rules.check_modelled
    refuses it)."""
    pytest.importorskip("torch")
    from autotune import hf_blocks, hf_config

    jitter = tmp_path / "jitter.json"
    jitter.write_text(json.dumps({**json.load(open(os.path.join(MOE_DIR, "mixtral-8x7b-v0.1.json"))),
                                  "router_jitter_noise": 0.01}))
    monkeypatch.setattr(hf_config, "training_noise", lambda cfg: None)
    with pytest.raises(ConfigError) as err:
        hf_config_fields(str(jitter))
    assert "\n" not in str(err.value) and "block activations are -" in str(err.value)

    def never(*args):
        raise AssertionError("measured a MoE file of a family the memory model does not size")

    monkeypatch.setattr(hf_blocks, "saved_bytes_of_blocks", never)
    top4 = tmp_path / "phimoe-top4.json"  # phimoe's sparsemixer routes two experts whatever top-k says: not sized
    top4.write_text(json.dumps({**json.load(open(os.path.join(MOE_DIR, "phi-3.5-moe.json"))), "num_experts_per_tok": 4}))
    hf_config_fields(str(top4))
