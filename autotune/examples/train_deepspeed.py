"""Train a few steps with a front point's DeepSpeed config: the script front.json's ``launch`` line names.

    deepspeed --num_gpus 8 --module autotune.examples.train_deepspeed --job JOB.yaml \
        --deepspeed RUN/ds_configs/0.json --checkpointing RUN/trainers/0/checkpointing.json

It builds the job's model as autotune profiles it (autotune.models.sources.build_for_job: the
reference decoder, the Hugging Face model of ``model.hf_config``, or the user's ``model.python``
factory, with synthetic batches), applies the point's activation checkpointing
(``autotune.apply_checkpointing``: no DeepSpeed config carries it), and runs ``--steps`` optimizer
steps of ``gradient_accumulation_steps`` micro-batches through ``deepspeed.initialize(config=...)``.
Replace the model and the batches with yours; the config and the checkpointing call stay. A
long-context point (checkpointing.json ``long_context``: Ulysses, tiled loss / MLP, activation
offload; a Hugging Face model) gets ``autotune.models.long_context.apply_long_context`` before
``deepspeed.initialize(mpu=...)``, and under Ulysses every batch goes through ``shard_batch``.

Without a launcher (``python -m autotune.examples.train_deepspeed ...``) it runs as one process over gloo,
which is how it runs on a CPU (``DS_ACCELERATOR=cpu``). A config written for more GPUs than the
processes that run it keeps its micro-batch and accumulation; ``train_batch_size`` is then
recomputed by DeepSpeed for the world size at hand (said on stdout). On a CPU DeepSpeed has no fused
Adam: the config's optimizer section is built as its torch.optim class (autotune's worker does the same).
"""

from __future__ import annotations

import argparse
import json
import os

from autotune.worker.dist_env import one_process_env, run_script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True, help="the autotune job file the run was made from")
    ap.add_argument("--deepspeed", required=True, help="the front point's DeepSpeed config (ds_configs/<k>.json)")
    ap.add_argument("--checkpointing", help="the point's trainers/<k>/checkpointing.json (none: no checkpointing)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps to run (default 2)")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                    help="set by the deepspeed launcher")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist

    import autotune
    from autotune.config import load_config
    from autotune.models.sources import batch_seed, build_for_job, job_source, loss_of, norm_kernel_refusal
    from autotune.worker.engines import torch_optimizer_of

    cuda = torch.cuda.is_available()
    cfg = load_config(args.job)
    refusal = norm_kernel_refusal(cfg.model, cuda)
    if refusal:
        raise SystemExit(refusal)
    one_process_env()  # its free port taken just before the group binds it
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    with open(args.deepspeed) as fh:
        ds_config = json.load(fh)
    # each rank its own batches (the worker's seeds), of the job's own tokens where profile.tokens names them
    built = build_for_job(job_source(cfg), cfg.model, cfg.training, seed=batch_seed(0, rank))
    model = built.module
    ckpt: dict = {}
    if args.checkpointing:
        with open(args.checkpointing) as fh:
            ckpt = json.load(fh)
        if ckpt["granularity"] != "none":
            notes = autotune.apply_checkpointing(model, ckpt["granularity"], ckpt["num_layers"])
            if rank == 0:
                print(f"checkpointing: {ckpt['call']}" + "".join(f"; {n}" for n in notes))
    mpu, sp = None, int(ds_config.get("sequence_parallel_size", 1))
    if ckpt.get("long_context"):
        from autotune.models import long_context

        lc = ckpt["long_context"]
        if world % sp:
            raise SystemExit(f"sequence_parallel_size {sp} needs a multiple of {sp} processes, but got {world}")
        mpu = long_context.apply_long_context(model, autotune.Strategy(**lc["strategy"]), seq_length=lc["seq_length"],
                                              gradient_accumulation_steps=ds_config["gradient_accumulation_steps"])
        if rank == 0:
            print(f"long context: {lc['call']}")
    elif sp > 1:
        raise SystemExit(f"sequence_parallel_size {sp}: pass the point's checkpointing.json (its long_context)")

    mbs, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    dp = world // sp  # the data-parallel ranks (Ulysses: a group of sp ranks shares one batch)
    if ds_config.get("train_batch_size") != mbs * gas * dp:
        if rank == 0:
            print(f"train_batch_size {ds_config.get('train_batch_size')} is for another world size; DeepSpeed "
                  f"recomputes it for {world} process(es): {mbs} x {gas} x {dp}")
        ds_config.pop("train_batch_size", None)
    optimizer = None
    if not cuda:  # DeepSpeed's Adam needs its CUDA ops: the same optimizer as a torch.optim class
        name, kwargs = torch_optimizer_of(ds_config.pop("optimizer", None) or {})
        optimizer = getattr(torch.optim, name)(model.parameters(), **kwargs)
        ds_config["zero_allow_untested_optimizer"] = True
        ds_config["zero_force_ds_cpu_optimizer"] = False
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu,
                                      model_parameters=None if optimizer is not None else model.parameters())
    seq_len = cfg.training.seq_len
    for step in range(args.steps):
        for _ in range(gas):
            batch = built.batch_fn(mbs, seq_len, engine.device)
            if mpu is not None:
                batch = long_context.shard_batch(batch, mpu, engine.device)
            loss = loss_of(engine(**batch))
            engine.backward(loss)
            engine.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} ({mbs} x {gas} micro-batches of {seq_len // sp} tokens "
                  "per rank)")
    dist.barrier()  # every rank past its last collective before any tears the group down (gloo can abort)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_script(main)
