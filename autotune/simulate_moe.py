"""Mixture-of-experts terms of the throughput simulator (autotune.simulate): active parameters and
the FLOPs / MFU on them, the MoE block's compute (router, routed experts as a grouped GEMM over
few tokens each, shared expert, permutation), the expert-parallel all-to-all and FSDP2's
all-gathers of expert shards over GPUs / EP.

Pure arithmetic (no torch). Dense models never reach this module: ``simulate`` calls it only for
``model.is_moe``, so their results are unchanged.
"""

from __future__ import annotations

from typing import Any

from autotune.spec import HardwareSpec, ModelSpec
from autotune.simulate_comm import _link_bandwidth


def expert_params(model: ModelSpec) -> int:
    """Parameters of one routed expert (gated MLP d -> f -> d, biases with expert_bias), as in
    ModelSpec.moe_params."""
    d, f = model.hidden_size, model.moe_intermediate_size or model.intermediate_size
    return 3 * d * f + ((2 * f + d) if model.expert_bias else 0)


def routed_expert_params(model: ModelSpec) -> int:
    """Every routed expert of every MoE block (what expert parallelism splits)."""
    return model.num_moe_layers * model.num_experts * expert_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters one token passes through: all but the routed experts it is not sent to (top-k of
    num_experts per MoE block; router, shared expert, attention, embeddings, head all count), the
    "activated parameters" of Mixtral (arXiv 2401.04088 sec. 2: 13B of 47B) and DeepSeek-V3
    (arXiv 2412.19437 sec. 1: 37B of 671B)."""
    if not model.is_moe:
        return model.num_parameters
    idle = model.num_experts - model.num_experts_per_tok
    return model.num_parameters - model.num_moe_layers * idle * expert_params(model)


def moe_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """ModelSpec.flops_per_token's 6N + 12 L d S (llm-foundry's, embeddings counted) with N the
    active parameters; torchtitan's MoE MFU (torchtitan/models/utils.py
    get_moe_model_nparams_and_flops) is the same less 6 x the embedding."""
    return 6.0 * active_params(model) + 12.0 * model.num_hidden_layers * model.hidden_size * seq_len


def tokens_per_expert(model: ModelSpec, tokens: float, ep: int) -> float:
    """Rows of each local expert's GEMM with ``tokens`` per GPU and balanced routing: every GPU
    routes tokens x top_k rows, EP sends them to the ep GPUs holding num_experts / ep experts each."""
    return tokens * model.num_experts_per_tok * ep / model.num_experts


def moe_micro_batch(model: ModelSpec, T: float, ep: int, rates: Any, p: dict, mb: Any) -> Any:
    """``mb`` (simulate._micro_batch_compute of the model as if every block had the dense MLP) with
    the MoE blocks' feed-forward in place of the MLP: per block averaged over the dense and MoE
    blocks. Routed experts run as one grouped GEMM whose efficiency saturates in the rows per
    expert (tokens_per_expert, the same M-saturation as simulate's GEMMs: Nvidia "Matrix
    Multiplication Background" sec. 4-5); router and shared expert at the block's T rows."""
    peak, hbm, act_bytes = rates
    L, d, e, k = model.num_hidden_layers, model.hidden_size, model.num_experts, model.num_experts_per_tok
    f, fm, fs = model.intermediate_size, model.moe_intermediate_size or model.intermediate_size, \
        model.shared_expert_intermediate_size
    kh, mh = p["gemm_k_half"], p["gemm_m_half"]
    rate = peak * p["gemm_eff"] * T / (T + mh)
    M = tokens_per_expert(model, T, ep)
    rate_e = peak * p["gemm_eff"] * M / (M + mh)
    n_in = 2 if model.gated_mlp else 1
    dense_gemm = T * (2.0 * n_in * d * f + 2.0 * f * d) * (1.0 + kh / min(d, f)) / rate
    dense_elem = T * (3 if model.gated_mlp else 2) * f * act_bytes / hbm
    # routed: T k rows of the gated expert MLP (gate_up d x 2fm, down fm x d; Kaplan et al. 2020
    # table 1: 2 K N per row); router Linear(d, e); shared expert a gated MLP of width fs at T rows
    routed = T * k * 6.0 * d * fm * (1.0 + kh / min(d, fm)) / rate_e
    router = T * 2.0 * d * e * (1.0 + kh / min(d, e)) / rate
    shared = T * 6.0 * d * fs * (1.0 + kh / min(d, fs)) / rate if fs else 0.0
    moe_gemm = routed + router + shared
    # elementwise: expert activations (r 2fm, w fm per row), shared's (3 fs), the permutation gather
    # and unpermute (r d, w d per row each) and the weighted combine (r k d, w d), softmax/top-k over
    # e logits (torchtitan/models/moe/moe.py TokenChoiceTopKRouter, _permute / _unpermute)
    moe_elem = T * (k * 3 * fm + 3 * fs + 4 * k * d + k * d + d + 3 * e) * act_bytes / hbm
    n_moe = model.num_moe_layers
    gemm_delta = n_moe * (moe_gemm - dense_gemm) / L  # per block, averaged over the L blocks
    elem_delta = n_moe * (moe_elem - dense_elem) / L
    fwd_delta = gemm_delta + elem_delta
    return mb._replace(
        fwd=mb.fwd + L * fwd_delta, bwd=mb.bwd + L * 2.0 * fwd_delta, fwd_block=mb.fwd_block + fwd_delta,
        gemm_fwd_block=mb.gemm_fwd_block + gemm_delta, elem_fwd_block=mb.elem_fwd_block + elem_delta,
        mlp_module=mb.mlp_module + fwd_delta, mlp_gemm=mb.mlp_gemm + gemm_delta)


def all_to_all_bytes(model: ModelSpec, T: float, ep: int, act_bytes: int) -> float:
    """Bytes one GPU sends in one all-to-all of one MoE block (dispatch or combine): its T x top_k
    routed rows of hidden_size, all but the 1/ep that stay local (torchtitan/distributed/
    expert_parallel.py ExpertParallel._token_dispatch / _token_combine, all_to_all_single_autograd)."""
    return T * model.num_experts_per_tok * model.hidden_size * act_bytes * (ep - 1) / ep


def all_to_all_time(model: ModelSpec, hardware: HardwareSpec, T: float, ep: int, act_bytes: int, p: dict,
                    recomputed_moe_blocks: int = 0) -> float:
    """The expert-parallel all-to-alls of one micro-batch, seconds: per MoE block dispatch and
    combine in forward and their gradients in backward (4), twice more for each MoE block whose
    forward is recomputed; blocking (the experts wait for their rows), so none is overlapped."""
    if ep <= 1:
        return 0.0
    bw = _link_bandwidth(hardware, p, crosses_nodes=ep > hardware.gpus_per_node)
    one = all_to_all_bytes(model, T, ep, act_bytes) / bw + (ep - 1) * p["coll_latency_s"]
    return (4 * model.num_moe_layers + 2 * recomputed_moe_blocks) * one


def recomputed_moe_blocks(model: ModelSpec, strategy: Any) -> int:
    """MoE blocks whose forward (with its all-to-alls) runs again in backward: full or mlp
    checkpointing of a MoE block."""
    if strategy.checkpointing not in ("full", "mlp"):
        return 0
    dense = set(model.dense_layers)
    return sum(1 for i in strategy.checkpointed_blocks(model.num_hidden_layers) if i not in dense)


def fsdp2_gathered_params(model: ModelSpec, n: int, ep: int) -> float:
    """The parameter count whose ring all-gather over every GPU moves what FSDP2 moves with EP:
    the dense parts over the n GPUs FSDP shards over, each GPU's num_experts / ep experts over the n / ep GPUs of
    its dp_shard_mod_ep mesh (torchtitan/models/llama4/infra/parallelize.py apply_fsdp: the experts
    under ``fully_shard(..., mesh=dp_mod_ep_mesh)``). Ring volume (m-1)/m of the group's bytes."""
    N = float(model.num_parameters)
    if ep <= 1 or n <= 1:
        return N
    experts = float(routed_expert_params(model))
    m = n // ep
    return (N - experts) + (experts / ep) * ((m - 1) / m) * (n / (n - 1))
