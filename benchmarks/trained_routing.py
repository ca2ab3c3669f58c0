"""What routers that see text do to expert parallelism's load factors, against the defaults the memory model
sizes EP with where a job states none (memory.moe ``expert_imbalance``, memory.expert_parallel
``rank_imbalance``; docs/moe.md, Load imbalance).

    python benchmarks/trained_routing.py                      # 3 families, 300 steps each (about 25 minutes)
    python benchmarks/trained_routing.py --alignment          # the routers' inputs at init (a minute)
    python benchmarks/trained_routing.py --steps 100 --only mixtral --json /tmp/routing.json

Each family's published config.json (tests/data/hf/moe) keeps its router (experts, top-k, auxiliary-loss
coefficient, top-k renormalisation) and is shrunk elsewhere (4 blocks, expert width 64, h ``--hidden``; at
init also h ``--wide``). The text: this repository's files at a fixed commit (CORPUS_REV), five domains
(Python, Markdown, JSON, YAML, CSV; every fifth file held out) as byte-level BPE tokens of a tokenizer trained
on the rest. The ``trained`` router learns with its auxiliary loss (transformers' ``load_balancing_loss_func``,
added by the model under ``output_router_logits``). Each held-out micro-step of ``ep`` ranks is dispatched as
autotune.models.expert_parallel lays it out (expert e on rank e // (E / ep)), and
``memory.expert_parallel.measured_routing`` turns the splits into the four factors a profiled trial prints
(the worst over the micro-steps). Batches (BATCHINGS): uniform random ids (what the profile backend feeds),
any domain per sequence, one domain per rank's micro-batch, one domain for every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {  # a published file (tests/data/hf/moe) whose router is kept
    "mixtral": "mixtral-8x7b-v0.1.json",      # 8 experts, top-2, aux 0.02
    "olmoe": "olmoe-1b-7b-0924.json",         # 64 experts, top-8, aux 0.01, no renormalisation
    "qwen3_moe": "qwen3-30b-a3b.json",        # 128 experts, top-8, aux 0.001
}
DOMAINS = {"python": ".py", "markdown": ".md", "json": ".json", "yaml": ".yaml", "csv": ".csv"}
"""This repository's tracked text, by kind (file suffix)."""
SHRUNK = dict(intermediate_size=64, moe_intermediate_size=64,
              max_position_embeddings=1024, output_router_logits=True, tie_word_embeddings=False)
"""What each published file is shrunk by (its router kept); the width is ``--hidden`` (trained) or ``--wide``,
the depth ``--blocks``."""


CORPUS_REV = "cec667f30c6c075bb08577ac133f8aa6e178365a"
"""The commit whose files are the corpus, so the figures do not move as the repository does."""


def corpus() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Training and held-out text per domain: the files of each kind at CORPUS_REV concatenated, every fifth
    file (sorted by path) held out."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, check=True).stdout  # noqa: E731
    try:
        files = git("ls-tree", "-r", "--name-only", CORPUS_REV).decode().split()
    except subprocess.CalledProcessError:
        raise SystemExit(f"trained_routing.py: commit {CORPUS_REV[:7]} (the corpus) is not in this clone: "
                         f"git fetch --unshallow")
    train: dict[str, bytes] = {}
    held: dict[str, bytes] = {}
    for domain, suffix in DOMAINS.items():
        texts = [git("show", f"{CORPUS_REV}:{f}") for f in sorted(files) if f.endswith(suffix)]
        train[domain] = b"\n".join(t for i, t in enumerate(texts) if i % 5)
        held[domain] = b"\n".join(t for i, t in enumerate(texts) if not i % 5)
    return train, held


def tokenized(train: dict[str, bytes], held: dict[str, bytes], vocab: int) -> tuple[dict[str, list[int]], dict[str, list[int]], int]:
    """Both splits as token ids of a byte-level BPE tokenizer (the ``tokenizers`` library, as GPT-2's and
    Llama-3's are built) trained on the training split: a language model's token statistics (frequent tokens
    are a few percent each), which the routers at init and after training see."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)

    def pieces():
        for text in train.values():
            s = text.decode("utf-8", "replace")
            yield from (s[i:i + 10000] for i in range(0, len(s), 10000))

    tok.train_from_iterator(pieces(), trainers.BpeTrainer(vocab_size=vocab, show_progress=False))
    enc = lambda split: {d: tok.encode(t.decode("utf-8", "replace")).ids for d, t in split.items()}  # noqa: E731
    return enc(train), enc(held), tok.get_vocab_size()


def window(rng: random.Random, text: list[int], seq: int) -> list[int]:
    start = rng.randrange(0, len(text) - seq)
    return list(text[start:start + seq])


def build(family: str, vocab: int, hidden: int, blocks: int = 4):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((ROOT / "tests/data/hf/moe" / FAMILIES[family]).read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "transformers_version")}
    heads = max(4, hidden // 64)
    cfg.update(SHRUNK, num_hidden_layers=blocks, vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads,
               head_dim=hidden // heads, num_key_value_heads=max(2, heads // 4))
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), config


def train(model, texts: dict[str, list[int]], steps: int, seq: int, batch: int, seed: int) -> list[float]:
    import torch

    rng = random.Random(seed)
    domains = sorted(texts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        ids = torch.tensor([window(rng, texts[rng.choice(domains)], seq) for _ in range(batch)])
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    return losses


def routers(model, ids, take) -> list:
    """One forward of ``ids`` without gradients, ``take(inputs, outputs)`` of every MoE block's router collected."""
    import torch

    seen: list = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(take(inp, out)))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def routed(model, ids):
    """Every MoE block's top-k expert indices (tokens x k) for one micro-batch."""
    return routers(model, ids, lambda inp, out: out[2].reshape(-1, out[2].shape[-1]))


BATCHINGS = ("uniform", "mixed", "domain/rank", "one domain")
"""How a micro-batch's sequences are drawn: uniform random token ids (what the profile backend feeds), any
held-out domain per sequence, one domain per rank's micro-batch, one domain for every rank."""


def alignment(model, ids) -> list[float]:
    """Each MoE block's router inputs' mean pairwise cosine over one micro-batch's tokens (1: one vector)."""
    import torch

    out = []
    for x in routers(model, ids, lambda inp, _: inp[0].reshape(-1, inp[0].shape[-1])):
        x = torch.nn.functional.normalize(x.float(), dim=-1)
        n = x.shape[0]
        out.append(float(((x @ x.T).sum() - n) / (n * n - n)))
    return out


def factors(model, spec, held, ep: int, batching: str, mbs: int, seq: int, micro_steps: int, seed: int):
    """The four factors over ``micro_steps`` micro-steps of ``ep`` ranks (a MeasuredRouting)."""
    import torch

    from autotune.memory.expert_parallel import measured_routing

    rng = random.Random(seed)
    E, k = spec.num_experts, spec.num_experts_per_tok
    local = E // ep
    domains = sorted(held)
    steps: list[list[list[int]]] = []  # every destination rank's micro-steps
    for _ in range(micro_steps):
        one = rng.choice(domains)
        per_rank = []
        for _ in range(ep):
            if batching == "uniform":
                seqs = [[rng.randrange(spec.vocab_size) for _ in range(seq)] for _ in range(mbs)]
            elif batching == "mixed":
                seqs = [window(rng, held[rng.choice(domains)], seq) for _ in range(mbs)]
            else:
                d = one if batching == "one domain" else rng.choice(domains)
                seqs = [window(rng, held[d], seq) for _ in range(mbs)]
            per_rank.append([torch.bincount(p.reshape(-1), minlength=E).tolist()
                             for p in routed(model, torch.tensor(seqs))])
        for q in range(ep):  # destination rank q receives (source r, local expert j) chunks per block
            steps.append([[per_rank[r][b][q * local + j] for r in range(ep) for j in range(local)]
                          for b in range(len(per_rank[0]))])
    return measured_routing(spec, mbs * seq * k, steps)


def summary(rows: list[dict]) -> None:
    """Per family and router, over every batching: the largest factors (the expert's over experts / top-k) and
    the rows beyond the defaults."""
    for family in dict.fromkeys(r["family"] for r in rows):
        for router in dict.fromkeys(r["router"] for r in rows if r["family"] == family):
            sel = [r for r in rows if r["family"] == family and r["router"] == router]
            expert = max(sel, key=lambda r: r["factors"]["moe_load_imbalance"])
            rank = max(sel, key=lambda r: r["factors"]["ep_rank_imbalance"])
            print(f"  {family:10} {router:13} largest: expert {expert['factors']['moe_load_imbalance']:.3f} "
                  f"(of {expert['defaults']['moe_load_imbalance']:g}), rank {rank['factors']['ep_rank_imbalance']:.3f} "
                  f"(EP {rank['ep']}, {rank['batches']}, default {rank['defaults']['ep_rank_imbalance']:g}), step "
                  f"{max(r['factors']['ep_step_imbalance'] for r in sel):.3f}; beyond the defaults "
                  f"{sum(bool(r['beyond_defaults']) for r in sel)} of {len(sel)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per family (0: no trained rows)")
    ap.add_argument("--blocks", type=int, default=4, help="decoder blocks of every model")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--micro-steps", type=int, default=8, help="held-out micro-steps per row")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the trained models")
    ap.add_argument("--wide", type=int, default=1024, help="hidden size of the second model at init (0: none)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    ap.add_argument("--alignment", action="store_true",
                    help="only print each family's router inputs' alignment at init (--hidden, --wide, 4096)")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)
    unknown = [f for f in args.only.split(",") if f and f not in FAMILIES]
    if unknown:
        ap.error(f"--only: unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                 f"(choices: {', '.join(FAMILIES)})")

    import torch

    from autotune.hf_config import map_hf_config
    from autotune.memory.expert_parallel import sized_routing
    from autotune.spec import ModelSpec

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train_bytes, held_bytes = corpus()
    train_ids, held, vocab = tokenized(train_bytes, held_bytes, args.vocab)
    print(f"corpus (tokens, training + held out; BPE vocabulary {vocab}): "
          f"{', '.join(f'{d} {len(t):,}+{len(held[d]):,}' for d, t in train_ids.items())}")
    if args.alignment:
        rng = random.Random(0)
        ids = torch.tensor([window(rng, held["python"], 512)])
        for family in [f for f in FAMILIES if not args.only or f in args.only.split(",")]:
            for hidden in sorted({args.hidden, args.wide or args.hidden, 4096}):
                model, _ = build(family, vocab, hidden, args.blocks)
                cos = alignment(model.eval(), ids)
                print(f"{family:10} h {hidden:5d} at init: router inputs' mean pairwise cosine per MoE block "
                      f"{' '.join(f'{c:.2f}' for c in cos)}")
                del model
        return 0
    print(f"{'family':10} {'router':13} {'batches':11} {'ep':>3} {'tokens':>6}  expert / least / rank / step"
          f"   defaults (expert / rank / step)")
    rows = []
    for family in [f for f in FAMILIES if not args.only or f in args.only.split(",")]:
        routers = [("init", args.hidden)] + ([(f"init h{args.wide}", args.wide)] if args.wide else [])
        for router, hidden in routers + ([("trained", args.hidden)] if args.steps else []):
            model, config = build(family, vocab, hidden, args.blocks)
            if router == "trained":
                losses = train(model, train_ids, args.steps, 512, 8, seed=1)
                print(f"  {family}: trained {args.steps} steps (h {hidden}), loss {losses[0]:.2f} -> "
                      f"{sum(losses[-20:]) / len(losses[-20:]):.2f}")
            fields = map_hf_config(config.to_dict(), FAMILIES[family])
            spec = ModelSpec(**{k: v for k, v in fields.items() if k in ModelSpec.__dataclass_fields__})
            model.eval()
            for batching in BATCHINGS:
                for ep in (2, 8):
                    for mbs in (1, 4):
                        f = factors(model, spec, held, ep, batching, mbs, 512, args.micro_steps, seed=2)
                        d = sized_routing(spec, ep)
                        over = f.beyond(d)
                        rows.append(dict(family=family, router=router, batches=batching, ep=ep, tokens=mbs * 512,
                                         factors=f._asdict(), defaults=d._asdict(), beyond_defaults=over))
                        print(f"{family:10} {router:13} {batching:11} {ep:3d} {mbs * 512:6d}  "
                              f"{f.moe_load_imbalance:.3f} / {f.moe_min_load:.3f} / {f.ep_rank_imbalance:.3f} / "
                              f"{f.ep_step_imbalance:.3f}   {d.moe_load_imbalance:g} / {d.ep_rank_imbalance:g} / "
                              f"{d.ep_step_imbalance:.3g}{'   BEYOND ' + ', '.join(over) if over else ''}")
            del model
    print(f"rows: {len(rows)}, beyond the defaults: {sum(bool(r['beyond_defaults']) for r in rows)}")
    summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
