"""Long-context training on the model side: Ulysses sequence parallelism, sequence-tiled loss and
MLP, and offload of checkpointed block inputs to host memory (issue 24's knobs).

This module owns the torch-side half of a long-context front point, what a training script calls
next to its DeepSpeed config (the config only carries ``sequence_parallel_size``); the profiling
worker applies the same calls, so a point runs as it was measured. Every piece is DeepSpeed's Arctic
Long Sequence Training (ALST, arXiv 2506.13996; deepspeed/runtime/sequence_parallel/ulysses_sp.py)
on a Hugging Face causal LM::

    from autotune.models import long_context as lc

    mpu = lc.register_ulysses(model, sequence_parallel_size=4, micro_batch_size=1, seq_length=131072)
    lc.tile_mlp(model)                                   # every decoder layer's MLP through TiledMLP
    lc.use_long_context_loss(model, mpu, tiled=True)     # forward: hidden states -> tiled loss
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu, ...)
    for batch in lc.shard_batch(train_loader, mpu):      # UlyssesSPDataLoaderAdapter
        with lc.offload_activations():                   # checkpointed blocks' inputs -> host
            loss = engine(**batch).loss
        engine.backward(loss); engine.step()

or all of it from a Strategy: ``mpu = lc.apply_long_context(model, strategy, seq_length=...)``.

* ``register_ulysses``: ``UlyssesSPAttentionHF.register_with_transformers`` (the model's attention
  function in transformers' ALL_ATTENTION_FUNCTIONS replaced by the all-to-all wrapper; the model's
  own implementation must be sdpa / flash / flex: DeepSpeed refuses eager); returns the mpu to pass
  to ``deepspeed.initialize``.
* ``shard_batch``: a DataLoader through ``UlyssesSPDataLoaderAdapter``; a single batch dict the
  same way (the SP group's first rank's sample, ``position_ids`` added, ``labels`` replaced by
  pre-shifted ``shift_labels``, this rank's sequence shard kept).
* ``tiled_loss`` / ``causal_lm_loss`` / ``use_long_context_loss``: logits and cross entropy over
  sequence tiles with ``TiledFusedLogitsLoss`` (about 1 GiB of fp32 logits a tile, ArcticTraining's
  ``SFTTrainer.loss``); under Ulysses each rank back-propagates its own tokens' share of the
  group's mean (``causal_lm_loss``).
* ``tile_mlp``: each decoder layer's ``mlp`` through ``TiledMLP`` (ceil(seq / hidden) tiles, the
  example in TiledMLP's docstring); only the MLP input is saved, each tile recomputed in backward.
* ``offload_activations``: while active, the inputs non-reentrant ``torch.utils.checkpoint`` saves
  for each checkpointed block are packed into host memory (pinned on CUDA) and copied back for the
  block's recomputation (ALST's activation-checkpoint offload; ArcticTraining patches the reentrant
  CheckpointFunction the same way). On a CPU device the host copies live outside torch's allocator
  (numpy buffers), so the profiler's device peak leaves them out as a GPU's would;
  ``host_offload_bytes()`` reports them.

Known limit: TiledFusedLogitsLoss runs the head's backward inside the forward, so the head's
weight gradient sees only the loss gradient it is told in advance (``gradient_accumulation_steps``
gives it 1 / GAS); fp16's dynamic loss scale is not known then, so with fp16 the head's gradient
misses it (bf16 / fp32: exact).

torch, transformers and deepspeed are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Iterator, Optional

from autotune.memory.split import loss_tiles, mlp_tiles  # the tile counts the memory model sizes


# ------------------------------------------------------------------------------------ Ulysses


def register_ulysses(model: Any, sequence_parallel_size: int, micro_batch_size: int, seq_length: int) -> Any:
    """Ulysses sequence parallelism for a Hugging Face model: DeepSpeed's attention wrapper
    registered over the model's attention implementation; returns the mpu for
    ``deepspeed.initialize(mpu=...)`` (None when ``sequence_parallel_size`` is 1). Needs
    ``torch.distributed`` initialised and fixed shapes (``seq_length``: the global sequence)."""
    if int(sequence_parallel_size) <= 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl in ("eager", "paged|eager"):
        raise ValueError(f"sequence_parallel_size {sequence_parallel_size} needs attn_implementation sdpa, flash or "
                         f"flex (DeepSpeed's UlyssesSPAttentionHF refuses eager), but the model uses {impl}")
    if seq_length % sequence_parallel_size:
        raise ValueError(f"sequence_parallel_size must divide seq_length, but got {sequence_parallel_size} for "
                         f"{seq_length}")
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=impl, sequence_parallel_size=int(sequence_parallel_size),
        micro_batch_size=int(micro_batch_size), seq_length=int(seq_length), seq_length_is_variable=False)


def sp_world_size(mpu: Any) -> int:
    """The Ulysses degree of ``mpu`` (1 for None)."""
    return 1 if mpu is None else int(mpu.get_sequence_parallel_world_size())


def shard_batch(batch_or_dataloader: Any, mpu: Any, device: Any = None) -> Any:
    """This rank's sequence shard. A DataLoader (any iterable of batch dicts): wrapped in
    ``UlyssesSPDataLoaderAdapter`` (each SP rank's samples in turn, shared by the group). A batch
    dict: the group's first rank's sample, sharded as the adapter does (``position_ids`` added as
    0..seq-1 where missing, ``labels`` replaced by ``shift_labels`` = labels shifted left with -100
    at the end, every [batch, seq] tensor cut to this rank's ``seq / sp`` tokens). A DataLoader's
    batches get ``position_ids`` too where missing. ``mpu`` None: the batch unchanged."""
    if mpu is None or sp_world_size(mpu) == 1:
        return batch_or_dataloader
    import torch
    import torch.distributed as dist

    group, sp, rank = mpu.get_sequence_parallel_group(), sp_world_size(mpu), int(mpu.get_sequence_parallel_rank())
    if not isinstance(batch_or_dataloader, dict):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        return UlyssesSPDataLoaderAdapter(_WithPositions(batch_or_dataloader), sp_rank=rank, sp_group=group,
                                          sp_world_size=sp, device=device if device is not None else torch.device("cpu"))
    batch = dict(batch_or_dataloader)
    ids = batch["input_ids"]
    bs, seq = ids.shape[:2]
    if seq % sp:
        raise ValueError(f"sequence_parallel_size must divide the batch's sequence, but got {sp} for {seq}")
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(seq, device=ids.device).unsqueeze(0).expand(bs, seq).contiguous()
    if "shift_labels" not in batch:
        labels = batch.pop("labels", ids)
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    src = dist.get_global_rank(group, 0)  # the SP group's first rank: every rank of it trains that sample
    chunk = seq // sp
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq:
            value = value.contiguous()
            dist.broadcast(value, src=src, group=group)
            # a copy: with one sample the slice already counts as contiguous, and .contiguous() would
            # return the view, keeping the whole sequence's storage alive on every rank
            value = value[:, chunk * rank:chunk * (rank + 1)].clone(memory_format=torch.contiguous_format)
        out[key] = value
    return out


class _WithPositions:
    """A DataLoader's batches with ``position_ids`` (0..seq-1) added where missing: DeepSpeed's
    adapter refuses batches without them (they keep each token's global position in its shard)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict]:
        import torch

        for batch in self.loader:
            if isinstance(batch, dict) and "position_ids" not in batch and "input_ids" in batch:
                ids = batch["input_ids"]
                batch = {**batch, "position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()}
            yield batch


# ------------------------------------------------------------------------------------ loss


def _head_logits(model: Any, hidden: Any) -> Any:
    """The model's output head on ``hidden`` with the family's logits scaling (the Granite families:
    modeling_granite.py / modeling_granitemoe.py ``logits / self.config.logits_scaling``; other families
    read the key otherwise, HyperCLOVAX multiplies) and final-logit softcapping (Gemma-2)."""
    import torch

    logits = model.get_output_embeddings()(hidden)
    scaling = getattr(model.config, "logits_scaling", None)
    if scaling is not None and str(getattr(model.config, "model_type", "")).startswith("granite"):
        logits = logits / scaling
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _shifted(labels: Any = None, shift_labels: Any = None) -> Any:
    import torch

    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("tiled_loss needs labels or shift_labels")
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def _tile_loss(denominator: Any) -> Any:
    """The per-tile function of TiledFusedLogitsLoss: the tile's summed cross entropy (HF's own
    loss function, upcast to fp32 as HF does) over ``denominator`` counted tokens."""

    def fn(model: Any, hidden: Any, shift_labels: Any) -> Any:
        logits = _head_logits(model, hidden)
        good = (shift_labels != -100).sum()
        if int(good) == 0:  # a tile of ignored tokens: 0, with gradients defined
            return (logits.sum() * 0.0).float()
        loss = model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                                   shift_labels=shift_labels)
        return loss * good / denominator

    return fn


def tiled_loss(model: Any, hidden_states: Any, labels: Any = None, shift_labels: Any = None,
               shards: Optional[int] = None, denominator: Any = None) -> Any:
    """Mean next-token cross entropy of a causal LM from its last hidden states (its sum over
    ``denominator`` tokens, default: the counted ones here), logits computed in ``shards`` sequence
    tiles by ``TiledFusedLogitsLoss`` (default: ``loss_tiles``), each tile's backward run at once:
    the full logits never exist. ``labels`` are shifted here (HF's convention); ``shift_labels``
    are taken as they are (Ulysses' pre-shifted shards). The head's gradient is exact when the
    returned loss is back-propagated with gradient 1 (``loss.backward()``; the module docstring's
    limit)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    y = _shifted(labels, shift_labels)
    bs, seq = y.shape[:2]
    n = int(shards) if shards else loss_tiles(bs * seq, int(model.config.vocab_size))
    n = max(1, min(n, bs * seq))
    if denominator is None:
        denominator = (y != -100).sum().clamp(min=1)
    head = model.get_output_embeddings()
    params = list(head.parameters())
    embed = model.get_input_embeddings()
    tied = [p for p in params if any(p is q for q in embed.parameters())]
    if not tied:
        return TiledFusedLogitsLoss.apply(_tile_loss(denominator), model, hidden_states, y, None, n, params, "sum")
    # a head tied to the input embedding gets its second gradient in backward: DeepSpeed must not
    # reduce it at the last tile (ZeRO-1/2: "Gradient computed twice for this partition", ZeRO-3:
    # one parameter twice in a bucket), so it stays not ready through every tile (stage_1_and_2.py
    # and stage3.py read ds_grad_is_ready) and the embedding's backward accumulation reduces both
    for p in tied:
        p.ds_grad_is_ready = False
    try:
        return TiledFusedLogitsLoss.apply(_tile_loss(denominator), model, hidden_states, y, None, n,
                                          [p for p in params if all(p is not t for t in tied)], "sum")
    finally:
        for p in tied:
            p.ds_grad_is_ready = True


def causal_lm_loss(model: Any, batch: dict, mpu: Any = None, tiled: bool = False,
                   shards: Optional[int] = None, sp_gradient_scale: float = 1.0,
                   loss_gradient: float = 1.0) -> tuple[Any, Any]:
    """(loss, logits or None) of a Hugging Face causal LM on ``batch`` (input_ids, labels or
    shift_labels, position_ids...): the base model's hidden states, then the tiled loss or the
    plain head + HF loss over this rank's tokens. With Ulysses (``mpu``) each rank's loss is its
    tokens' summed cross entropy over the SP group's counted tokens; the value returned is the
    group's sum (the whole sample's mean, as one rank computes it), its gradient the rank's own
    part: DeepSpeed sums the gradients over the SP ranks (ZeRO's reduce divides by
    seq-data-parallel size / sp, runtime/zero/stage_1_and_2.py ``average_tensor``), so they equal
    one rank's on the whole sample. ZeRO-3 divides by the whole seq-data-parallel size instead
    (runtime/comm/coalesced_collectives.py ``reduce_scatter_coalesced``): pass
    ``sp_gradient_scale`` = sp there (``use_long_context_loss(zero_stage=3)`` does). (ArcticTraining's
    all-gather of the losses back-propagates the sum to every rank, which is that scale.)

    ``loss_gradient``: the gradient the returned loss will be back-propagated with (DeepSpeed's
    ``engine.backward`` and a ``(loss / GAS).backward()`` loop: 1 / GAS). The tiled head's backward
    runs inside the forward, so it is given that gradient up front and the loss passes the
    gradient 1 on to the tiles: the head's gradient then matches the untiled one under gradient
    accumulation too (DeepSpeed's own TiledFusedLogitsLoss use misses the 1 / GAS). HF Trainer's
    ``num_items_in_batch`` (the accumulation's tokens) makes the loss sum / it with gradient 1
    (trainer.py ``training_step`` then skips its / GAS), as HF's ForCausalLMLoss."""
    kwargs = dict(batch)
    labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    items = kwargs.pop("num_items_in_batch", None)
    loss_gradient = 1.0 if items is not None else loss_gradient
    kwargs["use_cache"] = False
    out = model.base_model(**kwargs)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    y = _shifted(labels, shift)
    good = (y != -100).sum()
    denominator = good.clone() if items is None else good.new_zeros(()) + items
    sp = sp_world_size(mpu)
    if sp > 1 and items is None:
        import torch.distributed as dist

        dist.all_reduce(denominator, group=mpu.get_sequence_parallel_group())
    # the gradient the tiles see (the Ulysses seed scale, the caller's loss gradient) folded into
    # the denominator, so the tiled head, whose backward runs inside the forward with gradient 1,
    # sees it too; the returned loss divides it out again (its value) and passes gradient 1 on
    seed = (sp_gradient_scale if sp > 1 else 1.0) * float(loss_gradient)
    denominator = denominator.clamp(min=1) / seed
    logits = None
    if tiled:
        loss = tiled_loss(model, hidden, shift_labels=y, shards=shards, denominator=denominator)
    else:
        logits = _head_logits(model, hidden)
        if int(good) == 0:
            loss = (logits.sum() * 0.0).float()
        else:
            loss = model.loss_function(logits=logits, labels=None, vocab_size=model.config.vocab_size,
                                       shift_labels=y) * good / denominator
    value = loss.detach() / seed  # this rank's share of the mean
    if sp > 1:
        import torch.distributed as dist

        dist.all_reduce(value, group=mpu.get_sequence_parallel_group())  # the group's: the whole sample's
    if seed != 1.0 or sp > 1:
        loss = loss / float(loss_gradient) + (value - loss.detach() / float(loss_gradient))
    return loss, logits


def use_long_context_loss(model: Any, mpu: Any = None, tiled: bool = False, shards: Optional[int] = None,
                          zero_stage: int = 0, gradient_accumulation_steps: int = 1) -> Any:
    """Replace ``model.forward`` (this instance) by ``causal_lm_loss``: ``model(**batch).loss`` is
    then the tiled and/or sequence-parallel loss, so ``engine(**batch)`` keeps DeepSpeed's own
    forward around it. ``zero_stage``: the DeepSpeed ZeRO stage the model trains under (3 scales
    the Ulysses gradient seed, ``causal_lm_loss``); ``gradient_accumulation_steps``: the loss is
    back-propagated with 1 / this (DeepSpeed's engine.backward, FSDP2's (loss / GAS).backward())."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    scale = float(sp_world_size(mpu)) if int(zero_stage) == 3 else 1.0

    def forward(self: Any, **batch: Any) -> Any:
        loss, logits = causal_lm_loss(self, batch, mpu=mpu, tiled=tiled, shards=shards, sp_gradient_scale=scale,
                                      loss_gradient=1.0 / max(1, int(gradient_accumulation_steps)))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # the model's signature (self prepended: a bound method drops it), so HF Trainer keeps the batch's
    # columns and passes num_items_in_batch (trainer.py _remove_unused_columns, model_accepts_loss_kwargs)
    sig = inspect.signature(model.forward)
    forward.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()])
    model.forward = types.MethodType(forward, model)
    return model


# ------------------------------------------------------------------------------------ MLP


def decoder_mlps(model: Any) -> list:
    """Each decoder layer's MLP module (a child named ``mlp`` of a block in the model's layer list)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    layers = max(lists, key=len) if lists else []
    return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]


def tile_mlp(model: Any, shards: Optional[int] = None, agree_across_ranks: bool = True) -> int:
    """Run every decoder layer's MLP through DeepSpeed's ``TiledMLP`` over ``shards`` sequence tiles
    (default ceil(seq / hidden_size), TiledMLP's docstring; the largest over the ranks when
    ``agree_across_ranks`` and torch.distributed is up, so ZeRO-3's gathers stay in step). Returns
    the number of MLPs tiled (ValueError when the model has none)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlps = decoder_mlps(model)
    if not mlps:
        raise ValueError(f"tiled_mlp: no decoder layer with an .mlp module in {type(model).__name__}")
    for mlp in mlps:
        if getattr(mlp, "_autotune_tiled", False):
            continue
        plain = type(mlp).forward

        def _contiguous(self: Any, x: Any, _plain: Any = plain) -> Any:
            # TiledMLP's forward tiles [batch, seq, h] along seq: with batch > 1 a tile is strided,
            # which views in the MLP (GPT-2's Conv1D) refuse
            return _plain(self, x.contiguous())

        def forward(self: Any, x: Any, _contiguous: Any = _contiguous) -> Any:
            n = int(shards) if shards else mlp_tiles(x.shape[-2], x.shape[-1])
            if not shards and agree_across_ranks:
                n = _max_over_ranks(n, x.device)
            return TiledMLP.apply(_contiguous, self, x, max(1, min(n, x.shape[-2])), list(self.parameters()))

        mlp.forward = types.MethodType(forward, mlp)
        mlp._autotune_tiled = True
    return len(mlps)


def _max_over_ranks(n: int, device: Any) -> int:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    t = torch.tensor(n, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ------------------------------------------------------------------------------------ offload

_HOST = {"live": 0, "peak": 0}


def host_offload_bytes(reset: bool = False) -> dict[str, int]:
    """Host bytes held by ``offload_activations`` now (``live``) and at most since the last reset
    (``peak``)."""
    out = dict(_HOST)
    if reset:
        _HOST["peak"] = _HOST["live"]
    return out


class _Held:
    """One offloaded tensor's host copy (weak-referenceable, so its release is counted)."""

    __slots__ = ("data", "__weakref__")

    def __init__(self, data: Any) -> None:
        import weakref

        self.data = data
        _HOST["live"] += data.nbytes
        _HOST["peak"] = max(_HOST["peak"], _HOST["live"])
        weakref.finalize(self, _release, data.nbytes)


_PIN = [True]
"""Whether ``offload_activations`` pins the host copies (its ``pin_memory``)."""


def _pack(t: Any) -> Any:
    import torch

    if t.device.type == "cpu":
        # the host copy outside torch's allocator: on a CPU device "device" and host are one memory,
        # and the profiler counts only torch's, as a GPU's allocator counts only device memory
        import numpy as np

        src = t.detach().contiguous()
        arr = np.empty(src.numel() * src.element_size(), dtype=np.uint8)
        torch.from_numpy(arr).copy_(src.reshape(-1).view(torch.uint8))
        return ("cpu", _Held(arr), t.dtype, tuple(t.shape))
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=_PIN[0] and torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return (t.device, _Held(host), t.dtype, tuple(t.shape))


def _release(nbytes: int) -> None:
    _HOST["live"] -= nbytes


def _unpack(packed: Any) -> Any:
    import torch

    device, held, dtype, shape = packed
    if device == "cpu":
        return torch.from_numpy(held.data).view(dtype).view(shape)
    return held.data.to(device, non_blocking=True)


@contextlib.contextmanager
def offload_activations(pin_memory: bool = True) -> Iterator[None]:
    """While active (around the forward), the inputs each non-reentrant checkpoint saves for its
    block's recomputation are packed into host memory and copied back when backward recomputes the
    block (torch.utils.checkpoint ``_CheckpointFrame.save_inputs`` under
    ``torch.autograd.graph.saved_tensors_hooks``); what the blocks save inside stays the
    checkpoint's, everything outside the checkpointed blocks stays on the device. Needs
    checkpointing (``full``) on the blocks; without it nothing moves. ``pin_memory`` (the strategy's):
    the host copies are pinned on CUDA (asynchronous copies; each a power-of-two block of torch's
    host allocator, which autotune's memory model counts), pageable otherwise."""
    import torch
    from torch.utils import checkpoint as ckpt

    frame = getattr(ckpt, "_CheckpointFrame", None)
    if frame is None or not hasattr(frame, "save_inputs"):
        raise RuntimeError(f"activation_offload: this torch ({torch.__version__}) has no "
                           f"torch.utils.checkpoint._CheckpointFrame.save_inputs to offload through")
    plain = frame.save_inputs

    def save_inputs(self: Any, *args: Any) -> None:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            plain(self, *args)

    frame.save_inputs = save_inputs
    pinned, _PIN[0] = _PIN[0], bool(pin_memory)
    try:
        yield
    finally:
        frame.save_inputs = plain
        _PIN[0] = pinned


def offload_in_forward(model: Any, pin_memory: bool = True) -> Any:
    """Run ``model.forward`` (this instance) inside ``offload_activations(pin_memory)``. Returns the model."""
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with offload_activations(pin_memory):
            return inner(*args, **kwargs)

    model.forward = forward
    return model


# ------------------------------------------------------------------------------------ all of it


def apply_long_context(model: Any, strategy: Any, seq_length: Optional[int] = None,
                       micro_batch_size: Optional[int] = None, loss_shards: Optional[int] = None,
                       mlp_shards: Optional[int] = None, gradient_accumulation_steps: int = 1) -> Any:
    """Apply what ``strategy`` (autotune.strategy.Strategy) asks of a Hugging Face causal LM:
    Ulysses (``sequence_parallel_size``; ``seq_length`` needed), the tiled MLP, the tiled and/or
    sequence-parallel loss in ``model.forward``, the offload of checkpointed inputs around the
    forward. Checkpointing itself is ``autotune.apply_checkpointing``'s; context parallelism is
    the FSDP2 engine's (``context_parallel_size``: torch's ``context_parallel`` around each step).
    ``gradient_accumulation_steps``: the training loop's (the loss is back-propagated with 1 / it).
    Returns the mpu for ``deepspeed.initialize`` (None without Ulysses)."""
    sp = int(getattr(strategy, "sequence_parallel_size", 1) or 1)
    mpu = None
    if sp > 1:
        if seq_length is None:
            raise ValueError("sequence_parallel_size > 1 needs seq_length (the global sequence) for Ulysses")
        mbs = micro_batch_size if micro_batch_size is not None else strategy.micro_batch_size
        mpu = register_ulysses(model, sp, mbs, seq_length)
    if getattr(strategy, "tiled_mlp", False):
        tile_mlp(model, shards=mlp_shards)
    cp = int(getattr(strategy, "context_parallel_size", 1) or 1)
    if sp > 1 or cp > 1 or getattr(strategy, "tiled_loss", False):  # CP: its shards need pre-shifted labels
        use_long_context_loss(model, mpu, tiled=bool(getattr(strategy, "tiled_loss", False)), shards=loss_shards,
                              zero_stage=getattr(strategy, "zero_stage", 0) if strategy.engine == "deepspeed" else 0,
                              gradient_accumulation_steps=gradient_accumulation_steps)
    if getattr(strategy, "activation_offload", "none") != "none":
        if getattr(strategy, "checkpointing", "none") != "full":
            raise ValueError(f"activation_offload={strategy.activation_offload} needs checkpointing full, but got "
                             f"{strategy.checkpointing}")
        offload_in_forward(model, pin_memory=bool(getattr(strategy, "pin_memory", True)))
    return mpu
