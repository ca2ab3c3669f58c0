"""The trace's attention and dropout: a FlashAttention-2-shaped custom op and the patches that route
``F.scaled_dot_product_attention`` and ``F.dropout`` through it (and through ``torch.native_dropout``)
while a trace runs; and the HF masking patch that keeps a fake batch unpacked."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

_FLASH_LOCK = threading.Lock()
_FLASH: dict[str, Any] = {}


def flash_ops() -> dict[str, Any]:
    """Register (once) ``autotune_trace::flash_fwd`` / ``flash_bwd`` and return them with their FLOP formulas.

    The fake kernels allocate exactly what FlashAttention-2's forward returns and saves: the output
    (b, a, s, hd) in the input dtype, laid out (b, s, a, hd) in memory as FA2 does, and the log-sum-exp (b, a, s) in fp32; its backward returns
    dq, dk, dv shaped like q, k, v (GQA: k/v keep their kv heads). The real kernels (not used by the
    trace) are the math path, so the ops are also correct outside fake mode.
    """
    with _FLASH_LOCK:
        if _FLASH:
            return _FLASH
        import torch

        _register_flash_ops()
        fwd, bwd = torch.ops.autotune_trace.flash_fwd, torch.ops.autotune_trace.flash_bwd
        fwd_flops, bwd_flops = _flop_formulas()
        _FLASH.update(apply=_flash_function().apply, fwd=fwd, bwd=bwd, flop_mapping={fwd: fwd_flops, bwd: bwd_flops})
        return _FLASH


def _expand(k: Any, heads: int) -> Any:
    """k or v with its kv heads repeated to ``heads`` (GQA)."""
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1) if rep > 1 else k


def _register_flash_ops() -> None:
    """``autotune_trace::flash_fwd`` / ``flash_bwd``: math-path kernels and FlashAttention-2-shaped fakes."""
    import torch

    @torch.library.custom_op("autotune_trace::flash_fwd", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)")
    def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        kk, vv = _expand(k, q.shape[1]), _expand(v, q.shape[1])
        s = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * scale
        if causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1 + m - n), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vv.float()).to(q.dtype)
        return out.transpose(1, 2).contiguous().transpose(1, 2), lse  # (b, s, a, hd) memory, like FA2

    @flash_fwd.register_fake
    def _(q, k, v, causal, scale):
        b, a, s, _ = q.shape
        # FA2 (and PyTorch's flash kernels) allocate the output (b, s, a, hd) and return it
        # transposed, so the caller's transpose(1, 2).reshape(b, s, a*hd) is a free view.
        out = q.new_empty((b, s, a, v.shape[-1])).transpose(1, 2)
        return out, q.new_empty((b, a, s), dtype=torch.float32)

    @torch.library.custom_op("autotune_trace::flash_bwd", mutates_args=(),
                             schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                                    "bool causal, float scale) -> (Tensor, Tensor, Tensor)")
    def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.enable_grad():
            qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
            ke, ve = _expand(kk, q.shape[1]), _expand(vv, q.shape[1])
            s = torch.matmul(qq, ke.transpose(-1, -2)) * scale
            if causal:
                n, m = s.shape[-2:]
                s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1 + m - n),
                                  float("-inf"))
            o = torch.matmul(torch.softmax(s, -1), ve)
            dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), dout.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @flash_bwd.register_fake
    def _(dout, q, k, v, out, lse, causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_function() -> Any:
    """The autograd.Function running the two ops."""
    import torch

    class _Flash(torch.autograd.Function):
        # A plain autograd.Function (not register_autograd): its save order is stable under
        # non-reentrant checkpoint recomputation.
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            out, lse = torch.ops.autotune_trace.flash_fwd(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.scale = causal, scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = torch.ops.autotune_trace.flash_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
            return dq, dk, dv, None, None
    return _Flash


def _flop_formulas() -> tuple[Any, Any]:
    """FLOPs of the forward and backward ops: torch's own SDPA formulas."""
    from torch.utils import flop_counter as fc

    def _q_heads_shape(q_shape, kv_shape):
        # torch's formulas count GQA per query head; present k/v with the query head count.
        return (kv_shape[0], q_shape[1], kv_shape[2], kv_shape[3])

    # FlopCounterMode hands the formulas the argument shapes (its shape_wrapper).
    def fwd_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(q, _q_heads_shape(q, k), _q_heads_shape(q, v))

    def bwd_flops(dout, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(dout, q, _q_heads_shape(q, k), _q_heads_shape(q, v))
    return fwd_flops, bwd_flops


@contextlib.contextmanager
def sdpa_to_flash():
    """Route ``F.scaled_dot_product_attention`` to the flash-attention op and ``F.dropout`` to native_dropout.

    A patch of the module attribute rather than a TorchFunctionMode: the Python mode stack is not
    active while the autograd engine re-runs a non-reentrant checkpoint, so a mode would see the
    forward but not its recomputation. Code that bound the function by name at import time
    (``from torch.nn.functional import scaled_dot_product_attention``) is not redirected.
    """
    import torch.nn.functional as F

    ops = flash_ops()

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # Dropout inside flash attention keeps only an RNG state (no mask); an explicit attn_mask
        # (HF may pass one even for padding-free causal batches) is taken as causal.
        causal = bool(is_causal or attn_mask is not None)
        sc = float(scale) if scale is not None else 1.0 / float(query.shape[-1]) ** 0.5
        return ops["apply"](query, key, value, causal, sc)

    def dropout(input, p=0.5, training=True, inplace=False):
        # GPU dropout is the fused native_dropout (saves a 1-byte bool mask); on CPU, at::dropout
        # takes the unfused path (mask = bernoulli noise in the input dtype, 2 bytes in bf16).
        if not training or p == 0.0:
            return input
        out, _mask = torch.native_dropout(input, p, True)
        return out

    import torch

    with _PATCH_LOCK:
        originals = (F.scaled_dot_product_attention, F.dropout)
        F.scaled_dot_product_attention, F.dropout = sdpa, dropout
        try:
            yield
        finally:
            F.scaled_dot_product_attention, F.dropout = originals


_PATCH_LOCK = threading.Lock()


_HF_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def unpacked_positions(source: str):
    """HF models: tell transformers' mask code the batch is not packed, as a real run finds out.

    ``masking_utils.find_packed_sequence_indices`` cannot read fake position ids, so under
    FakeTensorMode it assumes packed sequences and builds an explicit mask; with a mask the sdpa
    integration repeats k/v for GQA (``repeat_kv``: two q-sized copies per layer) where a real
    run, whose ``arange`` positions show one sequence per row, passes no mask and lets sdpa
    handle GQA (``use_gqa_in_sdpa``). The traced batch is unpacked by construction.
    """
    mu = None
    if source == "hf":
        try:
            import transformers.masking_utils as mu
        except ImportError:
            mu = None
    if mu is None or not hasattr(mu, "find_packed_sequence_indices"):
        yield
        return
    with _HF_PATCH_LOCK:
        original = mu.find_packed_sequence_indices
        mu.find_packed_sequence_indices = lambda position_ids: None
        try:
            yield
        finally:
            mu.find_packed_sequence_indices = original
