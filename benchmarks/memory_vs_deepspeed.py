"""Analytical peak memory vs real DeepSpeed training steps on the CPU accelerator.

    python benchmarks/memory_vs_deepspeed.py --json out.json     # full grid, 208 configs
    python benchmarks/memory_vs_deepspeed.py --quick             # 3 reference configs
    python benchmarks/memory_vs_deepspeed.py --spot              # 8 off-grid HF configs (GA 3, ...)
    python benchmarks/memory_vs_deepspeed.py --filter model=hf-phi3 --filter stage=3
    python benchmarks/memory_vs_deepspeed.py --reuse out.json    # re-predict stored measurements
    python benchmarks/memory_vs_deepspeed.py --long-context      # 18 rows of issue 24's knobs (long_context_grid)
    python benchmarks/memory_vs_deepspeed.py --moe               # the Mixtral / Qwen3-MoE / DeepSeek-V2 rows (moe_grid, docs/moe.md)

The grid: 10 Hugging Face families from their published config.json (tests/data/hf: llama, mistral,
qwen2, qwen3, gemma, gemma2, phi3, olmo2, gpt2 with its default dropout 0.1, gpt_neox), shrunk to CPU size
with the family's own switches kept, each under 8 strategies (ZeRO 0-3, 1 and 2 gloo ranks,
gradient accumulation 1/2/4, checkpointing none/full, bf16/fp32); plus 8 rows of autotune's
reference decoders (selective checkpointing, eager attention), 8 rows of module-level
checkpointing (attention / mlp), 6 of op-level checkpointing (op), 9 of selective checkpointing of
HF models (8 families, ZeRO 0/2/3 and fsdp2, one every 2nd block), 3 of every-k-th-block
checkpointing, 18 of the fsdp2 engine (1 and 2 ranks; resharding after forward or not, reduce
in fp32 or bf16; none/full/op/attention/mlp checkpointing) and 16 of ZeRO-1/2 on 2 ranks under
gradient accumulation 1/2/4/8, fp32 and bf16 (8 measured steps each), and 8 of the measured tables'
shapes (data/measured/tiny-gpt2-2rank-quiet, tiny-llama-engines-2rank-quiet: ZeRO-2/3 and FSDP2, 2
ranks, fp32/bf16, GA 4/8), 3 of DeepSpeed ZeRO-0 on the llama-sv shape (the checkpoint frame, the final
norm's backward), and 49 at long sequences (``LONG_ROWS``: seq 1024-4096 on three families shrunk to
h = 64, every ZeRO stage x none/full/op, 1 and 2 ranks, mbs 1-2, bf16/fp32; a 64-token vocabulary, where
the final norm's backward is the peak; Mistral's sliding window at and below the sequence; two rows at
seq 512/256). Every config runs
``autotune.worker.main`` in fresh processes (``python`` for 1 rank, ``torchrun
--nproc_per_node 2`` with gloo for 2) with a torch AdamW (fused, like DeepSpeed's FusedAdam)
passed to ``deepspeed.initialize``, the usual loop (``outputs = engine(**batch);
engine.backward(outputs.loss); engine.step()``), 2 warm-up and 2 measured optimizer steps.

Measured: the peak tensor bytes from torch.profiler's allocation events (c10's tally made to count
every thread, ``autotune.worker.cpu_memory.track_all_threads``), the max over the measured optimizer
steps (all their micro-steps) and over ranks: what a job runs out of memory at. Predicted:
``estimate_memory(..., device="cpu").gpu["peak"]`` for the same model, strategy and data-parallel
size. Prints every row, then the rows again worst (most under-predicted) first, then the signed
error summary. Optimizer offload is not in the grid: on a CPU-only machine "GPU" and host memory
are one allocator, so the split cannot be measured here (tests/memory/test_memory.py checks placement
against DeepSpeed's source and estimators).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.memory import estimate_memory  # noqa: E402
from autotune.presets import gpu_from_name  # noqa: E402
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

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
_LC = {"sp": {"sequence_parallel_size": 2}, "tl": {"tiled_loss": True}, "tm": {"tiled_mlp": True},
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
]


def long_context_grid() -> list[dict]:
    """LONG_CONTEXT_ROWS as grid rows (``knobs``: the long-context Strategy fields of the row)."""
    rows = []
    for *head, names in LONG_CONTEXT_ROWS:
        knobs: dict = {}
        for name in names.split("+"):
            knobs.update(_LC[name])
        rows.append(dict(zip(ROW_KEYS, head), knobs=knobs))
    return rows


MOE_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision): ZeRO 0-3 and fsdp2, 1/2 ranks, fp32/bf16
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
]


# expert parallelism 2 on 2 gloo ranks (fsdp2: each block's E / 2 experts their own fully_shard unit,
# all_to_all_single dispatch and combine; autotune.models.fsdp2.apply), predicted with the stated
# MOE_LOAD_IMBALANCE for the rows each rank receives (docs/moe.md "Expert parallelism")
MOE_EP_ROWS = [  # (model, stage, ranks, GA, mbs, seq, ckpt, precision): expert_parallel_size 2
    ("hf-mixtral", "fsdp2", 2, 1, 2, 256, "none", "bf16"), ("hf-qwen3moe-sv", "fsdp2", 2, 1, 4, 256, "none", "bf16"),
    ("hf-mixtral-sv", "fsdp2", 2, 1, 4, 256, "none", "fp32"), ("hf-qwen3moe", "fsdp2-keep", 2, 1, 2, 256, "full", "fp32"),
    ("hf-mixtral-sv", "fsdp2", 2, 2, 2, 256, "full", "bf16"), ("hf-qwen3moe-sv", "fsdp2", 2, 1, 4, 256, "selective", "fp32"),
]


def moe_grid() -> list[dict]:
    """MOE_ROWS and MOE_EP_ROWS (knob expert_parallel_size 2) as grid rows (--moe)."""
    return ([dict(zip(ROW_KEYS, r)) for r in MOE_ROWS]
            + [dict(zip(ROW_KEYS, r), knobs={"expert_parallel_size": 2}) for r in MOE_EP_ROWS])


def row_key(row: dict) -> tuple:
    """A row's identity (--reuse): ROW_KEYS, and its long-context knobs when it has any."""
    key = tuple(row.get(k, 1 if k == "ga" else None) for k in ROW_KEYS)
    return key + (json.dumps(row["knobs"], sort_keys=True),) if row.get("knobs") else key


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
            + [dict(zip(ROW_KEYS, r)) for r in LONG_ROWS if have_hf])


def row_strategy(row: dict) -> Strategy:
    """The strategy a row names: ``stage`` a ZeRO stage or an fsdp2 variant, ``ckpt`` a granularity
    or ``granularity/k`` (every k-th block)."""
    granularity, _, every = str(row["ckpt"]).partition("/")
    common = dict(micro_batch_size=row["mbs"], checkpointing=granularity, precision=row["precision"],
                  checkpoint_every=int(every) if every else None, **row.get("knobs", {}))
    stage = row["stage"]
    if isinstance(stage, str):
        return Strategy(engine="fsdp2", reshard_after_forward=stage != "fsdp2-keep",
                        reduce_dtype="bf16" if stage == "fsdp2-rbf16" else "fp32", **common)
    return Strategy(zero_stage=stage, **common)


def specs(row: dict, workdir: Path | None = None) -> tuple[ModelSpec, TrainingSpec, HardwareSpec, Strategy]:
    if row["model"] in HF_FAMILIES or row["model"] in LONG_FAMILIES:
        from autotune.config import hf_config_fields

        model = ModelSpec(**hf_config_fields(_hf_path(row["model"], workdir or Path(tempfile.gettempdir()))))
    else:
        model = ModelSpec(**MODELS[row["model"]])
    split = int(row.get("knobs", {}).get("sequence_parallel_size", 1)) * int(
        row.get("knobs", {}).get("context_parallel_size", 1))  # ranks sharing a sequence (1 without knobs)
    training = TrainingSpec(seq_len=row["seq"], global_batch_size=row["mbs"] * row["nproc"] * row.get("ga", 1) // split,
                            precision=row["precision"])
    hardware = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=row["nproc"], num_nodes=1)
    return model, training, hardware, row_strategy(row)


def run_row(row: dict, workdir: Path, timeout: float = 900) -> dict:
    model, training, hardware, strategy = specs(row, workdir)
    d = Path(tempfile.mkdtemp(prefix="mem_", dir=workdir))
    job = {"model": dataclasses.asdict(model), "training": {"seq_len": training.seq_len,
                                                       "global_batch_size": training.global_batch_size,
                                                       "precision": training.precision},
           "strategy": strategy.as_dict(), "warmup_steps": 2, "measure_steps": row.get("measure_steps", 2), "device": "cpu",
           "result_path": str(d / "result.json")}
    if row["model"] in HF_FAMILIES or row["model"] in LONG_FAMILIES:
        job["hf_config"] = _hf_path(row["model"], workdir)
    (d / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ep = strategy.expert_parallel_size > 1  # the worker that records the dispatch's received rows
    worker = [str(ROOT / "benchmarks" / "ep_rows_worker.py")] if ep else ["-m", "autotune.worker.main"]
    if row["nproc"] == 1:
        cmd = [sys.executable, *worker, str(d / "job.json")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(row["nproc"]),
               "--master_port", str(29500 + (hash(str(d)) % 2000)), *worker, str(d / "job.json")]
    t0 = time.time()
    out = dict(row)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # one stuck config does not end the run (the others are kept)
        out.update(status="timeout", reason=f"no result after {timeout:.0f} s")
        return out
    out["wall_s"] = round(time.time() - t0, 1)
    try:
        res = json.loads((d / "result.json").read_text())
    except FileNotFoundError:
        out.update(status="crash", reason=(proc.stderr or "")[-500:])
        return out
    out["status"] = res["status"]
    if res["status"] != "ok":
        out["reason"] = res.get("reason")
        return out
    ranks = res.get("all_ranks") or {}
    peaks = ranks.get("peak_allocated_bytes") or [res["peak_allocated_bytes"]]
    mins = ranks.get("min_step_peak_bytes") or [res.get("min_step_peak_bytes") or res["peak_allocated_bytes"]]
    # what a job OOMs at: the max over the measured optimizer steps (every micro-step) and ranks;
    # the smallest step peak is kept to show the spread
    k = peaks.index(max(peaks))
    out.update(measured=max(peaks), measured_min=min(mins), measured_phase=ranks.get("peak_phase", [res["peak_phase"]])[k],
               phases_measured=(ranks.get("phase_peaks_bytes") or [res["phase_peaks_bytes"]])[k],
               per_rank_peaks=peaks, optimizer=res["optimizer"], gas=res["gradient_accumulation_steps"],
               loop=res.get("loop"))
    if res.get("host_offload_peak_bytes") is not None:  # activation offload: rank 0's host bytes (not in the peak)
        out["host_offload_measured"] = res["host_offload_peak_bytes"]
    if ep:  # the busiest rank's dispatch: the largest output of an all-to-all fed tokens x top-k rows
        sent = row["mbs"] * row["seq"] * model.num_experts_per_tok
        out["received_rows"] = max(json.loads(f.read_text()).get(str(sent), 0) for f in d.glob("received_rows.*.json"))
        # every measured micro-step's dispatch splits (rows per source rank and local expert, forward order), all ranks
        out["routing_steps"] = [st for f in sorted(d.glob("routing_steps.*.json")) for st in json.loads(f.read_text())]
    return predict(out, workdir)


def predict(out: dict, workdir: Path) -> dict:
    """Add the memory model's prediction for a measured row (``device="cpu"``, the usual loop)."""
    model, training, hardware, strategy = specs(out, workdir)
    est = estimate_memory(model, training, hardware, strategy, device="cpu")
    out["dropout"] = bool(model.hidden_dropout or model.attention_dropout)
    out.update(predicted=est.gpu["peak"], predicted_phase=est.peak_phase, phases_predicted=est.phases)
    if out.get("knobs"):  # the long-context rows: the host RAM side too (activation offload's copies)
        out["host_predicted_per_node"] = est.cpu_bytes_per_node
    out["error"] = (out["predicted"] - out["measured"]) / out["measured"]
    if out.get("received_rows"):  # expert parallelism: also at the measured routing (the mechanism's error)
        out["imbalance_measured"] = out["received_rows"] / (out["mbs"] * out["seq"] * model.num_experts_per_tok)
        mean = out["mbs"] * out["seq"] * model.num_experts_per_tok
        # each micro-step at its routing: its dispatches' mean rows (the blocks' saves are affine in the rows, so
        # L blocks at the mean keep what the L blocks keep) and each dispatch's own chunk loop; else the bound
        out["predicted_routing"] = max(
            (_at_routing(sum(map(sum, st)) / len(st) / mean, model, training, hardware, strategy, st)
             for st in out.get("routing_steps") or [] if st),
            default=_at_routing(out["imbalance_measured"], model, training, hardware, strategy))
        out["error_routing"] = (out["predicted_routing"] - out["measured"]) / out["measured"]
        # the stated factors a user who measured this routing would give (ModelSpec.moe_load_imbalance: the
        # largest chunk, one source rank's rows for one expert, over its mean; ep_rank_imbalance: the rank's)
        chunks = [n for st in out.get("routing_steps") or [] for dispatch in st for n in dispatch]
        if chunks:
            out["expert_imbalance_measured"] = max(chunks) * model.num_experts / mean
            stated = model.replace(moe_load_imbalance=out["expert_imbalance_measured"],
                                   ep_rank_imbalance=out["imbalance_measured"])
            out["predicted_stated"] = estimate_memory(stated, training, hardware, strategy, device="cpu").gpu["peak"]
            out["error_stated"] = (out["predicted_stated"] - out["measured"]) / out["measured"]
    return out


def _at_routing(imbalance: float, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                strategy: Strategy, splits: list | None = None) -> int:
    """The peak predicted with ``imbalance`` (a measured step's busiest rank's received rows over the
    mean) as the model's ``ep_rank_imbalance`` and, when given, a micro-step's dispatch splits (``splits``,
    forward order; backward runs them last first) in place of the bound over every split:
    memory.expert_parallel.chunk_rows swapped for the call (the analytical model never knows the
    routing), the activations' cache cleared before and after."""
    from autotune.memory import activations, expert_parallel

    chunks = expert_parallel.chunk_rows
    if splits:
        expert_parallel.chunk_rows = lambda m, tokens, ep: tuple(tuple(reversed(c)) for c in splits)
    activations._breakdown.cache_clear()
    try:
        return estimate_memory(model.replace(ep_rank_imbalance=imbalance), training, hardware, strategy,
                               device="cpu").gpu["peak"]
    finally:
        expert_parallel.chunk_rows = chunks
        activations._breakdown.cache_clear()


ROW_KEYS = ("model", "stage", "nproc", "ga", "mbs", "seq", "ckpt", "precision")


def knob_text(knobs: dict) -> str:
    """A row's long-context and expert-parallel knobs in short: sp2, cp2, ep2, tl, tm, ao."""
    parts = [f"{n}{knobs[k]}" for n, k in (("sp", "sequence_parallel_size"), ("cp", "context_parallel_size"),
                                           ("ep", "expert_parallel_size")) if knobs.get(k, 1) > 1]
    parts += [n for n, k in (("tl", "tiled_loss"), ("tm", "tiled_mlp")) if knobs.get(k)]
    return "+".join(parts + (["ao"] if knobs.get("activation_offload", "none") != "none" else []))


def summarize(results: list[dict]) -> list[str]:
    """Signed-error summary lines, worst case first (under-prediction is the failure direction)."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return ["no config measured"]
    errs = [r["error"] for r in ok]
    worst_under = min(ok, key=lambda r: r["error"])
    worst_abs = max(ok, key=lambda r: abs(r["error"]))

    def name(r: dict) -> str:
        engine = r["stage"] if isinstance(r["stage"], str) else f"ZeRO-{r['stage']}"
        return (f"{r['model']} {engine} {r['nproc']} rank(s) GA {r.get('ga', 1)} mbs {r['mbs']} seq {r['seq']} "
                f"{r['ckpt']} {r['precision']}" + (f" {knob_text(r['knobs'])}" if r.get("knobs") else ""))

    lines = [f"configs: {len(results)} run, {len(ok)} ok, {len({(HF_FAMILIES.get(r['model']) or LONG_FAMILIES[r['model']])[0] for r in ok if r['model'] in HF_FAMILIES or r['model'] in LONG_FAMILIES})} "
             f"HF families",
             f"worst under-prediction: {100 * worst_under['error']:+.2f}% ({name(worst_under)})",
             f"worst |error|: {100 * worst_abs['error']:+.2f}% ({name(worst_abs)})",
             f"|error| median {100 * statistics.median(abs(e) for e in errs):.2f}%  max {100 * max(abs(e) for e in errs):.2f}%"
             f"  signed min {100 * min(errs):+.2f}% max {100 * max(errs):+.2f}%  under-predicted by > 2%: "
             f"{sum(e < -0.02 for e in errs)}  (targets: median <= 1%, max <= 3%, none under -2%)"]
    groups = {
        "HF families": [r for r in ok if r["model"] in HF_FAMILIES or r["model"] in LONG_FAMILIES],
        "reference decoders": [r for r in ok if r["model"] not in HF_FAMILIES and r["model"] not in LONG_FAMILIES],
        "seq >= 1024": [r for r in ok if r["seq"] >= 1024],
        "1 rank": [r for r in ok if r["nproc"] == 1],
        "2 ranks": [r for r in ok if r["nproc"] > 1],
        **{f"ZeRO-{z}": [r for r in ok if r["stage"] == z] for z in range(4)},
        "fsdp2": [r for r in ok if isinstance(r["stage"], str)],
        "every k-th block": [r for r in ok if "/" in str(r["ckpt"])],
        **{f"GA {g}": [r for r in ok if r.get("ga", 1) == g] for g in (1, 2, 4, 8)},
        "dropout on": [r for r in ok if r.get("dropout")],
        **{f"long context {n}": [r for r in ok if n in knob_text(r.get("knobs") or {}).split("+")]
           for n in ("sp2", "tl", "tm", "ao")},
        "expert parallel": [r for r in ok if (r.get("knobs") or {}).get("expert_parallel_size", 1) > 1],
    }
    for gname, rs in groups.items():
        if rs:
            e = [r["error"] for r in rs]
            lines.append(f"  {gname:<20} n={len(rs):<3} worst {100 * min(e):+.2f}%  median |err| "
                         f"{100 * statistics.median(abs(x) for x in e):.2f}%  max |err| {100 * max(abs(x) for x in e):.2f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few reference configs instead of the full grid")
    ap.add_argument("--spot", action="store_true", help="8 off-grid HF configs (GA 3, other shapes) instead of the grid")
    ap.add_argument("--long-context", action="store_true",
                    help="the long-context knob rows (long_context_grid: Ulysses, tiled loss / MLP, activation "
                         "offload) instead of the grid")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts rows (moe_grid) instead of the grid")
    ap.add_argument("--json", help="write all rows (measured, predicted, per-phase) to this file")
    ap.add_argument("--filter", action="append", default=[], help="KEY=VALUE on grid rows, e.g. stage=3 or stage=fsdp2,fsdp2-keep")
    ap.add_argument("--jobs", type=int, default=2, help="configs run this many at a time")
    ap.add_argument("--reuse", action="append", default=[],
                    help="a --json file of an earlier run: its measured rows are not run again, only "
                         "predicted again with the current model (later files win)")
    ap.add_argument("--no-run", action="store_true",
                    help="with --reuse: report the stored measurements only, run nothing new")
    args = ap.parse_args(argv)
    rows = grid(args.quick)
    if args.spot:
        rows = [dict(zip(ROW_KEYS, r)) for r in SPOT_ROWS]
    elif args.long_context:
        rows = long_context_grid()
    elif args.moe:
        rows = moe_grid()
    elif not args.quick and importlib.util.find_spec("transformers") is not None:
        rows += hf_grid()
    for f in args.filter:
        k, v = f.split("=", 1)
        rows = [r for r in rows if str(r.get(k)) in v.split(",")]  # VALUE: one, or alternatives a,b
    workdir = Path(tempfile.mkdtemp(prefix="autotune_membench_"))
    print(f"{len(rows)} configs; work dir {workdir}", flush=True)
    header = (f"{'model':<15}{'engine':>11}{'np':>3}{'GA':>3}{'mbs':>4}{'seq':>5} {'ckpt':<10}{'prec':<5}{'measured MiB':>13}"
              f"{'predicted MiB':>14}{'err %':>8}  phase(meas/pred)")
    print(header, flush=True)
    results: list[dict] = []

    def row_text(r: dict) -> str:
        head = (f"{r['model']:<15}{str(r['stage']):>11}{r['nproc']:>3}{r.get('ga', 1):>3}{r['mbs']:>4}{r['seq']:>5} "
                f"{r['ckpt']:<10}{r['precision']:<5}")
        if r.get("knobs"):
            head += f"[{knob_text(r['knobs'])}] "
        if r.get("status") != "ok":
            return head + f"  {r.get('status')}: {str(r.get('reason'))[:200]}"
        routing = (f"  at the measured routing (imbalance {r['imbalance_measured']:.3f}): {100 * r['error_routing']:+.2f}%"
                   if r.get("error_routing") is not None else "")
        if r.get("error_stated") is not None:
            routing += (f"; stated factors {r['expert_imbalance_measured']:.3f} / {r['imbalance_measured']:.3f}: "
                        f"{100 * r['error_stated']:+.2f}%")
        return (head + f"{r['measured'] / 2**20:>13.2f}{r['predicted'] / 2**20:>14.2f}{100 * r['error']:>+8.2f}"
                f"  {r['measured_phase']}/{r['predicted_phase']}" + routing)

    stored: dict[tuple, dict] = {}
    for path in args.reuse:
        for r in json.loads(Path(path).read_text()):
            if r.get("status") == "ok":
                stored[row_key(r)] = r
    todo = [] if args.no_run else [r for r in rows if row_key(r) not in stored]
    for row in rows:
        key = row_key(row)
        if key in stored:
            r = predict(dict(stored[key]), workdir)
            results.append(r)
            print(row_text(r) + "  (reused measurement)", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for r in pool.map(lambda row: run_row(row, workdir), todo):
            results.append(r)
            print(row_text(r), flush=True)
            if args.json:  # written as rows arrive: an interrupted run keeps what it measured (--reuse)
                Path(args.json).write_text(json.dumps(results, indent=1))
    print("\nworst first (signed error = predicted / measured - 1; measured = max over 2 measured optimizer "
          "steps, every micro-step, and over ranks):")
    for r in sorted(results, key=lambda r: r.get("error", -9)):
        print(row_text(r))
    print()
    if len(results) < len(rows):
        print(f"{len(rows) - len(results)} of the {len(rows)} grid configs not measured (--no-run)")
    for line in summarize(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = [r for r in results if r.get("status") == "ok"]
    return 0 if ok and len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
