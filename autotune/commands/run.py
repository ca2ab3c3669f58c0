"""``autotune run CONFIG``: screen, search and write the run directory (front, trials, report)."""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
from typing import Any

from autotune.compare import DEFAULT_MAX_REGRESSION
from autotune.config import BACKENDS, SAMPLERS
from autotune.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="search the strategy space with Optuna and write the Pareto front",
                       description="Screen every candidate of the search space with the memory model, run a "
                       "multi-objective Optuna study (min peak memory, max tokens/s) over the survivors with the "
                       "profile backend, and write runs/<name>/ (study, trials.csv, front.json, ds_configs/, "
                       "best.json, summary.md).")
    p.add_argument("config", help="job file (YAML)")
    p.add_argument("--backend", metavar="{" + ",".join(BACKENDS) + "}",
                     help="how survivors are measured: simulate, profile (real training steps of either engine), "
                     "replay or script (your profile.command) (default: the config's profile.backend, else simulate)")
    p.add_argument("--trials", type=int, metavar="N",
                     help="candidates to evaluate with the backend (default: search.trials); pruned candidates and "
                     "repeats do not count")
    p.add_argument("--out", default="runs", metavar="DIR", help="parent folder of run directories (default: runs)")
    p.add_argument("--name", metavar="NAME", help="run name (default: config stem + UTC timestamp)")
    p.add_argument("--resume", action="store_true", help="continue the study of an existing run --name")
    p.add_argument("--storage", metavar="URL",
                     help="Optuna storage: an RDB URL (sqlite:///x.db, postgresql://...) or a journal file path "
                     "(default: runs/<name>/study.journal for simulate/replay, runs/<name>/study.db (SQLite, "
                     "with a trial heartbeat) for profile / deepspeed)")
    p.add_argument("--seed", type=int, metavar="N", help="sampler seed (default: search.seed)")
    p.add_argument("--sampler", choices=SAMPLERS,
                     help="Optuna sampler (default: search.sampler); sweep evaluates every candidate once")
    p.add_argument("--calibration", metavar="RUN_DIR",
                     help="start from the simulator parameters fitted by an earlier profiled run on the same "
                     "hardware (its calibration.json)")
    p.add_argument("--json", action="store_true", help="print front.json to stdout instead of the table")
    p.add_argument("--snapshot", type=int, metavar="TRIAL",
                     help="backend profile: the workers of trial number TRIAL record a CUDA memory snapshot "
                     "(runs/<name>/trials/TRIAL/memory_snapshot.pickle, also on OOM; open it in "
                     "https://pytorch.org/memory_viz); a no-op with a note on CPU")
    p.add_argument("--baseline", metavar="RUN_DIR|latest",
                     help="nightly retuning: re-measure this run's front first, then compare against it and exit "
                     "with compare's status (latest: <out>/latest-<config stem>)")
    p.add_argument("--max-regression", default=DEFAULT_MAX_REGRESSION, metavar="PCT",
                     help="with --baseline: tolerated loss of the recommended point's tokens/s (default: 5%%)")


def _load_numpy_single_threaded() -> None:
    """Load numpy (Optuna's and the memory grid's) with one OpenBLAS thread unless the caller chose a number:
    this process multiplies only small matrices, and OpenBLAS's idle worker threads spin on a core for a
    while after loading (docs/accuracy.md, "Run speed"). The environment is restored: launched processes
    (profiling workers) see the caller's."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


def _skip_collection_at_exit() -> None:
    """When this process exits, freeze what is alive (gc.freeze): the interpreter's shutdown collections then
    skip the run's ~10^5 objects (the screened candidates, the study), whose memory the OS takes back anyway
    (docs/accuracy.md, "Run speed"). Python does not promise to finalize objects alive at exit either."""
    atexit.unregister(gc.freeze)  # registered once, however many runs the process makes
    atexit.register(gc.freeze)


def run(args: argparse.Namespace) -> int:
    _load_numpy_single_threaded()
    _skip_collection_at_exit()
    from autotune import compare
    from autotune.commands._job import load_job
    from autotune.config import check_backend
    from autotune.output import assumed_routing_lines, config_dirs, measured_routing_lines, recommendation_lines
    from autotune.report import write_report
    from autotune.rundir import open_run

    if args.backend is not None:
        check_backend(args.backend, "--backend")
    cfg = load_job(args.config)
    if args.sampler:
        import dataclasses

        cfg = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, sampler=args.sampler))
    compare.parse_threshold(args.max_regression)  # a bad --max-regression fails before running
    baseline = compare.resolve_baseline(args.out, args.config, args.baseline)
    run = open_run(cfg, out=args.out, name=args.name, resume=args.resume, storage=args.storage,
                   backend=args.backend, seed=args.seed, trials=args.trials, calibration=args.calibration,
                   snapshot=args.snapshot)
    seeds = compare.baseline_seeds(baseline, cfg) if baseline and not args.resume else None
    resume_hint = f"autotune run {args.config} --name {run.name} --out {args.out} --resume --trials {run.trials}"
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
        print("\n" + "\n".join(recommendation_lines(front["best"], run.run_dir)
                                + measured_routing_lines(front.get("measured_routing"))
                                + assumed_routing_lines(front.get("assumed_routing"))))
        if front.get("front_confidence"):
            print(front["front_confidence"])
        configs = "".join(f"{d}/, " for d in config_dirs(front))
        print(f"\nfiles: {run.run_dir}/ (front.json, trials.csv, {configs}best.json, summary.md, "
              f"{'report.html, front.png, ' if report else ''}"
              f"{os.path.basename(run.storage_path) if run.storage_path else 'study in ' + run.storage_url})")
    if run.interrupted:
        print(f"interrupted: resume with  {resume_hint}", file=sys.stderr)
        return 130
    status = compare.baseline_compare(run.run_dir, baseline, args.max_regression, as_json=args.json) if baseline else 0
    compare.update_latest(args.out, run.run_dir, compare.config_stem(args.config), accepted=status == 0)
    return status
