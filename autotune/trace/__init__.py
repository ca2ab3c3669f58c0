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

The package: ``ops`` (the flash-attention op and the patches that route SDPA and dropout
through it), ``tracker`` (MemTracker with phases and re-filed categories, garbage-collection
points), ``run`` (``trace_memory``, ``TraceResult``, ``TraceCache``), ``combine`` (traced
activations + analytical states: ``combine``, ``traced_estimate``).

Importing this package does not import torch; every function imports it lazily.
"""

from __future__ import annotations

from autotune.trace.combine import combine, traced_estimate
from autotune.trace.run import TraceCache, TraceError, TraceResult, trace_memory

__all__ = ["TraceCache", "TraceError", "TraceResult", "combine", "trace_memory", "traced_estimate"]
