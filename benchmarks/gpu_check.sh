#!/usr/bin/env bash
# Predicted vs measured peak memory and tokens/s of the reference Llama model, profiled for real.
#
#   benchmarks/gpu_check.sh                     # one NVIDIA GPU: 3 cases, <= 8 minutes in total
#   benchmarks/gpu_check.sh --device cpu --tiny # the same path on a CPU (gloo), tiny model, ~1 minute
#   options: --gpu PRESET (default: guessed from the device name), --out DIR (default: a temp dir),
#            --timeout S (per case, default 150)
#
# Installs nothing but the project's own dependencies (the "profile" extra: torch, deepspeed) and
# only when they are missing. Each case runs through autotune's deepspeed backend (torchrun, one
# process per GPU, worker in its own process group with a timeout), so a failing case is reported
# as a row with its status (oom, crash, timeout...) instead of stopping the script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
if ! "$PY" -c "import torch, deepspeed, optuna, yaml" 2>/dev/null; then
    echo "gpu_check: installing the project with its profile extra (torch, deepspeed)" >&2
    "$PY" -m pip install -q -e ".[profile]"
fi
exec "$PY" - "$@" <<'PYEOF'
import argparse
import dataclasses
import os
import sys
import tempfile
import time

from autotune import presets
from autotune.config import Config, ProfileSection
from autotune.profile.deepspeed_backend import DeepSpeedBackend
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy

GIB = float(1 << 30)
ap = argparse.ArgumentParser(prog="gpu_check.sh")
ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
ap.add_argument("--tiny", action="store_true", help="tiny model (the CPU smoke test)")
ap.add_argument("--gpu", default=None, help="GPU preset for the predictions (default: from the device name)")
ap.add_argument("--out", default=None)
ap.add_argument("--timeout", type=float, default=150.0)
args = ap.parse_args(sys.argv[1:])


def llama(name, L, d, heads, kv, ff, vocab=32000):
    return ModelSpec(name=name, num_hidden_layers=L, hidden_size=d, num_attention_heads=heads,
                     num_key_value_heads=kv, intermediate_size=ff, vocab_size=vocab, max_position_embeddings=4096,
                     source="gpu_check.sh (Llama-2 architecture, TinyLlama-1.1B / GPT-2-small widths)")


if args.device == "cuda":
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible (use --device cpu --tiny for the CPU path)")
    props = torch.cuda.get_device_properties(0)
    dev_name = props.name
    guess = args.gpu
    if guess is None:
        low = dev_name.lower()
        table = [("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb" if props.total_memory > 60 * GIB
                  else "a100-40gb"), ("l40s", "l40s"), ("4090", "rtx4090"), ("v100", "v100-32gb")]
        guess = next((p for k, p in table if k in low), "h100-80gb")
    # the real memory size, whatever the preset says
    gpu = presets.gpu_from_name(guess, memory_bytes=int(props.total_memory))
    hw = HardwareSpec(gpu=gpu, gpus_per_node=1, num_nodes=1)
    precision, impl = "bf16", "torch"  # torch fused AdamW: no JIT-built DeepSpeed ops needed
    small = llama("llama-150m", 12, 768, 12, 12, 2048)
    big = llama("llama-1.1b", 22, 2048, 32, 4, 5632)
    cases = [
        (small, TrainingSpec(seq_len=1024, global_batch_size=8, precision=precision),
         Strategy(zero_stage=0, micro_batch_size=8, precision=precision)),
        (big, TrainingSpec(seq_len=2048, global_batch_size=8, precision=precision),
         Strategy(zero_stage=2, micro_batch_size=4, checkpointing="full", precision=precision)),
        (big, TrainingSpec(seq_len=2048, global_batch_size=8, precision=precision),
         Strategy(zero_stage=3, micro_batch_size=8, checkpointing="selective", precision=precision)),
    ]
    warmup, measure = 2, 3
else:
    dev_name = "cpu"
    from autotune.config import load_config

    tiny_cfg = load_config(os.path.join(os.getcwd(), "examples", "tiny-cpu.yaml"))
    hw = tiny_cfg.hardware
    precision, impl = "fp32", "torch"
    model = tiny_cfg.model if args.tiny else llama("llama-20m", 4, 256, 4, 2, 688, 8000)
    tr = TrainingSpec(seq_len=64 if args.tiny else 256, global_batch_size=8, precision=precision)
    cases = [(model, tr, Strategy(zero_stage=1, micro_batch_size=4, precision=precision)),
             (model, tr, Strategy(zero_stage=3, micro_batch_size=8, checkpointing="full", precision=precision))]
    warmup, measure = 1, 2

out = args.out or tempfile.mkdtemp(prefix="autotune-gpu-check-")
print(f"gpu_check: {dev_name} (predictions for {hw.gpu.name}), results under {out}", flush=True)
rows = []
t_all = time.time()
for k, (model, training, strategy) in enumerate(cases):
    cfg = Config(path="gpu_check", model=model, training=training, hardware=hw, strategy=strategy,
                 profile=ProfileSection(backend="deepspeed", warmup_steps=warmup, measure_steps=measure,
                                        timeout_s=args.timeout, launcher="torchrun"))
    be = DeepSpeedBackend(cfg, os.path.join(out, f"case{k}"), device=args.device, optimizer_impl=impl)
    t0 = time.time()
    m = be.evaluate(strategy)
    x = m.extra
    rows.append((f"{model.name} s{training.seq_len}", strategy.describe(model.num_hidden_layers), m, x))
    print(f"  case {k}: {m.status} in {time.time() - t0:.0f} s{(' - ' + m.reason) if m.reason else ''}", flush=True)


UNIT, SCALE = ("MiB", float(1 << 20)) if args.device == "cpu" else ("GiB", GIB)


def g(v):
    return "-" if v is None else f"{v / SCALE:.2f}"


def pct(v):
    return "-" if v is None else f"{v:+.1f}%"


def num(v):
    return "-" if v is None else f"{v:,.0f}"


head = ("model", "strategy", f"pred {UNIT}", f"meas {UNIT}", "err", "pred tok/s", "meas tok/s", "err", "MFU", "status")
table = [head]
for name, strat, m, x in rows:
    table.append((name, strat, g(x.get("predicted_peak_bytes")), g(m.peak_memory_bytes), pct(x.get("memory_error_pct")),
                  num(x.get("predicted_tokens_per_s_per_gpu")), num(m.tokens_per_s_per_gpu), pct(x.get("tokens_error_pct")),
                  "-" if m.mfu is None else f"{100 * m.mfu:.1f}%", m.status))
widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
print()
for r in table:
    print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
print(f"\n(total {time.time() - t_all:.0f} s; per-GPU peak = max_memory_allocated on CUDA, profiler tensor peak on CPU;"
      " tokens/s per GPU from the median step)")
sys.exit(0 if all(m.ok for _, _, m, _ in rows) else 1)
PYEOF
