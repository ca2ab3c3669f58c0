"""The rows of the memory benchmark (benchmarks/memory_vs_deepspeed.py): the model shapes, the Hugging
Face families shrunk to CPU size, and each group of (model, stage, ranks, GA, mbs, seq, ckpt, precision)
rows with the grids built from them. Pure data and small helpers: no torch, no process launched."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROW_KEYS = ("model", "stage", "nproc", "ga", "mbs", "seq", "ckpt", "precision")
"""The keys of a row's tuple, in order."""

MODELS = {
    # Llama-style: RMSNorm, RoPE, SwiGLU, GQA, untied head
    "llama-s": dict(name="llama-s", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=344, vocab_size=2048, max_position_embeddings=1024),
    "llama-m": dict(name="llama-m", num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=688, vocab_size=4096, max_position_embeddings=1024),
    # Llama-style with a small vocabulary: the peak falls in the blocks' backward or the optimizer
    # step instead of the loss
    "llama-sv": dict(name="llama-sv", num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=688, vocab_size=256, max_position_embeddings=1024),
    # the measured tables' models (data/measured/tiny-gpt2-2rank-quiet, tiny-llama-engines-2rank-quiet)
    "tiny-gpt2": dict(name="tiny-gpt2", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=512, vocab_size=1024, hidden_act="gelu_new",
                      tie_word_embeddings=True, norm="layernorm", bias=True, position_embedding="learned",
                      max_position_embeddings=256),
    "tiny-llama": dict(name="tiny-llama", num_hidden_layers=4, hidden_size=192, num_attention_heads=6,
                       num_key_value_heads=2, intermediate_size=512, vocab_size=2048, max_position_embeddings=256),
    # GPT-2-style: LayerNorm with bias, GELU, learned positions, tied head, residual dropout
    "gpt2-s": dict(name="gpt2-s", num_hidden_layers=3, hidden_size=192, num_attention_heads=6,
                   num_key_value_heads=6, intermediate_size=768, vocab_size=4096, hidden_act="gelu_new",
                   tie_word_embeddings=True, norm="layernorm", bias=True, position_embedding="learned",
                   max_position_embeddings=1024, hidden_dropout=0.1),
    "gpt2-eager": dict(name="gpt2-eager", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=512, vocab_size=2048, hidden_act="gelu_new",
                       tie_word_embeddings=True, norm="layernorm", bias=True, position_embedding="learned",
                       max_position_embeddings=1024, attn_implementation="eager", attention_dropout=0.1,
                       hidden_dropout=0.1),
}


# Hugging Face transformers models (``model.hf_config``: built with from_config, sdpa attention,
# HF's own loss and gradient_checkpointing_enable); rows run only when transformers is installed.
# Each family is its published config.json (tests/data/hf/, sources in its README) shrunk to a
# CPU-sized shape: the family's own switches (norms, biases, qk-norm, tied head, dropout,
# softcapping, parallel residual...) are kept, only the sizes below are replaced.
HF_DIR = ROOT / "tests" / "data" / "hf"
_SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 344, "vocab_size": 2048, "max_position_embeddings": 1024}
HF_FAMILIES = {
    "hf-llama": ("llama-3.2-1b", {"head_dim": 32}),
    "hf-mistral": ("mistral-7b-v0.1", {"sliding_window": 4096}),
    "hf-qwen2": ("qwen2-0.5b", {}),
    "hf-qwen3": ("qwen3-0.6b", {"head_dim": 32}),
    "hf-gemma": ("gemma-7b", {"head_dim": 32, "num_key_value_heads": 4}),
    # eager attention with attention-logit softcapping, 4 norms per block, final-logit softcapping
    "hf-gemma2": ("gemma2-2b", {"head_dim": 32, "num_key_value_heads": 2, "query_pre_attn_scalar": 32}),
    "hf-phi3": ("phi-3-mini-4k", {"num_key_value_heads": 4, "pad_token_id": 0, "bos_token_id": 1,
                                  "eos_token_id": 2}),
    "hf-olmo2": ("olmo2-7b", {"num_key_value_heads": 4, "pad_token_id": 0, "eos_token_id": 2}),
    # GPT-2 with its default dropout 0.1 (attention, residual, embedding); the others have none
    "hf-gpt2": ("gpt2", {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_inner": 512, "n_positions": 1024,
                         "vocab_size": 2048}),
    "hf-neox": ("pythia-160m", {"num_key_value_heads": None, "intermediate_size": 512, "bos_token_id": 0,
                                "eos_token_id": 0}),
    # GPT-NeoX with attention dropout: sdpa's CPU math path on a fused, rotary q/k/v projection
    "hf-neox-drop": ("pythia-160m", {"num_key_value_heads": None, "intermediate_size": 512, "bos_token_id": 0,
                                     "eos_token_id": 0, "attention_dropout": 0.1}),
}
# long sequences (1024-4096 tokens) on tiny widths, so a real step takes seconds: three of the families
# above shrunk further, with small vocabularies so the peak can fall inside the blocks' backward
_LONG = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 172, "max_position_embeddings": 4096}
LONG_FAMILIES = {
    "hf-llama-long": ("llama-3.2-1b", {**_LONG, "vocab_size": 512}),
    "hf-qwen2-long": ("qwen2-0.5b", {**_LONG, "vocab_size": 1024}),
    "hf-gemma-long": ("gemma-7b", {**_LONG, "vocab_size": 256}),
    # Mistral's sliding window (4096): at seq >= 4096 transformers builds the attention mask
    "hf-mistral-long": ("mistral-7b-v0.1", {**_LONG, "vocab_size": 256, "sliding_window": 4096}),
    # a 64-token vocabulary: the loss is small, so unchecked the final norm's backward is the peak
    "hf-llama-v64": ("llama-3.2-1b", {**_LONG, "vocab_size": 64}),
    # Gemma-3's four norms per block (GemmaRMSNorm), every layer sliding over a window above the sequence
    "hf-gemma3-long": ("gemma3-1b-pt", {**_LONG, "vocab_size": 256, "sliding_window": 4096, "query_pre_attn_scalar": 16}),
}
# mixture-of-experts (issue 25): the published Mixtral / Qwen3-MoE config.json (tests/data/hf/moe) shrunk to
# 4 experts, top-2, on the HF shape above (transformers' default grouped_mm experts path); "-sv": a
# 256-token vocabulary, so the peak can fall in the blocks' backward instead of the loss
_MOE = {**_SMALL, "head_dim": 32, "num_experts_per_tok": 2}
MOE_FAMILIES = {
    "hf-mixtral": ("moe/mixtral-8x7b-v0.1", {**_MOE, "num_local_experts": 4}),
    "hf-qwen3moe": ("moe/qwen3-30b-a3b", {**_MOE, "num_experts": 4, "moe_intermediate_size": 176}),
    "hf-mixtral-sv": ("moe/mixtral-8x7b-v0.1", {**_MOE, "num_local_experts": 4, "vocab_size": 256}),
    "hf-qwen3moe-sv": ("moe/qwen3-30b-a3b", {**_MOE, "num_experts": 4, "moe_intermediate_size": 176,
                                              "vocab_size": 256}),
    # 2 experts, top-1: under EP 2 one expert per rank (E = ep), where nothing averages the busiest expert out
    "hf-mixtral-e2": ("moe/mixtral-8x7b-v0.1", {**_MOE, "num_local_experts": 2, "num_experts_per_tok": 1,
                                                 "vocab_size": 256}),
}
# DeepSeek-V2 (multi-head latent attention, 1 shared expert; docs/moe.md): DeepSeek-V2-Lite's config.json
# shrunk the same way, every layer routed (first_k_dense_replace 0), a plain q_proj (q_lora_rank null, as
# published) or the q LoRA ("-q"); query/key heads 32 + 16 wide, values 32 (sdpa's CPU math kernel)
_DSV2 = {**_SMALL, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 176, "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 64,
         "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "bos_token_id": 0, "eos_token_id": 1}
MOE_FAMILIES.update({
    "hf-deepseekv2": ("moe/deepseek-v2-lite", _DSV2),
    "hf-deepseekv2-q": ("moe/deepseek-v2-lite", {**_DSV2, "q_lora_rank": 48}),
    "hf-deepseekv2-sv": ("moe/deepseek-v2-lite", {**_DSV2, "vocab_size": 256}),
    # DeepSeek-V3: DeepSeek-V2's shape above on V3's config.json (its sigmoid router with the correction bias,
    # noaux_tc top-k over the best 1 of 2 groups, cos/sin rotary on interleaved pairs; docs/moe.md), q LoRA;
    # "-sv": a 256-token vocabulary and the rotate_half rotary (rope_interleave false)
    "hf-deepseekv3": ("moe/deepseek-v3", {**_DSV2, "q_lora_rank": 48, "n_group": 2, "topk_group": 1}),
    "hf-deepseekv3-sv": ("moe/deepseek-v3", {**_DSV2, "q_lora_rank": 48, "n_group": 2, "topk_group": 1,
                                             "vocab_size": 256, "rope_interleave": False}),
    # Qwen1.5-MoE: the shared expert (as wide as the dense MLP here) behind its sigmoid gate, qkv biases
    "hf-qwen2moe": ("moe/qwen1.5-moe-a2.7b", {**_MOE, "num_experts": 4, "moe_intermediate_size": 176,
                                             "shared_expert_intermediate_size": 344, "bos_token_id": 0, "eos_token_id": 1}),
    "hf-qwen2moe-sv": ("moe/qwen1.5-moe-a2.7b", {**_MOE, "num_experts": 4, "moe_intermediate_size": 176, "vocab_size": 256,
                                                "shared_expert_intermediate_size": 344, "bos_token_id": 0, "eos_token_id": 1}),
})
# dense-MLP blocks among the MoE ones (memory/mixed.py): DeepSeek-V2-Lite's first_k_dense_replace 1 as published
# (block 0 a DeepseekV2MLP of intermediate_size), Qwen1.5-MoE's mlp_only_layers (block 1 a Qwen2MoeMLP)
MOE_FAMILIES.update({
    "hf-deepseekv2-dense": ("moe/deepseek-v2-lite", {**_DSV2, "first_k_dense_replace": 1}),
    # DeepSeek-V3's router and rotary with its dense first blocks (the published file: first_k_dense_replace 3)
    "hf-deepseekv3-dense": ("moe/deepseek-v3", {**_DSV2, "q_lora_rank": 48, "n_group": 2, "topk_group": 1,
                                                "first_k_dense_replace": 1}),
    "hf-qwen2moe-dense": ("moe/qwen1.5-moe-a2.7b", {**_MOE, "num_experts": 4, "moe_intermediate_size": 176,
                                                   "shared_expert_intermediate_size": 344, "mlp_only_layers": [1],
                                                   "bos_token_id": 0, "eos_token_id": 1}),
})
# OLMoE: q/k RMSNorm over the whole projections, its router's top-k not renormalised (norm_topk_prob false
# as published) and cast back to the model dtype, the router registered before the experts
MOE_FAMILIES.update({
    "hf-olmoe": ("moe/olmoe-1b-7b-0924", {**_MOE, "num_experts": 4, "intermediate_size": 176, "pad_token_id": 0,
                                         "eos_token_id": 1}),
    "hf-olmoe-sv": ("moe/olmoe-1b-7b-0924", {**_MOE, "num_experts": 4, "intermediate_size": 176, "vocab_size": 256,
                                            "pad_token_id": 0, "eos_token_id": 1}),
})
# gpt-oss: biased attention and experts, eager attention with per-head sinks, alternating sliding (128) and full
# layers, the clamped SwiGLU, the router's softmax over its top-k; seq 256 so the sliding mask differs
MOE_FAMILIES.update({
    "hf-gptoss": ("moe/gpt-oss-20b", {**_MOE, "num_local_experts": 4, "intermediate_size": 176, "pad_token_id": 0,
                                     "eos_token_id": 1, "layer_types": ["sliding_attention", "full_attention"]}),
    "hf-gptoss-sv": ("moe/gpt-oss-20b", {**_MOE, "num_local_experts": 4, "intermediate_size": 176, "vocab_size": 256,
                                        "pad_token_id": 0, "eos_token_id": 1,
                                        "layer_types": ["sliding_attention", "full_attention"]}),
})
# Granite-MoE: the router's softmax over the top-k logits (cast back), the embedding / residual / logits
# multipliers and the published attention dropout 0.1 (sdpa's CPU math kernel), tied head
MOE_FAMILIES.update({
    "hf-granitemoe": ("moe/granite-3.0-1b-a400m", {**_MOE, "num_local_experts": 4, "intermediate_size": 176}),
    "hf-granitemoe-sv": ("moe/granite-3.0-1b-a400m", {**_MOE, "num_local_experts": 4, "intermediate_size": 176,
                                                     "vocab_size": 256}),
})
# phimoe (Phi-3.5-MoE): the sparsemixer router (two Gumbel-sampled rounds, weights in the model dtype), the published
# input jitter 0.01 (two uniform draws kept per block), biased q/k/v/o, LayerNorms with bias, a biased head
MOE_FAMILIES.update({
    "hf-phimoe": ("moe/phi-3.5-moe", {**_MOE, "num_local_experts": 4, "bos_token_id": 0, "eos_token_id": 1}),
    "hf-phimoe-sv": ("moe/phi-3.5-moe", {**_MOE, "num_local_experts": 4, "vocab_size": 256, "bos_token_id": 0,
                                        "eos_token_id": 1}),
})
# experts narrower than the model (f 64 < h 128, as Qwen3-30B-A3B's 768 < 2048), 16 of them on 128 tokens: the
# expert weight gradients large beside the activations
MOE_FAMILIES["hf-qwen3moe-nf"] = ("moe/qwen3-30b-a3b", {**_MOE, "num_experts": 16, "moe_intermediate_size": 64,
                                                       "vocab_size": 256})
LONG_FAMILIES.update(MOE_FAMILIES)  # full overrides like the long families' (hf_config, specs, run_row)

# strategies each HF family is measured with: (ZeRO stage, ranks, grad. accumulation, ckpt, precision)
HF_STRATEGIES = [(0, 1, 1, "none", "bf16"), (1, 2, 2, "none", "bf16"), (2, 1, 4, "full", "bf16"),
                 (3, 2, 1, "full", "bf16"), (0, 2, 2, "full", "fp32"), (2, 2, 1, "none", "fp32"),
                 (3, 1, 2, "none", "bf16"), (1, 1, 4, "full", "fp32")]


def hf_config(name: str) -> dict:
    base, over = HF_FAMILIES.get(name) or LONG_FAMILIES[name]
    cfg = json.loads((HF_DIR / f"{base}.json").read_text())
    if cfg["model_type"] != "gpt2" and name in HF_FAMILIES:
        cfg.update(_SMALL)
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}  # DeepSeek's null: a plain q_proj


def hf_grid() -> list[dict]:
    rows = []
    for j, (stage, nproc, ga, ck, prec) in enumerate(HF_STRATEGIES):  # strategy-major: a partial run is balanced
        for i, model in enumerate(HF_FAMILIES):
            mbs, seq = ((2, 256), (4, 128))[(i + j) % 2]
            rows.append(dict(model=model, stage=stage, nproc=nproc, ga=ga, mbs=mbs, seq=seq, ckpt=ck, precision=prec))
    return rows


def _hf_path(name: str, workdir: Path) -> str:
    path = workdir / f"{name}.json"
    if not path.exists():
        path.write_text(json.dumps(hf_config(name)))
    return str(path)


REFERENCE_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision)
    ("llama-s", 0, 1, 1, 1, 256, "none", "bf16"), ("llama-s", 2, 2, 2, 2, 256, "none", "bf16"),
    ("llama-m", 3, 2, 4, 4, 128, "full", "bf16"), ("llama-m", 1, 1, 2, 4, 64, "selective", "fp32"),
    ("gpt2-s", 2, 2, 4, 2, 256, "full", "fp32"), ("gpt2-s", 3, 1, 1, 2, 512, "none", "bf16"),
    ("gpt2-eager", 1, 2, 1, 4, 64, "selective", "bf16"), ("gpt2-eager", 0, 2, 4, 1, 256, "none", "bf16"),
]


# off-grid checks: other shapes, gradient accumulation 3, other stage/rank/precision mixes
SPOT_ROWS = [("hf-llama", 2, 2, 3, 1, 512, "full", "bf16"), ("hf-qwen3", 3, 2, 4, 2, 128, "none", "fp32"),
             ("hf-gemma2", 0, 2, 4, 1, 256, "none", "fp32"), ("hf-phi3", 1, 1, 3, 3, 128, "full", "bf16"),
             ("hf-neox", 2, 2, 2, 2, 256, "full", "fp32"), ("hf-gpt2", 3, 1, 3, 2, 256, "none", "fp32"),
             ("hf-olmo2", 0, 1, 4, 1, 512, "none", "bf16"), ("hf-mistral", 1, 2, 1, 3, 192, "full", "fp32")]


# module-level checkpointing (attention / mlp module recomputed, the other kept) and op-level, HF and reference
GRANULARITY_ROWS = [("hf-llama", 2, 2, 2, 2, 256, "attention", "bf16"), ("hf-gpt2", 1, 1, 2, 2, 256, "mlp", "fp32"),
                    ("hf-phi3", 3, 2, 1, 2, 256, "mlp", "bf16"), ("hf-gemma2", 0, 1, 4, 2, 256, "attention", "fp32"),
                    ("hf-neox", 2, 1, 1, 4, 128, "attention", "fp32"), ("hf-qwen3", 0, 2, 2, 4, 128, "mlp", "bf16"),
                    ("llama-m", 3, 2, 2, 4, 128, "attention", "bf16"), ("gpt2-s", 1, 1, 2, 2, 256, "mlp", "bf16"),
                    # op-level selective checkpointing (torchtitan's policy, autotune.models.checkpointing.op_sac_context)
                    ("hf-llama", 0, 1, 2, 2, 256, "op", "bf16"), ("hf-qwen2", 3, 2, 1, 4, 128, "op", "fp32"),
                    ("hf-phi3", 2, 2, 2, 2, 256, "op", "bf16"), ("hf-gpt2", 1, 2, 1, 2, 256, "op", "fp32"),
                    ("hf-gemma2", 2, 1, 2, 2, 256, "op", "bf16"), ("llama-s", 1, 1, 4, 2, 256, "op", "bf16")]


# selective checkpointing of HF models (the attention core recomputed: the attention function wrapped
# through transformers' AttentionInterface, autotune.models.checkpointing.checkpoint_attention_core)
SELECTIVE_ROWS = [("hf-llama", 0, 1, 2, 2, 256, "selective", "bf16"), ("hf-qwen3", 2, 2, 1, 4, 128, "selective", "fp32"),
                  ("hf-phi3", 2, 1, 2, 2, 256, "selective", "bf16"), ("hf-gemma2", 0, 2, 1, 2, 256, "selective", "bf16"),
                  ("hf-gpt2", 0, 1, 1, 2, 256, "selective", "fp32"), ("hf-olmo2", 3, 2, 1, 2, 256, "selective", "bf16"),
                  ("hf-llama", "fsdp2", 2, 1, 2, 256, "selective", "bf16"), ("hf-neox", "fsdp2", 1, 2, 4, 128, "selective", "fp32"),
                  ("hf-mistral", "fsdp2-keep", 2, 1, 2, 256, "selective/2", "fp32")]

# every k-th block checkpointed ("<granularity>/<k>"), both engines
EVERY_K_ROWS = [("hf-llama", 2, 2, 1, 2, 256, "full/2", "bf16"), ("llama-m", 0, 1, 2, 2, 128, "op/2", "fp32"),
                ("hf-qwen3", "fsdp2", 2, 1, 2, 256, "attention/2", "bf16")]

# the fsdp2 engine (autotune.models.fsdp2.apply: fully_shard per block + root, MixedPrecisionPolicy with
# param_dtype = precision, AdamW foreach): stage "fsdp2" (reshard_after_forward), "fsdp2-keep"
# (reshard_after_forward False), "fsdp2-rbf16" (reduce_dtype bf16)
FSDP2_ROWS = [("llama-s", "fsdp2", 1, 1, 1, 256, "none", "bf16"), ("llama-s", "fsdp2", 2, 2, 2, 256, "none", "bf16"),
              ("llama-m", "fsdp2", 2, 1, 4, 128, "full", "bf16"), ("llama-m", "fsdp2-keep", 2, 1, 4, 128, "full", "bf16"),
              ("gpt2-s", "fsdp2", 2, 2, 2, 256, "full", "fp32"), ("gpt2-s", "fsdp2-keep", 1, 1, 2, 256, "none", "bf16"),
              ("hf-llama", "fsdp2", 2, 1, 2, 256, "op", "bf16"), ("hf-llama", "fsdp2", 1, 2, 2, 256, "op", "fp32"),
              ("hf-qwen3", "fsdp2", 2, 1, 2, 256, "mlp", "bf16"), ("hf-gemma2", "fsdp2", 2, 1, 2, 256, "full", "bf16"),
              ("hf-gpt2", "fsdp2-rbf16", 2, 1, 2, 256, "attention", "bf16"), ("hf-phi3", "fsdp2-keep", 2, 2, 2, 128, "op", "bf16"),
              ("hf-neox", "fsdp2", 1, 1, 4, 128, "none", "fp32"), ("llama-m", "fsdp2-rbf16", 2, 2, 2, 128, "op", "bf16"),
              # small vocabulary: peaks inside the blocks' backward and at the optimizer step
              ("llama-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"), ("llama-sv", "fsdp2-keep", 2, 2, 4, 256, "full", "bf16"),
              ("llama-sv", "fsdp2", 1, 1, 2, 256, "op", "fp32"), ("llama-sv", "fsdp2", 1, 1, 1, 32, "full", "fp32")]


# ZeRO-1/2 on 2 ranks under gradient accumulation 1/2/4/8, fp32 and bf16, small activations: the peak
# at the reduce that ends a backward (ZeRO-2: every micro-step; ZeRO-1: the boundary, where the carried
# gradients have moved into the reduce buckets), or in a later micro-step's backward. 8 measured
# optimizer steps, not 2: the CPU measurement once let gloo's worker thread hold the flat all-reduced
# copy past the partition's allocation in about 1 reduce in 4 to 1 in 30 (now the worker yields to it,
# autotune.worker.engines._yield_after_collectives); more steps show that no such step is left
GA_ROWS = [("llama-s", stage, 2, ga, 1, 128, "full" if ga in (1, 4) else "none", prec)
           for stage in (1, 2) for prec in ("fp32", "bf16") for ga in (1, 2, 4, 8)]
GA_ROWS_STEPS = 8


# the measured tables' shapes where the model was off (fp32, 2 ranks, GA 8 or 4 as the tables ran them):
# ZeRO-2's gradient partition holding a straddling parameter whole, ZeRO-3's reduce-scatter copy on
# gloo, FSDP2's root all-gather copy-out at the start of backward, and FSDP2 with full checkpointing
TABLE_ROWS = [("tiny-gpt2", 2, 2, 8, 1, 64, "none", "fp32"), ("tiny-gpt2", 2, 2, 4, 2, 64, "full", "bf16"),
              ("tiny-gpt2", 3, 2, 8, 1, 64, "full", "fp32"), ("tiny-gpt2", 3, 2, 8, 1, 64, "none", "fp32"),
              ("tiny-llama", "fsdp2-keep", 2, 8, 1, 96, "none", "fp32"), ("tiny-llama", "fsdp2", 2, 8, 1, 96, "full", "fp32"),
              ("tiny-llama", "fsdp2-keep", 2, 4, 2, 96, "full", "fp32"), ("tiny-llama", "fsdp2", 2, 4, 2, 96, "full", "fp32")]

# DeepSpeed ZeRO-0 on the llama-sv shape of the two FSDP2 rows the checkpoint frame explained (the
# same mechanism without FSDP2), and the same shape unchecked in bf16 (its peak: the final RMSNorm's
# backward, which the DeepSpeed walk does not visit; docs/accuracy.md)
FRAME_ROWS = [("llama-sv", 0, 1, 1, 2, 256, "op", "fp32"), ("llama-sv", 0, 1, 1, 4, 256, "full", "bf16"),
              ("llama-sv", 0, 1, 1, 4, 256, "none", "bf16")]

# eager attention's core backward as the step's peak (Gemma-2's softcapped s x s scores at seq 512-1024, every
# engine, full / attention / op checkpointing; the reference GPT-2 with attention dropout; gpt-oss): what the block's
# backward has released when the core's runs (activations.py ``_released_before_core``)
CORE_ROWS = [("hf-gemma2", 2, 2, 1, 1, 512, "full", "fp32"), ("hf-gemma2", 3, 2, 1, 1, 512, "full", "bf16"),
             ("hf-gemma2", 1, 2, 1, 1, 1024, "full", "bf16"), ("hf-gemma2", 2, 1, 1, 1, 512, "attention", "bf16"),
             ("hf-gemma2", 0, 1, 1, 2, 512, "full", "bf16"), ("hf-gemma2", 1, 2, 1, 1, 512, "op", "bf16"),
             ("gpt2-eager", 1, 1, 1, 1, 512, "full", "bf16"),
             # gpt-oss: eager attention with sinks (its softmax in the model dtype), MoE blocks
             ("hf-gptoss-sv", 0, 1, 1, 1, 512, "full", "bf16"), ("hf-gptoss-sv", 2, 2, 1, 1, 1024, "full", "bf16"),
             ("hf-gptoss-sv", 0, 1, 1, 1, 1024, "none", "bf16")]

# Gemma-3's four-norm block (GemmaRMSNorm): the post-feedforward norm's backward, before the MLP's, as the
# step's peak under checkpointing (activations.py, the norms_per_block == 4 instant); every ZeRO stage and FSDP2
NORM_ROWS = [("hf-gemma3-long", 1, 1, 1, 1, 2048, "full", "bf16"), ("hf-gemma3-long", 3, 2, 1, 1, 1024, "op", "bf16"),
             ("hf-gemma3-long", 0, 1, 1, 1, 2048, "full", "fp32"), ("hf-gemma3-long", 2, 1, 1, 1, 2048, "none", "bf16"),
             ("hf-gemma3-long", 2, 2, 1, 1, 2048, "full", "bf16"), ("hf-gemma3-long", "fsdp2", 1, 1, 1, 2048, "full", "bf16")]


# sdpa's CPU math path (attention dropout): GPT-2's fused c_attn and GPT-NeoX's fused rotary q/k/v, one and two
# sequences per micro-batch (fp32 with one keeps the fused output through v, activations.py _fused_output_kept),
# seq 256-512, where under selective / attention checkpointing the core's recomputed backward is the peak
MATH_ROWS = [("hf-gpt2", "fsdp2", 1, 1, 1, 512, "none", "fp32"), ("hf-gpt2", 0, 1, 1, 1, 256, "none", "fp32"),
             ("hf-gpt2", 3, 2, 1, 1, 256, "none", "fp32"), ("hf-gpt2", "fsdp2", 1, 1, 1, 512, "selective", "fp32"),
             ("hf-gpt2", 0, 1, 1, 1, 512, "selective", "bf16"), ("hf-gpt2", 0, 1, 1, 1, 512, "attention", "fp32"),
             ("hf-gpt2", 0, 1, 1, 2, 512, "selective", "fp32"), ("hf-gpt2", 2, 1, 1, 2, 512, "selective", "bf16"),
             ("hf-neox-drop", 0, 1, 1, 1, 512, "none", "fp32"), ("hf-neox-drop", 2, 1, 1, 2, 512, "none", "fp32"),
             ("hf-neox-drop", "fsdp2", 1, 1, 1, 512, "selective", "bf16"),
             ("hf-neox-drop", 3, 2, 1, 1, 512, "selective", "fp32")]
CARRY_ROWS = [("hf-neox-drop", 1, 1, 2, 1, 512, "selective", "fp32"), ("hf-neox-drop", 1, 2, 2, 1, 512, "selective", "fp32"),
              ("hf-gpt2", 1, 1, 2, 1, 512, "attention", "fp32"), ("hf-gpt2", 1, 2, 2, 1, 512, "selective", "fp32"),
              ("hf-neox-drop", 1, 1, 4, 1, 512, "selective", "fp32"), ("hf-neox-drop", 1, 1, 2, 2, 256, "attention", "bf16"),
              ("hf-gemma2", 1, 1, 2, 1, 512, "attention", "fp32"), ("hf-gpt2", 1, 1, 2, 1, 512, "full", "fp32")]
"""ZeRO-1 with gradient accumulation where the peak comes late in the backward (a core recomputed after the MLP's
backward): two micro-steps (the carry split between them, estimate.split_carry), and four for contrast."""


def long_rows() -> list[tuple]:
    """Long sequences with and without checkpointing: every (ZeRO stage, checkpointing) pair on each
    long family, seq 1024/2048/4096, mbs 1/2, 1 and 2 ranks and bf16/fp32 rotating so each family sees
    each value (a partial run stays balanced)."""
    rows = []
    pairs = [(z, ck) for ck in ("none", "full", "op") for z in range(4)]
    for j, (stage, ck) in enumerate(pairs):
        for i, model in enumerate(("hf-llama-long", "hf-qwen2-long", "hf-gemma-long")):
            k = i + j
            seq = (1024, 2048, 4096)[k % 3]
            mbs = (1, 2)[(k // 3) % 2] if seq < 4096 else 1
            nproc = (1, 2)[(i + j // 2) % 2]
            prec = "fp32" if (k % 4 == 3) else "bf16"
            rows.append((model, stage, nproc, 1, mbs, seq, ck, prec))
    # and the settings of two held-out shorter-sequence checks (ZeRO-2 full seq 512 mbs 2, ZeRO-3
    # unchecked seq 256, bf16, 1 rank) on the tiny Llama
    rows += [("hf-llama-long", 2, 1, 1, 2, 512, "full", "bf16"), ("hf-llama-long", 3, 1, 1, 2, 256, "none", "bf16")]
    return rows + [("hf-llama-v64", 0, 1, 1, 1, 4096, "none", "bf16"), ("hf-llama-v64", 1, 2, 1, 1, 2048, "none", "bf16"),
                   ("hf-llama-v64", 2, 1, 1, 2, 1024, "none", "bf16"), ("hf-llama-v64", 3, 2, 1, 1, 2048, "none", "bf16"),
                   ("hf-llama-v64", 2, 2, 1, 1, 4096, "full", "bf16"), ("hf-llama-v64", 0, 1, 1, 1, 2048, "op", "fp32"),
                   # the sliding window at and below the sequence
                   ("hf-mistral-long", 0, 1, 1, 1, 4096, "none", "bf16"), ("hf-mistral-long", 2, 2, 1, 1, 4096, "full", "bf16"),
                   ("hf-mistral-long", 1, 1, 1, 1, 4096, "op", "fp32"), ("hf-mistral-long", 3, 2, 1, 2, 4096, "none", "bf16"),
                   ("hf-mistral-long", 0, 2, 1, 2, 2048, "full", "bf16")]


LONG_ROWS = long_rows()


# issue 24's long-context knobs (autotune.models.long_context through the worker): Ulysses sequence
# parallel 2 on 2 ranks ("sp"), the tiled loss ("tl", TiledFusedLogitsLoss: one 1-GiB tile at these
# sizes), the tiled MLP ("tm", ceil(seq / hidden) tiles), activation offload of the checkpointed
# inputs to host ("ao", full checkpointing), alone and together, on 9 HF families (Gemma-2: eager
# attention, no Ulysses), ZeRO 0-3 and fsdp2 (context parallel has no CPU kernel: not measured),
# 1 and 2 ranks, bf16/fp32. Row = ROW_KEYS + "knobs" (Strategy fields)
LONG_CONTEXT_KNOBS = {"sp": {"sequence_parallel_size": 2}, "tl": {"tiled_loss": True}, "tm": {"tiled_mlp": True},
                      "ao": {"activation_offload": "cpu"}}
LONG_CONTEXT_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision, knobs)
    ("hf-llama", 2, 2, 1, 1, 512, "none", "bf16", "sp"), ("hf-qwen3", 3, 2, 1, 2, 256, "full", "fp32", "sp"),
    ("hf-mistral", 1, 2, 1, 1, 512, "full", "bf16", "sp+tm"), ("hf-phi3", 0, 2, 1, 2, 256, "none", "fp32", "sp+tl"),
    ("hf-llama", 0, 1, 1, 2, 512, "none", "bf16", "tl"), ("hf-gemma", 3, 1, 1, 2, 256, "full", "fp32", "tl"),
    ("hf-olmo2", 2, 2, 1, 2, 256, "none", "bf16", "tl"), ("hf-gpt2", 1, 1, 1, 2, 256, "none", "fp32", "tm"),
    ("hf-neox", 2, 2, 1, 2, 256, "full", "bf16", "tm"), ("hf-qwen2", 3, 2, 1, 2, 256, "none", "bf16", "tm"),
    ("hf-llama", 0, 1, 1, 2, 256, "full", "bf16", "ao"), ("hf-qwen3", 2, 2, 1, 2, 256, "full", "fp32", "ao"),
    ("hf-gemma2", "fsdp2", 2, 1, 1, 512, "full", "bf16", "ao"), ("hf-llama", "fsdp2", 1, 1, 2, 256, "none", "fp32", "tl+tm"),
    ("hf-mistral", 3, 2, 1, 1, 512, "full", "bf16", "sp+tl+tm+ao"),
    ("hf-llama-long", 2, 2, 1, 1, 2048, "none", "bf16", "sp"), ("hf-qwen2-long", 1, 1, 1, 1, 2048, "full", "bf16", "tl+tm"),
    ("hf-gemma-long", 0, 2, 1, 1, 2048, "full", "fp32", "sp+ao"),
    # op checkpointing with Ulysses (its all-to-alls inside the checkpointed block, replayed by count)
    ("hf-llama", 2, 2, 1, 1, 512, "op", "bf16", "sp+tl"), ("hf-llama-long", 1, 2, 1, 1, 2048, "op", "fp32", "sp"),
    # the pre-MLP (OLMo2: post-MLP) RMSNorm's backward under TiledMLP, torch's norm (docs/long-context.md)
    ("hf-gemma-long", 1, 1, 1, 1, 2048, "full", "bf16", "tl+tm"), ("hf-olmo2", 1, 1, 1, 1, 1024, "full", "bf16", "tl+tm"),
    ("hf-llama-long", 2, 2, 1, 1, 2048, "full", "fp32", "tl+tm"), ("hf-gemma3-long", 1, 1, 1, 1, 2048, "full", "bf16", "tl+tm"),
    ("hf-gemma3-long", 0, 1, 1, 1, 2048, "full", "fp32", "tm"), ("hf-gemma3-long", 3, 2, 1, 1, 2048, "full", "bf16", "tm"),
    # op checkpointing over TiledMLP: the policy counts and keeps every other mm output of the tiles too
    # (activations._op_sac_saved ``tiles``); Qwen2's biased q/k/v (addmm), Llama's four mm, a shorter last tile
    ("hf-qwen2-long", "fsdp2", 1, 1, 1, 1024, "op", "bf16", "tm"), ("hf-qwen2", "fsdp2-keep", 2, 4, 2, 1024, "op", "bf16", "tl+tm"),
    ("hf-llama-long", 2, 1, 1, 1, 1024, "op", "bf16", "tm"), ("hf-llama-long", 0, 1, 1, 1, 2048, "op", "fp32", "tm"),
    ("hf-olmo2", "fsdp2", 1, 1, 2, 1024, "op", "fp32", "tm"), ("hf-qwen3", 1, 1, 4, 1, 512, "op", "fp32", "tm"),
    ("hf-phi3", 2, 1, 1, 1, 1000, "op", "bf16", "tm"),
]


def long_context_grid() -> list[dict]:
    """LONG_CONTEXT_ROWS as grid rows (``knobs``: the long-context Strategy fields of the row)."""
    rows = []
    for *head, names in LONG_CONTEXT_ROWS:
        knobs: dict = {}
        for name in names.split("+"):
            knobs.update(LONG_CONTEXT_KNOBS[name])
        rows.append(dict(zip(ROW_KEYS, head), knobs=knobs))
    return rows


MOE_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision): ZeRO 0-3 and fsdp2, 1/2 ranks, fp32/bf16
    ("hf-qwen3moe-nf", 0, 1, 1, 2, 64, "none", "bf16"), ("hf-qwen3moe-nf", "fsdp2", 1, 1, 2, 64, "none", "fp32"),
    ("hf-qwen3moe-nf", 3, 2, 1, 2, 64, "none", "bf16"),
    ("hf-mixtral", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-qwen3moe", 0, 2, 1, 2, 256, "full", "fp32"),
    ("hf-mixtral", 1, 2, 2, 2, 256, "none", "fp32"), ("hf-qwen3moe", 1, 1, 1, 4, 128, "none", "bf16"),
    ("hf-mixtral", 2, 2, 1, 2, 256, "full", "bf16"), ("hf-qwen3moe", 2, 1, 2, 2, 256, "none", "fp32"),
    ("hf-mixtral", 3, 1, 1, 4, 128, "full", "fp32"), ("hf-qwen3moe", 3, 2, 1, 2, 256, "none", "bf16"),
    ("hf-mixtral", "fsdp2", 2, 1, 2, 256, "none", "bf16"), ("hf-qwen3moe", "fsdp2", 1, 1, 2, 256, "full", "fp32"),
    ("hf-mixtral-sv", 0, 1, 1, 4, 256, "none", "bf16"), ("hf-qwen3moe-sv", 2, 2, 1, 4, 256, "none", "bf16"),
    ("hf-mixtral-sv", 3, 2, 1, 2, 256, "none", "fp32"), ("hf-qwen3moe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"),
    ("hf-mixtral-sv", "fsdp2-keep", 1, 1, 4, 256, "full", "bf16"), ("hf-qwen3moe-sv", 1, 1, 2, 4, 256, "full", "fp32"),
    # DeepSeek-V2: latent attention (plain q_proj / q LoRA), 1 shared expert (memory/mla.py, moe.py)
    ("hf-deepseekv2", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-deepseekv2-q", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-deepseekv2-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-deepseekv2", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-deepseekv2-q", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-deepseekv2-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-deepseekv2-sv", 3, 1, 1, 4, 256, "none", "fp32"), ("hf-deepseekv2-q", 0, 2, 1, 2, 256, "full", "fp32"),
    # DeepSeek-V3: the sigmoid router with the correction bias, group-limited top-k, cos/sin rotary (moe.py, mla.py)
    ("hf-deepseekv3", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-deepseekv3", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-deepseekv3-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-deepseekv3", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-deepseekv3", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-deepseekv3-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-deepseekv3-sv", 3, 1, 1, 4, 256, "none", "fp32"), ("hf-deepseekv3", 0, 2, 1, 2, 256, "full", "fp32"),
    # Qwen1.5-MoE: the sigmoid-gated shared expert, qkv biases, top-k not renormalised (moe.py)
    ("hf-qwen2moe", 0, 2, 1, 2, 256, "none", "bf16"), ("hf-qwen2moe-sv", 1, 1, 1, 4, 256, "none", "fp32"),
    ("hf-qwen2moe-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-qwen2moe", 3, 1, 2, 2, 256, "full", "fp32"),
    ("hf-qwen2moe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"), ("hf-qwen2moe", "fsdp2-keep", 1, 1, 2, 256, "full", "fp32"),
    # dense-MLP blocks among the MoE ones (memory/mixed.py)
    ("hf-deepseekv2-dense", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-deepseekv2-dense", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-deepseekv2-dense", "fsdp2", 2, 1, 2, 256, "none", "fp32"), ("hf-qwen2moe-dense", 2, 2, 1, 4, 256, "none", "bf16"),
    ("hf-qwen2moe-dense", "fsdp2-keep", 1, 1, 2, 256, "full", "fp32"), ("hf-qwen2moe-dense", 1, 1, 1, 2, 256, "selective", "bf16"),
    ("hf-deepseekv3-dense", 3, 2, 1, 2, 256, "full", "bf16"), ("hf-deepseekv3-dense", "fsdp2", 2, 1, 2, 256, "none", "fp32"),
    ("hf-deepseekv3-dense", 1, 1, 1, 2, 256, "none", "bf16"),
    # OLMoE: qk-norm over the whole projections, top-k not renormalised (moe.py)
    ("hf-olmoe", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-olmoe", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-olmoe-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-olmoe", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-olmoe", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-olmoe-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-olmoe-sv", 3, 1, 1, 4, 256, "none", "fp32"), ("hf-olmoe-sv", "fsdp2-keep", 1, 1, 4, 256, "full", "bf16"),
    ("hf-olmoe", 1, 1, 1, 2, 256, "selective", "bf16"),
    # gpt-oss: eager attention with sinks, biased experts, the clamped SwiGLU (moe.py, activations.py)
    ("hf-gptoss", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-gptoss", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-gptoss-sv", 2, 2, 1, 2, 256, "none", "bf16"), ("hf-gptoss", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-gptoss", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-gptoss-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-gptoss-sv", 3, 1, 1, 2, 256, "none", "fp32"), ("hf-gptoss-sv", "fsdp2-keep", 1, 1, 2, 256, "full", "bf16"),
    ("hf-gptoss", 1, 1, 1, 2, 256, "selective", "bf16"), ("hf-gptoss-sv", 2, 2, 2, 2, 256, "full", "fp32"),
    ("hf-gptoss", 0, 1, 1, 2, 256, "op", "bf16"),
    # Granite-MoE: top-k softmax router, multipliers, attention dropout (moe.py, activations.py)
    ("hf-granitemoe", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-granitemoe", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-granitemoe-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-granitemoe", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-granitemoe", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-granitemoe-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-granitemoe-sv", 3, 1, 1, 4, 256, "none", "fp32"), ("hf-granitemoe-sv", "fsdp2-keep", 1, 1, 4, 256, "full", "bf16"),
    ("hf-granitemoe", 1, 1, 1, 2, 256, "selective", "bf16"),
    # phimoe: the sparsemixer router, input jitter, biased attention, LayerNorms with bias, biased head (moe.py)
    ("hf-phimoe", 0, 1, 1, 2, 256, "none", "bf16"), ("hf-phimoe", 1, 2, 1, 2, 256, "none", "fp32"),
    ("hf-phimoe-sv", 2, 2, 1, 4, 256, "none", "bf16"), ("hf-phimoe", 3, 2, 1, 2, 256, "full", "bf16"),
    ("hf-phimoe", "fsdp2", 1, 1, 2, 256, "none", "bf16"), ("hf-phimoe-sv", "fsdp2", 2, 2, 2, 256, "none", "fp32"),
    ("hf-phimoe-sv", 3, 1, 1, 4, 256, "none", "fp32"), ("hf-phimoe-sv", "fsdp2-keep", 1, 1, 4, 256, "full", "bf16"),
    ("hf-phimoe", 1, 1, 1, 2, 256, "selective", "bf16"),
    # op-level checkpointing (torchtitan's policy): the attention's and the router's / shared expert's aten.mm
    # outputs kept, the grouped GEMMs recomputed (activations.py _moe_linears)
    ("hf-mixtral", 1, 2, 1, 2, 256, "op", "bf16"), ("hf-qwen3moe-sv", 3, 1, 1, 4, 256, "op", "fp32"),
    ("hf-qwen2moe", 2, 2, 1, 2, 256, "op", "bf16"), ("hf-qwen2moe-sv", "fsdp2", 1, 1, 4, 256, "op", "fp32"),
    ("hf-olmoe-sv", 0, 1, 1, 4, 256, "op", "bf16"), ("hf-granitemoe", "fsdp2", 2, 1, 2, 256, "op", "bf16"),
    ("hf-phimoe", 3, 2, 1, 2, 256, "op", "bf16"), ("hf-mixtral-sv", "fsdp2-keep", 1, 1, 4, 256, "op", "bf16"),
    # selective checkpointing of latent attention: the kernel recomputed, its inputs kept by the checkpoint
    # (mla.core_inputs; read +5.4% / +6.1% while the whole kernel was counted saved)
    ("hf-deepseekv2", 0, 1, 1, 1, 256, "selective", "fp32"), ("hf-deepseekv2-dense", 0, 2, 1, 1, 256, "selective", "fp32"),
    ("hf-deepseekv2-sv", 2, 2, 1, 1, 256, "selective", "bf16"), ("hf-deepseekv3", 1, 1, 1, 1, 256, "selective", "bf16"),
    ("hf-deepseekv2-q", "fsdp2", 1, 1, 1, 512, "selective", "fp32"),
    # Granite-MoE's feed-forward is ``block_sparse_moe``, not ``mlp``: mlp checkpointing failed in the worker
    ("hf-granitemoe", 0, 1, 1, 2, 256, "mlp", "bf16"), ("hf-granitemoe-sv", 2, 2, 1, 4, 256, "mlp", "fp32"),
    # FSDP2 on gloo, bf16: the block's pre-backward prefetch holds the next unit's cast shard (the all-gather's
    # input) beside its output and gloo's temporary (fsdp2.py; read -2.08% without it)
    ("hf-qwen3moe-nf", "fsdp2", 2, 1, 1, 512, "selective", "bf16"),
    # latent attention's value a view of kv_b_proj's output in fp32 with one sequence (mla.value_kept; -1.07%)
    ("hf-deepseekv3", 0, 1, 1, 1, 512, "mlp", "fp32"), ("hf-deepseekv2", "fsdp2", 1, 1, 1, 512, "none", "fp32"),
]
ATTENTION_INSTANT_ROWS = [  # FSDP2: a block's attention core backward, the MLP's and o_proj's unsharded weight gradients
    # alive, above its MLP's instant where the MLP saves more than the core's transient (walk.backward_blocks)
    ("hf-granitemoe-sv", "fsdp2-rbf16", 2, 4, 1, 256, "op", "bf16"), ("hf-granitemoe-sv", "fsdp2", 1, 1, 1, 256, "full", "bf16"),
    ("hf-granitemoe-sv", "fsdp2-rbf16", 1, 1, 1, 256, "op", "bf16"), ("hf-granitemoe-sv", "fsdp2-keep", 2, 1, 1, 256, "none", "bf16"),
    ("hf-qwen3moe-sv", "fsdp2", 1, 1, 1, 256, "full", "bf16"), ("hf-mixtral-sv", "fsdp2", 2, 1, 1, 256, "full", "fp32"),
]
POST_BACKWARD_ROWS = [  # FSDP2 on 2 ranks, few tokens: a block's post-backward is the peak, its parameters resharded
    # before the reduce-scatter, gloo's clone of the fp32 input beside it and the new shard (fsdp2._blocks_backward)
    ("hf-qwen3moe-nf", "fsdp2-keep", 2, 2, 1, 128, "op", "bf16"), ("hf-qwen3moe-nf", "fsdp2-keep", 2, 1, 1, 128, "none", "bf16"),
    ("hf-qwen3moe-nf", "fsdp2", 2, 1, 1, 128, "op", "bf16"), ("hf-qwen3moe-nf", "fsdp2-keep", 2, 1, 1, 128, "full", "bf16"),
    ("hf-mixtral-sv", "fsdp2-keep", 2, 1, 1, 128, "none", "bf16"), ("hf-olmoe-sv", "fsdp2-rbf16", 2, 1, 1, 128, "full", "bf16"),
    ("hf-qwen3moe-nf", "fsdp2-keep", 2, 1, 1, 128, "none", "fp32"),
]
GQA_MATH_ROWS = [  # sdpa's CPU math kernel (Granite's attention dropout) with grouped kv heads: enable_gqa repeats k and v
    # inside the kernel (activations._math_core_forward_transient), the recomputed core's forward end the peak
    ("hf-granitemoe-sv", 1, 1, 1, 1, 256, "attention", "bf16"), ("hf-granitemoe-sv", 0, 1, 1, 1, 256, "selective", "fp32"),
    ("hf-granitemoe-sv", 2, 1, 1, 2, 256, "attention", "bf16"), ("hf-granitemoe-sv", "fsdp2", 1, 1, 1, 256, "selective", "bf16"),
    # selective, recomputed after the MLP's backward: the core's instant below the recomputed set (walk._recompute),
    # its peak inside the kernel at the dropout's cast
    ("hf-granitemoe-sv", 1, 1, 1, 2, 128, "selective", "bf16"), ("hf-granitemoe-sv", 1, 2, 1, 2, 128, "selective", "bf16"),
    ("hf-granitemoe-sv", 2, 2, 1, 2, 128, "selective", "bf16"),
]
EAGER_WEIGHTS_ROWS = [  # gpt-oss's eager attention returns its weights, held by the decoder layer through the experts'
    # forward where a checkpointed core saves none (activations._eager_weights_returned): the forward's peak
    ("hf-gptoss-sv", "fsdp2-rbf16", 2, 2, 1, 256, "selective", "fp32"), ("hf-gptoss-sv", "fsdp2-rbf16", 2, 1, 1, 256, "selective", "fp32"),
    ("hf-gptoss-sv", "fsdp2-rbf16", 1, 2, 1, 256, "selective", "fp32"), ("hf-gptoss-sv", "fsdp2-rbf16", 1, 2, 1, 256, "selective", "bf16"),
]
CARRY_MOE_ROWS = [  # ZeRO-1, two micro-steps (estimate.split_carry): the forward's last attention core holds the whole
    # carry (estimate.last_forward_relief); gpt-oss's eager core with sinks
    ("hf-gptoss-sv", 1, 1, 2, 1, 512, "attention", "fp32"), ("hf-gptoss-sv", 1, 2, 2, 1, 512, "full", "bf16"),
]
MLA_CORE_ROWS = [  # latent attention's core on sdpa's CPU math kernel at 384-512 tokens, few heads: its softmax
    # backward holds the peak; the block's post-attention norm released before it (activations._released_before_core),
    # in fp32 the value's gradient beside the probabilities' (mla.backward_transient)
    ("hf-deepseekv3", 0, 1, 1, 1, 512, "full", "fp32"), ("hf-deepseekv3", "fsdp2-rbf16", 1, 1, 2, 512, "full", "fp32"),
    ("hf-deepseekv2-sv", 1, 2, 1, 1, 512, "full", "bf16"), ("hf-deepseekv2", 2, 2, 1, 1, 512, "selective", "fp32"),
    ("hf-deepseekv2", 2, 1, 1, 1, 512, "selective", "fp32"), ("hf-deepseekv3-sv", "fsdp2", 2, 1, 1, 512, "attention", "bf16"),
    ("hf-deepseekv2-dense", 3, 2, 1, 1, 512, "full", "fp32"), ("hf-deepseekv2-q", "fsdp2-keep", 1, 1, 2, 384, "full", "fp32"),
    # its recomputation after the MLP's backward (attention): the peak at the kernel's softmax (mla.core_forward_transient)
    ("hf-deepseekv2-sv", 2, 1, 2, 2, 128, "attention", "bf16"), ("hf-deepseekv2-sv", 2, 1, 1, 2, 128, "attention", "bf16"),
    ("hf-deepseekv2-sv", 0, 1, 2, 2, 128, "attention", "bf16"),
]


# expert parallelism 2 on 2 gloo ranks (fsdp2: each block's E / 2 experts their own fully_shard unit,
# all_to_all_single dispatch and combine; autotune.models.fsdp2.apply), predicted at the default load factors
# for the rows each rank receives, and at the routing each measured (docs/moe.md "Expert parallelism");
# EP_MEASURE measured steps, each micro-step a new batch (a rank's received rows follow its batch's routing)
MOE_EP_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision): expert_parallel_size 2
    ("hf-mixtral", "fsdp2", 2, 1, 2, 256, "none", "bf16"), ("hf-qwen3moe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"),
    ("hf-mixtral-sv", "fsdp2", 2, 1, 4, 256, "none", "fp32"), ("hf-qwen3moe", "fsdp2-keep", 2, 1, 2, 256, "full", "fp32"),
    ("hf-mixtral-sv", "fsdp2", 2, 2, 2, 256, "full", "bf16"), ("hf-qwen3moe-sv", "fsdp2", 2, 1, 4, 256, "selective", "fp32"),
    # shared experts, latent attention and dense-MLP blocks among the routed ones (DeepSeek-V2/V3, Qwen1.5-MoE)
    ("hf-deepseekv3-dense", "fsdp2", 2, 1, 2, 256, "none", "bf16"), ("hf-deepseekv2-sv", "fsdp2", 2, 1, 4, 256, "none", "fp32"),
    ("hf-qwen2moe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"), ("hf-qwen2moe-dense", "fsdp2-keep", 2, 1, 2, 256, "full", "fp32"),
    # checkpointed: the MoE backward's instants set the peak (the shared experts' around the routed chunk loop)
    ("hf-qwen2moe-sv", "fsdp2", 2, 1, 4, 512, "full", "fp32"), ("hf-deepseekv3-sv", "fsdp2", 2, 1, 4, 256, "full", "fp32"),
    ("hf-deepseekv2-sv", "fsdp2-keep", 2, 1, 8, 256, "full", "fp32"),
    ("hf-olmoe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"), ("hf-granitemoe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"),
    ("hf-phimoe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"),
    # module-level checkpointing: the experts' own fully_shard unit inside the recomputed MLP
    ("hf-mixtral-sv", "fsdp2", 2, 1, 4, 256, "mlp", "bf16"), ("hf-mixtral-sv", "fsdp2", 2, 1, 4, 256, "attention", "fp32"),
    ("hf-qwen3moe-sv", "fsdp2-keep", 2, 1, 4, 256, "mlp", "fp32"),
    # one expert per rank (2 experts, top-1, EP 2)
    ("hf-mixtral-e2", "fsdp2", 2, 1, 4, 256, "none", "bf16"), ("hf-mixtral-e2", "fsdp2-keep", 2, 1, 4, 256, "full", "fp32"),
    # latent attention's core holds the peak after the experts unit's post-backward (fsdp2._Units.rs_own, grad_own:
    # its parameters resharded, its gradients a reduce-scatter input and a new shard); two micro-steps among them
    ("hf-deepseekv2-sv", "fsdp2-keep", 2, 2, 1, 256, "full", "bf16"), ("hf-deepseekv3", "fsdp2-rbf16", 2, 2, 2, 512, "full", "fp32"),
    ("hf-deepseekv3-sv", "fsdp2-rbf16", 2, 2, 1, 128, "selective", "bf16"), ("hf-deepseekv3", "fsdp2-rbf16", 2, 1, 2, 512, "full", "fp32"),
    ("hf-deepseekv2-sv", "fsdp2", 2, 2, 1, 256, "full", "bf16"), ("hf-deepseekv2-sv", "fsdp2-keep", 2, 1, 1, 256, "full", "bf16"),
    # four micro-steps: the root's reduce-scatter holds the peak, its new shard beside the carried one (fsdp2.py)
    ("hf-qwen2moe-dense", "fsdp2-keep", 2, 4, 1, 128, "full", "bf16"),
]


EP_MEASURE = dict(measure_steps=8, fresh_batches=True)
"""How an EP row is measured (the worker's settings): the worst of 8 optimizer steps, every micro-step a new batch,
as a job's data loader gives (with two batches reused every step, the peak is one batch's routing)."""


def moe_grid() -> list[dict]:
    """MOE_ROWS, ATTENTION_INSTANT_ROWS, POST_BACKWARD_ROWS, CARRY_MOE_ROWS, GQA_MATH_ROWS, EAGER_WEIGHTS_ROWS,
    MLA_CORE_ROWS and MOE_EP_ROWS (knob expert_parallel_size 2) as grid rows (--moe)."""
    return ([dict(zip(ROW_KEYS, r)) for r in MOE_ROWS + ATTENTION_INSTANT_ROWS + POST_BACKWARD_ROWS + CARRY_MOE_ROWS
             + GQA_MATH_ROWS + EAGER_WEIGHTS_ROWS + MLA_CORE_ROWS]
            + [dict(zip(ROW_KEYS, r), knobs={"expert_parallel_size": 2}, **EP_MEASURE) for r in MOE_EP_ROWS])


def row_key(row: dict) -> tuple:
    """A row's identity (--reuse): ROW_KEYS, its long-context knobs when it has any, and its tokens when they are
    not uniform random ids (``--text``)."""
    key = tuple(row.get(k, 1 if k == "ga" else None) for k in ROW_KEYS)
    key = key + (json.dumps(row["knobs"], sort_keys=True),) if row.get("knobs") else key
    return key + (row["tokens"],) if row.get("tokens") else key


def grid(quick: bool) -> list[dict]:
    """Reference-decoder rows, the checkpointing-granularity rows and the fsdp2 rows (the HF
    families, hf_grid, carry most of the accuracy claim)."""
    rows = [dict(zip(ROW_KEYS, r)) for r in REFERENCE_ROWS]
    if quick:
        return rows[::3]
    have_hf = importlib.util.find_spec("transformers") is not None
    return (rows + [dict(zip(ROW_KEYS, r)) for r in GRANULARITY_ROWS + SELECTIVE_ROWS + EVERY_K_ROWS + FSDP2_ROWS
                    if have_hf or r[0] not in HF_FAMILIES]
            + [dict(zip(ROW_KEYS, r), measure_steps=GA_ROWS_STEPS) for r in GA_ROWS]
            + [dict(zip(ROW_KEYS, r)) for r in TABLE_ROWS + FRAME_ROWS]
            + [dict(zip(ROW_KEYS, r)) for r in CORE_ROWS if have_hf or r[0] not in HF_FAMILIES]
            + [dict(zip(ROW_KEYS, r)) for r in LONG_ROWS + NORM_ROWS + MATH_ROWS + CARRY_ROWS if have_hf])
