"""The routing an expert-parallel job's measured steps dispatched, recorded by the worker.

The memory model sizes an EP rank's received rows with stated factors (ModelSpec ``moe_load_imbalance``,
``moe_min_load``, ``ep_rank_imbalance``, ``ep_step_imbalance``; autotune's defaults where a job
states none). A profiled EP candidate measures them: every routed-experts module that
autotune.models.expert_parallel laid out calls its ``on_dispatch`` with the rows it sends and the rows it
receives per (source rank, local expert) after its counts exchange; the recorder keeps them per measured
micro-step (a forward opens one; a checkpointed block's recomputation dispatches again within it), and
the worker writes them into the rank's result (``routing``), whose entries over every rank ``factors_of`` pools
into the factors (autotune.memory.expert_parallel.measured_routing).
"""

from __future__ import annotations

from typing import Any, Optional


class RoutingRecorder:
    """Records the dispatches of a model's expert-parallel experts during the measured micro-steps."""

    def __init__(self, modules: list[Any]) -> None:
        self.sent: Optional[int] = None
        """Rows this rank sends per dispatch (tokens x top-k)."""
        self.steps: list[list[list[int]]] = []
        """Per measured micro-step, its dispatches' received rows per (source rank, local expert); empty until the
        first measured forward (the warm-up's dispatches are not kept)."""
        for module in modules:
            module.on_dispatch = self.dispatch

    @classmethod
    def install(cls, model: Any) -> Optional["RoutingRecorder"]:
        """A recorder on ``model``'s expert-parallel experts (those with an ``ep_group``); None without any."""
        modules = [m for m in model.modules() if getattr(m, "ep_group", None) is not None]
        return cls(modules) if modules else None

    def open_micro_step(self) -> None:
        """A measured micro-step's forward begins: its dispatches (and its recomputations') are recorded."""
        self.steps.append([])

    def dispatch(self, sent: int, received: list[int]) -> None:
        if self.steps:
            self.sent = sent
            self.steps[-1].append([int(n) for n in received])

    def factors(self, model_spec: Any) -> Any:
        """The routing every rank recorded as the factors a job states (a MeasuredRouting; None when nothing was
        dispatched): a collective when torch.distributed is initialised, so every rank calls it."""
        import torch.distributed as dist

        ranks = [self.result()]
        if dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, self.result())
        return factors_of(model_spec, ranks)

    def result(self) -> Optional[dict[str, Any]]:
        """The rank's ``routing`` result entry: ``sent`` rows per dispatch and the micro-steps' splits."""
        if self.sent is None:
            return None
        return {"sent": self.sent, "steps": self.steps}


def factors_of(model_spec: Any, results: list[Optional[dict[str, Any]]]) -> Any:
    """The factors (a MeasuredRouting; None when no rank dispatched) of every rank's ``routing`` result entry
    (``RoutingRecorder.result``; None for a rank without one), pooled: what the profile backend reads from the
    ranks' results and ``RoutingRecorder.factors`` gathers."""
    from autotune.memory.expert_parallel import measured_routing

    routed = [r for r in results if r]
    if not routed:
        return None
    return measured_routing(model_spec, int(routed[0]["sent"]), [st for r in routed for st in r["steps"]])
