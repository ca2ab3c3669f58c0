"""DeepSeek-V3 in the memory model (autotune/memory/moe.py ``router_sigmoid``, mla.py ``mla_rotary``): one tiny
block's saved tensors against what transformers keeps alive for backward (its sigmoid router with the
correction bias and group-limited top-k, its cos/sin rotary plain or interleaved), the parameters in ZeRO's
flat order, the layouts sized or refused, and the screen's numpy walk on a DeepSeek-V3 job."""

import json
import os

import pytest

from autotune.config import hf_config_fields, load_config
from autotune.errors import ConfigError
from autotune.memory import activation_breakdown, mla, moe
from autotune.memory.states import parameter_order
from autotune.spec import ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from conftest import ROOT
from test_memory_mla import _alive_saved_bytes_of_block
from test_memory_moe import _bench, _job, assert_screen_equals_estimate  # one definition each

V3 = os.path.join(ROOT, "tests", "data", "hf", "moe", "deepseek-v3.json")


def _config(tmp_path, **changes) -> str:
    """The benchmark's tiny DeepSeek-V3 (hf-deepseekv3) with ``changes``, built as
    autotune.models.sources.hf_model_from_config builds it (fp32, then cast)."""
    cfg = _bench().hf_config("hf-deepseekv3")
    cfg.pop("torch_dtype")
    cfg.update(changes)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("interleave,norm,nope,q_lora", [(True, True, 32, 48), (False, True, 32, None),
                                                         (True, False, 16, None), (False, False, 16, 48)])
def test_deepseek_v3_block_saved_tensors_match_transformers(interleave, norm, nope, q_lora, precision, tmp_path):
    """One tiny DeepSeek-V3 block (latent attention with the q LoRA or a plain q_proj, 4 routed experts top-2
    in 2 groups, the best 1 kept, a shared expert; rope_interleave and norm_topk_prob either way; nope 32:
    sdpa's CPU math kernel, 16: the flash kernel): what transformers keeps for backward equals
    per_block_plain to the byte, block 0 also keeping the cos / sin table every block shares. The model is
    cast as DeepSpeed casts it (every parameter and buffer, the fp32-kept router too)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = _config(tmp_path, rope_interleave=interleave, norm_topk_prob=norm, qk_nope_head_dim=nope,
                   q_lora_rank=q_lora)
    spec = ModelSpec(**hf_config_fields(path))
    assert spec.router_sigmoid and spec.router_norm_topk == norm and not spec.router_group_limited
    assert spec.mla_rotary == ("interleave" if interleave else "half") and mla.math_kernel(spec, "cpu") == (nope != 16)
    hf = transformers.AutoConfig.from_pretrained(path)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)  # deepspeed engine _cast_module_mixed_precision
    got = _alive_saved_bytes_of_block(model, 0, 2, 128, spec.vocab_size)
    act = activation_breakdown(spec, TrainingSpec(seq_len=128, global_batch_size=2, precision=precision),
                               Strategy(micro_batch_size=2, precision=precision), device="cpu")
    assert act.per_block_plain + mla.rope_table_bytes(spec, 128, 2 if precision == "bf16" else 4) == got


def test_deepseek_v3_router_terms_and_parameter_order(tmp_path):
    """V3's router keeps the sigmoid scores, the gather index and (norm_topk_prob) the quotient and its
    denominator, plus the fp32 input copy in 16-bit training; ZeRO's flat order holds every parameter."""
    m = ModelSpec(**hf_config_fields(_config(tmp_path)))
    e, k, h = m.num_experts, m.num_experts_per_tok, m.hidden_size
    assert moe.router_saved_per_token(m, 2) == 4 * h + 4 * e + 12 * k + 4
    assert moe.router_saved_per_token(m, 4) == 4 * e + 12 * k + 4
    assert moe.router_saved_per_token(m.replace(router_norm_topk=False), 2) == 4 * h + 4 * e + 8 * k
    assert sum(parameter_order(m)) == m.num_parameters
    assert moe.ffn_weight_elements(m) == sum(moe.ffn_parameter_order(m))
    assert mla.rope_table_bytes(m, 128, 2) == 2 * 2 * 128 * m.qk_rope_head_dim
    assert mla.rope_table_bytes(m.replace(mla_rotary="complex"), 128, 2) == 4 * 128 * m.qk_rope_head_dim


def test_deepseek_v3_layouts_sized_or_refused_in_one_line(tmp_path):
    """DeepSeek-V3 with every layer routed is sized; n_group not dividing the experts is refused in one
    line; the published file (first_k_dense_replace 3) is never refused for its router or rotary."""
    cfg = load_config(_job(tmp_path, _config(tmp_path)))
    assert moe.not_sized(cfg.model, "deepseek_v3") is None
    with pytest.raises(ConfigError) as err:
        load_config(_job(tmp_path, _config(tmp_path, n_group=3)))
    assert "\n" not in str(err.value) and "n_group 3" in str(err.value) and err.value.path == "model.hf_config"
    published = ModelSpec(**hf_config_fields(V3, exact_check=False))
    assert published.router_sigmoid and published.mla_rotary == "interleave"
    why = moe.not_sized(published, "deepseek_v3") or ""
    assert "sigmoid" not in why and "latent" not in why


def test_screen_grid_equals_estimate_memory_on_deepseek_v3(tmp_path):
    """The screen's numpy walk (autotune/memory/_fast.py) gives a DeepSeek-V3 candidate the verdict and
    bytes estimate_memory gives it (the engines space on 8 H100s, CUDA and CPU)."""
    assert_screen_equals_estimate(load_config(_job(tmp_path, _config(tmp_path))))
