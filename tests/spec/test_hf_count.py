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
from autotune.hf_config import EXACT_FAMILIES
from autotune.spec import ModelSpec
from conftest import BASE, ROOT

HF_DIR = os.path.join(ROOT, "tests", "data", "hf")
FILES = sorted(glob.glob(os.path.join(HF_DIR, "*.json")))
KIND = {f: json.load(open(f))["model_type"] for f in FILES}
MOE_DIR = os.path.join(HF_DIR, "moe")  # mixture-of-experts / MLA families: tests/spec/test_hf_moe.py
MOE_KINDS = {json.load(open(f))["model_type"] for f in glob.glob(os.path.join(MOE_DIR, "*.json"))}

# published totals (model cards / papers), independent of autotune and of transformers
PUBLISHED = {"gemma-7b": 8_537_680_896, "gpt2": 124_439_808, "pythia-160m": 162_322_944,
             "mistral-7b-v0.1": 7_241_732_096, "gemma3-1b-pt": 999_885_952, "qwen2-0.5b": 494_032_768, "phi-3-mini-4k": 3_821_079_552}


def test_the_proven_families_are_the_files_in_the_repo():
    """EXACT_FAMILIES (what the light install accepts) and the families proven below cannot drift."""
    assert set(KIND.values()) | MOE_KINDS == set(EXACT_FAMILIES)
    assert not set(KIND.values()) & MOE_KINDS


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_analytic_count_without_torch_matches_published(path):
    spec = ModelSpec(**hf_config_fields(path, exact_check=False))
    name = os.path.basename(path)[:-5]
    if name in PUBLISHED:
        assert spec.num_parameters == PUBLISHED[name]


@pytest.mark.parametrize("family", sorted(set(KIND.values())))
def test_analytic_count_equals_meta_device_model(family):
    """Every family the light install accepts, proven on its published config.json."""
    pytest.importorskip("transformers")
    paths = [f for f in FILES if KIND[f] == family]
    assert paths, f"no config.json of {family} in tests/data/hf"
    for path in paths:
        raw = json.load(open(path))
        spec = ModelSpec(**hf_config_fields(path))  # the exact check passes
        assert _meta_count(raw) == spec.num_parameters


def _moe(name: str) -> str:
    return os.path.join(MOE_DIR, f"{name}.json")


def _meta_count(raw: dict) -> int:
    """The whole model built on the meta device, independently of autotune.hf_count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version",
                                                      "torch_dtype")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw["model_type"], **cfg))
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def test_layer_extrapolation_is_exact(monkeypatch):
    pytest.importorskip("transformers")
    from autotune import hf_count

    raw = json.load(open(os.path.join(HF_DIR, "qwen3-0.6b.json")))
    small = dict(raw, num_hidden_layers=5, hidden_size=64, intermediate_size=96, vocab_size=256, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(hf_count, "FULL_BUILD_LAYERS", 3)  # 5 layers: extrapolated from 1, 2 (and 3 alike)
    assert hf_count.hf_parameter_count(small, 5) == _meta_count(small)


@pytest.mark.parametrize("full_build_layers", [4, 256])
def test_layers_that_differ_are_counted_as_built(monkeypatch, full_build_layers):
    """DeepSeek-V3's first_k_dense_replace dense layers before the MoE ones: a 1-and-2-layer
    extrapolation sees only dense layers (37.4 B for the 671 B model); deeper configs than
    FULL_BUILD_LAYERS whose layers differ are built whole too."""
    pytest.importorskip("transformers")
    from autotune import hf_count

    raw = json.load(open(_moe("deepseek-v3")))
    small = dict(raw, num_hidden_layers=5, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=8, v_head_dim=8, vocab_size=256)
    monkeypatch.setattr(hf_count, "FULL_BUILD_LAYERS", full_build_layers)
    assert hf_count.hf_parameter_count(small, 5) == _meta_count(small)


def _block_transformers(monkeypatch) -> None:
    """The light install: ``import transformers`` fails (ImportError), as when it is not installed."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    from autotune.hf_count import hf_parameter_count

    assert hf_parameter_count({"model_type": "llama"}, 2) is None


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_light_install_accepts_proven_families(path, monkeypatch, write, capsys):
    _block_transformers(monkeypatch)
    # seq_len under Gemma-3's 512-token window: longer, its mix of sliding and full layers is refused
    job = write(BASE.replace("preset: llama2-7b", f"hf_config: {path}").replace("seq_len: 4096", "seq_len: 256"))
    assert main(["estimate", job]) == 0, capsys.readouterr().err
    # sized, and said to be unchecked: one note line on stderr naming the file and the hf extra
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autotune: note: {os.path.join(os.path.dirname(job), path)}: ")
    assert "not checked against the transformers model" in err[0] and "autotune[hf]" in err[0]
    assert ("activations" in err[0]) == (not load_config(job).model.is_moe)


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
            "from autotune.errors import ConfigError\n"
            f"assert ModelSpec(**hf_config_fields({_moe('mixtral-8x7b-v0.1')!r})).num_parameters == 46_702_792_704\n"
            "assert model_from_name('llama2-7b').num_parameters == 6_738_415_616\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_torch_free_process_counts_in_a_child_and_caches_the_count(tmp_path):
    """The simulate path never imports torch: a fresh interpreter loading an hf_config job counts in a
    child process and caches the count; the next load reads the cache (a wrong cached count is then
    what refuses the file, proving it was read) and a config transformers cannot build is refused
    in one line through the child."""
    pytest.importorskip("transformers")
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")}
    job = os.path.join(ROOT, "examples", "llama3.1-8b-long.yaml")
    code = ("import sys\nfrom autotune.config import load_config\n"
            f"cfg = load_config({job!r})\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
            "print(cfg.model.num_parameters)\n")

    def load() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=600)

    first = load()
    assert first.returncode == 0, first.stderr[-2000:]
    assert int(first.stdout) == 8_030_261_248  # Llama-3.1-8B's model card
    cache = tmp_path / "cache" / "hf_counts.json"
    entries = {k: v for k, v in json.loads(cache.read_text()).items() if not k.startswith("blocks:")}
    assert list(entries.values()) == [8_030_261_248]  # (beside it, the block measurement: test_hf_blocks.py)
    cache.write_text(json.dumps({key: 8_030_261_249 for key in entries}))
    second = load()
    assert second.returncode != 0 and "transformers builds 8,030,261,249" in second.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.load(open(os.path.join(ROOT, "examples", "tiny-llama-hf.json"))),
                               "rope_scaling": {"rope_type": "no-such-rope"}}))
    (tmp_path / "job.yaml").write_text(BASE.replace("preset: llama2-7b", f"hf_config: {bad}"))
    out = subprocess.run([sys.executable, "-m", "autotune", "estimate", "job.yaml"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=600)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "transformers cannot build model_type 'llama'" in err[0], err
