#!/usr/bin/env bash
# Predicted vs measured memory and speed of real DeepSpeed steps, through autotune's profile backend.
#
#   benchmarks/gpu_check.sh                      # a CUDA host: 7 strategies, <= 8 minutes in total
#   benchmarks/gpu_check.sh --device cpu --tiny  # the dry run on a CPU (below)
#   options: --out DIR (the table's folder; default $OUT, else build/gpu_check), --gpus N (default 1),
#            --gpu PRESET (default: from the device name), --timeout S (per case), --budget S
#            (profiling time in all; later cases are skipped past it), --bundle DIR (default gpu_bundle/)
#
# Offline install: when gpu_bundle/ (filled by benchmarks/gpu_bundle.sh where pip works) is next to
# this script's repository, its wheels are installed with `pip install --no-index --no-deps
# --target build/gpu_site-cpXY` and put first on PYTHONPATH; nothing reaches for the network, and
# the host's own torch, transformers, numpy, ... are used as they are. Every requirement of the
# bundled packages and of the project is then checked against what is importable. Without the
# folder, the "profile" extra is pip-installed when DeepSpeed or Optuna is missing (network).
#
# The cases (ZeRO 0/1/2/3, ZeRO-3 with optimizer and parameter CPU offload, checkpointing none and
# full, gradient accumulation 1 and 4; a reference Llama decoder and one Hugging Face model) each
# run through autotune.backends.profiled (torchrun, worker in its own process group, killed
# after its timeout), so a failing case is a row with its status instead of the end of the script.
# The result is ONE file, DIR/gpu_check.md: predicted vs measured peak allocated and reserved
# memory, tokens/s per GPU and MFU, with the signed error of each (negative = under-predicted).
# Trial logs stay under build/gpu_check_work (--work DIR); the tails of failed cases' logs are
# copied into the table file.
#
# Dry run (--device cpu --tiny): builds a fresh virtualenv (build/gpu_dryrun/venv) holding only
# torch==2.13.0, installs the "#host:" packages of benchmarks/gpu_bundle.txt into it offline (the
# stand-in for a GPU host's own packages), then runs this script in it exactly as on a GPU host:
# offline install of a bundle built for this interpreter (gpu_bundle.sh --local, cached under
# build/gpu_dryrun/) and the same cases on a tiny model over gloo. Where `unshare -n` works (root),
# that part runs in a network namespace with nothing but loopback.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/benchmarks/gpu_check.sh"
LIST="$ROOT/benchmarks/gpu_bundle.txt"
PY="${PYTHON:-python3}"
cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1

DEVICE=cuda
TINY=0
BUNDLE=""
prev=""
for a in "$@"; do
    case "$prev" in
        --device) DEVICE="$a" ;;
        --bundle) BUNDLE="$a" ;;
    esac
    case "$a" in
        --tiny) TINY=1 ;;
        --device=*) DEVICE="${a#--device=}" ;;
        --bundle=*) BUNDLE="${a#--bundle=}" ;;
    esac
    prev="$a"
done
case "$DEVICE" in
    cuda|cpu) ;;
    *) echo "gpu_check: error: --device: expected cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac

# ------------------------------------------------------------------ the dry run's stand-in host
if [ "$DEVICE" = cpu ] && [ "$TINY" = 1 ] && [ -z "${AUTOTUNE_GPU_CHECK_INNER:-}" ]; then
    t0=$(date +%s)
    D="$ROOT/build/gpu_dryrun"
    tag="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    B="$D/bundle-$tag"
    if ! cmp -s "$LIST" "$B/gpu_bundle.txt"; then
        echo "gpu_check: dry run: filling $B for this interpreter (gpu_bundle.sh --local)" >&2
        PYTHON="$PY" "$ROOT/benchmarks/gpu_bundle.sh" --local --dest "$B" >&2
    fi
    echo "gpu_check: dry run: fresh virtualenv with only torch==2.13.0 ($D/venv)" >&2
    "$PY" -m venv --clear "$D/venv"
    VPY="$D/venv/bin/python"
    # (stands for the host's own torch: the one step of the dry run that may use an index)
    "$VPY" -m pip install -q torch==2.13.0 2> >(grep -v "is neither a file nor a directory" >&2)
    mapfile -t HOST < <(sed -n 's/^#host:[[:space:]]*\([^[:space:]]*\).*/\1/p' "$LIST" | grep -vx torch)
    echo "gpu_check: dry run: the host's own packages, offline: ${HOST[*]}" >&2
    PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL \
        "$VPY" -m pip install -q --no-index --find-links "$B/host" "${HOST[@]}"
    echo "gpu_check: dry run: setup took $(( $(date +%s) - t0 )) s; the check itself follows" >&2
    inner=(env AUTOTUNE_GPU_CHECK_INNER=1 PYTHON="$VPY" bash "$SELF" "$@" --bundle "$B")
    if command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
        echo "gpu_check: dry run: offline install and profiling in a network namespace (loopback only)" >&2
        exec unshare -n bash -c 'ip link set lo up && exec "$@"' gpu_check "${inner[@]}"
    fi
    echo "gpu_check: dry run: no network namespace here (unshare -n): offline by --no-index only" >&2
    exec "${inner[@]}"
fi

# ------------------------------------------------------------------ the host: GPU, then offline install
if [ "$DEVICE" = cuda ]; then
    if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
        echo "gpu_check: error: torch ($PY) sees no CUDA device (use --device cpu --tiny for the dry run)" >&2
        exit 2
    fi
fi
if [ -z "$BUNDLE" ] && [ -d "$ROOT/gpu_bundle" ]; then BUNDLE="$ROOT/gpu_bundle"; fi
if [ -n "$BUNDLE" ]; then
    BUNDLE="$(cd "$BUNDLE" && pwd)"
    tag="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    SITE="$ROOT/build/gpu_site-$tag"
    other="$(ls "$BUNDLE" | grep -E -- '-cp3[0-9]+-cp3' | grep -v -- "-$tag-" | head -1 || true)"
    if [ -n "$other" ]; then
        pyv="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        echo "gpu_check: error: $BUNDLE holds wheels for another Python ($other); this is $pyv: rerun" \
             "benchmarks/gpu_bundle.sh --python-version $pyv" >&2
        exit 2
    fi
    stamp="$(cat "$LIST"; ls "$BUNDLE")"
    if [ ! -f "$SITE/.bundle-stamp" ] || [ "$(cat "$SITE/.bundle-stamp")" != "$stamp" ]; then
        echo "gpu_check: installing $(ls "$BUNDLE"/*.whl | wc -l) wheels from $BUNDLE offline into $SITE" >&2
        rm -rf "$SITE"
        # --no-index and no pip configuration: only the bundle's own files are read
        PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL \
            "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE" --target "$SITE" "$BUNDLE"/*.whl
        printf '%s' "$stamp" > "$SITE/.bundle-stamp"
    fi
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"  # ninja, for DeepSpeed's JIT ops should any be built
    # every pin present, every requirement of the bundle and of the project satisfied (one line each)
    "$PY" - "$LIST" "$ROOT/pyproject.toml" <<'PYEOF'
import importlib.metadata as md
import re
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # the host's pip always has it
    from pip._vendor.packaging.requirements import Requirement

list_path, pyproject = sys.argv[1], sys.argv[2]
pins = [ln.split("#", 1)[0].strip() for ln in open(list_path, encoding="utf-8")]
pins = [p for p in pins if p]
problems, reqs = [], []
for pin in pins:
    name, version = pin.split("==")
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        problems.append(f"{pin}: not installed from the bundle (rerun benchmarks/gpu_bundle.sh)")
        continue
    if dist.version != version:
        problems.append(f"{pin}: found {dist.version} (the bundle is stale: rerun benchmarks/gpu_bundle.sh)")
    reqs += [(name, r) for r in dist.requires or []]
try:
    import tomllib

    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    reqs += [("autotune", r) for r in project["dependencies"] + project["optional-dependencies"]["profile"]]
except ImportError:  # Python 3.10: the bundle's own requirements are still checked
    pass
for who, text in reqs:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        problems.append(f"{who} needs {text}: not installed (neither on this host nor in the bundle)")
        continue
    if req.specifier and not req.specifier.contains(re.sub(r"\+.*", "", have), prereleases=True):
        problems.append(f"{who} needs {text}: found {have}")
if problems:
    print(f"gpu_check: error: {list_path}: " + "; ".join(problems), file=sys.stderr)
    sys.exit(2)
print(f"gpu_check: bundle installed offline, {len(pins)} pins and every requirement satisfied", file=sys.stderr)
PYEOF
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$PY" -c "import torch, deepspeed, optuna, yaml" 2>/dev/null; then
        echo "gpu_check: no gpu_bundle/ here: installing the project with its profile extra (network)" >&2
        "$PY" -m pip install -q -e ".[profile]"
    fi
fi

exec "$PY" - "$@" <<'PYEOF'
import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from autotune import presets
from autotune.config import Config, ProfileSection, hf_config_fields, load_config
from autotune.memory import estimate_memory
from autotune.backends.profiled import DeepSpeedBackend
from autotune.simulate import simulate
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec
from autotune.strategy import Strategy
from autotune.engine_configs import gradient_accumulation_steps

GIB = float(1 << 30)
ROOT = Path.cwd()
ap = argparse.ArgumentParser(prog="gpu_check.sh")
ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
ap.add_argument("--tiny", action="store_true", help="tiny models (the CPU dry run)")
ap.add_argument("--gpu", default=None, help="GPU preset for the predictions (default: from the device name)")
ap.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) per case")
ap.add_argument("--out", default=None, help="folder of the table file (default: $OUT, else build/gpu_check)")
ap.add_argument("--work", default=None, help="folder of the trial logs (default: build/gpu_check_work)")
ap.add_argument("--timeout", type=float, default=None, help="per case (default 150 s on CUDA, 300 s on CPU)")
ap.add_argument("--budget", type=float, default=None, help="profiling seconds in all (default 420 CUDA, 900 CPU)")
ap.add_argument("--bundle", default=None, help="the wheel folder installed from (used by the shell part)")
args = ap.parse_args(sys.argv[1:])
cuda = args.device == "cuda"
timeout = args.timeout or (150.0 if cuda else 300.0)
budget = args.budget or (420.0 if cuda else 900.0)


def llama(name, L, d, heads, kv, ff, vocab=32000, source="gpu_check.sh (Llama-2 architecture)"):
    return ModelSpec(name=name, num_hidden_layers=L, hidden_size=d, num_attention_heads=heads,
                     num_key_value_heads=kv, intermediate_size=ff, vocab_size=vocab, max_position_embeddings=4096,
                     source=source)


import torch  # noqa: E402  (the host's; deepspeed is imported by the workers only)

DS_VERSION = importlib.metadata.version("deepspeed")

work = Path(args.work or ROOT / "build" / "gpu_check_work")
work.mkdir(parents=True, exist_ok=True)
run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=work))
if cuda:
    props = torch.cuda.get_device_properties(0)
    dev_name = f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / GIB:.0f} GiB)"
    guess = args.gpu
    if guess is None:
        low = props.name.lower()
        table = [("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb" if props.total_memory > 60 * GIB
                  else "a100-40gb"), ("l40s", "l40s"), ("4090", "rtx4090"), ("v100", "v100-32gb")]
        guess = next((p for k, p in table if k in low), "h100-80gb")
    gpu = presets.gpu_from_name(guess, memory_bytes=int(props.total_memory))  # the real memory size
    hw = HardwareSpec(gpu=gpu, gpus_per_node=args.gpus, num_nodes=1)
    precision = "bf16"
    small = llama("llama-150m", 12, 768, 12, 12, 2048)
    big = llama("llama-1.1b", 22, 2048, 32, 4, 5632, source="TinyLlama/TinyLlama-1.1B config.json shape")
    s_small, s_big = 1024, 2048
    # TinyLlama/TinyLlama_v1.1 config.json (the HF model; random weights, nothing downloaded)
    hf_json = {"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
               "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
               "max_position_embeddings": 2048, "hidden_act": "silu", "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False, "_name_or_path": "hf-tinyllama-1.1b"}
    mbs_big = 4
    warmup, measure = 2, 5
else:
    tiny_cfg = load_config(str(ROOT / "examples" / "tiny-cpu.yaml"))
    hw = dataclasses.replace(tiny_cfg.hardware, gpus_per_node=args.gpus)
    dev_name = f"cpu ({os.cpu_count()} cores), {args.gpus} gloo rank(s)"
    precision = "fp32"
    if args.tiny:
        small = big = tiny_cfg.model
        s_small = s_big = 64
        hf_json = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 512,
                   "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": False,
                   "_name_or_path": "hf-tiny-llama"}
    else:
        small = big = llama("llama-20m", 4, 256, 4, 2, 688, 8000)
        s_small = s_big = 256
        hf_json = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 8000,
                   "max_position_embeddings": 1024, "hidden_act": "silu", "tie_word_embeddings": False,
                   "_name_or_path": "hf-llama-20m"}
    mbs_big = 4
    warmup, measure = 1, 2
hf_path = run_dir / "hf_config.json"
hf_path.write_text(json.dumps(hf_json, indent=1))
hf_model = ModelSpec(**hf_config_fields(str(hf_path)))

dp = args.gpus


def case(model, seq, gas, hf=False, **strategy):
    st = Strategy(precision=precision, **strategy)
    tr = TrainingSpec(seq_len=seq, global_batch_size=st.micro_batch_size * gas * dp, precision=precision)
    return model, tr, st, hf


# the issue's list first: ZeRO 0/2/3, ZeRO-3 + CPU offload of optimizer and parameters,
# checkpointing none/full, gradient accumulation 1 and 4, one Hugging Face model
cases = [
    case(small, s_small, 1, zero_stage=0, micro_batch_size=8),
    case(big, s_big, 1, zero_stage=2, micro_batch_size=mbs_big, checkpointing="full"),
    case(big, s_big, 4, zero_stage=3, micro_batch_size=mbs_big // 2, checkpointing="full"),
    case(big, s_big, 1, zero_stage=3, micro_batch_size=mbs_big, checkpointing="full",
         offload_optimizer="cpu", offload_params="cpu"),
    case(hf_model, s_big, 1, hf=True, zero_stage=2, micro_batch_size=mbs_big, checkpointing="full"),
    case(small, s_small, 4, zero_stage=2, micro_batch_size=4),
    case(small, s_small, 1, zero_stage=1, micro_batch_size=8),
]

out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "build" / "gpu_check")
out_dir.mkdir(parents=True, exist_ok=True)
table_path = out_dir / "gpu_check.md"
print(f"gpu_check: {dev_name}; predictions for {hw.gpu.name}; torch {torch.__version__}, deepspeed "
      f"{DS_VERSION}; {len(cases)} cases, budget {budget:.0f} s; logs under {run_dir}", flush=True)


def pct(pred, meas):
    """Signed error of the prediction in percent (negative: under-predicted)."""
    if pred is None or not meas:
        return None
    return 100.0 * (pred / meas - 1.0)


rows = []
t_all = time.time()
longest = 0.0
for k, (model, training, strategy, hf) in enumerate(cases):
    gas = gradient_accumulation_steps(strategy, training, hw)
    label = f"{'HF ' if hf else ''}{model.name} s{training.seq_len}"
    desc = strategy.describe(model.num_hidden_layers) + f", GAS {gas}"
    mem = estimate_memory(model, training, hw, strategy)
    sim = simulate(model, training, hw, strategy)
    # reserved = allocated peak + allocator_slack (autotune/memory.py: overhead = cuda_context + slack*peak;
    # the CUDA context lies outside the caching allocator)
    pred = {"alloc": mem.gpu["peak"], "reserved": mem.gpu["peak"] + int(hw.allocator_slack * mem.gpu["peak"]),
            "tps": sim.tokens_per_s_per_gpu, "mfu": sim.mfu}
    left = budget - (time.time() - t_all)
    if left < max(30.0, 1.2 * longest):
        rows.append(dict(k=k, label=label, desc=desc, status="skipped", reason=f"time budget ({budget:.0f} s) spent",
                         pred=pred, meas={}, extra={}))
        print(f"  case {k}: skipped (budget)", flush=True)
        continue
    cfg = Config(path=str(hf_path if hf else "gpu_check"), model=model, training=training, hardware=hw,
                 strategy=strategy, hf_config=str(hf_path) if hf else None,
                 profile=ProfileSection(backend="profile", warmup_steps=warmup, measure_steps=measure,
                                        timeout_s=min(timeout, left), launcher="torchrun"))
    be = DeepSpeedBackend(cfg, str(run_dir / f"case{k}"), device=args.device, optimizer_impl="torch")
    t0 = time.time()
    m = be.evaluate(strategy)
    dt = time.time() - t0
    longest = max(longest, dt)
    x = m.extra
    mfu = m.mfu
    if mfu is None and m.ok:  # CPU: against the nominal peak of examples/tiny-cpu.yaml, as predicted
        mfu = m.tokens_per_s_per_gpu * model.flops_per_token(training.seq_len) / hw.gpu.peak_flops(precision)
    meas = {"alloc": m.peak_memory_bytes, "reserved": x.get("peak_reserved_bytes"),
            "tps": m.tokens_per_s_per_gpu, "mfu": mfu}
    rows.append(dict(k=k, label=label, desc=desc, status=m.status, reason=m.reason, pred=pred, meas=meas, extra=x,
                     seconds=dt))
    print(f"  case {k}: {label}, {desc}: {m.status} in {dt:.0f} s{(' - ' + m.reason) if m.reason else ''}", flush=True)

UNIT, SCALE = ("GiB", GIB) if cuda else ("MiB", float(1 << 20))


def mem(v):
    return "-" if v is None else f"{v / SCALE:.3f}"


def err(v):
    return "-" if v is None else f"{v:+.1f}%"


def num(v):
    return "-" if v is None else f"{v:,.0f}"


def frac(v):
    return "-" if v is None else f"{100 * v:.2f}%"


for r in rows:
    r["err"] = {q: pct(r["pred"].get(q), r["meas"].get(q)) for q in ("alloc", "reserved", "tps", "mfu")}


def worst(q):
    """Most negative signed error (the failure direction for memory), with its case."""
    have = [(r["err"][q], r["k"]) for r in rows if r["err"][q] is not None]
    return min(have) if have else None


lines = [f"# autotune GPU check: predicted vs measured ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})", "",
         f"- device: {dev_name}; predictions for `{hw.gpu.name}` ({hw.gpu.memory_bytes / GIB:.1f} GiB, "
         f"{hw.gpu.peak_flops(precision) / 1e12:g} TFLOP/s {precision})",
         f"- torch {torch.__version__}, deepspeed {DS_VERSION}, Python {sys.version.split()[0]}; "
         f"optimizer torch AdamW (fused), {warmup} warm-up + {measure} measured optimizer steps per case",
         f"- command: `benchmarks/gpu_check.sh {' '.join(sys.argv[1:])}`; profiling took {time.time() - t_all:.0f} s",
         f"- {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} cases ok"]
for q, what in (("alloc", "peak allocated"), ("reserved", "peak reserved"), ("tps", "tokens/s per GPU")):
    w = worst(q)
    lines.append(f"- worst {what} error: " + ("-" if w is None else f"{w[0]:+.1f}% (case {w[1]})"))
lines += ["", f"| # | model | strategy | status | alloc pred {UNIT} | alloc meas {UNIT} | alloc err "
          f"| reserved pred {UNIT} | reserved meas {UNIT} | reserved err | tok/s pred | tok/s meas | tok/s err "
          "| MFU pred | MFU meas | MFU err | peak phase | s |",
          "|" + "---|" * 18]
for r in rows:
    p, me, e = r["pred"], r["meas"], r["err"]
    lines.append("| " + " | ".join([
        str(r["k"]), r["label"], r["desc"], r["status"], mem(p["alloc"]), mem(me.get("alloc")), err(e["alloc"]),
        mem(p["reserved"]), mem(me.get("reserved")), err(e["reserved"]), num(p["tps"]), num(me.get("tps")),
        err(e["tps"]), frac(p["mfu"]), frac(me.get("mfu")), err(e["mfu"]), str(r["extra"].get("peak_phase") or "-"),
        f"{r.get('seconds', 0):.0f}"]) + " |")
lines += ["", "Signed error = predicted / measured - 1 (negative: under-predicted; for memory that is the failure "
          "direction). Measured allocated = the worst rank's torch.cuda.max_memory_allocated over the measured steps "
          "(on CPU: peak tensor bytes from torch.profiler); reserved = max_memory_reserved (none on CPU). Predicted "
          "reserved = allocated peak x (1 + allocator_slack); the CUDA context is outside both. tokens/s per GPU from "
          "the median measured step; MFU = tokens/s x 6N+12LdS FLOPs per token / the preset's dense peak "
          "(on CPU against the nominal peak of examples/tiny-cpu.yaml)."]
if not cuda:
    lines += ["", "On the CPU (the dry run) the figures only show that the path works: the profiler's memory tracking "
              "slows every step (so tokens/s and MFU mean little), and CPU offload moves states into the same memory "
              "that is measured (so the offload rows read far above the GPU-side prediction)."]
failed = [r for r in rows if r["status"] not in ("ok", "skipped")]
for r in failed:
    lines += ["", f"## case {r['k']}: {r['status']}: {r['reason']}", ""]
    log_dir = r["extra"].get("log_dir")
    for name in ("stderr.log", "stdout.log"):
        p = Path(log_dir or "", name)
        if log_dir and p.is_file():
            tail = p.read_text(errors="replace").splitlines()[-25:]
            lines += [f"{name} (last {len(tail)} lines):", "```", *tail, "```"]
table_path.write_text("\n".join(lines) + "\n")
print("\n".join(lines[lines.index("") + 1:]))
print(f"\ngpu_check: table written to {table_path}")
sys.exit(0 if all(r["status"] == "ok" for r in rows) else 1)
PYEOF
