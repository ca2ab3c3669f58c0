"""Every causal-LM family of the installed transformers through ``model.hf_config``: which are sized, which
refused and why, and that each refusal is one line (no traceback, no silent mis-size).

    python benchmarks/hf_family_sweep.py                  # every model_type of MODEL_FOR_CAUSAL_LM_MAPPING
    python benchmarks/hf_family_sweep.py --only glm,granite --json /tmp/sweep.json
    python benchmarks/hf_family_sweep.py --variants         # the proven families' files with switches changed

Each family's config.json is transformers' default config of that model_type (``AutoConfig.for_model``),
read by autotune.config.hf_config_fields in this process (torch and transformers imported, so the parameter
count and the block measurement run here, not in children). Outcomes: accepted (described exactly; a MoE
layout the memory model does not size is refused later, by the job: model_rules.check_modelled); refused:
parameters (the description's count differs), activations (hf_blocks: a block off by more than 0.5%), not
checked (the shrunk model cannot run), not built, unmapped (a key the mapping needs is missing), other (a
value outside its choices, a layout hf_config refuses); crash: anything but a one-line ConfigError.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def outcome(text: str) -> str:
    """The refusal's kind from its one line."""
    if "transformers builds" in text:
        return "refused: parameters"
    if "block activations are" in text:
        return "refused: activations"
    if "cannot be checked" in text:
        return "refused: not checked"
    if "cannot build" in text or "cannot run" in text:
        return "refused: not built"
    if " has none of " in text or "is not among the families" in text:
        return "refused: unmapped"
    return "refused: other"


VARIANTS = [  # (a published file of tests/data/hf, the switches changed): switches no per-family test covers
    ("llama-3.2-1b.json", dict(attention_bias=True, mlp_bias=True)), ("llama-3.2-1b.json", dict(hidden_act="gelu")),
    ("llama-3.2-1b.json", dict(attention_dropout=0.1)), ("llama-3.2-1b.json", dict(head_dim=64)),
    ("llama-3.2-1b.json", dict(tie_word_embeddings=False)), ("mistral-7b-v0.1.json", dict(head_dim=16)),
    ("qwen2-0.5b.json", dict(hidden_act="gelu")), ("qwen3-0.6b.json", dict(attention_bias=True)),
    ("phi-3-mini-4k.json", dict(resid_pdrop=0.1)), ("phi-3-mini-4k.json", dict(partial_rotary_factor=0.5)),
    ("gemma2-2b.json", dict(attn_logit_softcapping=None)), ("olmo2-7b.json", dict(attention_bias=True)),
    ("gpt2.json", dict(activation_function="relu")), ("gpt2.json", dict(scale_attn_by_inverse_layer_idx=True)),
    ("gpt2.json", dict(reorder_and_upcast_attn=True)), ("pythia-160m.json", dict(rotary_pct=1.0)),
    ("pythia-160m.json", dict(use_parallel_residual=False)),
    ("pythia-160m.json", dict(attention_dropout=0.1, hidden_dropout=0.1)),
    # the sized mixture-of-experts families (docs/moe.md): their router and block switches
    ("moe/qwen3-30b-a3b.json", dict(norm_topk_prob=False)), ("moe/qwen3-30b-a3b.json", dict(attention_bias=True)),
    ("moe/qwen3-30b-a3b.json", dict(decoder_sparse_step=2)), ("moe/qwen1.5-moe-a2.7b.json", dict(norm_topk_prob=True)),
    ("moe/olmoe-1b-7b-0924.json", dict(norm_topk_prob=True)), ("moe/olmoe-1b-7b-0924.json", dict(clip_qkv=8.0)),
    ("moe/mixtral-8x7b-v0.1.json", dict(router_jitter_noise=0.01)), ("moe/mixtral-8x7b-v0.1.json", dict(hidden_act="gelu")),
    ("moe/deepseek-v3.json", dict(norm_topk_prob=False, rope_interleave=False)),
    ("moe/deepseek-v2-lite.json", dict(topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    ("moe/deepseek-v2-lite.json", dict(q_lora_rank=512)),
    ("moe/granite-3.0-1b-a400m.json", dict(attention_dropout=0.0, tie_word_embeddings=False)),
    ("moe/granite-3.0-1b-a400m.json", dict(attention_bias=True)), ("moe/granite-3.0-1b-a400m.json", dict(num_key_value_heads=4)),
    ("moe/phi-3.5-moe.json", dict(input_jitter_noise=0.0, lm_head_bias=False)),
    ("moe/phi-3.5-moe.json", dict(sliding_window=32, attention_dropout=0.1)),
    ("moe/phi-3.5-moe.json", dict(num_experts_per_tok=1)),
]


def _configs(args: argparse.Namespace, transformers) -> list[tuple[str, dict | None]]:
    """(label, config.json object or None when the family has no default config) to sweep."""
    if args.variants:
        hf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "hf")
        return [(f"{name[:-5]} {changes}", {**json.load(open(os.path.join(hf, name))), **changes})
                for name, changes in VARIANTS]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: list[tuple[str, dict | None]] = []
    for kind in args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            out.append((kind, {**transformers.AutoConfig.for_model(kind).to_dict(), "model_type": kind}))
        except Exception:  # noqa: BLE001 (a family without a default config)
            out.append((kind, None))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model_type values")
    parser.add_argument("--json", help="write {model_type: [outcome, line]} here")
    parser.add_argument("--variants", action="store_true", help="the proven families' files with switches changed")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (measured in this process)
    import transformers

    from autotune.config import hf_config_fields
    from autotune.errors import ConfigError

    transformers.logging.set_verbosity_error()
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, cfg) in enumerate(_configs(args, transformers)):
            if cfg is None:
                results[label] = ["no default config", ""]
                continue
            path = os.path.join(tmp, f"{i}.json")
            with open(path, "w") as fh:
                json.dump(cfg, fh, default=str)
            try:
                hf_config_fields(path)
                results[label] = ["accepted", ""]
            except ConfigError as err:
                text = str(err).replace(path, "config.json")
                results[label] = ["crash: multi-line" if "\n" in text else outcome(text), text]
            except Exception as err:  # noqa: BLE001 (what the sweep looks for)
                results[label] = ["crash", f"{type(err).__name__}: {err}"[:300]]
            print(f"{label:28s} {results[label][0]:22s} {results[label][1][:150]}", flush=True)
    counts = collections.Counter(r[0] for r in results.values())
    print(f"\n{len(results)} model_types: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 1 if any(k.startswith("crash") for k in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
