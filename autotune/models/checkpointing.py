"""Activation checkpointing of any ``nn.Module``, as autotune's strategies mean it.

``apply_checkpointing(model, granularity, num_layers)`` is the model-side half of a front point (the
DeepSpeed config does not carry checkpointing). It is what the profiler and the tracer apply, so a
point reproduces exactly as it was measured::

    import autotune
    autotune.apply_checkpointing(model, "full", num_layers=24)   # first 24 blocks recomputed
    autotune.apply_checkpointing(model, "op", num_layers=[1, 3, 5])  # these blocks (every 2nd of 6)

How it reaches the blocks, in order:

1. a model with ``set_checkpointing(granularity, num_layers)`` (autotune's reference decoders, or a
   user's model following them) does it itself;
2. ``selective`` (attention core softmax(QK^T)V recomputed, Korthikanti et al. 2022 sec. 5) on a
   Hugging Face model: ``checkpoint_attention_core`` registers a function with transformers'
   ``AttentionInterface`` (and the base's mask function with ``AttentionMaskInterface``) under
   ``autotune_selective_<base>``, where ``<base>`` is the model's attention implementation (sdpa,
   eager: the model file's own ``eager_attention_forward``, ...), and selects it with
   ``model.set_attn_implementation``. The function runs ``<base>`` inside non-reentrant
   ``torch.utils.checkpoint`` for the attention modules of the chosen blocks (marked
   ``_autotune_recompute_core``) and plainly for the others: the checkpoint keeps its inputs (q and k
   after rotary / qk-norm, v, the mask), the projections, rotary, norms and MLP are not recomputed.
   transformers' registered functions (``ALL_ATTENTION_FUNCTIONS["sdpa"]`` ...) are not modified;
   a model that does not dispatch through ``AttentionInterface`` is refused (ValueError);
   ``full`` on a Hugging Face model: ``gradient_checkpointing_enable`` with ``use_reentrant=False``,
   and for the first N of L layers the per-layer ``gradient_checkpointing`` flags turned off from
   layer N on;
3. any other module: the blocks are the longest ``nn.ModuleList`` in it; each of the first N gets
   its ``forward`` wrapped in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``;
4. ``attention`` / ``mlp`` on a model without ``set_checkpointing`` (HF or any other): the block's
   attention or MLP module (``SUBMODULE_NAMES``) gets its ``forward`` wrapped the same way; the
   norms around it are not recomputed. Transformers' source is never patched;
5. ``op`` on a model without ``set_checkpointing``: each of the first N blocks wrapped in a
   non-reentrant checkpoint with torchtitan's op-level selective policy (``op_sac_context``).

torch is imported only when a module is actually wrapped.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union, get_args

from autotune.strategy import Checkpointing

GRANULARITIES = get_args(Checkpointing)

Blocks = Union[None, int, Sequence[int]]
"""Which blocks are checkpointed: None = all, an int n = the first n, a sequence = those indices
(``Strategy.checkpointed_blocks``: every k-th block)."""


def chosen_blocks(which: Blocks, total: int) -> list[int]:
    """The block indices ``which`` names among ``total`` blocks (ValueError when out of range)."""
    if which is None:
        return list(range(total))
    if isinstance(which, int):
        if not 0 <= which <= total:
            raise ValueError(f"cannot checkpoint {which} blocks: the model has {total}")
        return list(range(which))
    out = sorted(set(int(i) for i in which))
    if out and not (0 <= out[0] and out[-1] < total):
        raise ValueError(f"block indices must be in 0..{total - 1}, but got {list(which)}")
    return out


def describe_blocks(which: Blocks, total: int) -> str:
    """``first 3 of 8`` or ``blocks 1, 3, 5 of 8``, for notes."""
    idx = chosen_blocks(which, total)
    if idx == list(range(len(idx))):
        return f"first {len(idx)} of {total}"
    return f"blocks {', '.join(map(str, idx))} of {total}"


def apply_checkpointing(model: Any, granularity: str, num_layers: Blocks = None) -> list[str]:
    """Checkpoint blocks of ``model`` at ``granularity`` (``"none" | "selective" | "attention" |
    "mlp" | "op" | "full"``): the first ``num_layers`` (None: all of them), or the block indices
    given as a list (every k-th block: ``Strategy.checkpointed_blocks``). Returns notes on how it
    was applied.

    Raises ValueError when the granularity is unknown, the layer count is out of range, or the
    model offers no way to apply it (``selective`` on a model that has neither ``set_checkpointing``
    nor transformers' ``set_attn_implementation``)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, but got {granularity!r}")
    if isinstance(num_layers, int) and num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, but got {num_layers}")
    empty = num_layers == 0 or (not isinstance(num_layers, int) and num_layers is not None and not len(num_layers))
    if hasattr(model, "set_checkpointing"):
        model.set_checkpointing("none" if empty else granularity, num_layers)
        return []
    if granularity == "none" or empty:
        return []
    if granularity == "selective":
        if not (hasattr(model, "set_attn_implementation") and hasattr(getattr(model, "config", None), "_attn_implementation")):
            raise ValueError("selective checkpointing (attention core recomputed) needs the model's own "
                             "set_checkpointing(granularity, num_layers), or a Hugging Face model (its attention "
                             "function is wrapped through AttentionInterface); use 'full' for this model")
        cores, total = _block_submodules(model, "attention", num_layers)
        name = checkpoint_attention_core(model, cores)
        return [f"attention core of the {describe_blocks(num_layers, total)} blocks recomputed: transformers "
                f"AttentionInterface function {name!r} (non-reentrant torch.utils.checkpoint)"]
    if granularity in ("attention", "mlp", "op"):
        notes = _no_kv_cache(model)
        if granularity == "op":
            return notes + _zero3_op_warning(model) + _wrap_blocks(model, num_layers, op_level=True)
        return notes + _wrap_submodules(model, granularity, num_layers)
    if hasattr(model, "gradient_checkpointing_enable"):
        return _hf_full(model, num_layers)
    return _wrap_blocks(model, num_layers)


def _zero3_op_warning(model: Any) -> list[str]:
    """A model whose parameters DeepSpeed ZeRO-3 has partitioned (``ds_id``, zero.Init or initialize):
    op-level checkpointing can stop in the backward (docs/engines.md; the strategy rules refuse it), so
    say so where a hand-written call meets it."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return []
    text = ("op checkpointing on a model partitioned by DeepSpeed ZeRO-3: a block's recomputation can gather "
            "parameters more often than its forward did, which torch's selective checkpoint refuses "
            "('... not found in storage'); autotune never proposes it (docs/engines.md)")
    warnings.warn(text, RuntimeWarning, stacklevel=3)
    return [text]


def _hf_full(model: Any, n: Blocks) -> list[str]:
    """Hugging Face models: their own non-reentrant checkpointing, per-layer flags for a subset."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
              and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    if not layers:  # transformers before GradientCheckpointingLayer (4.5x)
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
                  and type(m).__name__.endswith(("DecoderLayer", "Block", "Layer"))]
    try:
        on = set(chosen_blocks(n, len(layers)))
    except ValueError as err:
        raise ValueError(f"{err} checkpointable layers") from None
    if len(on) == len(layers):
        return []
    for i, layer in enumerate(layers):
        if i not in on:
            layer.gradient_checkpointing = False
    return [f"HF per-layer gradient_checkpointing flags: {describe_blocks(n, len(layers))} layers"]


def blocks_of(model: Any) -> Any:
    """The model's repeated blocks: its longest ``nn.ModuleList`` (ValueError when it has none)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to checkpoint; give it "
                         "set_checkpointing(granularity, num_layers)")
    return max(lists, key=len)


def _no_kv_cache(model: Any) -> list[str]:
    """A recomputed HF attention would append to the KV cache a second time (and op-level
    checkpointing refuses the mismatch): turn the cache off, as ``gradient_checkpointing_enable``
    does for training (transformers modeling_layers.py ``GradientCheckpointingLayer``)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
        return ["config.use_cache set to False (a recomputed layer must not update the KV cache twice)"]
    return []


def op_sac_context() -> Any:
    """Context for ``torch.utils.checkpoint.checkpoint(..., context_fn=op_sac_context)``: op-level
    selective activation checkpointing as torchtitan's ``op`` mode does it
    (torchtitan/distributed/activation_checkpoint.py ``_apply_op_sac``): the outputs of attention
    kernels and of every other ``aten.mm`` (the 1st, 3rd, ... of each checkpointed region) are kept,
    everything else (the other matmuls, norms, activations, rotary, ``addmm`` of biased linears) is
    recomputed. The CPU flash kernel is in the save list too, so the policy means the same on CPU."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)
    try:  # the traced tier's flash-attention op (autotune.trace.ops) is an attention kernel too
        save.add(torch.ops.autotune_trace.flash_fwd.default)
    except (AttributeError, RuntimeError):
        pass  # not registered: no trace in this process
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_forward(module: Any, op_level: bool = False) -> None:
    """Wrap ``module.forward`` in non-reentrant ``torch.utils.checkpoint`` (once); ``op_level``:
    with the op-level selective policy (``op_sac_context``)."""
    from torch.utils.checkpoint import checkpoint

    if getattr(module, "_autotune_checkpointed", False):
        return
    inner = module.forward
    extra = {"context_fn": op_sac_context} if op_level else {}

    def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
        return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = forward
    module._autotune_checkpointed = True


def _selected_blocks(model: Any, n: Blocks) -> tuple[list[Any], list[int]]:
    """The model's blocks and the indices of those checkpointed."""
    blocks = list(blocks_of(model))
    try:
        return blocks, chosen_blocks(n, len(blocks))
    except ValueError as err:
        raise ValueError(f"{err} (its longest ModuleList)") from None


def _wrap_blocks(model: Any, n: Blocks, op_level: bool = False) -> list[str]:
    blocks, idx = _selected_blocks(model, n)
    for i in idx:
        _checkpoint_forward(blocks[i], op_level)
    how = "torch.utils.checkpoint with the op-level selective policy" if op_level else "torch.utils.checkpoint"
    return [f"forward of the {describe_blocks(n, len(blocks))} blocks wrapped in {how}"]


SUBMODULE_NAMES = {"attention": ("self_attn", "attn", "attention", "self_attention"),
                   "mlp": ("mlp", "feed_forward", "ffn", "block_sparse_moe")}
"""Attribute names of a block's attention / MLP module (HF Llama-family ``self_attn`` / ``mlp``,
GPT-2 ``attn`` / ``mlp``, GPT-NeoX ``attention`` / ``mlp``, Granite-MoE's ``block_sparse_moe``,
autotune's decoders ``attn`` / ``mlp``)."""


def _block_submodules(model: Any, granularity: str, n: Blocks) -> tuple[list[Any], int]:
    """The ``attention`` / ``mlp`` module (``SUBMODULE_NAMES``) of each chosen block, and the block count."""
    blocks, idx = _selected_blocks(model, n)
    names = SUBMODULE_NAMES[granularity]
    subs = []
    for i in idx:
        block = blocks[i]
        sub = next((getattr(block, k) for k in names if hasattr(block, k)), None)
        if sub is None:
            raise ValueError(f"block {i} ({type(block).__name__}) has no {granularity} module (looked for "
                             f"{', '.join(names)}); use full checkpointing for this model")
        subs.append(sub)
    return subs, len(blocks)


def _wrap_submodules(model: Any, granularity: str, n: Blocks) -> list[str]:
    """``attention`` / ``mlp``: that module of each chosen block recomputed (its ``forward``
    wrapped in non-reentrant checkpoint; the norms around it are not recomputed)."""
    subs, total = _block_submodules(model, granularity, n)
    for sub in subs:
        _checkpoint_forward(sub)
    return [f"{granularity} module of the {describe_blocks(n, total)} blocks wrapped in torch.utils.checkpoint"]


def checkpoint_attention_core(model: Any, attention_modules: Any) -> str:
    """Selective checkpointing of a Hugging Face model (Korthikanti et al. 2022 sec. 5): the attention
    core softmax(QK^T)V of ``attention_modules`` (the chosen decoder layers' attention modules) is
    recomputed in backward; its inputs q, k, v and the mask are kept, the projections, rotary, norms
    and MLP are not recomputed. Registers ``autotune_selective_<base>`` with transformers'
    AttentionInterface (``<base>``: the model's attention implementation, whose mask function is
    registered under the same name) and selects it with ``model.set_attn_implementation``; the
    function runs ``<base>`` in non-reentrant ``torch.utils.checkpoint`` for the marked modules and
    plainly for the others. transformers' own functions are not modified. Returns the name."""
    import sys

    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prefix = "autotune_selective_"
    current = model.config._attn_implementation or "sdpa"
    base = current[len(prefix):] if current.startswith(prefix) else current
    name = prefix + base

    def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
        # eager is no AttentionInterface entry: each model file has its own eager_attention_forward
        inner = (sys.modules[type(module).__module__].eager_attention_forward if base == "eager"
                 else ALL_ATTENTION_FUNCTIONS[base])
        if getattr(module, "_autotune_recompute_core", False):
            return checkpoint(inner, module, *args, use_reentrant=False, **kwargs)
        return inner(module, *args, **kwargs)

    AttentionInterface.register(name, attention)
    if base in ALL_MASK_ATTENTION_FUNCTIONS:  # the masks the base expects (else transformers makes none)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    for module in model.modules():  # an earlier call's choice is replaced, not added to
        if getattr(module, "_autotune_recompute_core", False):
            module._autotune_recompute_core = False
    for module in attention_modules:
        module._autotune_recompute_core = True
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(f"{type(model).__name__} does not dispatch its attention through transformers' "
                         "AttentionInterface, so its attention core cannot be recomputed alone; use full checkpointing")
    return name
