"""Throughput simulator: step time, tokens/s per GPU, MFU and a time breakdown for one strategy.

Pure arithmetic on the typed specs: no I/O, no torch/deepspeed, no scipy (the search calls
``simulate`` thousands of times, so it is a flat function of floats, a few tens of microseconds).

The model (one optimizer step = ``gas`` micro-batches + optimizer step + fixed overhead):

* compute: every GEMM of a block and the LM head timed at ``peak * gemm_eff`` scaled by two
  saturating shape factors (tokens per micro-batch M and the smaller GEMM dimension K); the
  attention core at ``peak * attn_eff`` on the FLOPs causal flash attention executes; memory-bound elementwise
  work (norms, activation, residuals, loss/softmax over the vocabulary) at ``hbm * hbm_eff``.
* recompute: full checkpointing repeats the forward of the checkpointed blocks, selective only the
  attention core (Korthikanti et al. 2022, sec. 5), attention / mlp that module's GEMMs and
  elementwise work (the norms outside it are not repeated), op every second GEMM and all
  elementwise work (torchtitan's op-level policy keeps the attention core and every other matmul).
* communication: ZeRO/DP collective volumes with the ring factor (n-1)/n over intra- or
  inter-node bandwidth, per-collective latency, overlap with the forward/backward window and the
  non-overlappable first/last bucket; only the exposed part is charged.
* offload: PCIe traffic for gradients/parameters, CPU-Adam and NVMe time (ZeRO-Offload/Infinity).
* optimizer step on GPU: HBM-bound pass over the local shard; fixed per-step and per-layer overheads.
* long context (autotune.simulate_long): each GPU computes seq_len / (sp x cp) tokens of every sequence;
  Ulysses all-to-alls, the context-parallel k/v exchange, tiled MLP / loss and activation offload.
* mixture of experts (autotune.simulate_moe): MFU on the active parameters, the routed experts as a grouped
  GEMM over tokens x top_k / experts rows each, expert parallelism's all-to-alls and expert shards.

The efficiency parameters (``EFFICIENCY_KEYS``) are fitted per GPU by autotune.calibration.fit on
measured runs and stored in the GPU presets; uncalibrated GPUs use ``default_efficiency``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from autotune.spec import BYTES_PER_ELEMENT, GPUSpec, HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy, sequence_shards
from autotune.engine_configs import default_buckets, gradient_accumulation_steps
from autotune.simulate_comm import _exposed, _link_bandwidth, _ring_time
from autotune.simulate_long import long_context_terms, uses_long_context
from autotune.simulate_moe import all_to_all_time, fsdp2_gathered_params, moe_flops_per_token, moe_micro_batch, \
    recomputed_moe_blocks

EFFICIENCY_KEYS = (
    "gemm_eff",          # fraction of dense peak a large GEMM reaches
    "gemm_m_half",       # tokens per micro-batch at which GEMM efficiency is halved (saturating in M)
    "gemm_k_half",       # GEMM inner/outer width at which efficiency is halved (saturating in d)
    "attn_eff",          # fraction of peak reached by the (causal, flash) attention core on executed FLOPs
    "attn_s_half",       # causal tile quantisation: attention time x (1 + attn_s_half / seq_len)
    "hbm_eff",           # fraction of HBM bandwidth reached by elementwise kernels and the optimizer
    "comm_eff",          # fraction of nominal link bandwidth NCCL reaches (bus bandwidth)
    "overlap",           # fraction of overlappable communication actually hidden under compute
    "coll_latency_s",    # latency per ring hop of one collective, seconds
    "step_overhead_s",   # fixed time per optimizer step (Python, data loader, logging), seconds
    "layer_overhead_s",  # per block per micro-batch (hooks, launches, FSDP/ZeRO bookkeeping), seconds
)

# Typical values (close to the A100 fits in autotune/presets.py), the base of uncalibrated defaults.
_BASE_DEFAULTS = dict(
    gemm_eff=0.78, gemm_m_half=128.0, gemm_k_half=192.0, attn_eff=0.3, attn_s_half=128.0, hbm_eff=0.7,
    comm_eff=0.6, overlap=0.7, coll_latency_s=5e-6, step_overhead_s=0.03, layer_overhead_s=5e-4,
)


# Elementwise traffic per token per block, in activation elements (read + written), counted for a
# pre-norm block without dropout: 2 norms (r d, w d each), activation (r f, w f; gated: r 2f, w f),
# 2 residual adds (r 2d, w d each); backward about twice the forward (grad in + saved input + grad out).
# Source: per-operation accounting in Korthikanti et al. 2022, sec. 4.1 (same ops, counted as traffic).


def default_efficiency(gpu: GPUSpec) -> dict:
    """Uncalibrated parameters derived from the datasheet (used when ``gpu.efficiency`` is None).

    GEMM efficiency falls when the machine balance (peak FLOP/s per HBM byte/s) is high, as the
    roofline predicts for the tile loads of moderately sized GEMMs (Williams et al. 2009, roofline);
    PCIe-only GPUs (no NVLink, intra-node bandwidth <= PCIe) get a lower NCCL efficiency.
    """
    p = dict(_BASE_DEFAULTS)
    peak = max(gpu.peak_tflops_bf16, gpu.peak_tflops_fp16) * 1e12
    balance = peak / (gpu.hbm_bandwidth_gbps * 1e9)  # FLOP per byte; A100 ~200, H100 ~295, L40S ~420
    p["gemm_eff"] = _BASE_DEFAULTS["gemm_eff"] * min(1.0, (200.0 / balance) ** 0.15)
    p["attn_eff"] = _BASE_DEFAULTS["attn_eff"] * min(1.0, (200.0 / balance) ** 0.5)
    if gpu.peak_tflops_bf16 <= 0:
        # pre-Ampere (no bf16): FlashAttention-2 needs sm80+ (Dao-AILab/flash-attention README), so
        # attention falls back to slower kernels; V100 fp16 GEMMs also reach less of their peak.
        p["attn_eff"] *= 0.5
        p["gemm_eff"] *= 0.85
    if gpu.intra_node_bandwidth_gbps <= gpu.pcie_bandwidth_gbps * 1.01:
        p["comm_eff"] = 0.5
    return p


def efficiency_params(gpu: GPUSpec, params: Optional[dict] = None) -> tuple[dict, bool]:
    """Merged parameters (defaults < preset efficiency < explicit params) and whether calibrated."""
    p = default_efficiency(gpu)
    calibrated = bool(gpu.efficiency)
    if gpu.efficiency:
        p.update(gpu.efficiency)
    if params:
        p.update(params)
    return p, calibrated


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs utilisation, llm-foundry definition (ModelSpec.flops_per_token), fraction 0..1."""
    breakdown: dict = field(default_factory=dict)
    """Seconds per optimizer step: compute, recompute, exposed_communication, offload, optimizer, overhead."""
    calibrated: bool = False
    """False when the GPU preset has no fitted efficiency (datasheet-derived defaults)."""

    def as_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "breakdown": dict(self.breakdown),
            "calibrated": self.calibrated,
        }


class _MicroBatch(NamedTuple):
    """Compute time of one micro-batch on one GPU, seconds."""

    fwd: float
    """Forward: every block, the LM head and the embedding gather."""
    bwd: float
    """Backward of the same."""
    loss: float
    """Loss over the vocabulary (upcast, log-softmax and its gradient)."""
    fwd_block: float
    """Forward of one block (what full checkpointing repeats)."""
    attn_fwd_block: float
    """Forward of one block's attention core (what selective checkpointing repeats)."""
    gemm_fwd_block: float
    """Forward GEMMs of one block."""
    elem_fwd_block: float
    """Forward elementwise work of one block."""
    attn_module: float
    """Forward of one block's attention module: projections, core, rope/dropout."""
    mlp_module: float
    """Forward of one block's MLP module: its GEMMs and activation."""
    mlp_gemm: float
    """Forward GEMMs of one block's MLP (what tiled MLP runs at its tile's M)."""
    head_gemm: float
    """Forward GEMM of the LM head (what tiled loss runs at its tile's M)."""


class _Rates(NamedTuple):
    """What the GPU reaches for this strategy's precision."""

    peak: float
    """Dense FLOP/s at the compute precision."""
    hbm: float
    """Elementwise HBM bytes/s (bandwidth x hbm_eff)."""
    act_bytes: int
    """Bytes per activation element (and per 16-bit parameter or gradient on the wire)."""


def simulate(
    model: ModelSpec,
    training: TrainingSpec,
    hardware: HardwareSpec,
    strategy: Strategy,
    params: Optional[dict] = None,
) -> SimResult:
    """Predict one optimizer step of `strategy`; `params` overrides the GPU's efficiency dict."""
    return Simulator(model, training, hardware, params)(strategy)


class Simulator:
    """``simulate`` for many strategies of one job: the efficiency parameters merged once, and one
    micro-batch's compute once per (precision, micro-batch size), the knobs it reads."""

    def __init__(self, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                 params: Optional[dict] = None) -> None:
        self.model, self.training, self.hardware = model, training, hardware
        self.p, self.calibrated = efficiency_params(hardware.gpu, params)
        self.N = float(model.num_parameters)
        # MoE: MFU on the active parameters (autotune.simulate_moe)
        self.flops_per_token = (moe_flops_per_token if model.is_moe else ModelSpec.flops_per_token)(model,
                                                                                                     training.seq_len)
        self._compute: dict[tuple, tuple[_Rates, _MicroBatch]] = {}
        self._buckets: dict[tuple, dict[str, int]] = {}

    def buckets(self, strategy: Strategy) -> dict[str, int]:
        """``default_buckets`` once per value of the knobs it reads (the stage, the bucket knobs)."""
        key = (strategy.zero_stage, strategy.reduce_bucket_size, strategy.allgather_bucket_size,
               strategy.prefetch_bucket_size, strategy.param_persistence_threshold)
        if key not in self._buckets:
            self._buckets[key] = default_buckets(self.model, strategy)
        return self._buckets[key]

    def micro_batch(self, strategy: Strategy) -> tuple[_Rates, _MicroBatch]:
        """The rates at the strategy's precision and one micro-batch's compute time (on this GPU's
        share of every sequence: seq_len / sequence_shards tokens of each)."""
        shards = sequence_shards(strategy)
        key = (strategy.precision, strategy.micro_batch_size, shards, strategy.expert_parallel_size)
        if key not in self._compute:
            gpu, p, prec = self.hardware.gpu, self.p, strategy.precision
            peak = gpu.peak_flops(prec)
            if peak <= 0:  # e.g. bf16 on V100: validate() rejects it; simulate the fp16 path instead
                peak = gpu.peak_flops("fp16")
            rates = _Rates(peak, gpu.hbm_bandwidth_gbps * 1e9 * p["hbm_eff"], BYTES_PER_ELEMENT[prec])
            T = float(strategy.micro_batch_size * self.training.seq_len) / shards
            mb = _micro_batch_compute(self.model, self.training.seq_len, T, rates, p)
            if self.model.is_moe:  # the MoE blocks' feed-forward in place of the dense MLP
                mb = moe_micro_batch(self.model, T, strategy.expert_parallel_size, rates, p, mb)
            self._compute[key] = rates, mb
        return self._compute[key]

    def __call__(self, strategy: Strategy) -> SimResult:
        """``simulate(model, training, hardware, strategy, params)``."""
        model, training, hardware, p = self.model, self.training, self.hardware, self.p
        rates, mb = self.micro_batch(strategy)
        peak = rates.peak
        L = model.num_hidden_layers
        b = strategy.micro_batch_size
        # tokens per micro-batch per GPU (the GEMM M dimension): with Ulysses / context parallel each
        # GPU holds seq_len / (sp x cp) tokens of each sequence (ALST arXiv 2506.13996 sec. 3.2)
        T = float(b * training.seq_len) / sequence_shards(strategy)
        gas = gradient_accumulation_steps(strategy, training, hardware)
        compute_mb = mb.fwd + mb.bwd + mb.loss
        recompute_mb = _recompute(strategy, L, mb)
        fwd_window = mb.fwd
        bwd_window = mb.bwd + recompute_mb
        long = None
        if uses_long_context(strategy):  # the issue-24 knobs; default values never get here
            long = long_context_terms(model, hardware, strategy, rates, p, mb, training.seq_len, T, fwd_window,
                                      bwd_window)
            compute_mb += long.compute
            recompute_mb += long.recompute
            fwd_window += long.fwd_shift
            bwd_window += long.recompute + long.compute - long.fwd_shift
        if strategy.engine == "fsdp2":
            ep = strategy.expert_parallel_size
            gathered = self.N if ep == 1 else fsdp2_gathered_params(
                model, hardware.gpus_per_node if strategy.sharding == "hybrid" else hardware.num_gpus, ep)  # experts over n / ep
            comm_exposed = _fsdp2_communication(model, hardware, strategy, rates, p, gas, fwd_window, bwd_window,
                                                gathered)
            if ep > 1:  # the blocking all-to-alls of expert parallelism
                comm_exposed += gas * all_to_all_time(model, hardware, T, ep, rates.act_bytes, p,
                                                      recomputed_moe_blocks(model, strategy))
            optimizer, offload = _fsdp2_optimizer_and_offload(model, hardware, strategy, rates, p, gas,
                                                              fwd_window + bwd_window, self.N)
        else:
            buckets = self.buckets(strategy)
            comm_exposed = _exposed_communication(model, hardware, strategy, rates, p, gas, fwd_window, bwd_window,
                                                  self.N, buckets)
            optimizer, offload = _optimizer_and_offload(model, hardware, strategy, rates, p, gas, fwd_window,
                                                        bwd_window, self.N)
        if long is not None:
            comm_exposed += gas * long.communication
            offload += gas * long.offload
        return _result(self.flops_per_token, p, L, gas, T, peak, compute_mb, recompute_mb, comm_exposed, optimizer,
                       offload, self.calibrated)


def _result(flops_per_token: float, p: dict, L: int, gas: int, T: float, peak: float, compute_mb: float,
            recompute_mb: float, comm_exposed: float, optimizer: float, offload: float, calibrated: bool) -> SimResult:
    """The step's time from its parts, tokens/s, MFU and the breakdown."""
    overhead = p["step_overhead_s"] + p["layer_overhead_s"] * L * gas
    compute = gas * compute_mb
    recompute = gas * recompute_mb
    step = compute + recompute + comm_exposed + offload + optimizer + overhead
    tokens = gas * T
    tps = tokens / step
    mfu = flops_per_token * tps / peak
    return SimResult(
        step_time_s=step,
        tokens_per_s_per_gpu=tps,
        mfu=mfu,
        breakdown={
            "compute": compute,
            "recompute": recompute,
            "exposed_communication": comm_exposed,
            "offload": offload,
            "optimizer": optimizer,
            "overhead": overhead,
        },
        calibrated=calibrated,
    )


def _micro_batch_compute(model: ModelSpec, S: int, T: float, rates: _Rates, p: dict) -> _MicroBatch:
    """GEMMs, attention core and elementwise work of one micro-batch of T tokens (sequence length S)."""
    peak, hbm, act_bytes = rates
    L = model.num_hidden_layers
    d = model.hidden_size
    f = model.intermediate_size
    V = model.vocab_size
    # GEMM efficiency: saturating in M (tokens) and in the smaller of K/N (width); a smooth stand-in
    # for tile/wave quantisation (Nvidia "Matrix Multiplication Background" guide, sec. 4-5).
    e_gemm = p["gemm_eff"] * T / (T + p["gemm_m_half"])
    rate = peak * e_gemm
    kh = p["gemm_k_half"]
    q, kv = model.q_size, model.kv_size
    n_in = 2 if model.gated_mlp else 1
    # forward FLOPs per token of each GEMM = 2*K*N (Kaplan et al. 2020, table 1); time ~ 1/(K/(K+kh))
    blk_attn = 2.0 * d * (q + 2 * kv) * (1.0 + kh / min(d, q + 2 * kv)) + 2.0 * q * d * (1.0 + kh / min(q, d))
    blk_mlp = 2.0 * n_in * d * f * (1.0 + kh / min(d, f)) + 2.0 * f * d * (1.0 + kh / min(d, f))
    blk = blk_attn + blk_mlp
    head = 2.0 * d * V * (1.0 + kh / min(d, V))
    gemm_fwd_block = T * blk / rate  # one block, forward
    gemm_fwd_head = T * head / rate
    # attention core: QK^T and PV are 4*S*q FLOPs/token forward per layer without masking
    # (llm-foundry collect_results.py attn_flops_per_seq); causal flash attention skips masked tiles,
    # with tiles of size t it does (1 + t/S)/2 of that (Dao 2023, FlashAttention-2 sec. 3.1.1), and its
    # backward is 5 matmuls against 2 forward, i.e. 2.5x (same paper, sec. 3.1.2, recompute of P).
    attn_rate = peak * p["attn_eff"]
    attn_fwd_block = T * 2.0 * S * q * (1.0 + p["attn_s_half"] / S) / attn_rate
    # elementwise traffic (see table above): forward elements per token per block, backward 2x
    act_elems = 2 * 2 * d + (3 if model.gated_mlp else 2) * f + 2 * 3 * d
    elem_fwd_block = T * act_elems * act_bytes / hbm
    # loss: bf16 logits upcast to fp32, log-softmax and its gradient (~ read 2 + write 4 + read 4 +
    # write 4 + write 2 bytes per logit), HF LlamaForCausalLM / llm-foundry loss path.
    loss_time = T * V * 16.0 / hbm

    fwd_block = gemm_fwd_block + attn_fwd_block + elem_fwd_block
    fwd = L * fwd_block + gemm_fwd_head + T * d * 4 * act_bytes / hbm  # + embedding gather
    bwd = L * (2.0 * gemm_fwd_block + 2.5 * attn_fwd_block + 2.0 * elem_fwd_block) + 2.0 * gemm_fwd_head
    attn_module = T * blk_attn / rate + attn_fwd_block + T * 3 * d * act_bytes / hbm
    mlp_module = T * blk_mlp / rate + T * ((3 if model.gated_mlp else 2) * f + 3 * d) * act_bytes / hbm
    return _MicroBatch(fwd, bwd, loss_time, fwd_block, attn_fwd_block, gemm_fwd_block, elem_fwd_block, attn_module,
                       mlp_module, T * blk_mlp / rate, gemm_fwd_head)


def _recompute(strategy: Strategy, L: int, mb: _MicroBatch) -> float:
    """Forward work repeated in the backward of one micro-batch by activation checkpointing."""
    n_ckpt = strategy.num_checkpointed(L)
    if strategy.checkpointing == "full":
        return n_ckpt * mb.fwd_block  # one extra forward of each checkpointed block
    if strategy.checkpointing == "selective":
        return n_ckpt * mb.attn_fwd_block  # only the attention core (Korthikanti 2022, sec. 5)
    if strategy.checkpointing == "attention":  # the attention module: projections, core, rope/dropout
        return n_ckpt * mb.attn_module
    if strategy.checkpointing == "op":  # op-level SAC: half the block's GEMMs and the elementwise work
        return n_ckpt * (0.5 * mb.gemm_fwd_block + mb.elem_fwd_block)
    if strategy.checkpointing == "mlp":  # the MLP module: its GEMMs and activation
        return n_ckpt * mb.mlp_module
    return 0.0


def _exposed_communication(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, rates: _Rates, p: dict,
                           gas: int, fwd_window: float, bwd_window: float, N: float, buckets: dict) -> float:
    """Collective time of one optimizer step left on the critical path (ZeRO stage's collectives);
    ``N`` the model's parameters, ``buckets`` the strategy's (default_buckets)."""
    n = hardware.num_gpus
    if n <= 1:
        return 0.0
    L = model.num_hidden_layers
    bw = _link_bandwidth(hardware, p, crosses_nodes=hardware.num_nodes > 1)
    lat = p["coll_latency_s"]
    pbytes = rates.act_bytes  # 16-bit params and grads on the wire (fp32 when training in fp32)
    ov = p["overlap"]
    z = strategy.zero_stage
    P = N * pbytes
    if z == 3:
        # DeepSpeed ZeRO-3 / FSDP FULL_SHARD: all-gather params in forward and again in backward,
        # reduce-scatter grads, every micro-batch (ZeRO paper, Rajbhandari et al. 2020 sec. 7.2.2: 3x).
        nb = max(L + 1, math.ceil(N / max(1, buckets["prefetch_bucket_size"])))
        ag = _ring_time(P, n, bw, 0.0) + nb * (n - 1) * lat
        nr = max(L + 1, math.ceil(N / max(1, buckets["reduce_bucket_size"])))
        rs = _ring_time(P, n, bw, 0.0) + nr * (n - 1) * lat
        first = ag / nb  # first gather cannot be prefetched behind compute
        last = rs / nr  # last reduce-scatter bucket starts after the backward ends
        per_mb = first + last + _exposed(ag - first, fwd_window, ov) \
            + _exposed(ag + rs - last, bwd_window, ov)
        return gas * per_mb
    nr = max(1, math.ceil(N / max(1, buckets["reduce_bucket_size"])))
    if z == 0:
        # all-reduce = reduce-scatter + all-gather (2x), once at the accumulation boundary
        # (deepspeed/runtime/engine.py allreduce_gradients; Rajbhandari et al. 2020 sec. 7.1).
        red = 2.0 * _ring_time(P, n, bw, 0.0) + 2 * nr * (n - 1) * lat
        reductions, post = 1, 0.0
    else:
        red = _ring_time(P, n, bw, 0.0) + nr * (n - 1) * lat
        # ZeRO-2 reduces every micro-batch (partition_gradients), ZeRO-1 only at the boundary
        # (deepspeed/runtime/engine.py allreduce_gradients / zero/stage_1_and_2.py).
        reductions = gas if z == 2 else 1
        ng = max(1, math.ceil(N / max(1, buckets.get("allgather_bucket_size", N))))
        # updated 16-bit partitions all-gathered after the step, not overlapped (stage_1_and_2.py step)
        post = _ring_time(P, n, bw, 0.0) + ng * (n - 1) * lat
    last = red / nr
    per_red = last + _exposed(red - last, bwd_window, ov)
    return reductions * per_red + post


def _optimizer_and_offload(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, rates: _Rates, p: dict,
                           gas: int, fwd_window: float, bwd_window: float, N: float) -> tuple[float, float]:
    """(GPU optimizer step, exposed offload traffic and CPU-Adam) of one optimizer step, seconds
    (``N`` the model's parameters)."""
    gpu = hardware.gpu
    n = hardware.num_gpus
    prec = strategy.precision
    pbytes = rates.act_bytes
    ov = p["overlap"]
    z = strategy.zero_stage
    shard = N / n if z >= 1 else N  # parameters whose optimizer state this GPU owns
    # Adam on GPU: read grad, fp32 param, m, v; write fp32 param, m, v and the 16-bit copy
    # (deepspeed/ops/adam FusedAdam multi_tensor_adam: 4+4+4+4 read, 4+4+4+2 write bytes).
    opt_bytes = 30.0 if prec != "fp32" else 28.0
    if prec == "fp16":
        opt_bytes += 2.0  # overflow check over the gradients (loss scaler, deepspeed/runtime/fp16)
    optimizer = shard * opt_bytes / rates.hbm
    offload = 0.0
    pcie = gpu.pcie_bandwidth_gbps * 1e9
    gpn = hardware.gpus_per_node
    if strategy.offload_optimizer != "none":
        optimizer = 0.0
        # CPU-Adam over the node's shards (DeepSpeedCPUAdam; Ren et al. 2021 ZeRO-Offload sec. 4.2),
        # fp32 grads down (overlapped with backward) and 16-bit params up (not overlapped).
        cpu_adam = shard * gpn / (hardware.cpu_adam_gparams_per_s * 1e9)
        grads_down = shard * 4.0 / pcie
        params_up = shard * pbytes / pcie
        offload = cpu_adam + params_up + _exposed(grads_down, bwd_window, ov)
        if strategy.offload_optimizer == "nvme" and hardware.nvme is not None:
            # ZeRO-Infinity: fp32 param + m + v read and written per step (Rajbhandari et al. 2021 sec. 5)
            offload += shard * gpn * 12.0 * 2.0 / (hardware.nvme.bandwidth_gbps * 1e9)
    if strategy.offload_params != "none":
        # ZeRO-3 param offload: each GPU fetches its shard over PCIe for forward and backward, every
        # micro-batch, prefetched alongside the all-gathers (deepspeed/runtime/zero/partitioned_param_coordinator.py).
        fetch = 2.0 * (N / n) * pbytes / pcie
        if strategy.offload_params == "nvme" and hardware.nvme is not None:
            fetch += 2.0 * (N / n) * gpn * pbytes / (hardware.nvme.bandwidth_gbps * 1e9)
        offload += gas * _exposed(fetch, fwd_window + bwd_window, ov)
    return optimizer, offload


def _fsdp2_communication(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, rates: _Rates, p: dict,
                         gas: int, fwd_window: float, bwd_window: float, N: float) -> float:
    """FSDP2's collectives of one optimizer step left on the critical path: per micro-batch, one
    all-gather per unit (L blocks + root) in ``param_dtype`` in forward and, resharding after
    forward, again in backward; one reduce-scatter per unit in ``reduce_dtype``; hybrid sharding
    adds an all-reduce of each shard across nodes (torch/distributed/fsdp/_fully_shard
    _fsdp_collectives.py foreach_all_gather / foreach_reduce)."""
    hybrid = strategy.sharding == "hybrid" and hardware.num_nodes > 1
    n = hardware.gpus_per_node if hybrid else hardware.num_gpus
    if hardware.num_gpus <= 1:
        return 0.0
    units = model.num_hidden_layers + 1
    lat = p["coll_latency_s"]
    ov = p["overlap"]
    bw = _link_bandwidth(hardware, p, crosses_nodes=hardware.num_nodes > 1 and not hybrid)
    ag_once = _ring_time(N * rates.act_bytes, n, bw, 0.0) + units * (n - 1) * lat if n > 1 else 0.0
    rs = _ring_time(N * BYTES_PER_ELEMENT[strategy.reduce_dtype], n, bw, 0.0) + units * (n - 1) * lat \
        if n > 1 else 0.0
    if hybrid:  # each GPU's shard all-reduced with its replicas on the other nodes
        nodes = hardware.num_nodes
        rs += 2.0 * _ring_time(N / n * BYTES_PER_ELEMENT[strategy.reduce_dtype], nodes,
                               _link_bandwidth(hardware, p, crosses_nodes=True), 0.0) + 2 * units * (nodes - 1) * lat
    first = ag_once / units  # the root's gather cannot hide behind compute
    last = rs / units  # the root's reduce-scatter starts after the backward ends
    ag_bwd = ag_once if strategy.reshard_after_forward else 0.0
    per_mb = first + last + _exposed(ag_once - first, fwd_window, ov) + _exposed(ag_bwd + rs - last, bwd_window, ov)
    return gas * per_mb


def _fsdp2_optimizer_and_offload(model: ModelSpec, hardware: HardwareSpec, strategy: Strategy, rates: _Rates,
                                 p: dict, gas: int, window: float, N: float) -> tuple[float, float]:
    """(GPU optimizer step, exposed offload traffic and host step) of one FSDP2 optimizer step."""
    hybrid = strategy.sharding == "hybrid" and hardware.num_nodes > 1
    shard = N / (hardware.gpus_per_node if hybrid else hardware.num_gpus)
    # torch AdamW foreach on the fp32 shard: read grad, param, m, v; write param, m, v; the
    # sqrt temporary written and read (torch/optim/adamw.py _multi_tensor_adamw)
    step = shard * 36.0 / rates.hbm
    if strategy.offload_params == "none":
        return step, 0.0
    # CPUOffloadPolicy: the fp32 shard goes up for every all-gather (forward, and backward when
    # resharding), fp32 gradients come down, the optimizer steps on the host
    pcie = hardware.gpu.pcie_bandwidth_gbps * 1e9
    gathers = 2.0 if strategy.reshard_after_forward else 1.0
    traffic = gas * (gathers + 1.0) * shard * 4.0 / pcie
    host_step = shard * hardware.gpus_per_node / (hardware.cpu_adam_gparams_per_s * 1e9)
    return 0.0, host_step + _exposed(traffic, gas * window, p["overlap"])
