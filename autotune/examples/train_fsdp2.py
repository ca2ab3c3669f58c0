"""Train a few steps with a front point's FSDP2 layout: the script an fsdp2 point's ``launch`` line names.

    torchrun --nproc_per_node 8 -m autotune.examples.train_fsdp2 --job JOB.yaml --fsdp2 RUN/fsdp2_configs/0.json

It builds the job's model as autotune profiles it (autotune.models.sources.build_for_job: the
reference decoder, the Hugging Face model of ``model.hf_config``, or the user's ``model.python``
factory, with synthetic batches), applies the layout with ``autotune.apply`` (activation
checkpointing, then ``fully_shard`` per block and on the root; expert parallelism when the layout
has it) and its tiling / activation offload (``long_context``: autotune.models.long_context),
builds the layout's optimizer (``autotune.models.fsdp2.make_optimizer``) and runs ``--steps``
optimizer steps of ``gradient_accumulation_steps`` micro-batches with the layout's clipping (and,
for fp16, a ShardedGradScaler). With expert parallelism it records what the steps dispatched
(autotune.worker.routing) and prints it as the routing factors a job states. Replace the model and the
batches with yours; the layout and the calls stay. A context-parallel point is refused here: its batches run inside torch's
``context_parallel`` (CUDA only), which the point's snippet (``fsdp2_configs/<k>.py``) does.

Without a launcher (``python -m autotune.examples.train_fsdp2 ...``) it runs as one process over gloo, which
is how it runs on a CPU. A layout written for more GPUs than the processes that run it keeps its
micro-batch and accumulation; the mesh is then built over the processes at hand (said on stdout).
"""

from __future__ import annotations

import argparse
import json
import os

from autotune.worker.dist_env import one_process_env, run_script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="the autotune job file the run was made from")
    ap.add_argument("--fsdp2", required=True, help="the front point's FSDP2 layout (fsdp2_configs/<k>.json)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps to run (default 2)")
    return ap.parse_args(argv)


def long_context_strategy(layout: dict):
    """The layout's tiling / activation offload as the Strategy apply_long_context reads (None: none)."""
    import autotune

    lc = dict(layout.get("long_context") or {})  # the knobs off their defaults (engine_configs.long_context_knobs)
    lc.pop("context_parallel_size", None)  # the layout's context_parallel section: refused in main
    if not lc:
        return None
    ckpt = "full" if lc.get("activation_offload", "none") != "none" else "none"
    return autotune.Strategy(engine="fsdp2", checkpointing=ckpt, **lc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open(args.fsdp2) as fh:
        layout = json.load(fh)
    if layout.get("context_parallel"):
        raise SystemExit("context_parallel: run the point's snippet (fsdp2_configs/<k>.py, CUDA only): each batch "
                         "goes through torch's context_parallel, which this script does not do")
    import torch
    import torch.distributed as dist

    import autotune
    from autotune.config import load_config
    from autotune.models.fsdp2 import make_optimizer
    from autotune.models.sources import batch_seed, build_for_job, job_source, loss_of, norm_kernel_refusal

    cuda = torch.cuda.is_available()
    cfg = load_config(args.job)
    refusal = norm_kernel_refusal(cfg.model, cuda)
    if refusal:
        raise SystemExit(refusal)
    one_process_env()  # its free port taken just before the group binds it
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # each rank its own batches (the worker's seeds), of the job's own tokens where profile.tokens names them
    built = build_for_job(job_source(cfg), cfg.model, cfg.training, seed=batch_seed(0, rank))
    model = built.module.to(device)
    shape = layout["mesh"]["shape"]
    if rank == 0 and int(torch.tensor(shape).prod()) != world:
        print(f"the layout's mesh {tuple(shape)} is for another world size; sharding over {world} process(es)")
    mbs, gas = layout["micro_batch_size"], layout["gradient_accumulation_steps"]
    lc = long_context_strategy(layout)
    if lc is not None:  # tiling, and the forward inside offload_activations (before the checkpointing, as the snippet)
        from autotune.models import long_context

        long_context.apply_long_context(model, lc, seq_length=cfg.training.seq_len, gradient_accumulation_steps=gas)
    for note in autotune.apply(model, layout):
        if rank == 0:
            print(note)
    optimizer = make_optimizer(model, layout)
    scaler = None
    if layout.get("loss_scaling"):  # fp16: dynamic loss scaling, as the snippet's train_step
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=device.type)
    clip = float(layout.get("gradient_clipping") or 0.0)
    if layout.get("expert_parallel"):
        from autotune.models.expert_parallel import clip_grad_norm
    else:
        def clip_grad_norm(m, max_norm):
            return torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)

    routing = None
    if layout.get("expert_parallel"):  # the routing the steps dispatch, as the factors a job states
        from autotune.worker.routing import RoutingRecorder

        routing = RoutingRecorder.install(model)
    seq_len = cfg.training.seq_len
    for step in range(args.steps):
        for _ in range(gas):
            if routing is not None:
                routing.open_micro_step()
            batch = built.batch_fn(mbs, seq_len, device)
            loss = loss_of(model(**batch)) / gas
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        if clip > 0:
            clip_grad_norm(model, clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item() * gas:.4f} ({mbs} x {gas} micro-batches of {seq_len} tokens)")
    factors = routing.factors(cfg.model) if routing is not None else None
    if factors is not None and rank == 0:
        print(f"routing measured over {args.steps} step(s) of {world} rank(s); to size expert-parallel points at it, "
              "state in the job file (docs/moe.md, \"Measuring the routing\"):")
        print("\n".join(f"    {x}" for x in factors.statement()))
    dist.barrier()  # every rank past its last collective before any tears the group down (gloo can abort)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_script(main)
