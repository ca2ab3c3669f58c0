"""An example ``model: {python: "custom_model:build_model"}`` factory (see examples/custom-model.yaml).

The contract (autotune.models.sources): ``build_model(spec, training) -> (module, batch_fn)``;
the module is built on the CPU in fp32 (DeepSpeed casts and moves it), ``batch_fn(micro_batch_size,
seq_len, device)`` returns the keyword arguments of ``module(**batch)``, and the module returns a
scalar loss (or an object with ``.loss``). ``set_checkpointing(granularity, num_layers)`` is optional:
without it, strategies with activation checkpointing fail with a clear error.

This one is a small pre-norm decoder written with plain torch modules (nn.MultiheadAttention with a
causal mask, GELU MLP), sized from the ModelSpec of the config (preset or explicit fields).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
        self.checkpoint_attn = False

    def _attn(self, h: torch.Tensor) -> torch.Tensor:
        s = h.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + (checkpoint(self._attn, h, use_reentrant=False) if self.checkpoint_attn else self._attn(h))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, ffn: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.full = [False] * layers

    def set_checkpointing(self, granularity: str, num_layers: int) -> None:
        """``full``: whole layers; ``selective``: the attention only; first ``num_layers`` layers."""
        if granularity not in ("none", "selective", "full"):
            raise ValueError(f"unknown checkpointing {granularity!r}")
        for i, layer in enumerate(self.layers):
            on = granularity != "none" and i < num_layers
            self.full[i] = on and granularity == "full"
            layer.checkpoint_attn = on and granularity == "selective"

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for full, layer in zip(self.full, self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if full else layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.reshape(-1))


def build_model(spec, training):
    model = TinyLM(spec.vocab_size, spec.hidden_size, spec.num_attention_heads, spec.intermediate_size,
                   spec.num_hidden_layers, max(spec.max_position_embeddings, training.seq_len))
    generator = torch.Generator().manual_seed(0)

    def batch_fn(micro_batch_size: int, seq_len: int, device) -> dict:
        tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len + 1), generator=generator)
        return {"tokens": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device)}

    return model, batch_fn
