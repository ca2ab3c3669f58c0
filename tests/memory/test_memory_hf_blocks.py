"""The memory model's per-block activations against what real transformers blocks keep for
backward, family by family (published config.json in tests/data/hf, shrunk to CPU size with the
family's own switches kept), and the composite GELU's backward peak against an allocation trace."""

import dataclasses
import gc
import glob
import json
import os

import pytest

from autotune.config import hf_config_fields
from autotune.hf_blocks import saved_bytes_per_block
from autotune.memory.activations import _composite_gelu_backward_transient, _mlp_backward_transient
from autotune.memory import activation_breakdown, block_activation_bytes_per_token
from autotune.spec import ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from conftest import ROOT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HF_DIR = os.path.join(ROOT, "tests", "data", "hf")
FILES = sorted(glob.glob(os.path.join(HF_DIR, "*.json")))
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 344, "vocab_size": 512, "max_position_embeddings": 512, "head_dim": 32}
GPT2_SMALL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 512, "vocab_size": 512}


def _small_config(path: str, tmp_path) -> str:
    cfg = json.load(open(path))
    if cfg["model_type"] == "gpt2":
        cfg.update(GPT2_SMALL)
    else:
        cfg.update(SMALL)
        if cfg["model_type"] in ("gpt_neox", "phi3", "olmo2"):
            cfg["num_key_value_heads"] = 4
        if cfg["model_type"] == "gemma2":
            cfg["query_pre_attn_scalar"] = 32
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(cfg.get(k), int) and cfg[k] >= 512:
                cfg[k] = 0
    out = tmp_path / os.path.basename(path)
    out.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return str(out)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f)[:-5] for f in FILES])
def test_block_activations_match_transformers(path, precision, tmp_path):
    """Per block: q/k/v, attention core, norms (fp32 upcasts), MLP, dropout masks, rotary copies,
    parallel residual, softcapping; what the real block keeps for backward, within 0.5%."""
    small = _small_config(path, tmp_path)
    spec = ModelSpec(**hf_config_fields(small))
    cfg = transformers.AutoConfig.from_pretrained(small)
    cfg._attn_implementation = spec.attn_implementation
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).train()
    layers = model.transformer.h if hasattr(model, "transformer") else (
        model.gpt_neox.layers if hasattr(model, "gpt_neox") else model.model.layers)
    batch, seq = 2, 64
    measured = saved_bytes_per_block(model, layers, torch.randint(0, cfg.vocab_size, (batch, seq)))[1]
    p = 2 if precision == "bf16" else 4
    predicted = block_activation_bytes_per_token(spec, p, seq, "none", mask_bytes=p, device="cpu") * batch * seq
    assert predicted == pytest.approx(measured, rel=0.005), (spec.name, predicted, measured)


def test_composite_gelu_backward_peak_matches_an_allocation_trace():
    """transformers' GPT2MLP with gelu_new (0.5*x*(1+tanh(.))): the backward rises above the forward
    end by what the model adds for it; F.gelu(approximate="tanh") rises by less."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    tokens, h, f = 512, 128, 512
    rises = {}
    for act in ("gelu_new", "gelu_pytorch_tanh"):
        mlp = GPT2MLP(f, transformers.GPT2Config(n_embd=h, n_inner=f, activation_function=act, resid_pdrop=0.0))
        x = torch.randn(tokens, h, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = mlp(x)
            with torch.profiler.record_function("BACKWARD"):
                y.sum().backward()
        events, marks = _allocations_and_marks(prof)
        total, at_backward, peak = 0, None, 0
        for t, size in events:
            if at_backward is None and t >= marks["BACKWARD"]:
                at_backward = total
            total += size
            peak = max(peak, total)
        rises[act] = (peak - at_backward) / (tokens * f * 4)
    spec = ModelSpec(name="g", num_hidden_layers=1, hidden_size=h, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=f,
                     vocab_size=64, hidden_act="gelu_new", norm="layernorm", implementation="hf")
    # the model: the incoming gradient (f wide) at the down projection's backward, or the composite's
    # +2 f net at its last multiply's backward; the measured rises also hold the weight gradients
    assert _composite_gelu_backward_transient(spec, 4) / (4 * f) == 2
    assert _mlp_backward_transient(spec, 4, 4) / (4 * f) == 1
    assert rises["gelu_new"] == pytest.approx(2.25, abs=0.05)
    assert rises["gelu_pytorch_tanh"] == pytest.approx(1.5, abs=0.05)
    assert rises["gelu_new"] - rises["gelu_pytorch_tanh"] >= 0.5


def _allocations_and_marks(prof) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """torch.profiler's allocation events as sorted (time, +bytes | -bytes), and the start time of
    each record_function range by name."""
    from torch._C._profiler import _EventType

    events, marks, stack = [], {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].alloc_size))
        else:
            marks.setdefault(e.name, e.start_time_ns)
        stack.extend(e.children)
    return sorted(events), marks


def _net_forward_bytes(model, batch: int, seq: int, vocab: int) -> int:
    """Bytes a forward leaves allocated (saved activations, checkpoint inputs, logits, loss): the sum
    of the allocation events torch.profiler records during the forward."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randint(0, vocab, (batch, seq))
    gc.collect()  # an earlier forward's graph (checkpoint caches sit in reference cycles) is freed now
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(input_ids=x, labels=x, use_cache=False)
    del out
    return sum(size for _, size in _allocations_and_marks(prof)[0])


@pytest.mark.parametrize("granularity", ["selective", "attention", "mlp", "op", "full"])
@pytest.mark.parametrize("name", ["llama-3.2-1b", "gpt2", "phi-3-mini-4k", "pythia-160m", "gemma2-2b"])
def test_module_checkpointing_saves_what_the_model_says(name, granularity, tmp_path):
    """apply_checkpointing(model, "selective" | "attention" | "mlp" | "op" | "full") on real
    transformers models: the memory a forward leaves behind drops by what the memory model's
    per-block figures say (selective: the attention core's internals, its inputs kept)."""
    import autotune

    small = _small_config(os.path.join(HF_DIR, name + ".json"), tmp_path)
    spec = ModelSpec(**hf_config_fields(small))
    cfg = transformers.AutoConfig.from_pretrained(small)
    cfg._attn_implementation = spec.attn_implementation
    batch, seq, p = 2, 64, 4
    kept = {}
    for g in ("none", granularity):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).train()
        notes = autotune.apply_checkpointing(model, g)
        if g in ("attention", "mlp"):
            assert notes and g in notes[-1]
        if g == "selective":
            assert notes and "autotune_selective_" in notes[-1]
        _net_forward_bytes(model, batch, seq, cfg.vocab_size)  # warm-up (lazy buffers, rotary caches)
        kept[g] = _net_forward_bytes(model, batch, seq, cfg.vocab_size)
    training = TrainingSpec(seq_len=seq, global_batch_size=batch, precision="fp32")

    def kept_by_model(g: str) -> float:
        a = activation_breakdown(spec, training, Strategy(micro_batch_size=batch, checkpointing=g, precision="fp32"),
                                 device="cpu")
        return a.blocks + a.nonblock

    predicted = kept_by_model("none") - kept_by_model(granularity)
    # selective on sdpa's flash kernel frees only the log-sum-exp and keeps an RNG state per layer
    assert predicted > 0 or (granularity == "selective" and spec.attn_implementation == "sdpa")
    assert kept["none"] - kept[granularity] == pytest.approx(predicted, rel=0.02), (kept, predicted)


def _live_at_peak(prof) -> tuple[int, str]:
    """Bytes allocated inside the profile and still alive at its peak (per storage, so frees of
    blocks allocated before profiling do not count), and the op whose allocation made the peak."""
    from torch._C._profiler import _EventType

    events, stack = [], [(e, None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        e, parent = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size, parent))
        stack.extend((c, e) for c in e.children)
    live: dict[int, int] = {}
    peak, where = 0, ""
    for _, ptr, size, parent in sorted(events, key=lambda ev: ev[0]):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
        total = sum(live.values())
        if total > peak:
            names, q = [], parent
            while q is not None:
                names.append(q.name)
                q = q.parent
            peak, where = total, " < ".join(names)
    return peak, where


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("norm", ["rmsnorm", "rmsnorm_fp32"])
def test_final_norm_backward_peak_matches_an_allocation_trace(norm, precision):
    """transformers' LlamaRMSNorm / GemmaRMSNorm feeding a head, backward: at the peak (the last
    multiply of PowBackward0) what is alive beyond the logits is the model's final_norm_backward_live
    (the norm's fp32 input and five fp32 h-wide tensors), in bf16 and fp32."""
    from torch.profiler import ProfilerActivity, profile
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    tokens, h, vocab = 512, 128, 64
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    layer = (LlamaRMSNorm if norm == "rmsnorm" else GemmaRMSNorm)(h).to(dtype)
    x0 = torch.randn(tokens, h, dtype=dtype, requires_grad=True)
    head = torch.randn(vocab, h, dtype=dtype)  # no gradient: the head saves nothing of the norm's output
    grad = torch.randn(tokens, vocab, dtype=dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = x0 * 1.0  # the residual stream entering the final norm, made inside the profile
        y = layer(x)
        del x
        logits = y @ head.t()
        del y
        logits.backward(grad)
    peak, where = _live_at_peak(prof)
    spec = ModelSpec(name="n", num_hidden_layers=1, hidden_size=h, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=256, vocab_size=vocab, norm=norm, implementation="hf")
    act = activation_breakdown(spec, TrainingSpec(seq_len=tokens, global_batch_size=1, precision=precision),
                               Strategy(micro_batch_size=1, precision=precision), device="cpu")
    assert "PowBackward0" in where
    assert peak - logits.numel() * logits.element_size() == pytest.approx(act.final_norm_backward_live, rel=0.002)


@pytest.mark.parametrize("window", [64, 128])
def test_sliding_window_mask_saved_per_block(window, tmp_path):
    """HF Mistral under sdpa: with the sequence at least as long as the sliding window, transformers
    builds the mask and each block's attention keeps an additive (b, 1, s, s) copy plus k/v repeated
    for GQA; below the window it relies on is_causal. What block 1 saves, within 0.5%, both ways."""
    cfg = json.load(open(os.path.join(HF_DIR, "mistral-7b-v0.1.json")))
    cfg.update(SMALL, sliding_window=window)
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    spec = ModelSpec(**hf_config_fields(str(path)))
    assert spec.sliding_window == window
    hf = transformers.AutoConfig.from_pretrained(str(path))
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).train()
    batch, seq = 2, 64
    measured = saved_bytes_per_block(model, model.model.layers, torch.randint(0, hf.vocab_size, (batch, seq)))[1]
    predicted = block_activation_bytes_per_token(spec, 2, seq, "none", mask_bytes=2, device="cpu") * batch * seq
    assert predicted == pytest.approx(measured, rel=0.005), (window, predicted, measured)
    unmasked = block_activation_bytes_per_token(dataclasses.replace(spec, sliding_window=None), 2, seq, "none",
                                                mask_bytes=2, device="cpu") * batch * seq
    mask_and_repeats = (2 * seq + 2 * 2 * (spec.q_size - spec.kv_size)) * batch * seq
    assert predicted - unmasked == (mask_and_repeats if window <= seq else 0)


CORE_CASES = {"gemma2": ("gemma2-2b", {**SMALL, "query_pre_attn_scalar": 32, "vocab_size": 64, "attention_dropout": 0.0}),
              "gemma2-dropout": ("gemma2-2b", {**SMALL, "query_pre_attn_scalar": 32, "vocab_size": 64,
                                               "attention_dropout": 0.1})}


@pytest.mark.parametrize("case", sorted(CORE_CASES))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_attention_core_backward_matches_an_allocation_trace(precision, case, tmp_path):
    """transformers' Gemma-2 (eager attention with softcapped s x s scores, four norms per block), with
    and without attention dropout, no checkpointing, plain torch (every weight gradient kept as ``param.grad``, as
    ZeRO-0 keeps it): in the last block's backward, the peak over what was allocated when its output
    gradient arrived is the model's attention core instant (``attention_backward_transient`` net of
    ``mlp_saved_per_block``, with the block's weight gradients made before it,
    ``params_after_attention_core``), larger there than the MLP's."""
    from torch.profiler import ProfilerActivity, profile

    name, over = CORE_CASES[case]
    cfg = json.load(open(os.path.join(HF_DIR, f"{name}.json")))
    cfg.update(over)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    spec = ModelSpec(**hf_config_fields(str(path)))
    hf = transformers.AutoConfig.from_pretrained(str(path))
    hf._attn_implementation = spec.attn_implementation
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=dtype).train()
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers

    def mark(name):  # a tensor hook on the block's output: fires when its gradient arrives, holds nothing
        def on_grad(grad):
            with torch.profiler.record_function(name):
                pass
        return lambda module, args, out: (out[0] if isinstance(out, tuple) else out).register_hook(on_grad) and None

    layers[-1].register_forward_hook(mark("LAST_BLOCK"))
    layers[-2].register_forward_hook(mark("NEXT_BLOCK"))
    batch, seq = 1, 1024
    x = torch.randint(0, 64, (batch, seq))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
    events, marks = _allocations_and_marks(prof)
    total, start, peak = 0, None, 0
    for t, size in events:
        if t >= marks["NEXT_BLOCK"]:
            break
        if start is None and t >= marks["LAST_BLOCK"]:
            start = total
        total += size
        if start is not None:
            peak = max(peak, total)
    act = activation_breakdown(spec, TrainingSpec(seq_len=seq, global_batch_size=batch, precision=precision),
                               Strategy(micro_batch_size=batch, precision=precision), device="cpu")
    p = 2 if precision == "bf16" else 4
    attention = act.attention_backward_transient - act.mlp_saved_per_block + p * spec.params_after_attention_core()
    mlp = act.mlp_backward_transient
    assert attention > mlp  # the core's instant is this block's peak
    assert peak - start == pytest.approx(attention, rel=0.01), (peak - start, attention, mlp, act.attention_backward_transient)
