"""The training scripts a front point's launch line runs, shipped with autotune so the line works from
any directory: ``python -m autotune.examples.train_deepspeed`` (a DeepSpeed point: ``deepspeed --module``)
and ``python -m autotune.examples.train_fsdp2`` (an FSDP2 point: ``torchrun -m``). Each trains a few
steps of the job's model with the point's config; copy one and replace the model and batches with yours."""
