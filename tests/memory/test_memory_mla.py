"""DeepSeek-V2 in the memory model (autotune/memory/mla.py, moe.py): latent attention's and the shared
experts' saved tensors against what transformers keeps alive for backward in one tiny block, the
parameters in ZeRO's flat order, which DeepSeek layouts a job file sizes and which stay refused in one
line, and the screen's numpy walk on a DeepSeek-V2 job."""

import json
import os
import weakref

import pytest

from autotune.config import hf_config_fields, load_config
from autotune.errors import ConfigError
from autotune.memory import activation_breakdown, estimate_memory, mla, moe
from autotune.memory.states import parameter_order
from autotune.spec import ModelSpec, TrainingSpec
from autotune.strategy import Strategy, validate
from conftest import ROOT
from test_memory_moe import _bench, _job, assert_screen_equals_estimate  # one definition each

MOE_DIR = os.path.join(ROOT, "tests", "data", "hf", "moe")
LITE = os.path.join(MOE_DIR, "deepseek-v2-lite.json")


def _variant(tmp_path, **changes) -> str:
    """DeepSeek-V2-Lite's published config.json with ``changes``."""
    cfg = json.load(open(LITE))
    cfg.update(changes)
    path = tmp_path / "deepseek.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _alive_saved_bytes_of_block(model, index: int, batch: int, seq: int, vocab: int) -> int:
    """Bytes of the storages (parameters excluded) autograd saves inside ``model.model.layers[index]``
    that no earlier part of the forward saved and that are still alive when the forward returns (a node
    the graph drops, as a group-limited router's group max and top-k, frees what it saved; a storage
    whose saved tensors all died and whose address the allocator hands to a later one is counted anew,
    with the later one's size and block)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, int, list]] = {}  # storage -> (block, bytes, weak refs of its saved tensors)
    where = [-1]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *a, i=i: where.__setitem__(0, i))
        layer.register_forward_hook(lambda *a: where.__setitem__(0, -1))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            if ptr in seen and all(r() is None for r in seen[ptr][2]):
                del seen[ptr]
            seen.setdefault(ptr, (where[0], t.untyped_storage().nbytes(), []))[2].append(weakref.ref(t))
        return t

    x = torch.randint(0, vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=x, labels=x, use_cache=False)
    assert out.loss is not None
    return sum(n for block, n, refs in seen.values() if block == index and any(r() is not None for r in refs))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("name,router,nope", [("hf-deepseekv2", "greedy", 32), ("hf-deepseekv2-q", "greedy", 32),
                                              ("hf-deepseekv2", "group_limited_greedy", 32), ("hf-deepseekv2", "greedy", 16)])
def test_deepseek_v2_block_saved_tensors_match_transformers(name, router, nope, precision, tmp_path):
    """One tiny DeepSeek-V2 block of the memory benchmark (latent attention with a plain q_proj or the
    q LoRA, sdpa's CPU math kernel for qk 48 / v 32 heads, 4 routed experts top-2 plus a shared expert;
    greedy or group-limited top-k; nope 16: qk = v = 32, the CPU flash kernel): what transformers keeps for backward equals per_block_plain to the
    byte. The model is cast as DeepSpeed casts it (every parameter, the fp32-kept router too)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = _bench().hf_config(name)
    cfg.pop("torch_dtype")  # as autotune.models.sources.hf_model_from_config builds it: fp32, then cast
    cfg["qk_nope_head_dim"] = nope
    if router != "greedy":
        cfg.update(topk_method=router, n_group=2, topk_group=1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    spec = ModelSpec(**hf_config_fields(str(path)))
    assert spec.router_group_limited == (router != "greedy") and mla.math_kernel(spec, "cpu") == (nope != 16)
    hf = transformers.AutoConfig.from_pretrained(str(path))
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)  # deepspeed engine _cast_module_mixed_precision: every parameter
    got = _alive_saved_bytes_of_block(model, 0, 2, 128, spec.vocab_size)
    act = activation_breakdown(spec, TrainingSpec(seq_len=128, global_batch_size=2, precision=precision),
                               Strategy(micro_batch_size=2, precision=precision), device="cpu")
    # block 0 also saves the rotary table every block shares (the activations count it once, outside)
    assert act.per_block_plain + mla.rope_table_bytes(spec, 128) == got


def test_mla_terms_and_parameter_order(tmp_path):
    """ZeRO's flat order holds every parameter of DeepSeek-V2-Lite with every layer routed (latent
    attention, experts, router, shared experts); the CPU runs sdpa's math kernel for its 192-wide
    query / key and 128-wide value heads, the flash kernels when they are one width."""
    m = ModelSpec(**hf_config_fields(_variant(tmp_path, first_k_dense_replace=0), exact_check=False))
    assert m.is_mla and m.router_fp32 and not m.router_group_limited
    assert sum(parameter_order(m)) == m.num_parameters
    q = m.replace(q_lora_rank=1536)
    assert sum(parameter_order(q)) == q.num_parameters
    assert mla.math_kernel(m, "cpu") and not mla.math_kernel(m, "cuda")
    assert not mla.math_kernel(m.replace(qk_nope_head_dim=64), "cpu")
    # the routed experts, the router and the shared experts' 3 x h x (2 x 1408), in DeepseekV2Moe's order
    order = moe.ffn_parameter_order(m)
    assert order[2] == 64 * 2048 and order[3:] == [2 * 1408 * 2048] * 3
    assert moe.ffn_weight_elements(m) == sum(order)


def test_deepseek_layouts_sized_or_refused_in_one_line(tmp_path):
    """DeepSeek-V2 with every layer routed is accepted and sized; the published DeepSeek-V2-Lite (its
    first layer dense) stays refused in one line naming why (DeepSeek-V3: test_memory_deepseek_v3.py);
    latent attention with a sequence split or op checkpointing is refused too, selective checkpointing is
    sized (its measured rows: MOE_ROWS, test_memory_moe.py::test_stored_moe_rows_within_the_prediction_margin)."""
    assert load_config(_job(tmp_path, LITE)).model.dense_layers == (0,)  # sized now: test_memory_dense_layers.py
    cfg = load_config(_job(tmp_path, _variant(tmp_path, first_k_dense_replace=0)))
    m, tr, hw = cfg.model, cfg.training, cfg.hardware
    est = estimate_memory(m, tr, hw, Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full", precision="bf16"))
    assert est.gpu["parameters"] >= 2 * m.num_parameters / 8
    for bad in (Strategy(checkpointing="op"), Strategy(sequence_parallel_size=2)):
        errors = validate(bad, m, tr, hw)
        assert any("multi-head latent attention is not sized" in e for e in errors), bad
    assert not any("latent attention" in e for e in validate(Strategy(checkpointing="selective"), m, tr, hw))


def test_screen_grid_equals_estimate_memory_on_deepseek_v2(tmp_path):
    """The screen's numpy walk (autotune/memory/_fast.py) gives a DeepSeek-V2 candidate the verdict and
    bytes estimate_memory gives it (the engines space on 8 H100s, CUDA and CPU)."""
    assert_screen_equals_estimate(load_config(_job(tmp_path, _variant(tmp_path, first_k_dense_replace=0))))
