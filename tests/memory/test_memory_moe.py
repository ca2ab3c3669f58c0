"""The memory model's mixture-of-experts blocks (autotune/memory/moe.py): which published MoE
config.json files a job file accepts and sizes, which stay refused in one line, the routed block's
saved tensors against what transformers keeps for backward, and the stored measured MoE rows of
benchmarks/memory_vs_deepspeed.py (moe_grid: real DeepSpeed ZeRO 0-3 and FSDP2 steps) within the
prediction margin."""

import dataclasses
import glob
import json
import os
from pathlib import Path

import pytest

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.memory import PREDICTION_MARGIN, activation_breakdown, estimate_memory
from autotune.memory import moe
from autotune.memory.states import parameter_order
from autotune.spec import TrainingSpec
from autotune.strategy import Strategy
from conftest import ROOT, benchmark

MOE_DIR = os.path.join(ROOT, "tests", "data", "hf", "moe")
FILES = sorted(glob.glob(os.path.join(MOE_DIR, "*.json")))
SIZED = {"mixtral-8x7b-v0.1.json", "qwen3-30b-a3b.json", "qwen1.5-moe-a2.7b.json", "qwen2-57b-a14b.json",
         "deepseek-v2-lite.json", "deepseek-v3.json", "olmoe-1b-7b-0924.json", "gpt-oss-20b.json",
         "granite-3.0-1b-a400m.json", "phi-3.5-moe.json"}  # their dense first blocks: test_memory_dense_layers.py
DENSE_FIRST = {"deepseek-v2-lite.json", "deepseek-v3.json"}
"""Published files with dense blocks among the MoE ones: the screen leaves them to estimate_memory."""


def _bench():
    return benchmark("memory_vs_deepspeed")


def tiny_hf_model(name: str, tmp_path, precision: str = "bf16") -> tuple:
    """(ModelSpec, transformers model) of the memory benchmark's tiny HF family ``name`` (sdpa, seed 0)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    path = _bench()._hf_path(name, tmp_path)
    spec = ModelSpec(**hf_config_fields(path))
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = spec.attn_implementation  # sdpa; gpt-oss: eager (no sdpa path for its sinks)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return spec, transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def assert_screen_equals_estimate(cfg) -> None:
    """The screen's numpy walk (autotune/memory/_fast.py) gives every valid candidate of the engines space
    the verdict and bytes estimate_memory gives it, on CUDA and CPU (more than 50 compared)."""
    from autotune.memory import _fast
    from autotune.space import load_space
    from autotune.strategy import validate

    m, tr, hw = cfg.model, cfg.training, cfg.hardware
    pool = list(load_space("engines", precision=tr.precision).candidates(m))
    computed = 0
    for device in ("cuda", "cpu"):
        for s, v in zip(pool, _fast.verdicts(m, tr, hw, pool, headroom=0.05, device=device)):
            if v is None or validate(s, m, tr, hw):
                continue
            est = estimate_memory(m, tr, hw, s, headroom=0.05, device=device)
            assert v == (est.fits, est.total_gpu_bytes), s
            computed += 1
    assert computed > 50


def _job(tmp_path, path: str) -> str:
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{hf_config: {path}}}\ntraining: {{seq_len: 4096, global_batch_size: 64}}\n"
                   "hardware: {gpu: h100-80gb, gpus_per_node: 8}\n")
    return str(job)


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f)[:-5] for f in FILES])
def test_moe_families_sized_or_refused_in_one_line(path, tmp_path):
    """The sized families (SIZED) are accepted by a job file and sized (every expert's states, the routed
    tokens' activations); the other published MoE files stay refused in one line naming model.hf_config."""
    name = os.path.basename(path)
    if name not in SIZED:
        with pytest.raises(ConfigError) as err:
            load_config(_job(tmp_path, path))
        text = str(err.value)
        assert "\n" not in text and "model.hf_config" in text and "not modelled" in text
        return
    cfg = load_config(_job(tmp_path, path))
    m = cfg.model
    assert m.is_moe and moe.not_sized(m, json.load(open(path))["model_type"]) is None
    assert sum(parameter_order(m)) == m.num_parameters  # every expert in ZeRO's flat order
    s = Strategy(zero_stage=3, micro_batch_size=1, checkpointing="full", precision="bf16")
    est = estimate_memory(m, cfg.training, cfg.hardware, s)
    # ZeRO-3 over 8 GPUs: the bf16 parameters' share is the whole model's over 8
    assert est.gpu["parameters"] >= 2 * m.num_parameters / 8
    act = activation_breakdown(m, cfg.training, Strategy(micro_batch_size=1, precision="bf16"))
    k, f = m.num_experts_per_tok, moe.expert_width(m)
    # each token's top-k (token, expert) pairs keep at least their 2f up projection, 2 f-wide tensors
    assert act.mlp_saved_per_block >= 4096 * k * 2 * 4 * f


def test_moe_layouts_refused_without_the_family():
    """A MoE described by fields (no config.json) or of another family is refused, whatever its layout."""
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    m = ModelSpec(**hf_config_fields(os.path.join(MOE_DIR, "mixtral-8x7b-v0.1.json")))
    assert moe.not_sized(m, "mixtral") is None
    assert "model_type unknown" in moe.not_sized(m, None)
    assert "shared experts" in moe.not_sized(m.replace(shared_expert_intermediate_size=64), "mixtral")
    assert moe.not_sized(m.replace(dense_layers=(0,)), "qwen3_moe") is None  # dense layers: memory/mixed.py


def test_moe_terms_are_the_grouped_path():
    """Per token and pair, the routed block's bytes as integrations/moe.py grouped_mm_experts_forward
    keeps them: Mixtral's fp32 routing weight, Qwen3-MoE's in the model dtype; ZeRO's flat order puts
    Mixtral's router before the experts and Qwen3-MoE's after."""
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    mix = ModelSpec(**hf_config_fields(os.path.join(MOE_DIR, "mixtral-8x7b-v0.1.json")))
    qwen = ModelSpec(**hf_config_fields(os.path.join(MOE_DIR, "qwen3-30b-a3b.json")))
    h, f = mix.hidden_size, mix.intermediate_size
    assert moe.pair_saved(mix, 2) == 24 + 2 * (2 * h + 4 * f) + 4
    assert moe.pair_saved(qwen, 2) == 24 + 2 * (2 * qwen.hidden_size + 4 * 768) + 2
    assert moe.ffn_parameter_order(mix)[0] == 8 * h and moe.ffn_parameter_order(qwen)[-1] == 128 * qwen.hidden_size
    assert moe.worst_expert_tokens(mix, 1000) == 1000  # the default: every token (experts / top-k x the mean)
    assert moe.worst_expert_tokens(mix.replace(moe_load_imbalance=1.2), 1000) == 300  # a stated factor
    assert moe.worst_expert_tokens(mix, 1000, imbalance=9.0) == 1000


def test_moe_backward_peak_is_the_traced_one(tmp_path):
    """The MoE backward's peak above the saved set, as traced on one tiny Qwen3-MoE block (4 experts,
    top-2, h 128, f 176, 1024 tokens; torch 2.13 CPU profiler, docs/moe.md): the routing-weight
    multiply's 1,560,576 bytes in bf16; Mixtral's fp32 routing weights make those gradients fp32."""
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    bench = _bench()
    qwen = ModelSpec(**hf_config_fields(bench._hf_path("hf-qwen3moe-sv", tmp_path)))
    mix = ModelSpec(**hf_config_fields(bench._hf_path("hf-mixtral-sv", tmp_path)))
    assert moe.moe_backward_transient(qwen, 2, 1024) == 1_560_576
    assert moe.moe_backward_transient(mix, 2, 1024) == (3 * 4 + 2) * 128 * 2048 - 8 * 2048
    # at published sizes the experts' weight gradients dominate: 3 x E x h x f beside the freed pairs
    big = mix.replace(hidden_size=4096, intermediate_size=14336, num_experts=8)
    assert moe.moe_backward_transient(big, 2, 16) == 3 * 2 * 8 * 4096 * 14336 - (2 * 2 * 14336 + 8) * 32


def test_qwen2_moe_backward_peak_is_the_traced_one(tmp_path):
    """Qwen1.5-MoE's block (4 experts top-2 of width 176, a 344-wide shared expert behind its sigmoid gate,
    512 tokens; traced Qwen2MoeSparseMoeBlock backward, torch 2.13 CPU): the routing-weight multiply's
    instant with the gate's gradients alive, 2,034.5 / 4,085 bytes per token above the saved set in bf16 /
    fp32 less the h-wide output-gradient copy of the block-alone harness (the real steps lack it: the fp32
    benchmark rows read +0.77% / +0.62% with it, -0.02% / -0.01% without); its router keeps no renormalisation (norm_topk_prob: false) and its weights in the model dtype."""
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    m = ModelSpec(**hf_config_fields(_bench()._hf_path("hf-qwen2moe", tmp_path)))
    assert m.shared_expert_gate and not m.router_norm_topk and moe.not_sized(m, "qwen2_moe") is None
    assert moe.moe_backward_transient(m, 2, 512) == (2034.5 - 2 * 128) * 512
    assert moe.moe_backward_transient(m, 4, 512) == (4085 - 4 * 128) * 512
    assert moe.router_saved_per_token(m, 2) == 4 * 4 + 8 * 2 and moe.pair_saved(m, 2) == 24 + 2 * (2 * 128 + 4 * 176) + 2
    assert moe.ffn_parameter_order(m)[0] == 4 * 128 and moe.ffn_parameter_order(m)[-1] == 128


def test_olmoe_router_and_order():
    """OLMoE (OlmoeTopKRouter, OlmoeSparseMoeBlock): the router of Qwen3-MoE with its published
    norm_topk_prob false (no renormalisation kept) and its weights cast back to the model dtype, registered
    before the experts; q/k RMSNorm over the whole projections. Qwen3-MoE's file states norm_topk_prob
    true; without the key its config's default, false, is read."""
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    path = os.path.join(MOE_DIR, "olmoe-1b-7b-0924.json")
    m = ModelSpec(**hf_config_fields(path))
    e, k, h = m.num_experts, m.num_experts_per_tok, m.hidden_size
    assert m.qk_norm == "full" and m.router_weights_cast and not m.router_norm_topk and not m.router_after_experts
    assert moe.router_saved_per_token(m, 2) == 4 * e + 8 * k
    assert moe.pair_saved(m, 2) == 24 + 2 * (2 * h + 4 * m.intermediate_size) + 2
    assert moe.ffn_parameter_order(m)[0] == e * h  # the router first
    cfg = json.load(open(os.path.join(MOE_DIR, "qwen3-30b-a3b.json")))
    assert ModelSpec(**hf_config_fields(os.path.join(MOE_DIR, "qwen3-30b-a3b.json"))).router_norm_topk
    cfg.pop("norm_topk_prob")
    from autotune.hf_config import map_hf_config

    assert not map_hf_config(cfg, "x.json")["router_norm_topk"]


def test_gpt_oss_terms(tmp_path):
    """gpt-oss (modeling_gpt_oss.py): the router keeps topk's indices and the k-wide softmax in the model dtype; a
    pair keeps gpt-oss's clamped SwiGLU (7 f-wide tensors with the up projection's output) and a fourth int64
    index (the bias gathers); eager attention with sinks keeps the s + 1 wide probabilities in the model dtype
    and max's indices; the experts' forward peak (the gathered gate_up biases and the clamped up half at the
    gated product) and the recomputation's (the combine's gradient beside it); neither EP nor a sequence split."""
    from autotune.config import hf_config_fields
    from autotune.memory.activations import _attention_core_saved
    from autotune.spec import ModelSpec
    from autotune.strategy import validation_errors

    m = ModelSpec(**hf_config_fields(_bench()._hf_path("hf-gptoss", tmp_path)))
    h, f, e, k, a, s = m.hidden_size, moe.expert_width(m), m.num_experts, m.num_experts_per_tok, m.num_attention_heads, 256
    assert (m.attn_implementation, m.norm, m.num_attention_masks) == ("eager", "rmsnorm_fp32", 2)
    assert moe.router_saved_per_token(m, 2) == 8 * k + 2 * k
    assert moe.pair_saved(m, 2) == 32 + 2 * (2 * h + 7 * f) + 2
    assert _attention_core_saved(m, 2, s, 2, "cpu") == 2 * m.q_size * 2 + 2 * 2 * m.q_size + 2 * a * (s + 1) + 8 * a
    t, pairs = 512, 512 * k
    locals_ = 2 * e * t + 2 * h * t + 4 * pairs + 4 * e  # router logits, the bf16 residual, histc's input and output
    assert moe.grouped_forward_transient(m, 2, t) == max(3 * f * 2 * pairs - (2 * h + 8) * pairs,
                                                         3 * 2 * h * pairs) + locals_
    assert moe.grouped_forward_transient(m, 2, t, recompute=True) == max(
        3 * f * 2 * pairs - (2 * h + 8) * pairs, 2 * 2 * h * pairs) + locals_ + 2 * h * pairs
    job = load_config(_job(tmp_path, os.path.join(MOE_DIR, "gpt-oss-20b.json")))
    hw = job.hardware
    keys = {key for key, _ in validation_errors(Strategy(engine="fsdp2", expert_parallel_size=8), job.model,
                                                job.training, hw)}
    assert "expert_parallel_size" in keys
    keys = {key for key, _ in validation_errors(Strategy(context_parallel_size=2, engine="fsdp2"), job.model,
                                                job.training, hw)}
    assert "context_parallel_size" in keys


def test_granitemoe_router_multipliers_and_dropout():
    """Granite-MoE (GraniteMoeTopKRouter, GraniteMoeMoE, GraniteMoeForCausalLM): the softmax over the k top
    fp32 logits keeps its output and topk's indices, the weights cast back to the model dtype (the pairs keep
    them in it), the router registered before the experts; the embedding, residual and logits multipliers
    read from the file (GraniteMoeConfig's defaults 1.0 without them: the ops run whatever the value); its
    published attention dropout 0.1 is sized (sdpa's dropout terms of the dense models), another family's
    dropout stays refused."""
    from autotune.config import hf_config_fields
    from autotune.hf_config import map_hf_config
    from autotune.spec import ModelSpec

    path = os.path.join(MOE_DIR, "granite-3.0-1b-a400m.json")
    m = ModelSpec(**hf_config_fields(path))
    e, k, h = m.num_experts, m.num_experts_per_tok, m.hidden_size
    assert (e, k, m.attention_dropout, m.tie_word_embeddings) == (32, 8, 0.1, True)
    assert m.router_topk_softmax and m.router_weights_cast and not m.router_norm_topk and not m.router_after_experts
    assert (m.embedding_multiplier, m.residual_multiplier, m.logits_scaling) == (12.0, 0.22, 6.0)
    assert moe.router_saved_per_token(m, 2) == moe.router_saved_per_token(m, 4) == 8 * k + 4 * k
    assert moe.pair_saved(m, 2) == 24 + 2 * (2 * h + 4 * m.intermediate_size) + 2
    assert moe.ffn_parameter_order(m)[0] == e * h  # the router first
    assert moe.not_sized(m, "granitemoe") is None
    assert "dropout" in moe.not_sized(m.replace(router_topk_softmax=False), "mixtral")
    cfg = json.load(open(path))
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        cfg.pop(key)
    assert [map_hf_config(cfg, "x.json")[key] for key in ("embedding_multiplier", "residual_multiplier",
                                                          "logits_scaling")] == [1.0, 1.0, 1.0]


def test_phimoe_terms(tmp_path):
    """phimoe (modeling_phimoe.py): the sparsemixer router keeps, per round (two), masked_fill's bool mask (E), the
    masked softmax (E) and its gather (1) in the model dtype and the sample's int64 index; the published
    input_jitter_noise keeps two uniform draws of the block input (h each; none without it); the routing
    weights in the model dtype; LayerNorm's mean and rstd in the parameters' dtype on the CPU, fp32 on CUDA;
    the head's bias last in parameters(), the router before the experts; a top-k other than 2 (the sparsemixer
    routes two whatever the file says) refused; its router_jitter_noise (the sparsemixer's epsilon) is no
    training noise; expert parallelism takes its experts."""
    from autotune.config import hf_config_fields
    from autotune.hf_config import map_hf_config
    from autotune.hf_moe import training_noise
    from autotune.memory.activations import _norm_saved
    from autotune.spec import ModelSpec
    from autotune.strategy import validation_errors

    path = os.path.join(MOE_DIR, "phi-3.5-moe.json")
    m = ModelSpec(**hf_config_fields(path))
    e, k, h, f, v = m.num_experts, m.num_experts_per_tok, m.hidden_size, m.intermediate_size, m.vocab_size
    assert (m.norm, m.bias, m.lm_head_bias, m.router_sparsemixer, m.router_weights_cast, m.input_jitter_draws) == (
        "layernorm", True, True, True, True, 2)
    for p in (2, 4):
        assert moe.router_saved_per_token(m, p) == 2 * ((1 + p) * e + p + 8)
        assert moe.pair_saved(m, p) == 24 + p * (2 * h + 4 * f) + p
        assert moe.moe_saved_per_token(m, p) == moe.router_saved_per_token(m, p) + k * moe.pair_saved(m, p) + 2 * p * h
        assert _norm_saved(m, p, "cpu") == 2 * p * h + 2 * p and _norm_saved(m, p) == 2 * p * h + 8
    assert moe.ffn_parameter_order(m)[0] == e * h and parameter_order(m)[-2:] == [v * h, v]
    cfg = json.load(open(path))
    assert map_hf_config({**cfg, "input_jitter_noise": 0.0}, "x.json")["input_jitter_draws"] == 0
    assert training_noise(cfg) is None and moe.not_sized(m, "phimoe") is None
    assert "top-k other than the sparsemixer's 2" in moe.not_sized(m.replace(num_experts_per_tok=4), "phimoe")
    mix = ModelSpec(**hf_config_fields(os.path.join(MOE_DIR, "mixtral-8x7b-v0.1.json")))
    assert "sparsemixer" in moe.not_sized(mix.replace(router_sparsemixer=True), "mixtral")
    assert "input jitter" in moe.not_sized(mix.replace(input_jitter_draws=1), "mixtral")
    job = load_config(_job(tmp_path, path))
    assert not validation_errors(Strategy(engine="fsdp2", expert_parallel_size=8), job.model, job.training, job.hardware)
    # its in-place input jitter modifies what a checkpoint of the MoE block saved: mlp checkpointing refused
    errs = validation_errors(Strategy(checkpointing="mlp"), job.model, job.training, job.hardware)
    assert [k for k, _ in errs] == ["checkpointing"] and "input_jitter_noise" in errs[0][1]
    assert not validation_errors(Strategy(checkpointing="mlp"), job.model.replace(input_jitter_draws=0), job.training,
                                 job.hardware)
    assert not validation_errors(Strategy(checkpointing="full"), job.model, job.training, job.hardware)


def test_zero12_hook_releases_the_experts_down_weight_gradient(tmp_path):
    """ZeRO-1/2's gradient hook copies each weight gradient into the reduce bucket and frees autograd's right
    after its AccumulateGrad (memory/states.py ``ffn_grads_released``), before the experts' gated multiply: the
    stored Phi-3.5-MoE rows whose peak is that multiply, ZeRO-1 GA 1 fp32 (traced: every expert's 704,512-byte
    down weight gradient freed before it) and ZeRO-2 bf16, re-predicted within 0.1% (+1.26% / +0.93% while the
    multiply held it; what remains is the worker's int64 token batches, 16 B per token). The released
    grouped_mm instants: no down weight gradient at the multiply (E x h x f less), the down grouped_mm's own
    instant (its input gradient beside its weight gradient) where it is the largest."""
    bench = _bench()
    stored = {bench.row_key(r): r for r in json.loads(
        (Path(ROOT) / "benchmarks" / "data" / "memory_vs_deepspeed.json").read_text()) if r.get("status") == "ok"}
    for key in (("hf-phimoe", 1, 2, 1, 2, 256, "none", "fp32"), ("hf-phimoe-sv", 2, 2, 1, 4, 256, "none", "bf16")):
        row = bench.predict(dict(stored[key]), tmp_path)
        assert abs(row["error"]) < 0.001, (key, row["error"])
        assert row["predicted"] < row["measured"] < row["predicted"] + 16 * key[4] * key[5] + 1024
    from autotune.config import hf_config_fields
    from autotune.spec import ModelSpec

    m = ModelSpec(**hf_config_fields(bench._hf_path("hf-phimoe", tmp_path)))
    e, h, f, k = m.num_experts, m.hidden_size, moe.expert_width(m), m.num_experts_per_tok
    for p in (2, 4):
        held, released = moe.grouped_routed(m, p, 512), moe.grouped_routed(m, p, 512, released=True)
        assert held[0] - released[0] == p * e * h * f and (held[2], released[2]) == (3 * p * e * h * f, 0)
        pairs = k * 256  # E h f > S (f - h) and 3 S > E h: the down grouped_mm's own instant is the peak
        assert moe.grouped_routed(m, p, 256, released=True)[0] == p * f * pairs + p * e * h * f - 8 * pairs
        assert moe.moe_backward_transient(m, p, 512, released=True) == released[0]


def test_zero3_leaf_families_are_deepspeeds_default_leaf_classes():
    """ModelSpec.zero3_leaf_block is set for exactly the families whose sparse block DeepSpeed makes a ZeRO-3 leaf
    module by default (the installed DeepSpeed's DEFAULT_LEAF_MODULE_CLASSES), and read from their files."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

    from autotune.config import hf_config_fields
    from autotune.hf_moe import ZERO3_LEAF_FAMILIES

    assert {c.split(".")[2] for c in DEFAULT_LEAF_MODULE_CLASSES} == set(ZERO3_LEAF_FAMILIES)
    for name in sorted(SIZED):
        path = os.path.join(MOE_DIR, name)
        kind = json.loads(Path(path).read_text())["model_type"]
        assert hf_config_fields(path).get("zero3_leaf_block", False) == (kind in ZERO3_LEAF_FAMILIES), name


def test_leaf_hook_reduces_in_parameter_order():
    """moe.leaf_hook_elements walks stage3.py's bucket over the block's parameters: Qwen3-MoE's order (gate_up,
    down, router) reduces gate_up alone beside down and the router, Mixtral's (router first) copies the router into
    the bucket first; without gloo's copy the hook holds every gradient; a bucket holding all of them reduces
    nothing there."""
    from autotune.spec import ModelSpec

    base = dict(name="tiny-moe", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=2, vocab_size=128,
                implementation="hf", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    qwen3 = ModelSpec(**base, router_after_experts=True, zero3_leaf_block=True)
    gate_up, down, router = 8 * 2 * 32 * 64, 8 * 64 * 32, 8 * 64
    assert moe.ffn_parameter_order(qwen3) == [gate_up, down, router]
    rb = 64 * 64
    assert moe.leaf_hook_elements(qwen3, rb, clone=True) == gate_up + down + router + gate_up
    assert moe.leaf_hook_elements(qwen3, rb, clone=False) == gate_up + down + router
    mixtral = ModelSpec(**base, zero3_leaf_block=True)
    assert moe.ffn_parameter_order(mixtral) == [router, gate_up, down]
    assert moe.leaf_hook_elements(mixtral, rb, clone=True) == gate_up + down + gate_up
    assert moe.leaf_hook_elements(mixtral, gate_up + down + router, clone=True) == gate_up + down + router


def test_zero3_leaf_hook_is_an_instant_of_the_walk(tmp_path):
    """Under ZeRO-3 on 2 gloo ranks a leaf MoE block's hook instant (every expert gradient and gloo's copy of the
    first one reduced) is the peak of the narrow-expert Qwen3-MoE of the benchmark; without the leaf flag it is
    not an instant (the walk's peak is lower by the hook's extra)."""
    bench = _bench()
    row = {"model": "hf-qwen3moe-nf", "stage": 3, "nproc": 2, "ga": 1, "mbs": 2, "seq": 64, "ckpt": "none",
           "precision": "bf16"}
    model, training, hardware, strategy = bench.specs(row, tmp_path)
    assert model.zero3_leaf_block
    leaf = estimate_memory(model, training, hardware, strategy, device="cpu").gpu["peak"]
    plain = estimate_memory(dataclasses.replace(model, zero3_leaf_block=False), training, hardware, strategy,
                            device="cpu").gpu["peak"]
    assert leaf > plain


def test_moe_training_noise_refused(tmp_path):
    """OLMoE's clip_qkv and Mixtral's router_jitter_noise add training-time tensors the model does not
    size: refused in one line naming the key."""
    for name, key, value in (("olmoe-1b-7b-0924.json", "clip_qkv", 8.0),
                             ("mixtral-8x7b-v0.1.json", "router_jitter_noise", 0.01)):
        cfg = json.load(open(os.path.join(MOE_DIR, name)))
        cfg[key] = value
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        with pytest.raises(ConfigError) as err:
            load_config(_job(tmp_path, str(path)))
        assert "\n" not in str(err.value) and key in str(err.value) and "model.hf_config" in str(err.value)


def test_dense_models_unchanged_by_the_moe_hooks():
    """The hooks leave a dense model's terms as they were: the down projection is f x h, the
    feed-forward's weights 3 f h."""
    from autotune.presets import model_from_name

    m = model_from_name("llama2-7b")
    assert moe.down_weight_elements(m) == m.hidden_size * m.intermediate_size
    assert moe.ffn_weight_elements(m) == 3 * m.hidden_size * m.intermediate_size


@pytest.mark.parametrize("name", ["hf-mixtral", "hf-qwen3moe", "hf-qwen2moe", "hf-olmoe", "hf-gptoss", "hf-granitemoe",
                                  "hf-phimoe"])
def test_moe_block_saved_tensors_match_transformers(name, tmp_path):
    """One tiny MoE block (4 experts, top-2) of the benchmark: what transformers saves for backward in
    it equals per_block_plain to the byte, bf16."""
    spec, model = tiny_hf_model(name, tmp_path)
    import torch

    from autotune.hf_blocks import saved_bytes_per_block

    got = saved_bytes_per_block(model, model.model.layers, torch.randint(0, spec.vocab_size, (2, 128)))[1]
    act = activation_breakdown(spec, TrainingSpec(seq_len=128, global_batch_size=2, precision="bf16"),
                               Strategy(micro_batch_size=2, precision="bf16"), device="cpu")
    assert act.per_block_plain == got


def _forward_kept(model, x) -> int:
    """Bytes one training forward leaves allocated (saved tensors, checkpoint inputs and caches, logits,
    loss): the sum of torch.profiler's allocation events during it."""
    import gc

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # an earlier forward's checkpoint caches (reference cycles) are freed first
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(input_ids=x, labels=x, use_cache=False)
    del out
    total, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        total += e.typed[1].alloc_size if e.typed[0] == _EventType.Allocation else 0
        stack.extend(e.children)
    return total


@pytest.mark.parametrize("name,zero3", [(n, False) for n in ("hf-mixtral", "hf-qwen3moe", "hf-qwen2moe", "hf-olmoe",
                                                             "hf-granitemoe", "hf-gptoss", "hf-phimoe")]
                         + [("hf-qwen2moe", True), ("hf-gptoss", True), ("hf-phimoe", True)])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_op_checkpointing_keeps_what_the_model_says(name, zero3, precision, tmp_path, monkeypatch):
    """apply_checkpointing(model, "op") (torchtitan's op-level policy) on the benchmark's tiny MoE blocks: what a
    forward keeps beyond full checkpointing (the block inputs) is, to the byte, what activations._op_sac_saved
    says: the attention kernel's outputs and every other aten.mm output in the block's order, the router's and
    Qwen2-MoE's shared expert's among them, the routed experts' _grouped_mm recomputed (the dense MLP's
    formula kept the expert projections and a down projection that a MoE block does not run); with everything
    else recomputed, what the forward drops is the plain block less that. ``zero3``: F.linear replaced by
    DeepSpeed ZeRO-3's memory-efficient linear (a biased linear on 3-D input runs matmul + bias: mm, the
    biased router on 2-D tokens addmm)."""
    spec, _ = tiny_hf_model(name, tmp_path, precision)
    import torch
    import transformers

    import autotune

    if zero3:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    batch, seq = 2, 128
    cfg = transformers.AutoConfig.from_pretrained(_bench()._hf_path(name, tmp_path))
    cfg._attn_implementation = spec.attn_implementation
    x = torch.randint(0, spec.vocab_size, (batch, seq))
    kept = {}
    for g in ("none", "full", "op"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16 if precision == "bf16" else torch.float32).train()
        autotune.apply_checkpointing(model, g)
        _forward_kept(model, x)  # warm-up (lazy buffers, rotary caches)
        kept[g] = _forward_kept(model, x)
    training = TrainingSpec(seq_len=seq, global_batch_size=batch, precision=precision)

    def model_kept(g: str) -> float:
        a = activation_breakdown(spec, training, Strategy(micro_batch_size=batch, checkpointing=g, precision=precision,
                                                          zero_stage=3 if zero3 else 0), device="cpu")
        return a.blocks + a.nonblock

    assert kept["op"] - kept["full"] == model_kept("op") - model_kept("full")
    assert kept["none"] - kept["op"] == model_kept("none") - model_kept("op")


KNOWN_UNDER: set[tuple] = set()
"""Stored MoE rows the model under-predicts beyond PREDICTION_MARGIN, each with its cause (none now: the -2.06% of
hf-qwen3moe-nf ZeRO-3 on 2 gloo ranks was the leaf MoE block's gradient hook, ``moe.leaf_hook_elements``)."""


def test_stored_moe_rows_within_the_prediction_margin(tmp_path):
    """Every MoE row of the memory benchmark (moe_grid: Mixtral / Qwen3-MoE, ZeRO 0-3 and FSDP2, 1 and
    2 ranks, fp32 / bf16, the worst step and rank) re-predicted from its stored measurement: none is
    under-predicted by more than PREDICTION_MARGIN."""
    pytest.importorskip("transformers")
    bench = _bench()
    stored = {bench.row_key(r): r for r in json.loads(
        (Path(ROOT) / "benchmarks" / "data" / "memory_vs_deepspeed.json").read_text()) if r.get("status") == "ok"}
    rows = bench.moe_grid()
    missing = [bench.row_key(r) for r in rows if bench.row_key(r) not in stored]
    assert not missing, f"MoE rows without a stored measurement: {missing}"
    assert {r["stage"] for r in rows} >= {0, 1, 2, 3, "fsdp2"} and {r["nproc"] for r in rows} == {1, 2}
    errors = {bench.row_key(r): bench.predict(dict(stored[bench.row_key(r)]), tmp_path)["error"] for r in rows}
    known = {k: errors.pop(k) for k in list(errors) if k in KNOWN_UNDER}
    assert len(known) == len(KNOWN_UNDER), known  # a known row that comes inside fails until taken off the list
    assert all(e < -PREDICTION_MARGIN for e in known.values()), known
    worst = min(errors, key=errors.get)
    assert errors[worst] >= -PREDICTION_MARGIN, (worst, errors[worst])


@pytest.mark.parametrize("name", sorted(SIZED - DENSE_FIRST))
def test_screen_grid_equals_estimate_memory_on_moe(name, tmp_path):
    """The screen's numpy walk (autotune/memory/_fast.py) gives a MoE candidate the verdict and bytes
    estimate_memory gives it (the engines space on 8 H100s, CUDA and CPU)."""
    assert_screen_equals_estimate(load_config(_job(tmp_path, os.path.join(MOE_DIR, name))))


def test_attention_instant_even_where_the_moe_saves_more(tmp_path):
    """A MoE block saves more in its feed-forward than its attention core's backward makes, yet that
    backward is an instant of its own: the MLP's saved tensors are gone, but FSDP2 holds the MLP's, o_proj's
    and the norms' unsharded weight gradients there (hf-granitemoe-sv FSDP2 bf16 read -0.88% to -1.18%
    without it; the q, k, v gradients come after it)."""
    from autotune.memory.fsdp2 import _units
    from autotune.memory.walk import backward_blocks

    job = load_config(_job(tmp_path, os.path.join(MOE_DIR, "granite-3.0-1b-a400m.json")))
    m, tr, hw = job.model, dataclasses.replace(job.training, seq_len=256), job.hardware
    s = Strategy(engine="fsdp2", micro_batch_size=1, checkpointing="full")
    act = activation_breakdown(m, tr, s, "cpu")
    assert 0 < act.attention_backward_transient < act.mlp_saved_per_block
    pts = backward_blocks(act, s, m.num_hidden_layers, act.nonblock - act.logits_saved)
    assert all(pt.attention == pt.saved + act.attention_backward_transient - act.mlp_saved_per_block for pt in pts)
    u = _units(m, s, hw)
    assert u.core_params == m.params_after_attention_core() < m.block_params()


def test_fsdp2_post_backward_reshards_and_gloo_clones_the_reduce_input(tmp_path):
    """A block's post-backward: its parameters resharded before the reduce-scatter (reshard after backward,
    whatever reshard_after_forward), and on the CPU gloo's clone of the reduce-scatter input beside it and the
    new shard (hf-qwen3moe-nf / hf-mixtral-sv FSDP2 2 ranks, 128 tokens, bf16 read -6.65% to -7.34% without).
    Few tokens: a Mixtral block's parameters outweigh its activations, so that instant is the step's peak."""
    job = load_config(_job(tmp_path, os.path.join(MOE_DIR, "mixtral-8x7b-v0.1.json")))
    m = job.model.replace(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, head_dim=16)
    tr = dataclasses.replace(job.training, seq_len=128, precision="bf16")
    hw = dataclasses.replace(job.hardware, gpus_per_node=2, num_nodes=1)
    s = Strategy(engine="fsdp2", micro_batch_size=1, precision="bf16", reshard_after_forward=False)
    cpu = estimate_memory(m, tr, hw, s, device="cpu")
    block = m.block_params()
    root = m.num_parameters - 2 * block
    # the peak: the last block's reduce-scatter: the root's and the first block's bf16 parameters still
    # gathered (reshard_after_forward False), the last block's resharded; its fp32 input and gloo's clone
    assert cpu.peak_phase == "backward"
    assert cpu.gpu["buffers"] == 2 * root + 2 * block + 2 * 4 * block
