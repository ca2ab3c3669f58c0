"""Expert parallelism for a Hugging Face MoE decoder (transformers 5: Mixtral, Qwen2/3-MoE, OLMoE, ...
whose ``mlp.experts`` holds ``gate_up_proj`` [E, 2f, d] and ``down_proj`` [E, d, f] and is called as
``experts(hidden_states, top_k_index, top_k_weights)``), laid out as torchtitan does for its own
MoE models (torchtitan/distributed/expert_parallel.py ExpertParallel): each of the ep ranks keeps
num_experts / ep experts (dim 0), tokens go to their experts' rank by ``all_to_all_single``
(dispatch) and come back by another (combine), both differentiable.

``expert_parallel`` is plain torch; ``autotune.models.fsdp2.snippet`` inlines its source, so the
snippet a front point ships runs the same code the tests run. torch is imported inside the
functions (the simulate path never imports it).
"""

from __future__ import annotations

from typing import Any


def experts_modules(model: Any) -> list[Any]:
    """The routed-experts modules of a Hugging Face MoE model laid out as transformers 5's Mixtral /
    Qwen-MoE / DeepSeek experts: ``gate_up_proj`` [E, 2f, d], ``down_proj`` [E, d, f], no biases, an
    ``act_fn`` (gpt-oss's transposed, biased experts are not)."""
    def fits(m: Any) -> bool:
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        return (getattr(gu, "ndim", 0) == 3 and getattr(dn, "ndim", 0) == 3 and hasattr(m, "act_fn")
                and not hasattr(m, "gate_up_proj_bias") and gu.shape[1] == 2 * dn.shape[2]
                and gu.shape[2] == dn.shape[1] and gu.shape[0] == dn.shape[0])

    return [m for m in model.modules() if fits(m)]


def expert_parallel(experts, ep_group):
    """Keep this rank's num_experts / ep experts of ``experts`` and route its tokens over ``ep_group``."""
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single

    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    num_experts = experts.gate_up_proj.shape[0]
    local = num_experts // ep
    for name in ("gate_up_proj", "down_proj"):  # this rank's slice of dim 0, as ExpertParallel's Shard(0)
        full = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))

    def exchange(rows, out_splits, in_splits):
        out = rows.new_empty((sum(out_splits), rows.shape[1]))
        return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=ep_group)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows sorted by expert (torchtitan moe.py _permute)
        counts = torch.bincount(flat, minlength=num_experts)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=ep_group)  # rows per (source rank, local expert)
        if self.on_dispatch is not None:  # a routing recorder (autotune.worker.routing): rows sent, received
            self.on_dispatch(int(flat.numel()), recv.tolist())
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_counts = recv.view(ep, local)
        recv_splits = recv_counts.sum(1).tolist()
        rows = exchange(hidden_states[order // k], recv_splits, send_splits)  # dispatch
        outs, start = [], 0
        for src in range(ep):
            for e in range(local):
                n = int(recv_counts[src, e])
                x = rows[start:start + n]
                gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
                start += n
        done = torch.cat(outs) if outs else rows
        back = exchange(done, send_splits, recv_splits)  # combine
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, order // k, weighted.to(out.dtype))

    experts.forward = types.MethodType(forward, experts)
    experts.on_dispatch = None
    experts.num_local_experts = local
    experts.ep_group = ep_group  # clip_grad_norm: the other ep ranks hold the other experts
    return experts


def clip_grad_norm(model, max_norm):
    """``clip_grad_norm_`` of a model with expert parallelism (torch's refuses gradients on two meshes:
    the experts' dp_shard_mod_ep, the dense parts' dp_shard_cp): each group's 2-norm, the experts' summed
    over the ep ranks (each holds other experts), combined and applied to both, as torchtitan does
    (torchtitan/distributed/utils.py ``_clip_grad_norm_with_ep``). Returns the total norm."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    owners = [m for m in model.modules() if getattr(m, "ep_group", None) is not None]
    expert_ids = {id(p) for m in owners for p in m.parameters()}
    groups = ([p.grad for p in model.parameters() if p.grad is not None and id(p) not in expert_ids],
              [p.grad for p in model.parameters() if p.grad is not None and id(p) in expert_ids])
    squares = []
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    if owners:
        dist.all_reduce(squares[1], group=owners[0].ep_group)
    total = (squares[0] + squares[1].to(squares[0].device)).sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for grads in groups:
        if grads and coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return total
