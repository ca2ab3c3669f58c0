"""Analytical peak memory vs real DeepSpeed training steps on the CPU accelerator.

    python benchmarks/memory_vs_deepspeed.py --json out.json     # full grid, 252 configs
    python benchmarks/memory_vs_deepspeed.py --quick             # 3 reference configs
    python benchmarks/memory_vs_deepspeed.py --spot              # 8 off-grid HF configs (GA 3, ...)
    python benchmarks/memory_vs_deepspeed.py --filter model=hf-phi3 --filter stage=3
    python benchmarks/memory_vs_deepspeed.py --reuse out.json    # re-predict stored measurements
    python benchmarks/memory_vs_deepspeed.py --long-context      # 33 rows of issue 24's knobs (long_context_grid)
    python benchmarks/memory_vs_deepspeed.py --moe               # the Mixtral / Qwen3-MoE / DeepSeek-V2 rows (moe_grid, docs/moe.md)
    python benchmarks/memory_vs_deepspeed.py --moe --filter expert_parallel_size=2 --text   # the EP rows on text

The grid: 10 Hugging Face families from their published config.json (tests/data/hf: llama, mistral,
qwen2, qwen3, gemma, gemma2, phi3, olmo2, gpt2 with its default dropout 0.1, gpt_neox), shrunk to CPU size
with the family's own switches kept, each under 8 strategies (ZeRO 0-3, 1 and 2 gloo ranks,
gradient accumulation 1/2/4, checkpointing none/full, bf16/fp32); plus 8 rows of autotune's
reference decoders (selective checkpointing, eager attention), 8 rows of module-level
checkpointing (attention / mlp), 6 of op-level checkpointing (op), 9 of selective checkpointing of
HF models (8 families, ZeRO 0/2/3 and fsdp2, one every 2nd block), 3 of every-k-th-block
checkpointing, 18 of the fsdp2 engine (1 and 2 ranks; resharding after forward or not, reduce
in fp32 or bf16; none/full/op/attention/mlp checkpointing) and 16 of ZeRO-1/2 on 2 ranks under
gradient accumulation 1/2/4/8, fp32 and bf16 (8 measured steps each), and 8 of the measured tables'
shapes (data/measured/tiny-gpt2-2rank-quiet, tiny-llama-engines-2rank-quiet: ZeRO-2/3 and FSDP2, 2
ranks, fp32/bf16, GA 4/8), 3 of DeepSpeed ZeRO-0 on the llama-sv shape (the checkpoint frame, the final
norm's backward), and 49 at long sequences (``LONG_ROWS``: seq 1024-4096 on three families shrunk to
h = 64, every ZeRO stage x none/full/op, 1 and 2 ranks, mbs 1-2, bf16/fp32; a 64-token vocabulary, where
the final norm's backward is the peak; Mistral's sliding window at and below the sequence; two rows at
seq 512/256), and 10 where eager attention's core backward is the peak (``CORE_ROWS``: Gemma-2 at seq
512-1024, the reference GPT-2 with attention dropout, gpt-oss), and 6 of Gemma-3's four-norm block
(``NORM_ROWS``), and 12 of sdpa's CPU math path (``MATH_ROWS``: attention dropout, 1 and 2 sequences), and 8 of
ZeRO-1's accumulation carry at a late backward peak (``CARRY_ROWS``). Every config runs
``autotune.worker.main`` in fresh processes (``python`` for 1 rank, ``torchrun
--nproc_per_node 2`` with gloo for 2) with a torch AdamW (fused, like DeepSpeed's FusedAdam)
passed to ``deepspeed.initialize``, the usual loop (``outputs = engine(**batch);
engine.backward(outputs.loss); engine.step()``), 2 warm-up and 2 measured optimizer steps (the EP rows 8, each
micro-step a new batch: memory_rows.EP_MEASURE; and a pilot run of each on other batches, PILOT_DATA_SEED, whose
measured routing the row is also predicted with, stated: a held-out measurement).

Measured: the peak tensor bytes from torch.profiler's allocation events (c10's tally made to count
every thread, ``autotune.worker.cpu_memory.track_all_threads``), the max over the measured optimizer
steps (all their micro-steps) and over ranks: what a job runs out of memory at. Predicted:
``estimate_memory(..., device="cpu").gpu["peak"]`` for the same model, strategy and data-parallel
size. Prints every row, then the rows again worst (most under-predicted) first, then the signed
error summary. Optimizer offload is not in the grid: on a CPU-only machine "GPU" and host memory
are one allocator, so the split cannot be measured here (tests/memory/test_memory.py checks placement
against DeepSpeed's source and estimators). The rows themselves are in benchmarks/memory_rows.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.memory import estimate_memory  # noqa: E402
from autotune.memory.expert_parallel import measured_routing  # noqa: E402
from autotune.presets import gpu_from_name  # noqa: E402
from autotune.spec import HardwareSpec, ModelSpec, TrainingSpec  # noqa: E402
from autotune.strategy import Strategy  # noqa: E402

from memory_rows import (  # noqa: E402  (the rows; the tests read them through this module)
    HF_FAMILIES, LONG_CONTEXT_KNOBS, LONG_FAMILIES, MODELS, ROW_KEYS, SPOT_ROWS, _hf_path, grid, hf_config, hf_grid,
    long_context_grid, moe_grid, row_key,
)


def row_strategy(row: dict) -> Strategy:
    """The strategy a row names: ``stage`` a ZeRO stage or an fsdp2 variant, ``ckpt`` a granularity
    or ``granularity/k`` (every k-th block)."""
    granularity, _, every = str(row["ckpt"]).partition("/")
    common = dict(micro_batch_size=row["mbs"], checkpointing=granularity, precision=row["precision"],
                  checkpoint_every=int(every) if every else None, **row.get("knobs", {}))
    stage = row["stage"]
    if isinstance(stage, str):
        return Strategy(engine="fsdp2", reshard_after_forward=stage != "fsdp2-keep",
                        reduce_dtype="bf16" if stage == "fsdp2-rbf16" else "fp32", **common)
    return Strategy(zero_stage=stage, **common)


def specs(row: dict, workdir: Path | None = None) -> tuple[ModelSpec, TrainingSpec, HardwareSpec, Strategy]:
    if row["model"] in HF_FAMILIES or row["model"] in LONG_FAMILIES:
        from autotune.config import hf_config_fields

        model = ModelSpec(**hf_config_fields(_hf_path(row["model"], workdir or Path(tempfile.gettempdir()))))
    else:
        model = ModelSpec(**MODELS[row["model"]])
    split = int(row.get("knobs", {}).get("sequence_parallel_size", 1)) * int(
        row.get("knobs", {}).get("context_parallel_size", 1))  # ranks sharing a sequence (1 without knobs)
    training = TrainingSpec(seq_len=row["seq"], global_batch_size=row["mbs"] * row["nproc"] * row.get("ga", 1) // split,
                            precision=row["precision"])
    hardware = HardwareSpec(gpu=gpu_from_name("h100-80gb"), gpus_per_node=row["nproc"], num_nodes=1)
    return model, training, hardware, row_strategy(row)


PILOT_DATA_SEED = 1
"""The batches' seed (the worker's ``data_seed``) of an expert-parallel row's pilot: the same model on other
batches, whose routing the row states (a held-out measurement, as a job states what it measured before)."""


def _launch(row: dict, job: dict, d: Path, timeout: float) -> tuple[dict | None, dict]:
    """Run the worker on ``job`` in ``d`` (1 rank: python; more: torchrun over gloo): rank 0's result, or None
    and the row's status and reason (a timeout, a crash without a result)."""
    (d / "job.json").write_text(json.dumps(dict(job, result_path=str(d / "result.json"))))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # expert parallelism: the worker that records the dispatch's received rows
    ep = job["strategy"].get("expert_parallel_size", 1) > 1
    worker = [str(ROOT / "benchmarks" / "ep_rows_worker.py")] if ep else ["-m", "autotune.worker.main"]
    if row["nproc"] == 1:
        cmd = [sys.executable, *worker, str(d / "job.json")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(row["nproc"]),
               "--master_port", str(29500 + (hash(str(d)) % 2000)), *worker, str(d / "job.json")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # one stuck config does not end the run (the others are kept)
        return None, dict(status="timeout", reason=f"no result after {timeout:.0f} s")
    try:
        return json.loads((d / "result.json").read_text()), {}
    except FileNotFoundError:
        return None, dict(status="crash", reason=(proc.stderr or "")[-500:])


def _routing_steps(d: Path) -> list:
    """Every measured micro-step's dispatch splits (rows per source rank and local expert, forward order), all
    ranks: the worker's own record (autotune.worker.routing), as the profile backend reads it."""
    return [st for f in [d / "result.json", *sorted(d.glob("result.rank*.json"))]
            for st in (json.loads(f.read_text()).get("routing") or {}).get("steps", [])]


_TEXT_LOCK = threading.Lock()


def text_tokens(vocab: int, workdir: Path) -> str:
    """A .npy of this repository's text at trained_routing.CORPUS_REV (every domain's held-out files, as that
    benchmark's byte-level BPE tokenizer of ``vocab`` ids trained on the rest encodes them), made once per
    vocabulary in ``workdir``: the rows' profile.tokens under ``--text``."""
    import numpy as np

    path = workdir / f"text-{vocab}.npy"
    with _TEXT_LOCK:
        if not path.exists():
            from trained_routing import corpus, tokenized

            _, held, _ = tokenized(*corpus(), vocab)
            np.save(path, np.array([i for d in sorted(held) for i in held[d]], dtype=np.int32))
    return str(path)


def run_row(row: dict, workdir: Path, timeout: float = 900) -> dict:
    model, training, hardware, strategy = specs(row, workdir)
    d = Path(tempfile.mkdtemp(prefix="mem_", dir=workdir))
    job = {"model": dataclasses.asdict(model), "training": {"seq_len": training.seq_len,
                                                       "global_batch_size": training.global_batch_size,
                                                       "precision": training.precision},
           "strategy": strategy.as_dict(), "warmup_steps": 2, "measure_steps": row.get("measure_steps", 2), "device": "cpu",
           "fresh_batches": bool(row.get("fresh_batches"))}
    if row["model"] in HF_FAMILIES or row["model"] in LONG_FAMILIES:
        job["hf_config"] = _hf_path(row["model"], workdir)
    if row.get("tokens") == "text":
        job["tokens"] = text_tokens(model.vocab_size, workdir)
    ep = strategy.expert_parallel_size > 1
    t0 = time.time()
    out = dict(row)
    res, failed = _launch(row, job, d, timeout)
    if res is None:
        out.update(failed)
        return out
    out["wall_s"] = round(time.time() - t0, 1)
    out["status"] = res["status"]
    if res["status"] != "ok":
        out["reason"] = res.get("reason")
        return out
    ranks = res.get("all_ranks") or {}
    peaks = ranks.get("peak_allocated_bytes") or [res["peak_allocated_bytes"]]
    mins = ranks.get("min_step_peak_bytes") or [res.get("min_step_peak_bytes") or res["peak_allocated_bytes"]]
    # what a job OOMs at: the max over the measured optimizer steps (every micro-step) and ranks;
    # the smallest step peak is kept to show the spread
    k = peaks.index(max(peaks))
    out.update(measured=max(peaks), measured_min=min(mins), measured_phase=ranks.get("peak_phase", [res["peak_phase"]])[k],
               phases_measured=(ranks.get("phase_peaks_bytes") or [res["phase_peaks_bytes"]])[k],
               per_rank_peaks=peaks, optimizer=res["optimizer"], gas=res["gradient_accumulation_steps"],
               loop=res.get("loop"))
    if res.get("host_offload_peak_bytes") is not None:  # activation offload: rank 0's host bytes (not in the peak)
        out["host_offload_measured"] = res["host_offload_peak_bytes"]
    if ep:  # the busiest rank's dispatch: the largest output of an all-to-all fed tokens x top-k rows
        sent = row["mbs"] * row["seq"] * model.num_experts_per_tok
        out["received_rows"] = max(json.loads(f.read_text()).get(str(sent), 0) for f in d.glob("received_rows.*.json"))
        out["routing_steps"] = _routing_steps(d)
        pilot = Path(tempfile.mkdtemp(prefix="pilot_", dir=workdir))
        if _launch(row, dict(job, data_seed=PILOT_DATA_SEED), pilot, timeout)[0] is not None:
            out["pilot_routing_steps"] = _routing_steps(pilot)
    return predict(out, workdir)


def predict(out: dict, workdir: Path) -> dict:
    """Add the memory model's prediction for a measured row (``device="cpu"``, the usual loop)."""
    model, training, hardware, strategy = specs(out, workdir)
    est = estimate_memory(model, training, hardware, strategy, device="cpu")
    out["dropout"] = bool(model.hidden_dropout or model.attention_dropout)
    out.update(predicted=est.gpu["peak"], predicted_phase=est.peak_phase, phases_predicted=est.phases)
    if out.get("knobs"):  # the long-context rows: the host RAM side too (activation offload's copies)
        out["host_predicted_per_node"] = est.cpu_bytes_per_node
    out["error"] = (out["predicted"] - out["measured"]) / out["measured"]
    if out.get("received_rows"):  # expert parallelism: also at the measured routing (the mechanism's error)
        mean = out["mbs"] * out["seq"] * model.num_experts_per_tok
        # the busiest dispatch of the measured micro-steps (received_rows also saw the warm-up steps)
        busiest = max((sum(d) for st in out.get("routing_steps") or [] for d in st), default=out["received_rows"])
        out["imbalance_measured"] = busiest / mean
        # each micro-step at its routing: its dispatches' mean rows (the blocks' saves are affine in the rows, so
        # L blocks at the mean keep what the L blocks keep) and each dispatch's own chunk loop; else the bound
        out["predicted_routing"] = max(
            (_at_routing(sum(map(sum, st)) / len(st) / mean, model, training, hardware, strategy, st)
             for st in out.get("routing_steps") or [] if st),
            default=_at_routing(out["imbalance_measured"], model, training, hardware, strategy))
        out["error_routing"] = (out["predicted_routing"] - out["measured"]) / out["measured"]
        # every block at its micro-step's busiest dispatch: a block's recomputation (a checkpointed row's peak)
        # is sized at its own rows, never fewer; a bound at the measured routing (the mean can be under)
        out["predicted_routing_busiest"] = max(
            (_at_routing(max(map(sum, st)) / mean, model, training, hardware, strategy, st)
             for st in out.get("routing_steps") or [] if st), default=out["predicted_routing"])
        out["error_routing_busiest"] = (out["predicted_routing_busiest"] - out["measured"]) / out["measured"]
        # the stated factors a user who measured this routing would give (what the profile backend records for an
        # expert-parallel trial: memory.expert_parallel.measured_routing)
        stated = measured_routing(model, mean, out.get("routing_steps") or [])
        if stated is not None:
            (out["expert_imbalance_measured"], out["expert_least_measured"], out["imbalance_measured"],
             out["step_imbalance_measured"]) = stated
            out["predicted_stated"] = _stated(stated, model, training, hardware, strategy)
            out["error_stated"] = (out["predicted_stated"] - out["measured"]) / out["measured"]
        # the factors measured on the pilot (the same model on other batches: PILOT_DATA_SEED) stated
        pilot = measured_routing(model, mean, out.get("pilot_routing_steps") or [])
        if pilot is not None:
            out["pilot_factors"] = list(pilot)
            out["predicted_pilot"] = _stated(pilot, model, training, hardware, strategy)
            out["error_pilot"] = (out["predicted_pilot"] - out["measured"]) / out["measured"]
    return out


def _stated(factors: Any, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec, strategy: Strategy) -> int:
    """The peak predicted with ``factors`` (a MeasuredRouting) stated in the model, as a job states them."""
    return estimate_memory(model.replace(**factors._asdict()), training, hardware, strategy, device="cpu").gpu["peak"]


def _at_routing(imbalance: float, model: ModelSpec, training: TrainingSpec, hardware: HardwareSpec,
                strategy: Strategy, splits: list | None = None) -> int:
    """The peak predicted with ``imbalance`` (a measured step's busiest rank's received rows over the
    mean) as the model's ``ep_rank_imbalance`` and, when given, a micro-step's dispatch splits (``splits``,
    forward order; backward runs them last first) in place of the bound over every split:
    memory.expert_parallel.chunk_rows swapped for the call (the analytical model never knows the
    routing), the activations' cache cleared before and after."""
    from autotune.memory import activations, expert_parallel

    chunks = expert_parallel.chunk_rows
    if splits:
        expert_parallel.chunk_rows = lambda m, tokens, ep: tuple(tuple(reversed(c)) for c in splits)
    activations._breakdown.cache_clear()
    try:
        return estimate_memory(model.replace(ep_rank_imbalance=imbalance), training, hardware, strategy,
                               device="cpu").gpu["peak"]
    finally:
        expert_parallel.chunk_rows = chunks
        activations._breakdown.cache_clear()




def knob_text(knobs: dict) -> str:
    """A row's long-context and expert-parallel knobs in short: sp2, cp2, ep2, tl, tm, ao."""
    parts = [f"{n}{knobs[k]}" for n, k in (("sp", "sequence_parallel_size"), ("cp", "context_parallel_size"),
                                           ("ep", "expert_parallel_size")) if knobs.get(k, 1) > 1]
    parts += [n for n, k in (("tl", "tiled_loss"), ("tm", "tiled_mlp")) if knobs.get(k)]
    return "+".join(parts + (["ao"] if knobs.get("activation_offload", "none") != "none" else []))


def summarize(results: list[dict]) -> list[str]:
    """Signed-error summary lines, worst case first (under-prediction is the failure direction)."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return ["no config measured"]
    errs = [r["error"] for r in ok]
    worst_under = min(ok, key=lambda r: r["error"])
    worst_abs = max(ok, key=lambda r: abs(r["error"]))

    def name(r: dict) -> str:
        engine = r["stage"] if isinstance(r["stage"], str) else f"ZeRO-{r['stage']}"
        return (f"{r['model']} {engine} {r['nproc']} rank(s) GA {r.get('ga', 1)} mbs {r['mbs']} seq {r['seq']} "
                f"{r['ckpt']} {r['precision']}" + (f" {knob_text(r['knobs'])}" if r.get("knobs") else ""))

    lines = [f"configs: {len(results)} run, {len(ok)} ok, {len({(HF_FAMILIES.get(r['model']) or LONG_FAMILIES[r['model']])[0] for r in ok if r['model'] in HF_FAMILIES or r['model'] in LONG_FAMILIES})} "
             f"HF families",
             f"worst under-prediction: {100 * worst_under['error']:+.2f}% ({name(worst_under)})",
             f"worst |error|: {100 * worst_abs['error']:+.2f}% ({name(worst_abs)})",
             f"|error| median {100 * statistics.median(abs(e) for e in errs):.2f}%  max {100 * max(abs(e) for e in errs):.2f}%"
             f"  signed min {100 * min(errs):+.2f}% max {100 * max(errs):+.2f}%  under-predicted by > 2%: "
             f"{sum(e < -0.02 for e in errs)}  (targets: median <= 1%, max <= 3%, none under -2%)"]
    groups = {
        "HF families": [r for r in ok if r["model"] in HF_FAMILIES or r["model"] in LONG_FAMILIES],
        "reference decoders": [r for r in ok if r["model"] not in HF_FAMILIES and r["model"] not in LONG_FAMILIES],
        "seq >= 1024": [r for r in ok if r["seq"] >= 1024],
        "1 rank": [r for r in ok if r["nproc"] == 1],
        "2 ranks": [r for r in ok if r["nproc"] > 1],
        **{f"ZeRO-{z}": [r for r in ok if r["stage"] == z] for z in range(4)},
        "fsdp2": [r for r in ok if isinstance(r["stage"], str)],
        "every k-th block": [r for r in ok if "/" in str(r["ckpt"])],
        **{f"GA {g}": [r for r in ok if r.get("ga", 1) == g] for g in (1, 2, 4, 8)},
        "dropout on": [r for r in ok if r.get("dropout")],
        **{f"long context {n}": [r for r in ok if n in knob_text(r.get("knobs") or {}).split("+")]
           for n in ("sp2", "tl", "tm", "ao")},
        "expert parallel": [r for r in ok if (r.get("knobs") or {}).get("expert_parallel_size", 1) > 1],
    }
    errors = {gname: [r["error"] for r in rs] for gname, rs in groups.items()}
    # the EP rows again with the routing their steps measured stated, as a profiled EP trial states it
    # (memory.expert_parallel.measured_routing; docs/moe.md, Measuring the routing)
    errors["EP, routing stated"] = [r["error_stated"] for r in groups["expert parallel"] if r.get("error_stated") is not None]
    # and with the routing their pilots measured (other batches) stated: a held-out measurement
    errors["EP, pilot stated"] = [r["error_pilot"] for r in groups["expert parallel"] if r.get("error_pilot") is not None]
    for gname, e in errors.items():
        if e:
            lines.append(f"  {gname:<20} n={len(e):<3} worst {100 * min(e):+.2f}%  median |err| "
                         f"{100 * statistics.median(abs(x) for x in e):.2f}%  max |err| {100 * max(abs(x) for x in e):.2f}%")
    return lines


def by_phase(results: list[dict]) -> list[str]:
    """Each phase's signed error (predicted phase peak / measured - 1, the step's worst rank), worst first: over
    every row, without the EP rows (sized at the default load factors), and the forward phase by checkpointing
    (a checkpointed block's forward interior is not modelled: docs/accuracy.md, By phase)."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("phases_measured") and r.get("phases_predicted")]
    lines = ["by phase (predicted phase peak / measured - 1):"]
    for phase in ("forward", "backward", "optimizer"):
        rows = [r for r in ok if r["phases_measured"].get(phase) and r["phases_predicted"].get(phase) is not None]
        groups = {"all": rows,
                  "without EP": [r for r in rows if (r.get("knobs") or {}).get("expert_parallel_size", 1) == 1]}
        if phase == "forward":
            groups.update({"no checkpointing": [r for r in groups["without EP"] if r["ckpt"] == "none"],
                           "checkpointing": [r for r in groups["without EP"] if r["ckpt"] != "none"]})
        for gname, rs in groups.items():
            if not rs:
                continue
            e = sorted(((r["phases_predicted"][phase] / r["phases_measured"][phase] - 1, r) for r in rs), key=lambda x: x[0])
            worst, top = e[0], e[-1]
            lines.append(f"  {phase:<9} {gname:<16} n={len(e):<3} {100 * worst[0]:+.2f}% .. {100 * top[0]:+.2f}%  "
                         f"median |err| {100 * statistics.median(abs(x) for x, _ in e):.2f}%  "
                         f"(worst {worst[1]['model']} {worst[1]['stage']} {worst[1]['ckpt']} {worst[1]['precision']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few reference configs instead of the full grid")
    ap.add_argument("--spot", action="store_true", help="8 off-grid HF configs (GA 3, other shapes) instead of the grid")
    ap.add_argument("--long-context", action="store_true",
                    help="the long-context knob rows (long_context_grid: Ulysses, tiled loss / MLP, activation "
                         "offload) instead of the grid")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts rows (moe_grid) instead of the grid")
    ap.add_argument("--text", action="store_true",
                    help="the rows train on this repository's text (text_tokens: BPE ids at the model's vocabulary) "
                         "instead of uniform random ids; a row's key then carries tokens=text")
    ap.add_argument("--json", help="write all rows (measured, predicted, per-phase) to this file")
    ap.add_argument("--filter", action="append", default=[], help="KEY=VALUE on grid rows, e.g. stage=3 or stage=fsdp2,fsdp2-keep or "
                                                                  "expert_parallel_size=2 (a knob)")
    ap.add_argument("--jobs", type=int, default=2, help="configs run this many at a time")
    ap.add_argument("--reuse", action="append", default=[],
                    help="a --json file of an earlier run: its measured rows are not run again, only "
                         "predicted again with the current model (later files win)")
    ap.add_argument("--by-phase", action="store_true",
                    help="also each phase's peak (estimate's peak_by_phase_bytes) against the largest total measured "
                         "inside that phase's calls (the worst rank's)")
    ap.add_argument("--no-run", action="store_true",
                    help="with --reuse: report the stored measurements only, run nothing new")
    args = ap.parse_args(argv)
    rows = grid(args.quick)
    if args.spot:
        rows = [dict(zip(ROW_KEYS, r)) for r in SPOT_ROWS]
    elif args.long_context:
        rows = long_context_grid()
    elif args.moe:
        rows = moe_grid()
    elif not args.quick and importlib.util.find_spec("transformers") is not None:
        rows += hf_grid()
    if args.text:
        rows = [dict(r, tokens="text") for r in rows]
    for f in args.filter:
        k, v = f.split("=", 1)
        # VALUE: one, or alternatives a,b; KEY a row's key or one of its knobs (expert_parallel_size=2)
        rows = [r for r in rows if str(r.get(k, (r.get("knobs") or {}).get(k))) in v.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="autotune_membench_"))
    print(f"{len(rows)} configs; work dir {workdir}", flush=True)
    header = (f"{'model':<15}{'engine':>11}{'np':>3}{'GA':>3}{'mbs':>4}{'seq':>5} {'ckpt':<10}{'prec':<5}{'measured MiB':>13}"
              f"{'predicted MiB':>14}{'err %':>8}  phase(meas/pred)")
    print(header, flush=True)
    results: list[dict] = []

    def row_text(r: dict) -> str:
        head = (f"{r['model']:<15}{str(r['stage']):>11}{r['nproc']:>3}{r.get('ga', 1):>3}{r['mbs']:>4}{r['seq']:>5} "
                f"{r['ckpt']:<10}{r['precision']:<5}")
        if r.get("knobs"):
            head += f"[{knob_text(r['knobs'])}] "
        if r.get("tokens"):
            head += f"<{r['tokens']}> "
        if r.get("status") != "ok":
            return head + f"  {r.get('status')}: {str(r.get('reason'))[:200]}"
        routing = (f"  at the measured routing (imbalance {r['imbalance_measured']:.3f}): {100 * r['error_routing']:+.2f}%"
                   f" (blocks at the busiest dispatch {100 * r['error_routing_busiest']:+.2f}%)"
                   if r.get("error_routing") is not None else "")
        if r.get("error_stated") is not None:
            routing += (f"; stated factors {r['expert_imbalance_measured']:.3f} / {r.get('expert_least_measured', 0):.3f}"
                        f" / {r['imbalance_measured']:.3f} / {r.get('step_imbalance_measured', 0):.3f}: "
                        f"{100 * r['error_stated']:+.2f}%")
        if r.get("error_pilot") is not None:
            routing += (f"; the pilot's ({' / '.join(f'{x:.3f}' for x in r['pilot_factors'])}): "
                        f"{100 * r['error_pilot']:+.2f}%")
        return (head + f"{r['measured'] / 2**20:>13.2f}{r['predicted'] / 2**20:>14.2f}{100 * r['error']:>+8.2f}"
                f"  {r['measured_phase']}/{r['predicted_phase']}" + routing)

    stored: dict[tuple, dict] = {}
    for path in args.reuse:
        for r in json.loads(Path(path).read_text()):
            if r.get("status") == "ok":
                stored[row_key(r)] = r
    todo = [] if args.no_run else [r for r in rows if row_key(r) not in stored]
    for row in rows:
        key = row_key(row)
        if key in stored:
            r = predict(dict(stored[key]), workdir)
            results.append(r)
            print(row_text(r) + "  (reused measurement)", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for r in pool.map(lambda row: run_row(row, workdir), todo):
            results.append(r)
            print(row_text(r), flush=True)
            if args.json:  # written as rows arrive: an interrupted run keeps what it measured (--reuse)
                Path(args.json).write_text(json.dumps(results, indent=1))
    print("\nworst first (signed error = predicted / measured - 1; measured = max over the measured optimizer "
          "steps (2; EP rows 8), every micro-step, and over ranks):")
    for r in sorted(results, key=lambda r: r.get("error", -9)):
        print(row_text(r))
    print()
    if len(results) < len(rows):
        print(f"{len(rows) - len(results)} of the {len(rows)} grid configs not measured (--no-run)")
    for line in summarize(results) + (by_phase(results) if args.by_phase else []):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = [r for r in results if r.get("status") == "ok"]
    return 0 if ok and len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
