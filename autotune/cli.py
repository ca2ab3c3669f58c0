"""Command line: ``autotune estimate | run | show | compare``. ``main(argv) -> int``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

from autotune import compare, worker_cmd
from autotune.errors import ConfigError
from autotune.strategy import CHECKPOINTINGS

GIB = float(1 << 30)


# ---------------------------------------------------------------- estimate

def _add_strategy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("strategy (overrides the config's strategy: section)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage: 0 (plain DP), 1, 2 or 3")
    g.add_argument("--micro-batch-size", type=int, metavar="N", help="sequences per GPU per forward/backward")
    g.add_argument("--checkpointing", choices=CHECKPOINTINGS,
                   help="activation checkpointing: none, selective (attention core recomputed), attention or mlp "
                        "(that module recomputed, the other kept), op (op-level selective, torchtitan's policy) "
                        "or full (whole block)")
    g.add_argument("--checkpoint-layers", type=int, metavar="N",
                   help="number of blocks checkpointed, 0..num_layers (default: all when checkpointing is on)")
    g.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"),
                   help="where optimizer states live (ZeRO >= 1)")
    g.add_argument("--offload-params", choices=("none", "cpu", "nvme"), help="where parameters live (ZeRO-3 only)")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="compute precision (fp16 = loss scaling)")


_FLAG_KEYS = ("zero_stage", "micro_batch_size", "checkpointing", "checkpoint_layers",
              "offload_optimizer", "offload_params", "precision")


def estimate_report(cfg: Any, strategy: Any, trace: bool = False) -> dict[str, Any]:
    """Everything ``autotune estimate --json`` prints, as one JSON-able dict."""
    from autotune.memory import estimate_memory
    from autotune.simulate import simulate
    from autotune.strategy import fsdp_equivalent, gradient_accumulation_steps, to_deepspeed_config

    provenance = None
    if trace:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConfigError("needs torch, from the profile extra: pip install torch==2.13.0 "
                              "-e '.[profile]'", path="--trace") from None
        from autotune.trace import traced_estimate

        mem, provenance = traced_estimate(cfg, strategy)
    else:
        mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy, headroom=cfg.search.headroom)
    sim = simulate(cfg.model, cfg.training, cfg.hardware, strategy)
    return {
        "config": cfg.path,
        "model": cfg.model.name,
        "num_parameters": cfg.model.num_parameters,
        "gpu": cfg.hardware.gpu.name,
        "num_gpus": cfg.hardware.num_gpus,
        "strategy": strategy.as_dict(),
        "strategy_text": strategy.describe(cfg.model.num_hidden_layers),
        "gradient_accumulation_steps": gradient_accumulation_steps(strategy, cfg.training, cfg.hardware),
        "gpu_memory_bytes": dict(mem.gpu),
        "gpu_total_bytes": mem.total_gpu_bytes,
        "gpu_capacity_bytes": cfg.hardware.gpu.memory_bytes,
        "gpu_usable_bytes": int(cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom)),
        "headroom": cfg.search.headroom,
        "peak_phase": mem.peak_phase,
        "peak_by_phase_bytes": dict(mem.phases),
        "cpu_memory_bytes": mem.cpu_bytes_per_node,
        "nvme_bytes": mem.nvme_bytes_per_node,
        "fits": mem.fits,
        "reasons": list(mem.reasons),
        "step_time_s": sim.step_time_s,
        "tokens_per_s_per_gpu": sim.tokens_per_s_per_gpu,
        "mfu": sim.mfu,
        "time_breakdown_s": dict(sim.breakdown),
        "calibrated": sim.calibrated,
        "fsdp": fsdp_equivalent(strategy, cfg.hardware),
        "deepspeed_config": to_deepspeed_config(strategy, cfg.model, cfg.training, cfg.hardware),
        "memory_fidelity": "traced" if trace else "analytic",
        **({"memory_provenance": provenance} if provenance else {}),
    }


def format_estimate(r: dict[str, Any]) -> str:
    """The breakdown as a table whose rows add up: the components at the peak sum to the peak
    allocated; the overhead on top of it gives the memory the GPU must hold, which is what the
    verdict compares with the usable capacity."""
    from autotune.memory import GPU_COMPONENTS

    mem = r["gpu_memory_bytes"]
    total = r["gpu_total_bytes"]
    unit, scale = ("GiB", GIB) if total >= GIB / 4 else ("MiB", GIB / 1024)
    lines = [
        f"{r['model']} ({r['num_parameters']:,} parameters) on {r['num_gpus']} x {r['gpu']}",
        f"strategy: {r['strategy_text']} (gradient accumulation {r['gradient_accumulation_steps']})",
        f"FSDP equivalent: {r['fsdp']['sharding_strategy']}",
        "",
        f"{'component (at the peak)':<30}{unit:>10}{'share':>9}",
    ]
    for key in GPU_COMPONENTS:
        if key != "overhead":
            lines.append(f"  {key.replace('_', ' '):<28}{mem[key] / scale:>10.2f}{100 * mem[key] / total:>8.1f}%")
    lines.append(f"{'= peak allocated':<30}{mem['peak'] / scale:>10.2f}{100 * mem['peak'] / total:>8.1f}%   "
                 f"(in {r['peak_phase']}; by phase: "
                 + ", ".join(f"{k} {v / scale:.2f}" for k, v in r["peak_by_phase_bytes"].items()) + ")")
    lines.append(f"{'+ context and allocator':<30}{mem['overhead'] / scale:>10.2f}{100 * mem['overhead'] / total:>8.1f}%")
    lines.append(f"{'= GPU memory needed':<30}{total / scale:>10.2f}")
    lines.append(f"{'usable of the GPU':<30}{r['gpu_usable_bytes'] / scale:>10.2f}   "
                 f"({r['gpu_capacity_bytes'] / scale:.2f} {unit} less {100 * r['headroom']:g}% headroom)")
    if r["cpu_memory_bytes"]:
        lines.append(f"{'CPU RAM / node':<18}{r['cpu_memory_bytes'] / scale:>10.2f}")
    if r["nvme_bytes"]:
        lines.append(f"{'NVMe / node':<18}{r['nvme_bytes'] / scale:>10.2f}")
    if r.get("memory_provenance"):
        prov = r["memory_provenance"]
        lines.append(f"memory sources: traced ({', '.join(prov.get('traced', {}))}); "
                     f"analytic ({', '.join(k for k in prov.get('analytic', {}) if k in GPU_COMPONENTS)})")
    lines.append("")
    lines.append("verdict: FITS" if r["fits"] else "verdict: DOES NOT FIT")
    lines.extend(f"  - {reason}" for reason in r["reasons"])
    lines.append("")
    cal = "" if r["calibrated"] else "  [uncalibrated GPU: datasheet defaults]"
    lines.append(f"step time {r['step_time_s']:.3f} s, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                 f"MFU {100 * r['mfu']:.1f}%{cal}")
    lines.append("  " + ", ".join(f"{k} {v:.3f} s" for k, v in r["time_breakdown_s"].items()))
    return "\n".join(lines)


def cmd_estimate(args: argparse.Namespace) -> int:
    from autotune.config import check_strategy, load_config

    cfg = load_config(args.config)
    overrides = {k: getattr(args, k) for k in _FLAG_KEYS if getattr(args, k) is not None}
    strategy = cfg.strategy.replace(**overrides)
    try:
        check_strategy(strategy, cfg.model, cfg.training, cfg.hardware)
    except ConfigError as err:
        flag = "--" + (err.path or "").replace("_", "-")
        raise ConfigError(err.message, file=args.config, path=flag if err.path in overrides else f"strategy.{err.path}")
    report = estimate_report(cfg, strategy, trace=args.trace)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_estimate(report))
    return 0


# ---------------------------------------------------------------- run

def cmd_run(args: argparse.Namespace) -> int:
    from autotune.config import load_config
    from autotune.report import write_report
    from autotune.rundir import open_run

    cfg = load_config(args.config)
    compare.parse_threshold(args.max_regression)  # a bad --max-regression fails before running
    baseline = compare.resolve_baseline(args.out, args.config, args.baseline)
    run = open_run(cfg, out=args.out, name=args.name, resume=args.resume, storage=args.storage,
                   backend=args.backend, seed=args.seed, trials=args.trials, calibration=args.calibration,
                   snapshot=args.snapshot)
    seeds = compare.baseline_seeds(baseline, cfg) if baseline and not args.resume else None
    resume_hint = f"autotune run {args.config} --name {run.name} --out {args.out} --resume"
    try:
        front = run.execute(progress=not args.json, enqueue=seeds)
    except ConfigError:
        run.discard()  # refused before the study started: leave nothing behind
        raise
    except KeyboardInterrupt as err:  # SIGTERM or a second Ctrl-C: the study is saved, the trial re-queued
        signum = getattr(err, "signum", 2)
        print(f"autotune: interrupted; finished trials are saved. Resume with  {resume_hint}", file=sys.stderr)
        return 128 + signum
    if not front["front"]:  # nothing usable: say why, exit 1, and leave the latest links alone
        from autotune.output import empty_front_reason

        write_report(run.run_dir, cfg)
        if args.json:
            print(json.dumps(front, indent=2))
        print(f"autotune: {empty_front_reason(front)} (run folder {run.run_dir})", file=sys.stderr)
        return 130 if run.interrupted else 1
    report = write_report(run.run_dir, cfg)
    if args.json:
        print(json.dumps(front, indent=2))
    else:
        from autotune.output import format_front

        print(format_front(front))
        print("\n" + "\n".join(compare.recommendation_lines(front["best"], run.run_dir)))
        if front.get("front_confidence"):
            print(front["front_confidence"])
        print(f"\nfiles: {run.run_dir}/ (front.json, trials.csv, ds_configs/, best.json, summary.md, "
              f"{'report.html, front.png, ' if report else ''}"
              f"{os.path.basename(run.storage_path) if run.storage_path else 'study in ' + run.storage_url})")
    if run.interrupted:
        print(f"interrupted: resume with  {resume_hint}", file=sys.stderr)
        return 130
    status = compare.baseline_compare(run.run_dir, baseline, args.max_regression, as_json=args.json) if baseline else 0
    compare.update_latest(args.out, run.run_dir, compare.config_stem(args.config), accepted=status == 0)
    return status


# ---------------------------------------------------------------- parser / main

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "estimate": cmd_estimate, "run": cmd_run, "show": compare.cmd_show, "compare": compare.cmd_compare,
    "worker": worker_cmd.cmd_worker}


def build_parser() -> argparse.ArgumentParser:
    from autotune import __version__

    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Simulation-based training-strategy autotuner: predicts per-GPU memory and step time of "
        "DeepSpeed strategies and searches for the memory/throughput Pareto front.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    est = sub.add_parser("estimate", help="memory breakdown, fit verdict and simulated speed of one strategy",
                         description="Print the per-GPU memory breakdown at the peak, the fits verdict "
                         "with reasons, the simulated step time, and the DeepSpeed config of one strategy.")
    est.add_argument("config", help="job file (YAML: model, training, hardware sections)")
    _add_strategy_flags(est)
    est.add_argument("--trace", action="store_true",
                     help="take activations from a FakeTensorMode trace of the real model on the CPU (allocates "
                     "nothing; needs torch) and combine them with the analytical model states and buffers")
    est.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    run = sub.add_parser("run", help="search the strategy space with Optuna and write the Pareto front",
                         description="Screen every candidate of the search space with the memory model, run a "
                         "multi-objective Optuna study (min peak memory, max tokens/s) over the survivors with the "
                         "profile backend, and write runs/<name>/ (study, trials.csv, front.json, ds_configs/, "
                         "best.json, summary.md).")
    run.add_argument("config", help="job file (YAML)")
    run.add_argument("--backend", choices=("simulate", "deepspeed", "replay"),
                     help="how survivors are measured (default: the config's profile.backend, else simulate)")
    run.add_argument("--trials", type=int, metavar="N",
                     help="candidates to evaluate with the backend (default: search.trials); pruned candidates and "
                     "repeats do not count")
    run.add_argument("--out", default="runs", metavar="DIR", help="parent folder of run directories (default: runs)")
    run.add_argument("--name", metavar="NAME", help="run name (default: config stem + UTC timestamp)")
    run.add_argument("--resume", action="store_true", help="continue the study of an existing run --name")
    run.add_argument("--storage", metavar="URL",
                     help="Optuna storage: an RDB URL (sqlite:///x.db, postgresql://...) or a journal file path "
                     "(default: runs/<name>/study.journal for simulate/replay, runs/<name>/study.db (SQLite, "
                     "with a trial heartbeat) for deepspeed)")
    run.add_argument("--seed", type=int, metavar="N", help="sampler seed (default: search.seed)")
    run.add_argument("--calibration", metavar="RUN_DIR",
                     help="start from the simulator parameters fitted by an earlier profiled run on the same "
                     "hardware (its calibration.json)")
    run.add_argument("--json", action="store_true", help="print front.json to stdout instead of the table")
    run.add_argument("--snapshot", type=int, metavar="TRIAL",
                     help="backend deepspeed: the workers of trial number TRIAL record a CUDA memory snapshot "
                     "(runs/<name>/trials/TRIAL/memory_snapshot.pickle, also on OOM; open it in "
                     "https://pytorch.org/memory_viz); a no-op with a note on CPU")
    run.add_argument("--baseline", metavar="RUN_DIR|latest",
                     help="nightly retuning: re-measure this run's front first, then compare against it and exit "
                     "with compare's status (latest: <out>/latest-<config stem>)")
    run.add_argument("--max-regression", default="5%", metavar="PCT",
                     help="with --baseline: tolerated loss of the recommended point's tokens/s (default: 5%%)")
    compare.add_parsers(sub)
    worker_cmd.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as err:
        print(f"autotune: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
