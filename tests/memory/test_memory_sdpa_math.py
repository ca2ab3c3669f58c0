"""sdpa's CPU math path (attention dropout on the CPU): what a block keeps depends on the micro-batch's
sequences (one keeps a fused q/k/v projection's output through v in fp32), the recomputed core's forward end
and its backward can hold a checkpointed step's peak, and the screen's numpy walk gives every such
candidate the bytes estimate_memory gives."""

import json
import os
import sys

import pytest

from autotune.config import hf_config_fields
from autotune.memory import _fast, activations, block_activation_bytes_per_token, estimate_memory
from autotune.spec import ModelSpec
from autotune.strategy import Strategy, validate
from conftest import ROOT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from autotune.hf_blocks import saved_bytes_per_block  # noqa: E402

SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 512, "head_dim": 32,
         "attention_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
GPT2_SMALL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 512, "vocab_size": 512}
# GPT-2's fused c_attn (its attn_pdrop 0.1), GPT-NeoX's fused rotary query_key_value, Llama's separate projections
FILES = ["gpt2.json", "pythia-160m.json", "llama-3.2-1b.json"]


def _small(name: str, tmp_path) -> str:
    cfg = json.load(open(os.path.join(ROOT, "tests", "data", "hf", name)))
    cfg.update(GPT2_SMALL if cfg["model_type"] == "gpt2" else SMALL)
    out = tmp_path / name
    out.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(out)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("name", FILES)
def test_math_path_block_bytes_at_one_and_two_sequences(name, precision, batch, tmp_path):
    """Saved-tensor hooks on a real block: the model's bytes for 1 and 2 sequences per micro-batch (with one,
    in fp32, GPT-2's and NeoX's whole fused output stays alive through v: p (q + kv) per token more)."""
    path = _small(name, tmp_path)
    spec = ModelSpec(**hf_config_fields(path))
    assert activations._sdpa_math(spec, "cpu")
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).train()
    layers = model.transformer.h if hasattr(model, "transformer") else (
        model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers)
    seq = 64
    measured = saved_bytes_per_block(model, layers, torch.randint(0, cfg.vocab_size, (batch, seq)))[1]
    p = 2 if precision == "bf16" else 4
    predicted = block_activation_bytes_per_token(spec, p, seq, "none", mask_bytes=p, device="cpu",
                                                 batch=batch) * batch * seq
    assert predicted == measured, (name, precision, batch, predicted, measured)
    kept = activations._fused_output_kept(spec, p, batch, "cpu")
    assert kept == (p == 4 and batch == 1 and name != "llama-3.2-1b.json")


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import memory_vs_deepspeed
    finally:
        sys.path.pop(0)
    return memory_vs_deepspeed


# GPT-2's block saves more after its core (composite GELU), which keeps the core's forward end below the backward
@pytest.mark.parametrize("name, seq, binds", [("hf-gpt2", 512, False), ("hf-neox-drop", 256, True)])
def test_math_path_instants_in_the_screen_and_the_walk(name, seq, binds, tmp_path, monkeypatch):
    """The recomputed core's forward end (``core_recompute_transient``) and the late recomputation of
    attention / selective checkpointing on the benchmark's GPT-2 and NeoX shapes: the screen's numpy walk gives
    every candidate the bytes and phase peaks of estimate_memory, and the core's instant sets some of NeoX's peaks
    (hf-neox-drop ZeRO-2 mbs 2 seq 256 full bf16 read -1.29% without it)."""
    bench = _bench()
    row = dict(zip(bench.ROW_KEYS, (name, 0, 1, 1, 2, seq, "full", "bf16")))  # 2 sequences: mbs 1 (GA 2) and 2
    m, tr, hw, _ = bench.specs(row, tmp_path)
    pool = [Strategy(engine=engine, zero_stage=stage, micro_batch_size=b, checkpointing=ck, precision=prec,
                     checkpoint_layers=n)
            for engine, stage in (("deepspeed", 0), ("deepspeed", 2), ("deepspeed", 3), ("fsdp2", 3))
            for b in (1, 2) for prec in ("bf16", "fp32")
            for ck in ("none", "full", "op", "selective", "attention", "mlp")
            for n in ((None,) if ck == "none" else (1, 2))]
    pool = [s for s in pool if not validate(s, m, tr, hw)]
    assert len(pool) > 150
    fast = _fast.verdicts(m, tr, hw, pool, device="cpu", loop="keep_outputs")
    for engine in ("deepspeed", "fsdp2"):
        on = [s for s in pool if s.engine == engine]
        phases, act_peak = _fast.phase_peaks(m, tr, hw, on, engine, device="cpu", loop="keep_outputs")
        for j, s in enumerate(on):
            est = estimate_memory(m, tr, hw, s, device="cpu")
            assert {ph: v[j] for ph, v in phases.items()} == est.phases and act_peak[j] == est.activation_peak, s
    for s, v in zip(pool, fast):
        est = estimate_memory(m, tr, hw, s, device="cpu")
        assert v == (est.fits, est.total_gpu_bytes), s
    with_it = [estimate_memory(m, tr, hw, s, device="cpu").gpu["peak"] for s in pool]
    monkeypatch.setattr(activations, "_math_core_forward_transient", lambda *a: -1e12)  # the instant never wins
    activations._breakdown.cache_clear()
    without = [estimate_memory(m, tr, hw, s, device="cpu").gpu["peak"] for s in pool]
    monkeypatch.undo()
    activations._breakdown.cache_clear()
    assert all(a >= b for a, b in zip(with_it, without)) and any(a > b for a, b in zip(with_it, without)) == binds
