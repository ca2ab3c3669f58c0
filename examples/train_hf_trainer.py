"""A tiny Hugging Face Trainer script that autotune's ``script`` backend profiles (examples/hf-trainer-script.yaml).

    python examples/train_hf_trainer.py --args RUN/trainers/0/hf_trainer_args.json \
        --model-config examples/tiny-llama-hf.json --max-steps 20 --output-dir out

It builds a Llama from the config (random weights, nothing downloaded), feeds synthetic tokens, and
trains with ``TrainingArguments(**args)``: the front point's micro-batch, accumulation, optimizer,
precision, checkpointing and DeepSpeed config (its ``deepspeed`` key, "auto" where Trainer fills
values) or FSDP2 arguments. The one autotune line is ``callbacks=[AutotuneCallback()]``: under
``autotune run`` it measures the steps and stops training; on its own it does nothing. Replace the
model and the dataset with yours; the arguments and the callback stay.

On a CPU (no CUDA): ``use_cpu`` and DeepSpeed's torch Adam (DeepSpeed has no fused Adam there).
"""

from __future__ import annotations

import argparse
import json
import os

from autotune.worker.dist_env import one_process_env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--args", required=True, help="the point's hf_trainer_args.json (TrainingArguments keywords)")
    ap.add_argument("--model-config", required=True, help="a Hugging Face config.json")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--output-dir", default="hf_trainer_out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    one_process_env()
    # autotune's callback first: on the CPU its memory count starts at this import
    from autotune.callbacks.hf import AutotuneCallback

    callback = AutotuneCallback()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    with open(args.model_config) as fh:
        config = json.load(fh)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                             attn_implementation="sdpa")
    with open(args.args) as fh:
        kwargs = json.load(fh)
    cuda = torch.cuda.is_available()
    if kwargs.get("deepspeed"):
        with open(kwargs["deepspeed"]) as fh:
            ds = json.load(fh)
        if not cuda:
            ds["optimizer"]["params"]["torch_adam"] = True
        kwargs["deepspeed"] = ds
    ckpt = os.path.join(os.path.dirname(args.args), "checkpointing.json")
    if not kwargs.get("activation_checkpointing") and os.path.exists(ckpt):
        with open(ckpt) as fh:
            spec = json.load(fh)
        if spec["granularity"] != "none":  # what Trainer cannot express: the model-side call
            import autotune

            autotune.apply_checkpointing(model, spec["granularity"], spec["num_layers"])
    vocab, seq = model.config.vocab_size, args.seq_len

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    training_args = TrainingArguments(**kwargs, output_dir=args.output_dir, max_steps=args.max_steps,
                                      report_to=[], save_strategy="no", logging_steps=1, use_cpu=not cuda,
                                      dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=training_args, train_dataset=Tokens(), callbacks=[callback]).train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
