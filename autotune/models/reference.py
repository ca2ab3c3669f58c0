"""Reference decoder models built from a :class:`~autotune.spec.ModelSpec` (torch only here).

Two block flavours, chosen from the spec's fields:

* Llama-style (``norm="rmsnorm"``, gated ``silu`` MLP, ``rope``): RMSNorm with the fp32 upcast
  exactly as Hugging Face ``LlamaRMSNorm``, rotary embeddings, SwiGLU, grouped-query attention.
* GPT/MPT-style (``norm="layernorm"``, ``gelu*``/``relu`` MLP, ``learned``/``alibi``/``none``
  positions, optional bias): LayerNorm, plain two-matrix MLP.

Attention is ``torch.nn.functional.scaled_dot_product_attention`` (``attn_implementation="sdpa"``)
or an explicit softmax(QK^T)V (``"eager"``, probabilities kept for backward). Dropout follows
``attention_dropout`` / ``hidden_dropout`` (embeddings and both residual branches, like GPT-2).
ALiBi is represented by no position parameters and plain causal attention (the memory footprint
of the bias itself is not modelled).

The parameter count equals ``ModelSpec.num_parameters`` exactly (tested for every preset family).
The loss is cross entropy on the logits upcast to fp32 (as HF ``ForCausalLMLoss``); ``forward``
returns ``{"loss", "logits"}`` like an HF ``CausalLMOutput`` (logits in the model dtype), so the
usual loop that keeps ``outputs`` keeps the logits alive exactly as with an HF model.

``set_checkpointing(granularity, num_layers)`` wraps the first ``num_layers`` blocks in
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: ``full`` recomputes the whole
block, ``selective`` only the attention core (Korthikanti et al. 2022, sec. 5), ``attention`` /
``mlp`` that module of the block (its input is the norm's output; the norms are not recomputed),
``op`` the block with torchtitan's op-level selective policy (``autotune.models.checkpointing.op_sac_context``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.models.checkpointing import op_sac_context
from autotune.spec import ModelSpec
from autotune.strategy import CHECKPOINTINGS


class RMSNorm(nn.Module):
    """Hugging Face ``LlamaRMSNorm``: computed in fp32, weight applied in the input dtype."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm in ("rmsnorm", "rmsnorm_fp32"):
        return RMSNorm(spec.hidden_size)
    return nn.LayerNorm(spec.hidden_size, eps=1e-5, bias=spec.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.spec = spec
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_size
        self.q_proj = nn.Linear(d, spec.q_size, bias=spec.bias)
        self.k_proj = nn.Linear(d, spec.kv_size, bias=spec.bias)
        self.v_proj = nn.Linear(d, spec.kv_size, bias=spec.bias)
        self.o_proj = nn.Linear(spec.q_size, d, bias=spec.bias)
        self.attn_dropout = spec.attention_dropout
        self.resid_dropout = nn.Dropout(spec.hidden_dropout)
        self.rope = spec.position_embedding == "rope"
        self.checkpoint_core = False

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T/sqrt(d))V with a causal mask; q (b,a,s,hd), k/v (b,kv,s,hd)."""
        p = self.attn_dropout if self.training else 0.0
        if self.spec.attn_implementation == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                  enable_gqa=self.kv_heads != self.heads)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p, self.training)
        return torch.matmul(probs, v)

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.checkpoint_core:
            o = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.resid_dropout(self.o_proj(o))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, f = spec.hidden_size, spec.intermediate_size
        self.gated = spec.gated_mlp
        act = spec.hidden_act.lower()
        if self.gated:
            self.gate_proj = nn.Linear(d, f, bias=spec.bias)
        self.up_proj = nn.Linear(d, f, bias=spec.bias)
        self.down_proj = nn.Linear(f, d, bias=spec.bias)
        if self.gated:
            self.act = F.silu
        elif act.startswith("gelu"):
            approx = "tanh" if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast") else "none"
            self.act = lambda t: F.gelu(t, approximate=approx)
        else:
            self.act = F.relu
        self.dropout = nn.Dropout(spec.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.act(self.up_proj(x))
        return self.dropout(self.down_proj(h))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_norm = _norm(spec)
        self.attn = Attention(spec)
        self.post_norm = _norm(spec)
        self.mlp = MLP(spec)
        self.checkpoint_module: Optional[str] = None  # "attention" | "mlp": that module recomputed

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> torch.Tensor:
        h = self.input_norm(x)
        if self.checkpoint_module == "attention":
            x = x + checkpoint(self.attn, h, cos, sin, use_reentrant=False)
        else:
            x = x + self.attn(h, cos, sin)
        h = self.post_norm(x)
        if self.checkpoint_module == "mlp":
            return x + checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h)


class Decoder(nn.Module):
    """Decoder-only LM; ``forward(input_ids, labels)`` returns ``{"loss": mean token cross entropy,
    "logits": (b, s, V) in the model dtype}``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, d)
        self.embed_positions = (
            nn.Embedding(spec.max_position_embeddings, d) if spec.position_embedding == "learned" else None
        )
        self.embed_dropout = nn.Dropout(spec.hidden_dropout)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_hidden_layers))
        self.norm = _norm(spec)
        # an nn.Linear module in both cases (like HF), so ZeRO-3's module hooks fetch its weight;
        # tied: the head's weight *is* the embedding matrix (one parameter)
        self.lm_head = nn.Linear(d, spec.vocab_size, bias=False)
        self._ckpt_block: list[Optional[str]] = [None] * spec.num_hidden_layers  # "full" | "op" | None
        self.rope_theta = 10000.0
        self.apply(self._init_weights)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 / Llama initialisation: N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def set_checkpointing(self, granularity: str, num_layers: Any = None) -> None:
        """Checkpoint blocks at ``granularity``: the first ``num_layers`` (all when None) or the
        block indices given as a list (autotune.models.checkpointing.chosen_blocks)."""
        from autotune.models.checkpointing import chosen_blocks

        if granularity not in CHECKPOINTINGS:
            raise ValueError(f"bad checkpointing {granularity!r} x {num_layers}")
        chosen = set() if granularity == "none" else set(chosen_blocks(num_layers, self.spec.num_hidden_layers))
        for i, block in enumerate(self.layers):
            on = i in chosen
            self._ckpt_block[i] = granularity if on and granularity in ("full", "op") else None
            block.attn.checkpoint_core = on and granularity == "selective"
            block.checkpoint_module = granularity if on and granularity in ("attention", "mlp") else None

    def _rope(self, s: int, device: torch.device, dtype: torch.dtype):
        hd = self.spec.head_size
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        t = torch.arange(s, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(s, device=input_ids.device))
        x = self.embed_dropout(x)
        cos = sin = None
        if self.spec.position_embedding == "rope":
            cos, sin = self._rope(s, x.device, x.dtype)
        for i, block in enumerate(self.layers):
            if self._ckpt_block[i] == "op":
                x = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=op_sac_context)
            elif self._ckpt_block[i] == "full":
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        x = self.norm(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, self.spec.vocab_size), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def build_model(spec: ModelSpec) -> Decoder:
    """The reference decoder for ``spec`` (fp32 parameters; DeepSpeed casts them)."""
    return Decoder(spec)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, shared tensors counted once."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            n += p.numel()
    return n


def synthetic_batch(spec: ModelSpec, micro_batch_size: int, seq_len: int, *, seed: int = 0,
                    device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token labels (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
