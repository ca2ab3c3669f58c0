"""Gemma-3 (gemma3_text): four norms per block, the local/global layer pattern, and the published
multimodal config.json that nests the text model under text_config."""

import json
import os

import pytest

from autotune.cli import main
from autotune.config import hf_config_fields, load_config
from autotune.errors import ConfigError
from autotune.hf_config import map_hf_config
from autotune.spec import ModelSpec
from conftest import ROOT

HF_DIR = os.path.join(ROOT, "tests", "data", "hf")
ONE_B = os.path.join(HF_DIR, "gemma3-1b-pt.json")
FOUR_B = os.path.join(HF_DIR, "multimodal", "gemma3-4b-pt.json")
# keras-hub keras_hub/src/models/gemma3/gemma3_presets.py: gemma3_1b 999,885,952 parameters; its
# gemma3_4b_text 3,880,099,328 has a 262,144-token table, HF's text model 262,208 (+64 x 2560)
PUBLISHED = {ONE_B: 999_885_952, FOUR_B: 3_880_099_328 + 64 * 2560}


def _job(write, hf: str, seq_len: int) -> str:
    return write(f"model: {{hf_config: {hf}}}\ntraining: {{seq_len: {seq_len}, global_batch_size: 64}}\n"
                 "hardware: {gpu: h100-80gb, gpus_per_node: 8}\n")


@pytest.mark.parametrize("path", [ONE_B, FOUR_B], ids=["1b", "4b-multimodal"])
def test_counts_equal_published_and_meta_device(path):
    fields = hf_config_fields(path, exact_check=False)
    spec = ModelSpec(**fields)
    assert spec.num_parameters == PUBLISHED[path]
    assert spec.norms_per_block == 4 and spec.qk_norm == "head" and spec.norm == "rmsnorm_fp32"
    pytest.importorskip("transformers")
    assert ModelSpec(**hf_config_fields(path)).num_parameters == _meta_count_of_text_model(path)


def _meta_count_of_text_model(path: str) -> int:
    """transformers' own text model of the file (Gemma3ForConditionalGeneration.language_model +
    lm_head for the nested one), on the meta device, independently of autotune."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3ForConditionalGeneration

    raw = json.load(open(path))
    cfg = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version",
                                                      "torch_dtype")}
    config = AutoConfig.for_model(raw["model_type"], **cfg)
    with torch.device("meta"):
        if raw["model_type"] == "gemma3":
            model = Gemma3ForConditionalGeneration(config)
            parts = [model.model.language_model, model.lm_head]
        else:
            parts = [AutoModelForCausalLM.from_config(config)]
    return sum({id(p): p.numel() for part in parts for p in part.parameters()}.values())


def test_layer_pattern_from_sliding_window_pattern_and_layer_types():
    raw = json.load(open(ONE_B))
    out = map_hf_config(raw, "c.json")
    assert (out["sliding_window"], out["sliding_window_layers"], out["num_attention_masks"]) == (512, 22, 2)
    types = ["sliding_attention", "full_attention"] * 13
    assert map_hf_config({**raw, "layer_types": types}, "c.json")["sliding_window_layers"] == 13
    none = map_hf_config({**raw, "sliding_window": None}, "c.json")
    assert none.get("sliding_window") is None and none.get("num_attention_masks", 1) == 1
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        map_hf_config({**raw, "attn_logit_softcapping": 50.0}, "c.json")


def test_nested_text_config_was_refused_now_read(write, capsys):
    """Before: 'has none of num_attention_heads' (the top level of a multimodal file)."""
    assert hf_config_fields(FOUR_B, exact_check=False)["num_attention_heads"] == 8  # Gemma3TextConfig default
    assert main(["estimate", _job(write, FOUR_B, 512)]) == 0, capsys.readouterr().err
    with pytest.raises(ConfigError, match="text_config names no model_type"):
        map_hf_config({"model_type": "llava", "text_config": {"hidden_size": 64}}, "c.json")


def test_mixed_sliding_layers_at_a_long_sequence_are_refused(write, capsys):
    """At seq_len >= sliding_window transformers builds the sliding layers' masks and not the full
    layers': sized for none or for all by the memory model, so refused in one line."""
    assert main(["estimate", _job(write, ONE_B, 511)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    path = _job(write, ONE_B, 512)
    assert main(["estimate", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autotune: error: {path}: training.seq_len: 22 of 26 layers")
    with pytest.raises(ConfigError, match="seq_len < 512"):
        load_config(path)


def test_profiler_builds_the_nested_text_model(tmp_path):
    """autotune.models.sources builds the text model of a nested file (what is sized), not the
    vision tower with it."""
    pytest.importorskip("transformers")
    from autotune.models.sources import hf_model_from_config

    raw = json.load(open(FOUR_B))
    raw["text_config"].update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=128,
                              head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    small = tmp_path / "config.json"
    small.write_text(json.dumps(raw))
    model = hf_model_from_config(str(small))
    assert type(model).__name__ == "Gemma3ForCausalLM"
    spec = ModelSpec(**hf_config_fields(str(small)))
    assert sum(p.numel() for p in model.parameters()) == spec.num_parameters
