"""Traced (FakeTensorMode + MemTracker) vs analytical (autotune.memory) activation memory and peak.

    python benchmarks/trace_vs_analytic.py            # reference models + HF configs, ~3-5 min on 2 cores
    python benchmarks/trace_vs_analytic.py --quick    # small models only (~30 s)
    python benchmarks/trace_vs_analytic.py --json out.json

Columns (GiB per GPU, 1 x A100-80GB, ZeRO-0 bf16, AdamW):
  saved  - activations alive at the end of the forward: traced vs analytic (activation_breakdown
           blocks + nonblock); d% = (analytic - traced) / traced
  act    - activation + temporary peak over forward/backward: traced vs analytic (the analytic
           peak-phase activations + logits, or its backward-start activations if it peaks at the step)
  peak   - analytic peak vs combined peak (analytic states/buffers + traced activations, trace.combine)
Target: |d%| <= 2 for standard decoders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from autotune import presets  # noqa: E402
from autotune.config import hf_config_fields  # noqa: E402
from autotune.memory import activation_breakdown, estimate_memory  # noqa: E402
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402
from autotune.trace import combine, trace_memory  # noqa: E402

GIB = float(1 << 30)

HF_GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024,
           "vocab_size": 50257, "activation_function": "gelu_new", "attn_pdrop": 0.1, "resid_pdrop": 0.1,
           "embd_pdrop": 0.1, "layer_norm_epsilon": 1e-5}
HF_LLAMA = {"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _cases(quick: bool, tmp: str):
    small_llama = ModelSpec(name="llama-160m", num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                            num_key_value_heads=4, intermediate_size=2048, vocab_size=32000)
    yield "ref", small_llama, None, 2048, 2
    yield "ref", presets.model_from_name("gpt2"), None, 1024, 4
    if quick:
        return
    yield "ref", presets.model_from_name("tiny-llama"), None, 2048, 2
    yield "ref", presets.model_from_name("gpt2-xl"), None, 1024, 2
    yield "ref", presets.model_from_name("llama2-7b"), None, 4096, 1
    for raw in (HF_GPT2, HF_LLAMA):
        path = os.path.join(tmp, f"{raw['model_type']}.json")
        with open(path, "w") as fh:
            json.dump(raw, fh)
        spec = ModelSpec(**hf_config_fields(path))
        yield "hf", spec, path, (1024 if raw["model_type"] == "gpt2" else 2048), 2


def _pct(analytic: float, traced: float) -> float:
    return 100.0 * (analytic - traced) / traced if traced else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--checkpointing", default="none,selective,full")
    args = ap.parse_args()
    try:
        import transformers  # noqa: F401
        have_hf = True
    except ImportError:
        have_hf = False
    hw = HardwareSpec(gpu=presets.gpu_from_name("a100-80gb"), gpus_per_node=1)
    rows = []
    head = (f"{'source':6} {'model':14} {'seq':>5} {'mbs':>3} {'ckpt':9} | {'saved tr':>8} {'an':>8} {'d%':>6} | "
            f"{'act tr':>8} {'an':>8} {'d%':>6} | {'peak an':>8} {'comb':>8} {'d%':>6} | {'s':>5}")
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory() as tmp:
        for src, spec, hf_path, seq, mbs in _cases(args.quick, tmp):
            if src == "hf" and not have_hf:
                print(f"{src:6} {spec.name[:14]:14} skipped: transformers not installed")
                continue
            for ck in args.checkpointing.split(","):
                training = TrainingSpec(seq_len=seq, global_batch_size=mbs)
                strategy = Strategy(zero_stage=0, micro_batch_size=mbs, checkpointing=ck)
                t0 = time.perf_counter()
                tr = trace_memory(spec, training, strategy, hf_config=hf_path)
                # the tracer's forward returns only the loss: the loop that drops outputs
                est = estimate_memory(spec, training, hw, strategy, loop="drop_outputs")
                comb, _ = combine(tr, est, model=spec, training=training, strategy=strategy)
                ab = activation_breakdown(spec, training, strategy)
                saved_an = ab.blocks + ab.nonblock
                act_an = est.activation_peak
                row = dict(source=src, model=spec.name, seq=seq, mbs=mbs, checkpointing=ck,
                           saved_traced=tr.saved_activations, saved_analytic=saved_an,
                           act_traced=tr.activation_peak, act_analytic=act_an, act_phase=tr.at_activation_peak["phase"],
                           analytic_peak_phase=est.peak_phase, peak_analytic=est.gpu["peak"],
                           peak_combined=comb.gpu["peak"], trace_s=time.perf_counter() - t0,
                           at_activation_peak=tr.at_activation_peak, phase_peaks=tr.phase_peaks)
                rows.append(row)
                print(f"{src:6} {spec.name[:14]:14} {seq:5d} {mbs:3d} {ck:9} | {tr.saved_activations / GIB:8.2f} "
                      f"{saved_an / GIB:8.2f} {_pct(saved_an, tr.saved_activations):+6.1f} | "
                      f"{tr.activation_peak / GIB:8.2f} {act_an / GIB:8.2f} {_pct(act_an, tr.activation_peak):+6.1f} | "
                      f"{est.gpu['peak'] / GIB:8.2f} {comb.gpu['peak'] / GIB:8.2f} "
                      f"{_pct(est.gpu['peak'], comb.gpu['peak']):+6.1f} | {row['trace_s']:5.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
