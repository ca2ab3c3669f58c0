"""model.hf_config: HF families described exactly (parameter count = the transformers model built on
the meta device), refused in one line otherwise; presets and explicit fields need no torch."""

import glob
import json
import os
import subprocess
import sys

import pytest

from autotune.cli import main
from autotune.config import hf_config_fields, load_config
from autotune.errors import ConfigError
from autotune.spec import ModelSpec
from conftest import BASE, ROOT

HF_DIR = os.path.join(ROOT, "tests", "data", "hf")
FILES = sorted(glob.glob(os.path.join(HF_DIR, "*.json")))

# published totals (model cards / papers), independent of autotune and of transformers
PUBLISHED = {"gemma-7b": 8_537_680_896, "gpt2": 124_439_808, "pythia-160m": 162_322_944,
             "mistral-7b-v0.1": 7_241_732_096, "qwen2-0.5b": 494_032_768, "phi-3-mini-4k": 3_821_079_552}


def test_ten_families_in_the_repo():
    kinds = {json.load(open(f))["model_type"] for f in FILES}
    assert kinds >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt2", "gpt_neox"}


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_analytic_count_without_torch_matches_published(path):
    spec = ModelSpec(**hf_config_fields(path, exact_check=False))
    name = os.path.basename(path)[:-5]
    if name in PUBLISHED:
        assert spec.num_parameters == PUBLISHED[name]


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_analytic_count_equals_meta_device_model(path):
    pytest.importorskip("transformers")
    from autotune.hf_count import hf_parameter_count

    raw = json.load(open(path))
    spec = ModelSpec(**hf_config_fields(path))  # the exact check passes
    assert hf_parameter_count(raw, spec.num_hidden_layers) == spec.num_parameters


def test_layer_extrapolation_is_exact():
    pytest.importorskip("transformers")
    from autotune.hf_count import hf_parameter_count

    raw = json.load(open(os.path.join(HF_DIR, "qwen3-0.6b.json")))
    small = dict(raw, num_hidden_layers=3, hidden_size=64, intermediate_size=96, vocab_size=256, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in small.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **cfg))
    direct = sum({id(p): p.numel() for p in model.parameters()}.values())
    assert hf_parameter_count(small, 3) == direct


def test_undescribed_family_is_refused_in_one_line(write, tmp_path, capsys):
    """Llama with attention_bias but no mlp_bias: o_proj carries a bias the description lacks."""
    pytest.importorskip("transformers")
    raw = json.load(open(os.path.join(HF_DIR, "llama-3.2-1b.json")))
    raw.update(attention_bias=True, mlp_bias=False, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    path = write(BASE.replace("preset: llama2-7b", "hf_config: config.json"))
    with pytest.raises(ConfigError, match=r"model.hf_config.*difference \+4,096 \(\+2,048 per layer\)"):
        load_config(path)
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autotune: error: {path}: model.hf_config: ")


def test_junk_that_transformers_cannot_build_is_refused(write, tmp_path):
    pytest.importorskip("transformers")
    raw = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 96, "vocab_size": 100, "rope_scaling": {"rope_type": "no-such-rope"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="model.hf_config"):
        load_config(write(BASE.replace("preset: llama2-7b", "hf_config: config.json")))


def test_without_torch_presets_and_hf_files_still_load(tmp_path):
    """A fresh interpreter where torch and transformers cannot be imported."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from autotune.config import hf_config_fields\n"
            "from autotune.hf_count import hf_parameter_count\n"
            "from autotune.presets import model_from_name\n"
            "from autotune.spec import ModelSpec\n"
            f"spec = ModelSpec(**hf_config_fields({os.path.join(HF_DIR, 'gemma-7b.json')!r}))\n"
            "assert spec.num_parameters == 8_537_680_896, spec.num_parameters\n"
            "assert hf_parameter_count({'model_type': 'llama'}, 2) is None\n"
            "assert model_from_name('llama2-7b').num_parameters == 6_738_415_616\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
