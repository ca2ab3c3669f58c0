"""``trace_memory``: one micro-batch (forward, backward, optimizer step) of the real module under
FakeTensorMode, measured by the tracker; ``TraceCache`` reuses traces across ZeRO/offload variants."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from autotune.spec import ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.trace.ops import flash_ops, sdpa_to_flash, unpacked_positions
from autotune.trace.tracker import ACT_CATEGORIES, GRAD32, MASTER, collect_after_each_module, frozen_heap, make_tracker


class TraceError(RuntimeError):
    """The model cannot be traced (missing dependency, unsupported option, user model error)."""


@dataclass(frozen=True)
class TraceResult:
    """Traced memory and FLOPs of one micro-batch (fwd + bwd + optimizer step), bytes per GPU."""

    model_name: str
    source: str
    """``reference`` (autotune.models.reference), ``hf`` (transformers from_config) or ``factory:<path>``."""
    micro_batch_size: int
    seq_len: int
    precision: str
    checkpointing: str
    checkpoint_layers: Any
    """Blocks checkpointed: their number (the first ones; 0 when checkpointing is none) or, every
    k-th block, their indices (a tuple)."""
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


def _set_checkpointing(model: Any, source: str, granularity: str, n: Any, num_layers: int) -> list[str]:
    """Apply the strategy's checkpointing to the built module (autotune.models.checkpointing, the same call
    the profiler and users make); returns notes on how it was applied."""
    from autotune.models.checkpointing import apply_checkpointing

    try:
        return apply_checkpointing(model, granularity, n)
    except ValueError as err:
        raise TraceError(f"{source} model: {err}") from None


def _loss(model: Any, batch: Optional[dict], inputs: list[Any], source: str, model_factory: Optional[str]) -> Any:
    """The forward, returning only the loss (profile.user_models.loss_of, as the profiler reads it) so
    the logits die as early as in a training loop. Fed the factory's batch as keywords, else the
    token ids and labels (as HF-style keywords when the forward takes them)."""
    from autotune.models.sources import loss_of

    if batch is not None:
        return loss_of(model(**batch), f"model factory {model_factory!r}")
    ids, labels = inputs
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
    return loss_of(out, f"{source} model")


def _dtype(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def _checkpoint_key(strategy: Strategy, num_layers: int) -> tuple[str, Any]:
    """(granularity, blocks): the number of first blocks, or every k-th block's indices (a tuple)."""
    n = strategy.num_checkpointed(num_layers)
    selection = strategy.checkpoint_selection(num_layers)
    return (strategy.checkpointing if n else "none", tuple(selection) if isinstance(selection, list) else n)


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
    contract of autotune.models.sources: ``build_model(spec, training) -> (module, batch_fn)``;
    the batch comes from ``batch_fn``) if given, else an HF model from `hf_config` when transformers
    is installed, else the reference decoder of ``autotune.models.reference``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    t0 = time.perf_counter()
    dtype = _dtype(strategy.precision)
    b, s = strategy.micro_batch_size, training.seq_len
    granularity, n_ckpt = _checkpoint_key(strategy, model_spec.num_hidden_layers)
    source, notes = _model_source(hf_config, model_factory)
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    tracker = make_tracker()
    flop_mode = FlopCounterMode(display=False, custom_mapping=flash_ops()["flop_mapping"])
    with fake:
        model, batch_fn = _build_module(source, model_spec, training, dtype, hf_config, model_factory, python_path)
        params = _prepare_module(model, source, granularity, n_ckpt, model_spec.num_hidden_layers, dtype, notes)
        batch, inputs = _inputs(model, model_spec, batch_fn, b, s)
        tracker.track_external(model, *inputs)
        # Cyclic garbage (autograd/checkpoint frames under fake mode) is freed whenever Python's
        # collector runs: frozen_heap collects first (the collections inside the trace then fall at
        # the same points whatever ran before in this process) and collect_after_each_module runs it
        # where real autograd would free the tensors (a deterministic, real-lifetime peak).
        with frozen_heap(), tracker, sdpa_to_flash(), unpacked_positions(source):
            step = _train_step(tracker, flop_mode, model, params, batch, inputs, source=source,
                               model_factory=model_factory, training=training, dtype=dtype,
                               optimizer_step=optimizer_step)
        tracker.reset_mod_stats()

    phase_peaks = {k: dict(v) for k, v in tracker.phase_peaks.items() if k != "setup"}
    peak = max((v["total"] for v in tracker.phase_peaks.values()), default=0)
    at_peak = dict(tracker.act_peak_snap)
    at_peak["phase"] = tracker.act_peak_phase  # type: ignore[assignment]
    return TraceResult(
        model_name=model_spec.name, source=source, micro_batch_size=b, seq_len=s, precision=strategy.precision,
        checkpointing=granularity, checkpoint_layers=n_ckpt, activation_peak=int(tracker.act_peak),
        saved_activations=int(step.saved_activations), peak=int(peak), phase_peaks=phase_peaks,
        states=step.states, at_activation_peak=at_peak,
        flops=_flop_summary(flop_mode, step.flops_forward, step.flops_total),
        parameters=sum(p.numel() for p in params), wall_s=time.perf_counter() - t0, notes=tuple(notes),
    )


def _prepare_module(model: Any, source: str, granularity: str, n_ckpt: Any, num_layers: int, dtype: Any,
                    notes: list[str]) -> list[Any]:
    """Put the built module in training mode with the strategy's checkpointing (``n_ckpt``: the number
    of first blocks or the block indices, as _checkpoint_key gives them) and the collector run after
    each checkpointed module's backward; returns its trainable parameters (shared ones once). Notes
    how checkpointing was applied and parameters not in ``dtype``."""
    model.train()
    notes += _set_checkpointing(model, source, granularity, n_ckpt, num_layers)
    if granularity != "none" and n_ckpt:
        collect_after_each_module(model)
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    wrong = {str(p.dtype) for p in params if p.dtype != dtype}
    if wrong:
        notes.append(f"parameters not in {dtype}: {sorted(wrong)} (kept as built)")
    return params


_STATE_NAMES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
                MASTER: "master_weights", GRAD32: "grads_fp32"}
"""Tracker category -> TraceResult.states key."""


class _Step(NamedTuple):
    """What one traced training step measured besides the tracker's own peaks."""

    flops_forward: int
    flops_total: int
    """Forward + backward (recompute included)."""
    saved_activations: int
    """Activations alive at the end of the forward."""
    states: dict
    """Model-state bytes per TraceResult.states key (the larger of before and after the optimizer step)."""
    alive: tuple
    """The optimizer and the fp32 master weights: the caller holds them until the trace returns."""


def _train_step(tracker: Any, flop_mode: Any, model: Any, params: list[Any], batch: Optional[dict],
                inputs: list[Any], *, source: str, model_factory: Optional[str], training: TrainingSpec,
                dtype: Any, optimizer_step: bool) -> _Step:
    """One micro-batch under the tracker, phase by phase: fp32 master weights (setup), forward,
    backward (FLOPs counted for both) and the optimizer step."""
    import torch

    # fp32 master weights, as a mixed-precision optimizer keeps them (not for fp32 training)
    masters = _master_weights(tracker, params) if dtype != torch.float32 and optimizer_step else []
    tracker.phase = "forward"
    with flop_mode:
        loss = _loss(model, batch, inputs, source, model_factory)
        flops_fwd = flop_mode.get_total_flops()
        saved = sum(v for k, v in tracker.categories().items() if k in ACT_CATEGORIES)
        tracker.phase = "backward"
        loss.backward()
        del loss
    flops_total = flop_mode.get_total_flops()
    tracker.phase = "optimizer"
    before = tracker.categories()
    opt = _optimizer_step(tracker, training, params, masters) if optimizer_step else None
    after = tracker.categories()
    states = {name: int(max(after.get(k, 0), before.get(k, 0))) for k, name in _STATE_NAMES.items()}
    return _Step(flops_fwd, flops_total, saved, states, (opt, masters))


def _inputs(model: Any, model_spec: ModelSpec, batch_fn: Optional[Callable[..., dict]], b: int,
            s: int) -> tuple[Optional[dict], list[Any]]:
    """The micro-batch (fake tensors): the factory's batch (and its tensors), or token ids and labels
    over the model's vocabulary (batch None)."""
    import torch

    if batch_fn is not None:
        batch = batch_fn(b, s, torch.device("cpu"))
        return batch, [v for v in batch.values() if isinstance(v, torch.Tensor)]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or model_spec.vocab_size
    ids = torch.randint(0, vocab, (b, s), dtype=torch.long)
    labels = torch.randint(0, vocab, (b, s), dtype=torch.long)
    return None, [ids, labels]


def _master_weights(tracker: Any, params: list[Any]) -> list[Any]:
    """fp32 copies of the parameters, filed under MASTER (setup phase)."""
    tracker.phase = "setup"
    masters = []
    for p in params:
        m = p.detach().float()
        tracker.refile(m, MASTER)
        masters.append(m)
    return masters


def _model_source(hf_config: Optional[str], model_factory: Optional[str]) -> tuple[str, list[str]]:
    """Which module the trace builds (``factory:<path>``, ``hf`` or ``reference``) and notes on it."""
    if model_factory:
        return f"factory:{model_factory}", []
    if hf_config:
        try:
            import transformers  # noqa: F401

            return "hf", []
        except ImportError:
            return "reference", ["transformers not installed: traced the reference decoder built from the HF config"]
    return "reference", []


def _build_module(source: str, model_spec: ModelSpec, training: TrainingSpec, dtype: Any,
                  hf_config: Optional[str], model_factory: Optional[str],
                  python_path: Optional[list[str]]) -> tuple[Any, Optional[Callable[..., dict]]]:
    """The module to trace, built in ``dtype`` (under the caller's fake mode: ``.to(dtype)`` fails
    there), and the factory's batch function (None: the trace feeds token ids and labels)."""
    import torch

    old_dtype = torch.get_default_dtype()
    batch_fn = None
    torch.set_default_dtype(dtype)
    try:
        if model_factory:
            from autotune.models.sources import UserModelError, build_factory_model

            try:
                built = build_factory_model(model_factory, model_spec, training, python_path)
            except UserModelError as err:
                raise TraceError(str(err)) from err
            model, batch_fn = built.module, built.batch_fn
        elif source == "hf":
            from autotune.models.sources import UserModelError, hf_model_from_config

            try:
                model = hf_model_from_config(hf_config)  # type: ignore[arg-type]
            except UserModelError as err:
                raise TraceError(str(err)) from err
        else:
            from autotune.models.reference import build_model

            model = build_model(model_spec)
    finally:
        torch.set_default_dtype(old_dtype)
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"{source} did not return an nn.Module (got {type(model).__name__})")
    return model, batch_fn


def _optimizer_step(tracker: Any, training: TrainingSpec, params: list[Any], masters: list[Any]) -> Any:
    """The optimizer step: with masters (mixed precision) fp32 gradients re-filed as GRAD32, the step
    on the masters and the 16-bit parameters copied back; without, the step on the parameters.
    Returns the optimizer: its states live as long as the caller holds it."""
    import torch

    if masters:
        for p, m in zip(params, masters):
            g = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            tracker.refile(g, GRAD32)
            p.grad = None
            m.grad = g
        opt_params = masters
    else:
        opt_params = params
    spec = training.optimizer  # the job's optimizer, as the configs and the worker build it
    fused = {"fused": True} if spec.type != "sgd" else {}
    opt = getattr(torch.optim, spec.torch_class)(opt_params, **spec.torch_kwargs(), **fused)
    opt.step()
    if masters:
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return opt


def _flop_summary(flop_mode: Any, flops_fwd: int, flops_total: int) -> dict[str, int]:
    """FLOPs of the micro-batch: forward, backward (recompute included), total, GEMMs and the
    attention core's forward and backward (the flash op's own counts)."""
    counts = flop_mode.get_flop_counts().get("Global", {})
    ops = flash_ops()
    attn_f = int(counts.get(ops["fwd"], 0))
    attn_b = int(counts.get(ops["bwd"], 0))
    gemm = int(sum(v for k, v in counts.items() if k not in (ops["fwd"], ops["bwd"])))
    return {"forward": int(flops_fwd), "backward": int(flops_total - flops_fwd), "total": int(flops_total),
            "gemm": gemm, "attention_fwd": attn_f, "attention_bwd": attn_b}


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
