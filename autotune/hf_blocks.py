"""What a config.json's blocks keep for backward, measured (torch + transformers), so that
hf_config.check_block_bytes can compare it with the memory model for every dense file and every file of
a sized mixture-of-experts family, the proven families' too (a file can set a switch no test covers).

A parameter count that matches (autotune.hf_count) does not make the activations right: a family can have
the Llama-shaped parameters and another forward (GLM's partial interleaved rotary, Helium's or Seed-OSS's
own blocks). ``saved_bytes_of_blocks(small, attn)`` takes the file shrunk to CPU size with its own switches
kept (``shrink``: ``BLOCKS`` blocks, width 128, 4 heads), runs one forward of the transformers model with
autograd's saved-tensor hooks (bf16 and fp32, batch ``BATCH`` x ``SEQ`` tokens) and returns the bytes each
block saved that no earlier part of the forward saved; hf_config.check_block_bytes compares them with the
memory model's ``block_activation_bytes_per_token`` of the same shrunk file.

As autotune.hf_count: measured here when this process has imported torch and transformers, else in a child
process (``python -m autotune.hf_blocks``; the simulate path never imports torch; ``warm`` has one child do
the parameter count too) and cached in the same cache file under a ``blocks:`` key per shrunk config,
BLOCKS_VERSION, transformers version and attention implementation.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from typing import Any

from autotune.hf_count import (DROP_KEYS, LAYER_KEYS, HFCountError, available, child_answer, imported_here, read_cache,
                               transformers_quietly, write_cache)

BLOCKS = 4
"""Blocks of the shrunk model; blocks 1.. are compared (block 0 also saves what every block shares)."""
BATCH, SEQ = 2, 64
"""The measured forward's batch and sequence length."""
PRECISIONS = {"bf16": 2, "fp32": 4}
"""The dtypes measured (name -> bytes per element)."""
BLOCKS_VERSION = 2
"""Part of each cache key: raise it when the measurement changes (``shrink``, ``_measure``)."""
TIMEOUT_S = 600
"""How long the child process may take."""

_WIDTH = {"hidden_size": 128, "n_embd": 128, "d_model": 128, "intermediate_size": 344, "n_inner": 512,
          "ffn_hidden_size": 344, "vocab_size": 512, "padded_vocab_size": 512, "max_position_embeddings": 512,
          "n_positions": 512, "max_seq_len": 512, "head_dim": 32}
"""Size keys set to CPU size where the file sets them (the family's switches are left as they are)."""
_MOE_WIDTH = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 176, "shared_expert_intermediate_size": 344, "kv_lora_rank": 64,
              "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_group": 2,
              "topk_group": 1}
"""A mixture-of-experts / latent-attention file's sizes at CPU size, where it sets them (the memory benchmark's
tiny MoE shape: 4 experts, top-2; DeepSeek-V3's groups 2 of 2 experts, one picked; MLA ranks and head dims)."""
_KEEP_NULL = ("q_lora_rank",)
"""Keys whose null is a value, not the default (DeepSeek-V2-Lite's q_lora_rank: null, a plain q_proj)."""
_HEADS = ("num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "multi_query_group_num", "kv_n_heads")
_DROP = DROP_KEYS + ("quantization_config",)


def shrink(cfg: dict) -> dict:
    """``cfg`` (a text model's config.json object) at CPU size: ``BLOCKS`` blocks, width 128, 4 heads
    (kv heads 4 if the file has as many as heads, else 2, or 1 for multi-query), head dim 32 where set,
    a 512-token vocabulary; token ids past it set to 0; per-layer lists cut to the blocks; longrope's
    factor lists cut to the head's rotary pairs."""
    out = {k: v for k, v in cfg.items() if k not in _DROP and (v is not None or k in _KEEP_NULL)}
    heads = next((out[k] for k in _HEADS if isinstance(out.get(k), int)), None)
    for key, value in {**_WIDTH, **_MOE_WIDTH}.items():
        if isinstance(out.get(key), int) and not isinstance(out.get(key), bool):
            out[key] = value
    if isinstance(out.get("qk_rope_head_dim"), int) and isinstance(out.get("head_dim"), int):
        out["head_dim"] = out["qk_rope_head_dim"]  # DeepseekV2Config / DeepseekV3Config: the rotary's width
    if isinstance(out.get("mlp_only_layers"), list):  # Qwen-MoE's dense blocks among the shrunk ones
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if isinstance(i, int) and i < BLOCKS]
    if isinstance(out.get("first_k_dense_replace"), int):  # DeepSeek's dense first blocks, at most all of them
        out["first_k_dense_replace"] = min(out["first_k_dense_replace"], BLOCKS)
    for key in _HEADS:
        if isinstance(out.get(key), int):
            out[key] = 4
    for key in _KV_HEADS:
        if isinstance(out.get(key), int):
            kv = out[key]
            out[key] = 4 if kv == heads else 1 if kv == 1 else 2
    for key in LAYER_KEYS:
        if isinstance(out.get(key), int):
            out[key] = BLOCKS
    for key in ("rope_scaling", "rope_parameters"):  # longrope's per-frequency factors (Phi-3.5-MoE, Phi-3 128k): one
        rope = out.get(key)  # per pair of the shrunk head's rotary dims (modeling_rope_utils.py
        lists = [k for k in ("long_factor", "short_factor") if isinstance(rope, dict) and isinstance(rope.get(k), list)]
        if lists:  # _compute_longrope_parameters: head_dim x partial_rotary_factor / 2 of them)
            part = rope.get("partial_rotary_factor") or out.get("partial_rotary_factor") or 1.0
            half = int(_WIDTH["head_dim"] * float(part)) // 2
            out[key] = {**rope, **{k: rope[k][:half] for k in lists}}
    for key, value in out.items():
        if isinstance(value, list) and value and key.startswith("layer"):  # per-layer lists: the first BLOCKS,
            out[key] = [value[i % len(value)] for i in range(BLOCKS)]  # a shorter one's pattern repeated
        if key.endswith("token_id") and isinstance(value, int) and value >= 512:
            out[key] = 0
    return out


def _cache_key(small: dict, attn: str) -> str:
    body = json.dumps(small, sort_keys=True, default=str)
    return (f"blocks:{hashlib.sha256(body.encode()).hexdigest()}:v{BLOCKS_VERSION}:"
            f"transformers {importlib.metadata.version('transformers')}:{attn}")


def saved_bytes_of_blocks(small: dict, attn_implementation: str) -> dict[str, list[int]]:
    """precision -> the bytes blocks 1.. of the shrunk config ``small`` keep for backward (parameters and
    what an earlier part of the forward saved excluded); HFCountError (one line) if transformers cannot
    build or run it. Cached; measured in a child process unless torch and transformers are imported."""
    if imported_here():
        return _measure_here(small, attn_implementation)
    key = _cache_key(small, attn_implementation)
    cached = read_cache().get(key)
    if isinstance(cached, dict) and set(cached) == set(PRECISIONS):
        return cached
    answer = child_answer("autotune.hf_blocks", {"small": small, "attn": attn_implementation}, TIMEOUT_S,
                          "measuring the blocks' saved tensors")
    write_cache(key, answer["bytes"])
    return answer["bytes"]


def warm(raw: dict, num_layers: int, small: dict, attn_implementation: str) -> None:
    """Fill the cache for hf_count.hf_parameter_count(raw, num_layers) and saved_bytes_of_blocks(small, attn)
    with one child process where neither is cached (a torch-free process; each alone starts its own).
    Never raises: a part the child could not compute is left to its own call, which reports it."""
    if not available() or imported_here():
        return
    from autotune.hf_count import count_cache_key

    count_key, blocks_key = count_cache_key(raw, num_layers), _cache_key(small, attn_implementation)
    cache = read_cache()
    if count_key in cache or blocks_key in cache:  # one is there: the other's own child costs no more
        return
    try:
        answer = child_answer("autotune.hf_blocks", {"small": small, "attn": attn_implementation, "raw": raw,
                                                     "num_layers": num_layers}, TIMEOUT_S, "the model checks")
    except HFCountError:
        return
    for key, part in ((count_key, "count"), (blocks_key, "bytes")):
        if part in answer:
            write_cache(key, answer[part])


_MEASURED: dict[str, dict[str, list[int]]] = {}
"""This process's measurements (key -> bytes): a fuzzed or repeated job measures once."""


def _measure_here(small: dict, attn: str) -> dict[str, list[int]]:
    key = _cache_key(small, attn)
    if key not in _MEASURED:
        with transformers_quietly(f"run model_type {small.get('model_type', 'llama')!r} shrunk to {BLOCKS} "
                                  f"blocks of width 128"):
            _MEASURED[key] = {name: _measure(small, attn, name) for name in PRECISIONS}
    return _MEASURED[key]


def _measure(small: dict, attn: str, precision: str) -> list[int]:
    """One forward of the shrunk model in ``precision`` under saved-tensor hooks: per block, the bytes of
    the storages first saved inside it (parameters excluded; rotary tables and masks are shared)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(small)
    config = AutoConfig.for_model(cfg.pop("model_type", None) or "llama", **cfg)
    config._attn_implementation = attn
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.random.fork_rng(devices=[]):  # seeded here, the caller's generator left as it was
        torch.manual_seed(0)
        # every parameter in the training dtype, as DeepSpeed's and FSDP2's mixed precision hold them (a module
        # built in fp32, as DeepSeek's router weight, is cast too: its linear then keeps an fp32 copy)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(dtype).train()
        layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == BLOCKS)
        return saved_bytes_per_block(model, layers, torch.randint(0, int(config.vocab_size), (BATCH, SEQ)))[1:]


def saved_bytes_per_block(model: Any, layers: Any, input_ids: Any) -> list[int]:
    """One training forward of ``model`` (with labels) under autograd's saved-tensor hooks: per block of
    ``layers``, the bytes of the storages first saved inside it that the graph still holds when the
    forward returns (parameters excluded; a tensor saved by a node the forward dropped, as DeepSeek-V3's
    group top-k whose output only yields indices, is not kept; what an earlier part of the forward saved,
    as the rotary tables and masks every block shares, counted there)."""
    import weakref

    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed: list[tuple[int, Any]] = []  # (block it was saved in, a weak reference to the saved tensor)
    where = [-1]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda *a, i=i: where.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda *a: where.__setitem__(0, -1)))

    def pack(t):
        packed.append((where[0], weakref.ref(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    first_seen: dict[int, tuple[int, int]] = {}  # storage -> (block it was first saved in, bytes)
    for block, ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            first_seen.setdefault(t.untyped_storage().data_ptr(), (block, t.untyped_storage().nbytes()))
    del out
    return [sum(n for block, n in first_seen.values() if block == i) for i in range(len(layers))]


def main() -> int:
    """The child process: ``{"small": config, "attn": implementation}`` on stdin, ``{"bytes": {...}}`` or
    ``{"error": one line}`` on stdout; with ``"raw"`` and ``"num_layers"`` too (``warm``), also
    ``{"count": n}``, and a part that failed is left out (no ``error``)."""
    from autotune.hf_count import hf_parameter_count

    job = json.load(sys.stdin)
    answer: dict[str, Any] = {}
    if "raw" in job:
        import torch  # noqa: F401  (imported: the count runs here, not in a child of this child)
        import transformers  # noqa: F401

        for part, compute in (("count", lambda: hf_parameter_count(job["raw"], int(job["num_layers"]))),
                              ("bytes", lambda: _measure_here(job["small"], job["attn"]))):
            try:
                answer[part] = compute()
            except HFCountError:
                pass
    else:
        try:
            answer["bytes"] = _measure_here(job["small"], job["attn"])
        except HFCountError as err:
            answer = {"error": str(err)}
    print(json.dumps(answer))
    return 0


__all__ = ["BLOCKS", "available", "saved_bytes_of_blocks", "saved_bytes_per_block", "shrink"]

if __name__ == "__main__":
    sys.exit(main())
