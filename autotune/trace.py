"""Traced memory tier: tensor-level peak memory of the real nn.Module, on CPU, allocating nothing.

The model (the reference decoder built from the ModelSpec, an HF model built ``from_config`` when
the job came from an HF ``config.json`` and transformers is installed, or the user's factory
``package.module:function``) is built and run under ``FakeTensorMode`` on the ``cpu`` device: one
micro-batch forward + backward with the strategy's activation checkpointing, then a
mixed-precision AdamW step. Every tensor is accounted by torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` and FLOPs by ``torch.utils.flop_counter.
FlopCounterMode``. Nothing is allocated: a 7B-shaped Llama at seq 4096 traces in about a minute.

What the trace cannot see are DeepSpeed's own buffers (reduce/all-gather buckets, the flat fp32
partitions, ZeRO-3 prefetch): :func:`combine` therefore takes the *activations and temporaries*
from the trace and the *model states and buffers* from the analytical model
(:mod:`autotune.memory`), and says which part came from where.

Traps handled here (observed with torch 2.13 on CPU):

* fake ``cuda`` tensors abort a CPU-only torch on backward, so the fake device is ``cpu``;
* ``.to(torch.bfloat16)`` on a module fails under fake mode, so 16-bit models are built under
  ``torch.set_default_dtype``;
* MemTracker files fp32 master weights as Activation (created outside a module, outside
  backward) and fp32 gradients as Temp (created during backward); they are re-filed here under
  their own categories (``Master`` and ``Grad fp32``) before the step runs;
* on CPU, ``scaled_dot_product_attention`` falls back to the math path (an s x s probability
  matrix kept for backward) whenever dropout is on, and FlopCounterMode counts 0 FLOPs for the
  CPU flash kernel. The trace therefore routes SDPA through a small custom op whose fake kernel
  has the memory behaviour of FlashAttention-2 on the GPU (saves q, k, v, out and the fp32
  log-sum-exp; Dao 2023, FlashAttention-2, alg. 1/2) and whose FLOPs are torch's own SDPA
  formulas (``flop_counter.sdpa_flop_count`` / ``sdpa_backward_flop_count``);
* on CPU, ``F.dropout`` is the unfused at::dropout (its mask is noise in the input dtype, 2 bytes
  per element in bf16); the trace calls ``torch.native_dropout`` instead, which is what CUDA runs
  (1-byte bool mask saved for backward).

Importing this module does not import torch; every function imports it lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from autotune.spec import ModelSpec, TrainingSpec
from autotune.strategy import Strategy

GIB = float(1 << 30)

MASTER = "Master"
"""Category for fp32 master weights (MemTracker would file them as Activation)."""
GRAD32 = "Grad fp32"
"""Category for fp32 gradients fed to the optimizer (MemTracker would file them as Temp)."""

STATE_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", MASTER, GRAD32)
"""MemTracker categories that are model states (the analytical model owns these in combine)."""
ACT_CATEGORIES = ("Activation", "Temp", "Other")
"""Categories that are activations / temporaries (inputs are 'Other': they live on the GPU too)."""

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class TraceError(RuntimeError):
    """The model cannot be traced (missing dependency, unsupported option, user model error)."""


# ------------------------------------------------------------------------------------- result


@dataclass(frozen=True)
class TraceResult:
    """Traced memory and FLOPs of one micro-batch (fwd + bwd + optimizer step), bytes per GPU."""

    model_name: str
    source: str
    """``reference`` (autotune.profile.models), ``hf`` (transformers from_config) or ``factory:<path>``."""
    micro_batch_size: int
    seq_len: int
    precision: str
    checkpointing: str
    checkpoint_layers: int
    """Number of blocks checkpointed (0 when checkpointing is none)."""
    activation_peak: int
    """Peak over forward+backward of activations + temporaries (+ the input ids), excluding model states."""
    saved_activations: int
    """Activations alive at the end of the forward (what backward needs; the classic 'activation memory')."""
    peak: int
    """Peak of everything the plain-torch trace holds (16-bit params, grads, masters, Adam states, activations)."""
    phase_peaks: dict
    """{forward|backward|optimizer: {"total": bytes, "activations": bytes}} peaks per phase."""
    states: dict
    """Model-state bytes the trace saw, per category (params, grads, masters, Adam states, buffers)."""
    at_activation_peak: dict
    """Category -> bytes at the instant of the activation peak (and its phase under ``phase``)."""
    flops: dict
    """FlopCounterMode totals for the micro-batch: forward, backward (incl. recompute), gemm, attention_fwd, attention_bwd, total."""
    parameters: int
    """Trainable parameters of the traced module (shared tensors once)."""
    wall_s: float
    notes: tuple = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------- flash attention op

_FLASH_LOCK = threading.Lock()
_FLASH: dict[str, Any] = {}


def _flash_ops() -> dict[str, Any]:
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
        from torch.utils import flop_counter as fc

        def _expand(k: "torch.Tensor", heads: int) -> "torch.Tensor":
            rep = heads // k.shape[1]
            return k.repeat_interleave(rep, dim=1) if rep > 1 else k

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

        def _q_heads_shape(q_shape, kv_shape):
            # torch's formulas count GQA per query head; present k/v with the query head count.
            return (kv_shape[0], q_shape[1], kv_shape[2], kv_shape[3])

        # FlopCounterMode hands the formulas the argument shapes (its shape_wrapper).
        def fwd_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_flop_count(q, _q_heads_shape(q, k), _q_heads_shape(q, v))

        def bwd_flops(dout, q, k, v, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(dout, q, _q_heads_shape(q, k), _q_heads_shape(q, v))

        _FLASH.update(
            apply=_Flash.apply,
            fwd=torch.ops.autotune_trace.flash_fwd,
            bwd=torch.ops.autotune_trace.flash_bwd,
            flop_mapping={torch.ops.autotune_trace.flash_fwd: fwd_flops,
                          torch.ops.autotune_trace.flash_bwd: bwd_flops},
        )
        return _FLASH


@contextlib.contextmanager
def _sdpa_to_flash():
    """Route ``F.scaled_dot_product_attention`` to the flash-attention op and ``F.dropout`` to native_dropout.

    A patch of the module attribute rather than a TorchFunctionMode: the Python mode stack is not
    active while the autograd engine re-runs a non-reentrant checkpoint, so a mode would see the
    forward but not its recomputation. Code that bound the function by name at import time
    (``from torch.nn.functional import scaled_dot_product_attention``) is not redirected.
    """
    import torch.nn.functional as F

    ops = _flash_ops()

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
def _unpacked_positions(source: str):
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


# ------------------------------------------------------------------------------------- tracker


def _make_tracker():
    """MemTracker that also records per-phase peaks and the activation (non-state) peak."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class _PhaseTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            # plain-string extra categories; MemTracker only indexes the snapshot dict with them
            self._ref_class = list(_MemRefType) + [MASTER, GRAD32]  # type: ignore[assignment]
            self.phase = "setup"
            self.phase_peaks: dict[str, dict[str, int]] = {}
            self.act_peak = 0
            self.act_peak_snap: dict[str, int] = {}
            self.act_peak_phase = ""

        def refile(self, tensor: Any, category: Any) -> None:
            """Put the storage of `tensor` under `category` (MemTracker's own re-filing path)."""
            self._update_and_maybe_create_winfos(tensor, category)

        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():  # one device: cpu
                total = snap.get("Total", 0)
                act = sum(v for k, v in snap.items() if str(getattr(k, "value", k)) in ACT_CATEGORIES)
                ph = self.phase_peaks.setdefault(self.phase, {"total": 0, "activations": 0})
                ph["total"] = max(ph["total"], total)
                ph["activations"] = max(ph["activations"], act)
                if self.phase in ("forward", "backward") and act > self.act_peak:
                    self.act_peak = act
                    self.act_peak_phase = self.phase
                    self.act_peak_snap = {str(getattr(k, "value", k)): v for k, v in snap.items()}

        def categories(self) -> dict[str, int]:
            out: dict[str, int] = {}
            for snap in self._curr_mem_snap.values():
                for k, v in snap.items():
                    out[str(getattr(k, "value", k))] = out.get(str(getattr(k, "value", k)), 0) + v
            return out

    return _PhaseTracker()


# ------------------------------------------------------------------------------------- models


def _hf_model(hf_config: str) -> Any:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise TraceError("hf source needs transformers (pip install transformers)") from err
    with open(hf_config, encoding="utf-8") as fh:
        raw = json.load(fh)
    kind = raw.pop("model_type", "llama")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path"):
        raw.pop(key, None)
    config = AutoConfig.for_model(kind, **raw)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError as err:  # e.g. Gemma2 (attention-logit softcapping): eager only
        if "scaled_dot_product_attention" not in str(err):
            raise
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _set_checkpointing(model: Any, source: str, granularity: str, n: int, num_layers: int) -> list[str]:
    """Apply the strategy's checkpointing to the built module (autotune.checkpointing, the same call
    the profiler and users make); returns notes on how it was applied."""
    from autotune.checkpointing import apply_checkpointing

    try:
        return apply_checkpointing(model, granularity, n)
    except ValueError as err:
        raise TraceError(f"{source} model: {err}") from None


@contextlib.contextmanager
def _frozen_heap():
    """Collect once, then move every existing object to the collector's permanent generation
    (``gc.freeze``) for the trace: the collections inside it (``_collect_after_each_module``) then
    scan only objects the trace created, not the whole torch/transformers heap."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _collect_after_each_module(model: Any) -> None:
    """Run the cycle collector after the backward of each layer and of each of its leaf modules
    (layers: the children of ModuleLists).

    Under FakeTensorMode a checkpointed layer's recomputed tensors end up in reference cycles, so
    they outlive their use until Python's collector happens to run: at 22 layers the traced
    activation peak came out 28% high, and collecting once per layer still left llama2-7b (seq
    4096) 20% high, from recomputed MLP tensors that real autograd frees as soon as their node
    has run (checked with real tensors: a SwiGLU MLP under non-reentrant checkpointing peaks at
    6 f-wide tensors). Collecting after every leaf module gives the real lifetimes back (traced =
    analytic to 0.0%); ``_frozen_heap`` keeps those collections cheap. The trace's module is thrown away
    afterwards, so the hooks stay.
    """
    import torch

    def collect(module: Any, grad_input: Any, grad_output: Any) -> None:
        gc.collect()

    for mlist in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for layer in mlist:
            for sub in layer.modules():
                if sub is layer or next(sub.children(), None) is None:
                    sub.register_full_backward_hook(collect)


def _loss(model: Any, ids: Any, labels: Any) -> Any:
    """Forward that returns only the loss, so logits die as early as in a training loop."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        names = {}
    if "input_ids" in names and "labels" in names:  # HF-style keyword forward
        kwargs = {"input_ids": ids, "labels": labels}
        if "use_cache" in names:
            kwargs["use_cache"] = False
        out = model(**kwargs)
    else:
        out = model(ids, labels)
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, dict):
        return out["loss"]
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


# ---------------------------------------------------------------------------------------- trace


def _dtype(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def _checkpoint_key(strategy: Strategy, num_layers: int) -> tuple[str, int]:
    n = strategy.num_checkpointed(num_layers)
    return (strategy.checkpointing if n else "none", n)


def trace_memory(
    model_spec: ModelSpec,
    training: TrainingSpec,
    strategy: Strategy,
    *,
    hf_config: Optional[str] = None,
    model_factory: Optional[str] = None,
    python_path: Optional[list[str]] = None,
    optimizer_step: bool = True,
) -> TraceResult:
    """Trace one micro-batch of `strategy` (fwd + bwd + mixed-precision AdamW step) under FakeTensorMode.

    Source of the module: `model_factory` (``package.module:function`` following the profiling
    contract of autotune.profile.user_models: ``build_model(spec, training) -> (module, batch_fn)``;
    the batch comes from ``batch_fn``) if given, else an HF model from `hf_config` when transformers
    is installed, else the reference decoder of ``autotune.profile.models``.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    t0 = time.perf_counter()
    precision = strategy.precision
    dtype = _dtype(precision)
    b, s = strategy.micro_batch_size, training.seq_len
    L = model_spec.num_hidden_layers
    granularity, n_ckpt = _checkpoint_key(strategy, L)
    notes: list[str] = []
    if model_factory:
        source = f"factory:{model_factory}"
    elif hf_config:
        try:
            import transformers  # noqa: F401

            source = "hf"
        except ImportError:
            source = "reference"
            notes.append("transformers not installed: traced the reference decoder built from the HF config")
    else:
        source = "reference"

    old_dtype = torch.get_default_dtype()
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    tracker = _make_tracker()
    flop_mode = FlopCounterMode(display=False, custom_mapping=_flash_ops()["flop_mapping"])
    batch_fn = None
    with fake:
        torch.set_default_dtype(dtype)
        try:
            if model_factory:
                from autotune.profile.user_models import UserModelError, build_factory_model

                try:
                    built = build_factory_model(model_factory, model_spec, training, python_path)
                except UserModelError as err:
                    raise TraceError(str(err)) from err
                model, batch_fn = built.module, built.batch_fn
            elif source == "hf":
                model = _hf_model(hf_config)  # type: ignore[arg-type]
            else:
                from autotune.profile.models import build_model

                model = build_model(model_spec)
        finally:
            torch.set_default_dtype(old_dtype)
        if not isinstance(model, torch.nn.Module):
            raise TraceError(f"{source} did not return an nn.Module (got {type(model).__name__})")
        model.train()
        notes += _set_checkpointing(model, source, granularity, n_ckpt, L)
        if granularity != "none" and n_ckpt:
            _collect_after_each_module(model)
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        wrong = {str(p.dtype) for p in params if p.dtype != dtype}
        if wrong:
            notes.append(f"parameters not in {dtype}: {sorted(wrong)} (kept as built)")
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or model_spec.vocab_size
        if batch_fn is not None:
            batch = batch_fn(b, s, torch.device("cpu"))
            inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        else:
            ids = torch.randint(0, vocab, (b, s), dtype=torch.long)
            labels = torch.randint(0, vocab, (b, s), dtype=torch.long)
            inputs = [ids, labels]
        tracker.track_external(model, *inputs)
        # Cyclic garbage (autograd/checkpoint frames under fake mode) is freed whenever Python's
        # collector runs: _frozen_heap collects first (the collections inside the trace then fall at
        # the same points whatever ran before in this process) and _collect_after_each_module runs it
        # where real autograd would free the tensors (a deterministic, real-lifetime peak).
        with _frozen_heap(), tracker, _sdpa_to_flash(), _unpacked_positions(source):
            # fp32 master weights, as a mixed-precision optimizer keeps them (not for fp32 training)
            masters = []
            if dtype != torch.float32 and optimizer_step:
                tracker.phase = "setup"
                for p in params:
                    m = p.detach().float()
                    tracker.refile(m, MASTER)
                    masters.append(m)
            tracker.phase = "forward"
            with flop_mode:
                if batch_fn is not None:
                    from autotune.profile.user_models import loss_of

                    loss = loss_of(model(**batch), f"model factory {model_factory!r}")
                else:
                    loss = _loss(model, *inputs)
                flops_fwd = flop_mode.get_total_flops()
                saved = sum(v for k, v in tracker.categories().items() if k in ACT_CATEGORIES)
                tracker.phase = "backward"
                loss.backward()
                del loss
            flops_total = flop_mode.get_total_flops()
            tracker.phase = "optimizer"
            states_before_step = tracker.categories()
            if optimizer_step:
                if masters:
                    for p, m in zip(params, masters):
                        g = p.grad.float() if p.grad is not None else torch.zeros_like(m)
                        tracker.refile(g, GRAD32)
                        p.grad = None
                        m.grad = g
                    opt_params = masters
                else:
                    opt_params = params
                fused = {"fused": True} if training.optimizer != "sgd" else {}
                if training.optimizer == "sgd":
                    opt = torch.optim.SGD(opt_params, lr=1e-4, momentum=0.9)
                elif training.optimizer == "adam":
                    opt = torch.optim.Adam(opt_params, lr=1e-4, **fused)
                else:
                    opt = torch.optim.AdamW(opt_params, lr=1e-4, weight_decay=0.1, **fused)
                opt.step()
                if masters:
                    with torch.no_grad():
                        for p, m in zip(params, masters):
                            p.copy_(m)
            final = tracker.categories()
        tracker.reset_mod_stats()

    counts = flop_mode.get_flop_counts().get("Global", {})
    ops = _flash_ops()
    attn_f = int(counts.get(ops["fwd"], 0))
    attn_b = int(counts.get(ops["bwd"], 0))
    gemm = int(sum(v for k, v in counts.items() if k not in (ops["fwd"], ops["bwd"])))
    flops = {"forward": int(flops_fwd), "backward": int(flops_total - flops_fwd), "total": int(flops_total),
             "gemm": gemm, "attention_fwd": attn_f, "attention_bwd": attn_b}
    state_keys = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
                  MASTER: "master_weights", GRAD32: "grads_fp32"}
    states = {name: int(max(final.get(k, 0), states_before_step.get(k, 0))) for k, name in state_keys.items()}
    phase_peaks = {k: dict(v) for k, v in tracker.phase_peaks.items() if k != "setup"}
    peak = max((v["total"] for v in tracker.phase_peaks.values()), default=0)
    at_peak = dict(tracker.act_peak_snap)
    at_peak["phase"] = tracker.act_peak_phase  # type: ignore[assignment]
    return TraceResult(
        model_name=model_spec.name, source=source, micro_batch_size=b, seq_len=s, precision=precision,
        checkpointing=granularity, checkpoint_layers=n_ckpt, activation_peak=int(tracker.act_peak),
        saved_activations=int(saved), peak=int(peak), phase_peaks=phase_peaks, states=states,
        at_activation_peak=at_peak, flops=flops, parameters=sum(p.numel() for p in params),
        wall_s=time.perf_counter() - t0, notes=tuple(notes),
    )


# ------------------------------------------------------------------------------------- cache


class TraceCache:
    """Traces keyed by what changes activations: (micro_batch, checkpointing, checkpoint_layers).

    The model, sequence length, precision, optimizer and model source are part of the key too, so
    one cache can serve several jobs; ZeRO stage, offload and bucket sizes are not: they change
    model states and DeepSpeed buffers only, which come from the analytical model in
    :func:`combine`. A search over N ZeRO/offload variants of one (micro-batch, checkpointing)
    pair therefore traces once.
    """

    def __init__(self, tracer: Optional[Callable[..., TraceResult]] = None) -> None:
        self._tracer = tracer or trace_memory
        self._store: dict[tuple, TraceResult] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(model_spec: ModelSpec, training: TrainingSpec, strategy: Strategy, *,
            hf_config: Optional[str] = None, model_factory: Optional[str] = None) -> tuple:
        granularity, n = _checkpoint_key(strategy, model_spec.num_hidden_layers)
        return (model_spec, training.seq_len, strategy.precision, training.optimizer, hf_config, model_factory,
                strategy.micro_batch_size, granularity, n)

    def get(self, model_spec: ModelSpec, training: TrainingSpec, strategy: Strategy, *,
            hf_config: Optional[str] = None, model_factory: Optional[str] = None) -> TraceResult:
        key = self.key(model_spec, training, strategy, hf_config=hf_config, model_factory=model_factory)
        with self._lock:
            hit = self._store.get(key)
            if hit is not None:
                self.hits += 1
                return hit
        result = self._tracer(model_spec, training, strategy, hf_config=hf_config, model_factory=model_factory)
        with self._lock:
            self.misses += 1
            return self._store.setdefault(key, result)

    def __len__(self) -> int:
        return len(self._store)


# ------------------------------------------------------------------------------------ combine

ACTIVATION_COMPONENTS = ("activations", "logits")
"""Analytical GPU components replaced by the trace (MemoryEstimate.gpu keys)."""
NON_PEAK_COMPONENTS = ("overhead", "peak")
"""MemoryEstimate.gpu keys that are not part of the allocated peak."""


def combine(trace: TraceResult, estimate: Any, *, capacity_bytes: Optional[float] = None,
            model: Optional[ModelSpec] = None, training: Optional[TrainingSpec] = None,
            strategy: Optional[Strategy] = None) -> tuple[Any, dict]:
    """A MemoryEstimate whose activations/temporaries come from `trace`, model states and buffers from `estimate`.

    With ``E`` the analytical estimate (``autotune.memory.MemoryEstimate``):

    * ``states_fb`` = what E holds besides activations at its forward/backward peak:
      ``E.gpu["peak"] - E.gpu["activations"] - E.gpu["logits"]`` when E peaks in forward or
      backward (params, optimizer states, gradients so far and DeepSpeed buffers of that instant);
      when E peaks at the optimizer step, ``E.phases["backward"]`` minus E's backward-start
      activations (``activation_breakdown``: saved blocks + non-block + loss backward transient);
    * combined ``peak`` = max(``states_fb`` + traced activation peak, ``E.phases["optimizer"]``);
    * ``gpu["activations"]`` = the traced activation + temporary peak (logits, the fp32 loss upcast
      and every backward temporary included, so ``gpu["logits"]`` = 0) when the combined peak is in
      forward/backward; ``gpu["buffers"]`` absorbs the rest so the components still sum to the peak.

    When `capacity_bytes` (GPU memory x (1 - headroom)) is given, ``fits``/``reasons`` are re-decided
    on the combined peak + overhead (host RAM / NVMe reasons of E are kept). Returns the estimate
    and a provenance dict naming where each component came from.
    """
    gpu = dict(estimate.gpu)
    phases = dict(getattr(estimate, "phases", {}) or {})
    peak_phase = getattr(estimate, "peak_phase", "backward")
    analytic_act = sum(int(gpu.get(k, 0)) for k in ACTIVATION_COMPONENTS)
    if peak_phase != "optimizer" or "backward" not in phases or None in (model, training, strategy):
        states_fb = int(gpu["peak"]) - analytic_act
        how = f"analytic peak ({peak_phase}) minus its activations and logits"
    else:
        from autotune.memory import activation_breakdown

        act = activation_breakdown(model, training, strategy)  # type: ignore[arg-type]
        states_fb = int(phases["backward"] - act["blocks"] - act["nonblock"] - act["loss_backward_transient"])
        how = "analytic backward phase minus its backward-start activations"
    fb_peak = states_fb + int(trace.activation_peak)
    opt_peak = int(phases.get("optimizer", 0))
    new_peak = max(fb_peak, opt_peak)
    states = {k: int(v) for k, v in gpu.items() if k not in ACTIVATION_COMPONENTS + NON_PEAK_COMPONENTS}
    if fb_peak >= opt_peak:
        new_phase = trace.at_activation_peak.get("phase", "backward")
        gpu["activations"] = int(trace.activation_peak)
        gpu["logits"] = 0
        gpu["buffers"] = int(gpu.get("buffers", 0)) + (states_fb - sum(states.values()))
    else:  # the optimizer step dominates: the analytical breakdown of that phase stands
        new_phase = "optimizer"
    gpu["peak"] = int(new_peak)
    changes: dict[str, Any] = {"gpu": gpu}
    if hasattr(estimate, "peak_phase"):
        changes["peak_phase"] = new_phase
    if phases:
        phases[trace.at_activation_peak.get("phase", "backward")] = fb_peak
        changes["phases"] = phases
    if capacity_bytes is not None and hasattr(estimate, "fits"):
        total = gpu["peak"] + int(gpu.get("overhead", 0))
        fits_gpu = total <= capacity_bytes
        reasons = [r for r in getattr(estimate, "reasons", []) if not r.startswith("peak ") and " free" not in r]
        if not fits_gpu:
            reasons.insert(0, f"traced peak {gpu['peak'] / GIB:.2f} GiB + overhead "
                              f"{int(gpu.get('overhead', 0)) / GIB:.2f} GiB > {capacity_bytes / GIB:.2f} GiB free")
        changes["fits"] = fits_gpu and not reasons
        changes["reasons"] = reasons
    try:
        combined = dataclasses.replace(estimate, **changes)
    except (TypeError, ValueError):
        combined = estimate
        for k, v in changes.items():
            setattr(combined, k, v)
    provenance = {
        "fidelity": "traced",
        "traced": {"activations": f"{trace.source} model under FakeTensorMode + MemTracker: peak of activations "
                                  f"+ temporaries over forward/backward ({trace.at_activation_peak.get('phase', '?')})",
                   "logits": "included in traced activations"},
        "analytic": {**{k: "autotune.memory (model states / DeepSpeed buffers are invisible to a plain trace)"
                        for k in states}, "states_at_fwd_bwd_peak": how, "optimizer_phase": "autotune.memory"},
        "analytic_activations_bytes": analytic_act,
        "traced_activations_bytes": int(trace.activation_peak),
        "traced_saved_activations_bytes": int(trace.saved_activations),
        "analytic_peak_bytes": int(estimate.gpu.get("peak", 0)),
        "combined_peak_bytes": gpu["peak"],
        "trace": {"source": trace.source, "micro_batch_size": trace.micro_batch_size,
                  "checkpointing": trace.checkpointing, "checkpoint_layers": trace.checkpoint_layers,
                  "wall_s": round(trace.wall_s, 2), "flops_per_micro_batch": trace.flops["total"],
                  "notes": list(trace.notes)},
    }
    return combined, provenance


def traced_estimate(cfg: Any, strategy: Strategy, cache: Optional[TraceCache] = None,
                    headroom: Optional[float] = None) -> tuple[Any, dict]:
    """``estimate_memory`` with activations from a trace: what ``autotune estimate --trace`` and
    ``search: {fidelity: traced}`` call. `cfg` is an :class:`autotune.config.Config`."""
    from autotune.memory import estimate_memory

    h = cfg.search.headroom if headroom is None else headroom
    mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy, headroom=h)
    cache = cache if cache is not None else TraceCache()
    if cfg.model_factory:  # the factory module may sit next to the job file, as for profiling
        from autotune.profile.user_models import load_factory

        load_factory(cfg.model_factory, [os.path.dirname(os.path.abspath(cfg.path)), os.getcwd()])
    trace = cache.get(cfg.model, cfg.training, strategy, hf_config=cfg.hf_config, model_factory=cfg.model_factory)
    return combine(trace, mem, capacity_bytes=cfg.hardware.gpu.memory_bytes * (1 - h),
                   model=cfg.model, training=cfg.training, strategy=strategy)
