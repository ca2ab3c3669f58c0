"""The activation terms of one step on one GPU (``ActivationBreakdown``), the record
autotune.memory.activations builds and the step walks (walk.py, estimate.py, fsdp2.py, _fast.py) read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class ActivationBreakdown:
    """The activation terms of one step on one GPU (``activation_breakdown``), bytes for one
    micro-batch (``micro_batch_size`` x ``seq_len`` tokens); "per block" terms are for one decoder
    block, the others for the whole model."""

    blocks: float
    """Saved activations of all blocks at the forward's end (checkpointed ones at what their
    checkpoint keeps)."""
    per_block_plain: float
    """Saved activations of one block without checkpointing (per block)."""
    per_block_checkpointed: float
    """Saved activations of one checkpointed block at ``granularity`` (per block)."""
    num_checkpointed: int
    """Blocks checkpointed (``Strategy.num_checkpointed``, at most the layer count)."""
    granularity: str
    """The checkpointing granularity applied (``Strategy.checkpointing``; ``none`` when no block is
    checkpointed)."""

    nonblock: float
    """Saved outside the blocks at the forward's end: the final norm, the embedding dropout mask,
    ``logits_saved``, the rope tables and the masks / position ids a checkpoint keeps."""
    logits_saved: float
    """Part of ``nonblock`` the loss keeps: the fp32 log-softmax output (and the final logit
    softcapping's tanh output)."""
    loss_forward_transient: float
    """At the forward's end, beyond what is saved: the logits (model dtype), their fp32 copy and
    log_softmax's output."""
    loss_backward_transient: float
    """At the backward's start: the fp32 nll and log_softmax gradients next to the saved output."""
    recompute: float
    """What one checkpointed block's recomputation adds to what its checkpoint keeps (``per_block_plain -
    per_block_checkpointed``, plus, under ``selective`` on sdpa's CPU math path, the core's inputs the
    checkpoint keeps and a plain core would not: activations._selective_inputs_unsaved; 0 without
    checkpointing; per block)."""
    mlp_saved_per_block: float
    """The MLP's saved intermediate tensors (2 or 4 f-wide, model dtype; per block)."""
    attention_backward_transient: float
    """Gradient buffers of the attention core's backward beyond its saved tensors (per block)."""
    final_norm_saved: float
    """What the final norm saves for backward (its output included)."""
    forward_only_masks: float
    """Masks alive during the decoder's forward only (the sliding-window bool mask when no
    checkpoint keeps it); not part of ``nonblock``."""
    final_norm_forward_extra: float
    """At the end of the final norm's forward (its weight multiply), beyond its saved tensors: in
    16-bit training the fp32 normalised value and the variance still bound to locals and the
    norm's input bound by the caller; HF's decoder also keeps the embedding output (16-bit) and
    the position ids bound (allocation traces, torch 2.13 CPU)."""
    hidden_grad: float
    """The hidden states' gradient flowing from block to block (one h-wide tensor, model dtype)."""
    checkpoint_frame_kept: float
    """What a checkpointed block's frame keeps during its backward beyond the recomputed set: the
    RNG state (CPU) and ``_checkpoint_frame_kept`` (per checkpointed block; 0 without checkpointing)."""
    final_norm_backward_live: float
    """The final RMSNorm's backward at its peak, replacing ``final_norm_saved`` at that instant:
    the fp32 input next to five fp32 h-wide tensors (PowBackward0's last multiply,
    torch/csrc/autograd/FunctionsManual.cpp ``pow_backward``); LayerNorm: its saved tensors."""
    mlp_backward_transient: float
    """The MLP backward's peak beyond the block's saved tensors: ``_mlp_backward_transient`` plus
    the down projection's weight gradient (f x h), or HF's composite GELU backward when larger
    (per block)."""
    mlp_backward_released: float
    """``mlp_backward_transient`` where each weight gradient leaves autograd right after its AccumulateGrad
    (memory/states.py ``ffn_grads_released``: ZeRO-1/2's reduce hook, accumulation into a carried
    ``param.grad``): no instant holds the down projection's weight gradient made before it (per block)."""
    logits_tokens: float
    """Tokens whose logits exist whole at once on this GPU (the micro-batch's share of its sequences;
    0 under ``tiled_loss``, whose model returns no logits): the logits the user's ``outputs`` keeps and
    the lm_head's input gradient are this many rows of the vocabulary."""
    offloaded: float
    """Bytes of checkpointed block inputs held in host memory (``activation_offload`` cpu), per GPU."""
    moe_forward_transient: float = 0.0
    """The routed experts' forward peak beyond the block's saved tensors, where it can exceed the
    backward's (expert parallelism's combine, ``memory.expert_parallel.ep_forward_transient``): an
    instant of the last block's forward, or of a checkpointed block's recomputation (per block; 0: none)."""
    masks_only_later: float = 0.0
    """Eager attention's 4-D masks of the layer kinds block 0 does not have (Gemma2's and gpt-oss's full-attention
    mask beside block 0's sliding one), which ``nonblock`` counts as kept by the checkpoints: the last
    checkpoint holding them is released before block 0's backward, so block 0's instants lack them."""
    moe_recompute_transient: float = 0.0
    """A checkpointed block's recomputation at its experts' forward peak, beyond the recomputed set: the forward's
    instant plus what the backward holds when the recomputation starts (grouped_mm: the combine's view backward
    makes the gradient contiguous, tokens x top-k x h, before ``inv_perm`` is unpacked; expert parallelism's
    transient was read off the recomputation itself); per block, 0: none."""
    core_recompute_transient: float = 0.0
    """A checkpointed block's recomputation at the end of its attention core's forward on sdpa's CPU math path,
    beyond the recomputed set: the core's locals and outputs (activations._math_core_forward_transient) less
    the block's saved tensors made after the core; per block, 0: none (other kernels stay below the block's
    backward instants)."""
    ep_mean_saved: float = 0.0
    """Expert parallelism: what a MoE block keeps of its received rows at the step's mean
    (``expert_parallel.step_rows``; part of the per-block terms); 0 without expert parallelism."""
    ep_spread: float = 0.0
    """Expert parallelism: what the busiest dispatch's received rows keep above ``ep_mean_saved``, the terms
    of the block being run (its transients) sized at the busiest, held blocks at the mean; the step walks add
    ``expert_parallel.ep_excess`` (0: the step's factor is the dispatch's)."""
    ep_blocks_hold: bool = False
    """With ``ep_spread``: a checkpointed block keeps its received rows (attention, selective), else only
    plain blocks and the block being recomputed hold them."""
    dense: Optional["ActivationBreakdown"] = None
    """A MoE model with dense-MLP blocks among the sparse ones (``ModelSpec.dense_layers``): the dense
    blocks' own terms (their "per block" fields; None: every block is of this record's kind)."""
    dense_layers: tuple[bool, ...] = ()
    """With ``dense``: per block index, whether that block has the dense MLP (``memory.mixed.layer_kinds``)."""

    @property
    def recomputed_after_mlp(self) -> bool:
        """A checkpointed block is recomputed at its attention's backward, after its MLP's: ``attention``
        checkpoints the attention module, ``selective`` its core (the first saved tensor the backward
        unpacks runs the recomputation, torch/utils/checkpoint.py); ``full`` and ``op`` recompute first."""
        return self.granularity in ("attention", "selective")

    @property
    def moe_recomputed(self) -> bool:
        """Whether a checkpointed block recomputes its MoE feed-forward (granularities other than attention /
        selective, which keep it)."""
        return not self.recomputed_after_mlp
