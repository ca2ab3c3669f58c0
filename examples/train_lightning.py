"""A tiny Lightning script that autotune's ``script`` backend profiles (examples/lightning-script.yaml).

    python examples/train_lightning.py --args RUN/trainers/0/lightning.json --fsdp2 RUN/fsdp2_configs/0.json \
        --model-config examples/tiny-llama-hf.json --max-steps 20 --output-dir out

A LightningModule around a Llama built from the config (random weights), synthetic tokens, and the
front point's Lightning arguments (autotune.trainers.lightning_args): for an fsdp2 point
``ModelParallelStrategy`` whose ``configure_model`` applies the point's layout (``autotune.apply``:
checkpointing, ``fully_shard`` per block and the root) and whose optimizer is the job's
(``autotune.models.fsdp2.make_optimizer``); for a DeepSpeed point ``DeepSpeedStrategy(config=...)``
(CUDA only in Lightning). The one autotune line is ``callbacks=[AutotuneCallback()]``: under
``autotune run`` it measures the steps and stops training; on its own it does nothing.

On a CPU (no CUDA) the Trainer's accelerator is ``cpu``.
"""

from __future__ import annotations

import argparse
import importlib
import json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--args", required=True, help="the point's lightning.json (strategy and Trainer arguments)")
    ap.add_argument("--fsdp2", help="the point's FSDP2 layout (fsdp2 points)")
    ap.add_argument("--model-config", required=True, help="a Hugging Face config.json")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--output-dir", default="lightning_out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # autotune's callback first: on the CPU its memory count starts at this import
    from autotune.callbacks.lightning import AutotuneCallback

    callback = AutotuneCallback()
    import lightning.pytorch as pl
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(args.model_config) as fh:
        config = json.load(fh)
    with open(args.args) as fh:
        point = json.load(fh)
    layout = None
    if args.fsdp2:
        with open(args.fsdp2) as fh:
            layout = json.load(fh)
    seq = args.seq_len

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                                          attn_implementation="sdpa")

        def configure_model(self) -> None:
            if layout is not None:
                import autotune

                autotune.apply(self.model, layout, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer | None:
            if layout is None:
                return None  # DeepSpeed: the config holds the job's optimizer
            from autotune.models.fsdp2 import make_optimizer

            return make_optimizer(self.model, layout)

    module = Module()
    vocab = module.model.config.vocab_size

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    mod, _, cls = point["strategy"].rpartition(".")
    strategy = getattr(importlib.import_module(mod), cls)(**point["strategy_args"])
    trainer_args = dict(point["trainer_args"])
    if not torch.cuda.is_available():
        trainer_args["accelerator"] = "cpu"
    trainer = pl.Trainer(strategy=strategy, **trainer_args, max_steps=args.max_steps, callbacks=[callback],
                         default_root_dir=args.output_dir, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=point["dataloader_batch_size"])
    trainer.fit(module, loader)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
