"""Mixture-of-experts and multi-head latent attention families: described exactly (the analytic
count of the published config.json = the transformers model built on the meta device); every published
file is sized (tests/memory/test_memory_moe.py), a variant the memory model does not size is refused in
one line."""

import glob
import json
import os
import sys

import pytest

from autotune.cli import main
from autotune.config import hf_config_fields, load_config
from autotune.errors import ConfigError
from autotune.hf_config import map_hf_config
from autotune.hf_moe import MOE_FAMILIES
from autotune.spec import ModelSpec
from conftest import BASE, ROOT
from test_hf_count import _meta_count  # the meta-device build, one definition

MOE_DIR = os.path.join(ROOT, "tests", "data", "hf", "moe")
FILES = sorted(glob.glob(os.path.join(MOE_DIR, "*.json")))
NAMES = [os.path.basename(f)[:-5] for f in FILES]
# the model cards' / papers' rounded totals (billions), independent of autotune and transformers
# (DeepSeek-V3's 671 B excludes its multi-token-prediction module, which transformers does not build)
PUBLISHED_B = {"mixtral-8x7b-v0.1": 46.7, "deepseek-v3": 671.0, "qwen3-30b-a3b": 30.5, "qwen1.5-moe-a2.7b": 14.3,
               "qwen2-57b-a14b": 57.4, "deepseek-v2-lite": 15.7, "olmoe-1b-7b-0924": 6.9, "phi-3.5-moe": 41.9,
               "gpt-oss-20b": 20.9}


def test_every_family_has_a_published_file():
    assert {json.load(open(f))["model_type"] for f in FILES} == set(MOE_FAMILIES)


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_analytic_count_without_torch_matches_published(path):
    spec = ModelSpec(**hf_config_fields(path, exact_check=False))
    name = os.path.basename(path)[:-5]
    assert spec.is_moe
    if name in PUBLISHED_B:
        assert round(spec.num_parameters / 1e9, 1) == PUBLISHED_B[name]


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_analytic_count_equals_meta_device_model(path):
    pytest.importorskip("transformers")
    spec = ModelSpec(**hf_config_fields(path))  # the exact check passes
    assert spec.num_parameters == _meta_count(json.load(open(path)))


SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             num_hidden_layers=6, pad_token_id=0)


@pytest.mark.parametrize("name,changes", [
    ("qwen3-30b-a3b", dict(num_experts=4, moe_intermediate_size=32, head_dim=16, decoder_sparse_step=2,
                           mlp_only_layers=[1, 4])),
    ("qwen1.5-moe-a2.7b", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                               decoder_sparse_step=3)),
    ("deepseek-v3", dict(n_routed_experts=8, n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=2,
                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                         num_key_value_heads=4, n_shared_experts=2)),
    ("deepseek-v2-lite", dict(n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=3, kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4)),
    ("gpt-oss-20b", dict(num_local_experts=4, head_dim=16, layer_types=None)),
    ("phi-3.5-moe", dict(num_local_experts=4, lm_head_bias=False)),
])
def test_dense_layers_biases_and_latent_attention_counted_as_built(name, changes, tmp_path):
    """Shrunk variants that move each structural switch: dense blocks (mlp_only_layers,
    decoder_sparse_step, first_k_dense_replace), shared experts, q LoRA or none, biases."""
    pytest.importorskip("transformers")
    raw = {**json.load(open(os.path.join(MOE_DIR, f"{name}.json"))), **SMALL, **changes}
    raw = {k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    spec = ModelSpec(**hf_config_fields(str(path), exact_check=False))
    assert spec.num_parameters == _meta_count(raw)


def test_a_variant_the_fields_cannot_express_is_refused():
    """phimoe without attention_bias: unbiased linears beside LayerNorms that keep their bias."""
    raw = json.load(open(os.path.join(MOE_DIR, "phi-3.5-moe.json")))
    with pytest.raises(ConfigError, match="attention_bias: false.*not described"):
        map_hf_config({**raw, "attention_bias": False}, "c.json")


def test_dense_blocks_and_sliding_layers_are_read():
    qwen = json.load(open(os.path.join(MOE_DIR, "qwen3-30b-a3b.json")))
    out = map_hf_config({**qwen, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, "c.json")
    assert set(out["dense_layers"]) == {1, *range(0, 48, 2)}  # (i + 1) % 2 != 0, or listed
    assert map_hf_config(json.load(open(os.path.join(MOE_DIR, "deepseek-v3.json"))), "c.json")["dense_layers"] == (0, 1, 2)
    oss = map_hf_config(json.load(open(os.path.join(MOE_DIR, "gpt-oss-20b.json"))), "c.json")
    assert (oss["sliding_window"], oss["sliding_window_layers"], oss["attention_sinks"]) == (128, 12, True)
    lite = map_hf_config(json.load(open(os.path.join(MOE_DIR, "deepseek-v2-lite.json"))), "c.json")
    assert lite["q_lora_rank"] is None and lite["shared_expert_intermediate_size"] == 2 * 1408


def test_the_expert_count_is_read_under_its_aliases():
    """The configuration classes alias the count (Qwen3MoeConfig num_experts -> num_local_experts,
    OlmoeConfig num_local_experts -> num_experts, DeepseekV3Config num_local_experts -> n_routed_experts):
    a file saved under the alias, the family's key null or absent, gives the same description (before, the
    family's default was read: 128 experts for a Qwen3-MoE file of 4)."""
    for name, key, alias in (("qwen3-30b-a3b.json", "num_experts", "num_local_experts"),
                             ("olmoe-1b-7b-0924.json", "num_experts", "num_local_experts"),
                             ("deepseek-v3.json", "n_routed_experts", "num_local_experts")):
        cfg = json.load(open(os.path.join(MOE_DIR, name)))
        plain = map_hf_config({**cfg, key: 16}, "c.json")
        moved = {k: v for k, v in cfg.items() if k != key}
        assert map_hf_config({**moved, alias: 16}, "c.json") == plain
        assert map_hf_config({**moved, key: None, alias: 16}, "c.json")["num_experts"] == 16


def _job(write, hf: str) -> str:
    return write(BASE.replace("preset: llama2-7b", f"hf_config: {hf}"))


SIZED = ("mixtral-8x7b-v0.1.json", "qwen3-30b-a3b.json", "qwen1.5-moe-a2.7b.json",  # accepted and sized:
         "qwen2-57b-a14b.json", "deepseek-v2-lite.json", "deepseek-v3.json",  # tests/memory/test_memory_moe.py;
         "olmoe-1b-7b-0924.json", "gpt-oss-20b.json", "granite-3.0-1b-a400m.json", "phi-3.5-moe.json")
# their dense first blocks (first_k_dense_replace 1 / 3): tests/memory/test_memory_dense_layers.py
assert not [f for f in FILES if os.path.basename(f) not in SIZED], "a published MoE file neither sized nor refused"
REFUSED = {"phi-3.5-moe-top4": ("phi-3.5-moe.json", {"num_experts_per_tok": 4})}
"""Described exactly but not sized (memory.moe.not_sized): phimoe's sparsemixer routes two experts whatever
num_experts_per_tok says (the parameters do not depend on it)."""


@pytest.mark.parametrize("light", [False, True], ids=["transformers", "light-install"])
@pytest.mark.parametrize("variant", sorted(REFUSED))
def test_refused_in_one_line_with_the_exact_count(variant, light, write, capsys, monkeypatch, tmp_path):
    """Before: refused by the count ('transformers builds 46,702,792,704') or, without
    transformers, by model_type. Now described exactly, and refused because the memory model does
    not size this layout's activations: exit 2, one line, never a front sized as a dense decoder."""
    name, changes = REFUSED[variant]
    path = str(tmp_path / f"{variant}.json")
    with open(path, "w") as f:
        json.dump({**json.load(open(os.path.join(MOE_DIR, name))), **changes}, f)
    if light:
        monkeypatch.setitem(sys.modules, "transformers", None)
    else:
        pytest.importorskip("transformers")
    spec = ModelSpec(**hf_config_fields(path, exact_check=False))
    job = _job(write, path)
    assert main(["estimate", job]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autotune: error: {job}: model.hf_config: {path}: ")
    assert f"mixture-of-experts ({spec.num_experts} experts, top-{spec.num_experts_per_tok})" in err[0]
    assert f"is described exactly ({spec.num_parameters:,} parameters) but its activations are not modelled" in err[0]
    assert ("multi-head latent attention" in err[0]) == ("deepseek" in path)


@pytest.mark.parametrize("name", SIZED)
def test_the_auxiliary_loss_is_refused_not_left_out(name, tmp_path, write, capsys):
    """output_router_logits: true makes the model keep every layer's router logits for its
    load-balancing loss, which the memory model does not size: one line, exit 2; false is sized."""
    raw = json.load(open(os.path.join(MOE_DIR, name)))
    for value, code in ((True, 2), (False, 0)):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "output_router_logits": value}))
        assert main(["estimate", _job(write, str(tmp_path / "config.json"))]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert (code == 0 and not err) or (len(err) == 1 and "output_router_logits: true" in err[0]), err


def test_explicit_expert_fields_are_refused_too(write):
    with pytest.raises(ConfigError, match="activations are not modelled") as err:
        load_config(write(BASE.replace("preset: llama2-7b", "preset: llama2-7b, num_experts: 8, num_experts_per_tok: 2")))
    assert err.value.path == "model.num_experts"
    with pytest.raises(ConfigError, match=r"model.dense_layers\[1\]"):
        load_config(write(BASE.replace("preset: llama2-7b", "preset: llama2-7b, dense_layers: [0, -1]")))


def test_a_family_not_described_is_still_refused(tmp_path, write, monkeypatch):
    """granitemoeshared (Granite MoE with a shared expert, not mapped): with transformers its
    description misses the experts (counts differ); without, its model_type is refused."""
    raw = {**json.load(open(os.path.join(MOE_DIR, "granite-3.0-1b-a400m.json"))), **SMALL,
           "model_type": "granitemoeshared", "num_local_experts": 4, "shared_intermediate_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    job = write(BASE.replace("preset: llama2-7b", "hf_config: config.json"))
    if "transformers" in sys.modules or _has_transformers():
        with pytest.raises(ConfigError, match="transformers builds"):
            load_config(job)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"model_type 'granitemoeshared' is not among.*autotune\[hf\]"):
        load_config(job)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
