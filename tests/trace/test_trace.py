"""Traced memory tier (autotune.trace): fake-tensor tracing, FLOP cross-check, checkpointing, cache."""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from autotune.spec import ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402
from autotune.trace import TraceCache, combine, trace_memory  # noqa: E402

LLAMA = ModelSpec(name="tiny-llama", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=344, vocab_size=512)
GPT = ModelSpec(name="tiny-gpt", num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=512, vocab_size=512, hidden_act="gelu_new", tie_word_embeddings=True,
                norm="layernorm", bias=True, position_embedding="learned", max_position_embeddings=256,
                attention_dropout=0.1, hidden_dropout=0.1)
TRAIN = TrainingSpec(seq_len=128, global_batch_size=8)


def _matmul_weights(spec: ModelSpec) -> int:
    """Parameters that take part in a GEMM: q/k/v/o and MLP weight matrices, and the LM head."""
    d, f = spec.hidden_size, spec.intermediate_size
    attn = d * spec.q_size + 2 * d * spec.kv_size + spec.q_size * d
    mlp = (3 if spec.gated_mlp else 2) * d * f
    return spec.num_hidden_layers * (attn + mlp) + spec.vocab_size * d


def _hf_spec(tmp_path, raw: dict) -> tuple[ModelSpec, str]:
    """Write an HF config.json and read it back as autotune does (model.hf_config)."""
    from autotune.config import hf_config_fields

    path = tmp_path / f"{raw['model_type']}.json"
    path.write_text(json.dumps(raw))
    return ModelSpec(**hf_config_fields(str(path))), str(path)


def test_import_does_not_import_torch():
    code = "import sys, autotune.trace; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_trace_allocates_nothing():
    # fp32 logits alone are 8 x 8192 x 32000 x 4 B = 7.8 GiB; a real run would need > 12 GiB.
    spec = ModelSpec(name="wide-vocab", num_hidden_layers=1, hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=512, vocab_size=32000)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r = trace_memory(spec, TrainingSpec(seq_len=8192, global_batch_size=8), Strategy(micro_batch_size=8))
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert r.activation_peak > 10 * 2**30
    assert rss1 - rss0 < 1 * 2**30


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=lambda s: s.name)
def test_flops_match_model_flops(spec):
    """FlopCounterMode vs ModelSpec.flops_per_token (llm-foundry 6N + 12*L*d*S, which the simulator's MFU uses).

    Hardware FLOPs of fwd+bwd of one micro-batch of T tokens, as FlopCounterMode counts them:
    GEMMs = 6 * T * (matmul weights), exactly (2 per weight per token forward, 4 backward);
    attention forward = 4 * L * q * S * T (QK^T and PV, unmasked); attention backward = 2.5x forward
    (torch's sdpa_backward_flop_count recomputes QK^T). The model-FLOPs definition counts attention
    3x forward and 6 FLOPs for *every* parameter, including embeddings/norms/biases that do no GEMM:
    traced_gemm + 3 * traced_attention_fwd + 6 * T * (N - matmul weights) == flops_per_token * T.
    """
    b, S = 2, TRAIN.seq_len
    T = b * S
    r = trace_memory(spec, TRAIN, Strategy(micro_batch_size=b))
    assert r.flops["gemm"] == 6 * T * _matmul_weights(spec)
    assert r.flops["attention_fwd"] == 4 * spec.num_hidden_layers * spec.q_size * S * T
    assert r.flops["attention_bwd"] == int(2.5 * r.flops["attention_fwd"])
    model_flops = r.flops["gemm"] + 3 * r.flops["attention_fwd"] + 6 * T * (spec.num_parameters - _matmul_weights(spec))
    expected = spec.flops_per_token(S) * T
    assert abs(model_flops - expected) / expected < 0.01
    assert r.parameters == spec.num_parameters


def test_full_checkpointing_recomputes_one_forward_and_lowers_activation_peak():
    b = 2
    base = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=b))
    sel = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=b, checkpointing="selective"))
    full = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=b, checkpointing="full"))
    half = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=b, checkpointing="full", checkpoint_layers=1))
    assert full.activation_peak < half.activation_peak < base.activation_peak
    assert full.saved_activations < half.saved_activations < base.saved_activations
    assert sel.saved_activations < base.saved_activations
    # the extra FLOPs of full checkpointing are one forward of every block (not the head), less the
    # block's last GEMM (down_proj): non-reentrant checkpoint stops recomputing once every saved
    # tensor is back (torch.utils.checkpoint early stopping, on by default), and the down_proj
    # output is saved by nothing.
    T, L = b * TRAIN.seq_len, LLAMA.num_hidden_layers
    block_gemm_fwd = 2 * T * (_matmul_weights(LLAMA) - LLAMA.vocab_size * LLAMA.hidden_size)
    down_proj_fwd = 2 * T * L * LLAMA.hidden_size * LLAMA.intermediate_size
    assert full.flops["total"] - base.flops["total"] == block_gemm_fwd - down_proj_fwd + base.flops["attention_fwd"]
    assert sel.flops["total"] - base.flops["total"] == base.flops["attention_fwd"]
    assert (full.checkpoint_layers, half.checkpoint_layers, base.checkpointing) == (L, 1, "none")


def test_master_weights_and_fp32_grads_are_refiled():
    r = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=1))
    n = LLAMA.num_parameters
    assert r.states["params"] == 2 * n and r.states["grads"] == 2 * n
    assert r.states["master_weights"] == 4 * n and r.states["grads_fp32"] == 4 * n
    assert 8 * n <= r.states["optimizer"] < 8 * n + 4096  # exp_avg, exp_avg_sq (+ step scalars)
    # masters sit in their own category, not among the activations
    assert r.at_activation_peak["Master"] == 4 * n
    assert r.phase_peaks["optimizer"]["activations"] < 4 * n


@dataclasses.dataclass(frozen=True)
class _Estimate:  # the shape of autotune.memory.MemoryEstimate that combine relies on
    gpu: dict
    fits: bool = True
    reasons: list = dataclasses.field(default_factory=list)


def _analytic(strategy: Strategy) -> _Estimate:
    n = LLAMA.num_parameters
    states = {0: 16 * n, 1: 10 * n, 2: 8 * n, 3: 5 * n}[strategy.zero_stage]
    gpu = {"parameters": states // 4, "gradients": states // 4, "optimizer_states": states // 2,
           "activations": 1000, "logits": 500, "buffers": 1 << 20, "overhead": 1 << 28}
    gpu["peak"] = sum(v for k, v in gpu.items() if k != "overhead")
    return _Estimate(gpu)


def test_cache_traces_each_pair_once_across_zero_stages():
    calls = []

    def tracer(*args, **kwargs):
        calls.append(args[2])
        return trace_memory(*args, **kwargs)

    cache = TraceCache(tracer)
    peaks = set()
    for mbs in (1, 2):
        for stage in (0, 1, 2, 3):
            for off in (("none",) if stage == 0 else ("none", "cpu")):
                s = Strategy(zero_stage=stage, micro_batch_size=mbs, offload_optimizer=off, checkpointing="full")
                t = cache.get(LLAMA, TRAIN, s)
                mem, prov = combine(t, _analytic(s), capacity_bytes=80 * 2**30)
                assert mem.gpu["activations"] == t.activation_peak and mem.gpu["logits"] == 0
                assert mem.gpu["peak"] == _analytic(s).gpu["peak"] - 1500 + t.activation_peak
                assert mem.fits and prov["analytic"]["buffers"] and "activations" in prov["traced"]
                peaks.add((mbs, t.activation_peak))
    # "full" with checkpoint_layers None and == L are the same trace
    cache.get(LLAMA, TRAIN, Strategy(micro_batch_size=1, checkpointing="full", checkpoint_layers=2))
    assert (cache.misses, len(calls), cache.hits) == (2, 2, 13)
    assert len(peaks) == 2 and min(peaks)[1] < max(peaks)[1]


def test_combine_decides_fit_on_traced_peak():
    t = trace_memory(LLAMA, TRAIN, Strategy(micro_batch_size=1))
    est = _analytic(Strategy())
    mem, _ = combine(t, est, capacity_bytes=est.gpu["peak"] - 1500 + t.activation_peak + est.gpu["overhead"] - 1)
    assert not mem.fits and "traced peak" in mem.reasons[0]


def test_hf_gpt2_and_llama_from_config(tmp_path):
    pytest.importorskip("transformers")
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 128}
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300}
    for raw in (gpt2, llama):
        spec, path = _hf_spec(tmp_path, raw)
        r = trace_memory(spec, TrainingSpec(seq_len=64, global_batch_size=2), Strategy(checkpointing="full"),
                         hf_config=path)
        assert r.source == "hf" and r.parameters == spec.num_parameters
        # attention forward runs twice per layer: forward + full-checkpoint recompute
        assert r.flops["attention_fwd"] == 2 * 4 * spec.num_hidden_layers * spec.q_size * 64 * 64
        assert r.activation_peak > r.saved_activations > 0


def test_hf_llama_gqa_trace_matches_the_analytic_saved_activations(tmp_path):
    # Real runs of HF Llama pass no attention mask, so transformers lets sdpa handle GQA without
    # repeat_kv copies (benchmarks/memory_vs_deepspeed.py hf-llama rows: -0.01%); the trace must
    # take the same path (trace._unpacked_positions), not the packed-sequence mask path
    pytest.importorskip("transformers")
    from autotune.memory import activation_breakdown

    spec, path = _hf_spec(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
                                     "num_attention_heads": 8, "num_key_value_heads": 2,
                                     "intermediate_size": 256, "vocab_size": 512})
    training, strategy = TrainingSpec(seq_len=128, global_batch_size=2), Strategy(micro_batch_size=2)
    r = trace_memory(spec, training, strategy, hf_config=path)
    ab = activation_breakdown(spec, training, strategy)
    assert abs(ab.blocks + ab.nonblock - r.saved_activations) / r.saved_activations < 0.02


def test_hf_selective_trace_recomputes_the_attention_core_and_matches_the_analytic(tmp_path):
    """selective on an HF model in the traced tier (autotune.models.checkpointing.checkpoint_attention_core):
    the checkpointed layer's attention core runs again in backward, the others do not, and the
    saved activations agree with the analytic model."""
    pytest.importorskip("transformers")
    from autotune.memory import activation_breakdown

    spec, path = _hf_spec(tmp_path, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
                                     "num_attention_heads": 8, "num_key_value_heads": 2,
                                     "intermediate_size": 256, "vocab_size": 512})
    training = TrainingSpec(seq_len=128, global_batch_size=2)
    strategy = Strategy(micro_batch_size=2, checkpointing="selective", checkpoint_layers=1)
    r = trace_memory(spec, training, strategy, hf_config=path)
    assert any("autotune_selective_sdpa" in n for n in r.notes)
    # three attention forwards: both layers, then layer 0's recompute
    assert r.flops["attention_fwd"] == 3 * 4 * 2 * spec.q_size * 128 * 128
    ab = activation_breakdown(spec, training, strategy)
    assert abs(ab.blocks + ab.nonblock - r.saved_activations) / r.saved_activations < 0.02


def test_traced_estimate_on_the_real_memory_model():
    from autotune import presets
    from autotune.config import Config
    from autotune.memory import MemoryEstimate
    from autotune.spec import HardwareSpec
    from autotune.trace import traced_estimate

    cfg = Config(path="job.yaml", model=LLAMA, training=TRAIN,
                 hardware=HardwareSpec(gpu=presets.gpu_from_name("a100-80gb"), gpus_per_node=2))
    cache = TraceCache()
    for stage in (0, 1, 2, 3):
        mem, prov = traced_estimate(cfg, Strategy(zero_stage=stage, micro_batch_size=2), cache)
        assert isinstance(mem, MemoryEstimate) and mem.fits
        assert mem.gpu["peak"] == prov["combined_peak_bytes"] >= mem.phases["optimizer"]
        if mem.peak_phase != "optimizer":
            assert mem.gpu["activations"] == prov["traced_activations_bytes"]
            assert sum(mem.gpu[k] for k in mem.gpu if k not in ("peak", "overhead")) == mem.gpu["peak"]
    assert (cache.misses, cache.hits) == (1, 3)


def test_cli_estimate_trace_and_traced_search(tmp_path, capsys):
    """`estimate --trace` and `search: {fidelity: traced}` go through the trace (tiny model)."""
    import json as _json

    from autotune.cli import main
    from autotune.config import load_config
    from autotune.search import screen
    from autotune.space import load_space

    job = tmp_path / "tiny.yaml"
    job.write_text("model: {preset: tiny-llama}\ntraining: {seq_len: 64, global_batch_size: 4, precision: bf16}\n"
                   "hardware: {gpu: a100-80gb, gpus_per_node: 1}\n"
                   "search: {fidelity: traced}\n")
    assert main(["estimate", str(job), "--trace", "--json"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["memory_fidelity"] == "traced"
    assert out["memory_provenance"]["traced_activations_bytes"] > 0
    space = tmp_path / "s.yaml"
    space.write_text("zero_stage: [0, 2]\nmicro_batch_size: [1, 2]\ncheckpointing: [none, full]\n")
    cfg = load_config(str(job))
    screened = screen(cfg, load_space(str(space)), 0.05)
    assert len(screened) == 8 and all(s.memory.fits for s in screened)
    # same (mbs, ckpt) pair across ZeRO stages -> same traced activations
    acts = {(s.strategy.micro_batch_size, s.strategy.checkpointing, s.strategy.zero_stage):
            s.memory.gpu["activations"] for s in screened}
    assert acts[(2, "none", 0)] == acts[(2, "none", 2)] > acts[(2, "full", 0)]


def test_trace_follows_the_factory_contract(capsys):
    """model.python factories (build_model(spec, training) -> (module, batch_fn)) trace too."""
    import json as _json
    import os as _os

    from autotune.cli import main
    from conftest import EXAMPLES

    assert main(["estimate", _os.path.join(EXAMPLES, "custom-model.yaml"), "--trace", "--json"]) == 0
    out = _json.loads(capsys.readouterr().out)
    assert out["memory_provenance"]["trace"]["source"].startswith("factory:custom_model")
    assert out["memory_provenance"]["traced_activations_bytes"] > 0
