"""Which nn.Module the profiling worker trains, and how it is fed: reference, Hugging Face or user factory.

Three sources, chosen from the job (autotune.worker.main's JSON, filled by DeepSpeedBackend.job_for):

* ``model_factory: "package.module:function"`` (``model: {python: ...}`` in the config): the user's
  factory, called ``build_model(spec: ModelSpec, training: TrainingSpec)`` and returning
  ``(module, batch_fn)``:

  - ``module``: a ``torch.nn.Module`` built on the CPU in fp32 (DeepSpeed casts it to the strategy's
    precision and moves it to the device);
  - ``batch_fn(micro_batch_size: int, seq_len: int, device) -> dict``: keyword arguments for
    ``module(**batch)`` (tensors already on ``device``); called a few times before the timed steps;
  - ``module(**batch)`` returns a scalar loss tensor, or an object / dict with a ``loss``.

  Checkpointing: ``autotune.models.checkpointing.apply_checkpointing``: the module's own
  ``set_checkpointing(granularity, num_layers)`` if it has one; otherwise HF-style
  ``gradient_checkpointing_enable`` for ``full``; otherwise the first N blocks of its longest
  ``nn.ModuleList`` are wrapped in non-reentrant ``torch.utils.checkpoint``. ``selective`` needs
  ``set_checkpointing`` (or a Hugging Face model); without it the trial fails with status ``error``.
  The factory's module directory must be importable: the worker prepends ``python_path`` (the
  directory of the config file and the directory ``autotune run`` was started in) to ``sys.path``.
* ``hf_config: path`` (and transformers importable): ``AutoModelForCausalLM.from_config`` with
  ``attn_implementation="sdpa"``, nothing downloaded (``HF_HUB_OFFLINE=1``); batches
  ``{input_ids, labels=input_ids, use_cache=False}`` (HF shifts the labels itself).
  Checkpointing: ``full`` = non-reentrant ``gradient_checkpointing_enable``, on the first N layers
  through the per-layer ``gradient_checkpointing`` flags; ``selective`` = the attention function
  wrapped in a checkpoint through transformers' AttentionInterface (autotune.models.checkpointing).
  Without transformers the reference decoder built from the same ModelSpec is used (with a note).
* otherwise the reference decoder of autotune.models.reference.

Every contract violation raises :class:`UserModelError` with one short sentence; the worker turns it
into ``status: "error"``. This module imports torch lazily (only the builders need it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class UserModelError(RuntimeError):
    """The model cannot be built or fed as the contract says (short, user-facing reason)."""


@dataclass
class BuiltModel:
    module: Any
    batch_fn: Callable[[int, int, Any], dict]
    source: str
    """``reference`` | ``hf`` | ``factory:<package.module:function>``."""
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ factory


def load_factory(path: str, python_path: Optional[list[str]] = None) -> Callable[..., Any]:
    """Import ``package.module:function``; ``python_path`` entries are put first on sys.path."""
    for entry in reversed(python_path or []):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    mod_name, sep, fn_name = str(path).partition(":")
    if not sep or not mod_name.strip() or not fn_name.strip():
        raise UserModelError(f"model factory must be 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(mod_name.strip())
    except Exception as err:  # ImportError, or the module itself raising at import
        raise UserModelError(f"cannot import model factory module {mod_name!r}: {type(err).__name__}: "
                             f"{_first_line(err)}") from err
    fn = getattr(module, fn_name.strip(), None)
    if fn is None:
        raise UserModelError(f"model factory module {mod_name!r} has no attribute {fn_name.strip()!r}")
    if not callable(fn):
        raise UserModelError(f"model factory {path!r} is not callable ({type(fn).__name__})")
    return fn


def build_factory_model(path: str, spec: Any, training: Any, python_path: Optional[list[str]] = None) -> BuiltModel:
    """Call the user's factory and check its return value against the contract."""
    import torch

    fn = load_factory(path, python_path)
    try:
        out = fn(spec, training)
    except UserModelError:
        raise
    except Exception as err:
        if is_oom(err):
            raise
        raise UserModelError(f"model factory {path!r} raised {type(err).__name__}: {_first_line(err)}") from err
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise UserModelError(f"model factory {path!r} must return (nn.Module, batch_fn), "
                             f"got {_describe(out)}")
    module, batch_fn = out
    if not isinstance(module, torch.nn.Module):
        raise UserModelError(f"model factory {path!r} returned {_describe(module)} instead of an nn.Module")
    if not callable(batch_fn):
        raise UserModelError(f"model factory {path!r} returned a non-callable batch_fn ({_describe(batch_fn)})")
    return BuiltModel(module, _checked_batch_fn(batch_fn, path), f"factory:{path}")


def _checked_batch_fn(batch_fn: Callable[..., Any], path: str) -> Callable[[int, int, Any], dict]:
    def call(micro_batch_size: int, seq_len: int, device: Any) -> dict:
        try:
            batch = batch_fn(micro_batch_size, seq_len, device)
        except Exception as err:
            if is_oom(err):
                raise
            raise UserModelError(f"batch_fn of {path!r} raised {type(err).__name__}: {_first_line(err)}") from err
        if not isinstance(batch, dict) or not all(isinstance(k, str) for k in batch):
            raise UserModelError(f"batch_fn of {path!r} must return a dict of keyword arguments, "
                                 f"got {_describe(batch)}")
        return batch

    return call


def is_oom(exc: BaseException) -> bool:
    """Whether an error is an out-of-memory error: the worker reports it as status ``oom`` (not
    ``error``), and the builders here let it through unwrapped. torch's OutOfMemoryError, Python's
    MemoryError, or a RuntimeError saying so (the CPU allocator and DeepSpeed's own messages)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def loss_of(out: Any, source: str = "model") -> Any:
    """The scalar loss tensor from a forward's output (tensor, ``.loss`` or ``["loss"]``)."""
    import torch

    loss = out
    if not isinstance(out, torch.Tensor):
        if isinstance(out, dict) and "loss" in out:
            loss = out["loss"]
        elif getattr(out, "loss", None) is not None:
            loss = out.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UserModelError(f"{source} forward must return a scalar loss tensor or an object with .loss, "
                             f"got {_describe(loss)}")
    return loss.reshape(())


# ------------------------------------------------------------------------------------ HF / reference


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def hf_model_from_config(hf_config: str) -> Any:
    """``AutoModelForCausalLM.from_config`` of an HF config.json, sdpa attention (eager where the
    family has no sdpa path), random weights; the profiler and the traced memory tier both build
    HF models with it."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise UserModelError("hf source needs transformers (pip install transformers)") from err
    with open(hf_config, encoding="utf-8") as fh:
        raw = json.load(fh)
    from autotune.hf_config import text_model_config

    raw = dict(text_model_config(raw, hf_config))  # a multimodal file: the text model it nests (what is sized)
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


def job_source(cfg: Any) -> dict[str, Any]:
    """A job's (autotune.config.Config) model source as the worker job's keys, paths absolute: its factory and
    where to import it from (the job file's directory, then the current one), or its HF config.json; and its own
    tokens (profile.tokens). What the profile backend's worker jobs and the launch scripts build from."""
    source: dict[str, Any] = {}
    if cfg.model_factory:
        source = {"model_factory": cfg.model_factory,
                  "python_path": [os.path.dirname(os.path.abspath(cfg.path)), os.getcwd()]}
    elif cfg.hf_config:
        source = {"hf_config": os.path.abspath(cfg.hf_config)}
    if cfg.profile.tokens:
        source["tokens"] = os.path.abspath(cfg.profile.tokens)
    return source


def batch_seed(seed: int, rank: int) -> int:
    """The first batch seed of ``rank`` in a run seeded ``seed`` (``build_for_job``'s ``seed``): each rank its own
    batches, as data-parallel ranks read."""
    return seed * 1000 + rank * 100


def _windows(tokens: Optional[str], vocab: int) -> Any:
    """The job's own tokens (``profile.tokens``: autotune.models.tokens.token_windows), None without; a file
    that cannot feed the model is a UserModelError (its one line)."""
    if not tokens:
        return None
    from autotune.models.tokens import token_windows

    try:
        return token_windows(tokens, vocab)
    except ValueError as err:
        raise UserModelError(f"profile.tokens: {err}") from None


def build_hf_model(hf_config: str, seed: int = 0, tokens: Optional[str] = None) -> BuiltModel:
    """``AutoModelForCausalLM.from_config`` (sdpa attention, random init, nothing downloaded); batches of
    uniform random ids, or windows of ``tokens`` (a .npy of the job's own ids)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        module = hf_model_from_config(hf_config)
    except Exception as err:
        if is_oom(err):
            raise
        raise UserModelError(f"cannot build the Hugging Face model from {hf_config}: {type(err).__name__}: "
                             f"{_first_line(err)}") from err
    vocab = int(module.config.vocab_size)
    draw = _windows(tokens, vocab)

    counter = [seed]

    def batch_fn(micro_batch_size: int, seq_len: int, device: Any) -> dict:
        import torch

        g = torch.Generator().manual_seed(counter[0])
        counter[0] += 1
        ids = (torch.randint(0, vocab, (micro_batch_size, seq_len), generator=g) if draw is None
               else draw(micro_batch_size, seq_len, g)).to(device)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return BuiltModel(module, batch_fn, "hf")


_NOT_IN_REFERENCE = ("qk_norm", "qkv_bias", "fused_qkv", "parallel_residual", "rotary_concat", "linear_addmm",
                     "norms_per_block", "num_attention_masks", "sliding_window", "attn_logit_softcapping",
                     "final_logit_softcapping", "num_experts", "kv_lora_rank", "attention_sinks", "lm_head_bias",
                     "embedding_multiplier", "residual_multiplier", "logits_scaling")
"""ModelSpec fields the reference decoder (autotune.models.reference) does not build: a spec that sets one
away from its default would profile another model than the one sized."""


def reference_unbuilt(spec: Any) -> list[str]:
    """The fields of ``spec`` set to what the reference decoder does not build (empty: it builds ``spec``)."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    return [name for name in _NOT_IN_REFERENCE if getattr(spec, name) != defaults[name]]


def build_reference_model(spec: Any, seed: int = 0, tokens: Optional[str] = None) -> BuiltModel:
    """autotune.models.reference's decoder for ``spec``; batches of uniform random ids (``synthetic_batch``),
    or windows of ``tokens`` (a .npy of the job's own ids), next-token labels."""
    unbuilt = reference_unbuilt(spec)
    if unbuilt:
        raise UserModelError(f"the reference decoder does not build {', '.join(unbuilt)} of model {spec.name!r}: "
                             f"give model.hf_config (its config.json) to profile it")
    from autotune.models.reference import build_model, synthetic_batch

    module = build_model(spec)
    draw = _windows(tokens, spec.vocab_size)

    counter = [seed]

    def batch_fn(micro_batch_size: int, seq_len: int, device: Any) -> dict:
        import torch

        if draw is None:
            x, y = synthetic_batch(spec, micro_batch_size, seq_len, seed=counter[0], device=device)
        else:
            window = draw(micro_batch_size, seq_len + 1, torch.Generator().manual_seed(counter[0]))
            x, y = window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)
        counter[0] += 1
        return {"input_ids": x, "labels": y}

    return BuiltModel(module, batch_fn, "reference")


def build_for_job(job: dict, spec: Any, training: Any, seed: int = 0) -> BuiltModel:
    """The module and batch function the job asks for (see the module docstring), with the norm kernel
    the model states (``apply_norm_kernel``); ``seed``: the first synthetic batch's seed (built-in
    sources; a factory seeds its own batches); ``tokens`` in the job: the built-in sources' batches are
    windows of that .npy of ids (profile.tokens; a factory's batches are its own)."""
    factory, hf_config, tokens = job.get("model_factory"), job.get("hf_config"), job.get("tokens")
    if factory:
        if tokens:
            raise UserModelError("profile.tokens: model.python's factory gives its own batches (its batch_fn)")
        built = build_factory_model(factory, spec, training, job.get("python_path"))
    elif hf_config and transformers_available():
        built = build_hf_model(hf_config, seed, tokens)
    else:
        built = build_reference_model(spec, seed, tokens)
        if hf_config:
            built.notes.append("transformers not installed: profiled the reference decoder built from the HF config")
    apply_norm_kernel(built, spec)
    return built


LIGER_ON_CPU = ("model.rms_norm_kernel liger needs CUDA: Liger's RMSNorm is a Triton kernel, which has no CPU "
                "driver (triton 3.9 on the CPU: RuntimeError: 0 active drivers ([]). There should only be one.)")
"""The one-line refusal of a Liger job on a CPU worker or script (the error its first forward raises, measured)."""


def norm_kernel_refusal(spec: Any, cuda: bool) -> Optional[str]:
    """Why the job's norm kernel cannot run on this device (``LIGER_ON_CPU``), checked before any process group
    or model is built; None where it can."""
    return LIGER_ON_CPU if getattr(spec, "rms_norm_kernel", "torch") == "liger" and not cuda else None


def apply_norm_kernel(built: BuiltModel, spec: Any) -> None:
    """``model.rms_norm_kernel: liger``: Liger's RMSNorm in every norm of a Hugging Face model, as HF Trainer's
    ``use_liger_kernel`` puts it there (transformers.integrations.liger ``apply_liger_kernel`` with
    ``model_rules.LIGER_KERNEL_CONFIG``); a factory's model keeps the norms it was built with (a note says so);
    the reference decoder has no Liger norm (refused in one line). Torch's RMSNorm: nothing to do."""
    if getattr(spec, "rms_norm_kernel", "torch") != "liger":
        return
    if built.source.startswith("factory"):
        built.notes.append("model.rms_norm_kernel liger: the factory's model runs the norms it was built with "
                           "(autotune swaps Liger's RMSNorm into Hugging Face models only)")
        return
    if built.source != "hf":
        raise UserModelError("model.rms_norm_kernel liger: autotune swaps Liger's RMSNorm into Hugging Face models "
                             "(model.hf_config, transformers installed); the reference decoder has none")
    from autotune.model_rules import LIGER_KERNEL_CONFIG

    if importlib.util.find_spec("liger_kernel") is None:
        raise UserModelError("model.rms_norm_kernel liger: liger-kernel is not installed (pip install liger-kernel)")
    try:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(built.module, dict(LIGER_KERNEL_CONFIG))
    except ImportError as err:
        raise UserModelError(f"model.rms_norm_kernel liger: {_first_line(err)}") from err
    built.notes.append("Liger's RMSNorm in every norm (model.rms_norm_kernel liger: liger-kernel's "
                       "apply_liger_kernel, rms_norm only)")


def set_checkpointing(built: BuiltModel, granularity: str, n: Any, num_layers: int) -> None:
    """Apply the strategy's activation checkpointing: the first ``n`` of ``num_layers`` layers, or
    the layer indices ``n`` lists (autotune.models.checkpointing.Blocks)."""
    model = built.module
    if hasattr(model, "set_checkpointing"):
        try:
            model.set_checkpointing(granularity if n else "none", n)
        except Exception as err:
            raise UserModelError(f"{built.source} set_checkpointing({granularity!r}, {n}) failed: "
                                 f"{type(err).__name__}: {_first_line(err)}") from err
        return
    if granularity == "none" or not n:
        return
    from autotune.models.checkpointing import apply_checkpointing

    try:
        built.notes += apply_checkpointing(model, granularity, n)
    except Exception as err:
        raise UserModelError(f"cannot apply {granularity} checkpointing to {n} layers: {_first_line(err)}") from err


# ------------------------------------------------------------------------------------ helpers


def _first_line(err: BaseException) -> str:
    return ((str(err).strip().splitlines() or [""])[0])[:200]


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return f"a tensor of shape {tuple(x.shape)}"
    except ImportError:  # pragma: no cover
        pass
    return type(x).__name__


