"""Analytical per-GPU memory model of one DeepSpeed training step (pure arithmetic, no torch).

``estimate_memory(model, training, hardware, strategy)`` returns a :class:`MemoryEstimate`: a
named per-GPU breakdown (bytes), the predicted ``torch.cuda.max_memory_allocated`` of a
steady-state step (``gpu["peak"]``), the phase where that peak falls, host RAM / NVMe needs of
offload, and a fits / does-not-fit verdict with reasons.

What is modelled, and where it comes from
-----------------------------------------
Model states follow what DeepSpeed 0.19 really allocates (engine.py ``_do_optimizer_sanity_check``
and ``_configure_optimizer``, zero/stage_1_and_2.py, zero/stage3.py, fp16/*.py), checked against
allocation traces of real steps (torch.profiler, see benchmarks/memory_vs_deepspeed.py):

* ZeRO-0, fp32: plain optimizer: 4 B params + 4 B grads + 8 B Adam moments per parameter.
* ZeRO-0, bf16/fp16: ``FP16_Optimizer`` (``FP16_UnfusedOptimizer`` for a client torch optimizer;
  same bytes): 16-bit params and grads, fp32 master weights, fp32 moments; at the step the
  16-bit grads are flattened into an fp32 copy. Backward ends with ``allreduce_bucket``, which
  flattens the gradients (one bucket, at most the whole model) even on one rank.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): full 16-bit (or fp32) params, fp32 master + moments
  partitioned by the data-parallel size N (a separate fp32 master copy even in fp32 training),
  two ``reduce_bucket_size`` gradient buffers (``overlap_comm`` double buffering) during backward,
  the gradient partition (``grads_in_partition``, model dtype: every parameter overlapping the
  rank's Psi/N slice, whole; the worst rank's, ``states.grad_partition_elements``), and at the step a
  flattened copy of that partition plus its fp32 conversion. Stage 1 in DeepSpeed 0.19 uses the
  same contiguous partitioned gradient path as stage 2 (same bytes).
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): 16-bit param partitions (Psi/N) plus persistent
  small params (numel <= param_persistence_threshold, kept whole), fetched (all-gathered) params
  of the blocks in flight, the fp16/bf16 gradient partition buffer, reduce buckets, fp32 master +
  moments partitions; at the step the fp32 gradient of the sub group. On the CPU accelerator (``device="cpu"``)
  gloo's reduce-scatter clones each gradient it reduces alone (NCCL does not). A leaf MoE block (Mixtral,
  Qwen2-MoE, Qwen3-MoE: DeepSpeed's default ZeRO-3 leaf modules) reduces its gradients at its backward hook
  (``moe.leaf_hook_elements``). The fetched params: DeepSpeed's coordinator replayed on the module tree
  (``zero3_fetch.py``), with the experts' weights grouped_mm keeps from forward to backward.
* Offload (``_model_states``), as DeepSpeed 0.19 places it: ZeRO-1/2 ``offload_optimizer`` (cpu
  or nvme: stages 1/2 have no NVMe swapper) moves master weights, moments and the fp32 gradient
  partition to pinned host RAM, with a largest-parameter staging buffer on each side; ZeRO-3
  ``offload_optimizer`` also moves the 16-bit gradient partitions to the host (stage3.py
  ``self.device``), nvme swaps master/moments/fp32 gradients to NVMe through pinned swap buffers;
  ``offload_param`` moves the 16-bit partitions to the host (cpu) or NVMe through pinned buffers,
  and the GPU keeps the fetched working set. Under ``pin_memory`` (autotune's default) on CUDA
  every pinned host tensor is what torch's caching host allocator holds for it, the next power of
  two (``common.pinned_bytes``; ZeRO-3 parameter offload also keeps each parameter's first pinned
  partition cached); a data loader forking its workers after the engine is built
  (``TrainingSpec.data_loader_fork``) doubles the host partitions the trainer rewrites
  (``common.forked_copies``). No figure is ever negative.
* Gradient accumulation (``_accumulation_carry``): what lives across micro-steps, per optimizer
  wrapper, with the DeepSpeed lines it comes from.
* The training loop: ``loop="keep_outputs"`` (default) keeps ``outputs.logits`` alive through
  backward, the step and the next forward, as the usual ``outputs = engine(**batch)`` loop does.

Activations follow Korthikanti et al. 2022 (Reducing Activation Recomputation in Large
Transformer Models, sec. 4) per operation, adapted to the reference decoders of
``autotune.models.reference`` (which mirror HF Llama / GPT-2): RMSNorm with the fp32 upcast
(4 + 2p bytes per element), LayerNorm (2p + mean/rstd: fp32 on CUDA, the weight's dtype on the CPU),
q/k/v sized by GQA, sdpa (flash:
output + fp32 log-sum-exp, no s^2) vs eager (fp32 softmax + probabilities), SwiGLU (4 tensors
of width f) vs GELU (2), dropout masks (1 byte) where the spec has dropout, per-block
checkpointing (full: block input only; selective: attention core recomputed), and the logits:
the fp32 upcast and log-softmax of the loss, which dominate small models with large
vocabularies.

The peak is the maximum over three phases: forward end (all saved activations plus the loss
transients), backward (start: logits gradient; the final norm's backward; then per block, saved
activations still alive plus gradients/buckets produced so far plus the recomputation of a
checkpointed block), and the optimizer step (states plus the step's gradient copies).

Validation: ``benchmarks/memory_vs_deepspeed.py`` runs real DeepSpeed 0.19 steps on the CPU
accelerator (1 and 2 gloo ranks, ZeRO 0-3, checkpointing none/selective/full, bf16/fp32, sdpa
and eager, Llama- and GPT-2-style) and compares ``peak`` (``device="cpu"``) with the peak tensor
bytes of torch.profiler's allocation events (what was found on the way: docs/accuracy.md).

Not modelled: tensor/pipeline parallelism, the
caching allocator's block rounding beyond ``hardware.allocator_slack``, NCCL internals (part of
``cuda_context_gib``), attention dropout under sdpa on CPU (PyTorch's CPU flash kernel has no
dropout, it falls back to the math kernel with s^2 buffers; on GPU dropout is free), the host
copy of the model each rank builds before ``deepspeed.initialize`` (use zero.Init for big models).
"""

from autotune.memory.common import GPU_COMPONENTS, MemoryEstimate, PREDICTION_MARGIN, overhead_bytes
from autotune.memory.activations import (ActivationBreakdown, CPU_RNG_STATE_BYTES, activation_breakdown,
                                          block_activation_bytes_per_token, sequence_bytes)
from autotune.memory.states import model_states_bytes, zero_model_states
from autotune.memory.estimate import LOOPS, Loop, estimate_memory

__all__ = [
    'ActivationBreakdown',
    'CPU_RNG_STATE_BYTES',
    'GPU_COMPONENTS',
    'LOOPS',
    'Loop',
    'MemoryEstimate',
    'PREDICTION_MARGIN',
    'activation_breakdown',
    'block_activation_bytes_per_token',
    'estimate_memory',
    'model_states_bytes',
    'overhead_bytes',
    'sequence_bytes',
    'zero_model_states',
]
