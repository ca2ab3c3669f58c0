"""Golden comparison: what `autotune estimate --json` and `autotune run --backend simulate` produce, so a
refactor can show that behaviour did not change.

    python benchmarks/golden.py record /tmp/golden.json     # record at one commit
    python benchmarks/golden.py check /tmp/golden.json      # re-run at another commit and compare
    python benchmarks/golden.py diff A.json B.json          # compare two recordings
    python benchmarks/golden.py check OLD.json --ignore-knobs engine,sharding  # knobs added since OLD

Recorded per examples/*.yaml:
- estimates: 250 deterministically sampled strategies (seeded by the example's name) from the union of
  the example's own search space, the default space at the job's precision and the raw product of
  every knob's values: 225 valid ones and 25 invalid ones (their one-line error is recorded). Each goes
  through the code the CLI runs (check_strategy + estimate_report, json and text), and 20 of them
  also through the CLI itself (`main(["estimate", ..., "--json"])`).
- ``autotune [COMMAND] --help`` of every command.
- ``autotune run TABLE --backend replay`` of every data/measured/*/config.yaml (the profiling loop:
  calibrator, ehvi sampler, stopping rule), files as for the simulated runs.
- the run: `autotune run EXAMPLE --backend simulate --seed 0` in a fresh folder: front.json,
  best.json, best_ds_config.json, ds_configs/, trials.csv, summary.md and the printed front, with
  run-specific fields (folder paths, run name, timestamps, wall times) replaced by placeholders.

Works on old and new layouts (estimate_report in autotune.cli or autotune.commands.estimate), so
the same script can record at any commit: run it with PYTHONPATH pointing at that tree.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import io
import itertools
import json
import os
import random
import re
import sys
import tempfile
from typing import Any

PER_EXAMPLE = 250
CLI_PER_EXAMPLE = 20
REFUSED_PER_EXAMPLE = 25


def _estimate_api() -> tuple[Any, Any]:
    try:
        from autotune.commands.estimate import estimate_report, format_estimate
    except ImportError:
        from autotune.cli import estimate_report, format_estimate
    return estimate_report, format_estimate


def _pool(cfg: Any) -> list[Any]:
    from autotune.space import load_space, space_for
    from autotune.strategy import Strategy

    model = cfg.model
    seen: dict[str, Any] = {}
    spaces = [space_for(cfg), load_space("default", precision=cfg.training.precision)]
    for space in spaces:
        for s in space.candidates(model):
            seen.setdefault(repr(s), s)
    layers = model.num_hidden_layers
    from autotune.strategy import CHECKPOINTINGS

    raw = itertools.product((0, 1, 2, 3), (1, 2, 3, 4, 8, 16), CHECKPOINTINGS,
                            (None, 0, max(1, layers // 2), layers, layers + 1), ("none", "cpu", "nvme"),
                            ("none", "cpu", "nvme"), ("bf16", "fp16", "fp32"))
    for z, mbs, ck, n, oo, op, prec in raw:
        s = Strategy(zero_stage=z, micro_batch_size=mbs, checkpointing=ck, checkpoint_layers=n,
                     offload_optimizer=oo, offload_params=op, precision=prec)
        seen.setdefault(repr(s), s)
    return [seen[k] for k in sorted(seen)]


def _flags(strategy: Any) -> list[str]:
    out = []
    for key in ("zero_stage", "micro_batch_size", "checkpointing", "checkpoint_layers", "offload_optimizer",
                "offload_params", "precision"):
        value = getattr(strategy, key)
        if value is not None:
            out += ["--" + key.replace("_", "-"), str(value)]
    return out


def _estimates(example: str) -> list[dict[str, Any]]:
    from autotune.cli import main
    from autotune.config import check_strategy, load_config
    from autotune.errors import ConfigError

    estimate_report, format_estimate = _estimate_api()
    cfg = load_config(example)
    valid, invalid = [], []
    for strategy in _pool(cfg):
        try:
            check_strategy(strategy, cfg.model, cfg.training, cfg.hardware)
            valid.append(strategy)
        except ConfigError:
            invalid.append(strategy)
    rng = random.Random(os.path.basename(example))
    n_invalid = min(REFUSED_PER_EXAMPLE, len(invalid))
    picked = rng.sample(valid, min(PER_EXAMPLE - n_invalid, len(valid))) + rng.sample(invalid, n_invalid)
    rng.shuffle(picked)
    out = []
    for i, strategy in enumerate(picked):
        rec: dict[str, Any] = {"strategy": repr(strategy)}
        try:
            check_strategy(strategy, cfg.model, cfg.training, cfg.hardware)
            report = estimate_report(cfg, strategy)
            rec["json"] = json.loads(json.dumps(report))
            rec["text"] = format_estimate(report)
        except ConfigError as err:
            rec["error"] = str(err)
        no_buckets = all(getattr(strategy, k) is None for k in (
            "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"))
        if i < CLI_PER_EXAMPLE * 3 and no_buckets and sum("cli" in r for r in out) < CLI_PER_EXAMPLE:
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                rc = main(["estimate", example, *_flags(strategy), "--json"])
            rec["cli"] = {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        out.append(rec)
    return out


def _scrub(text: str, out_dir: str, name: str) -> str:
    text = text.replace(os.path.realpath(out_dir), "<OUT>").replace(out_dir, "<OUT>").replace(name, "<NAME>")
    text = text.replace(os.path.realpath(os.getcwd()), "<REPO>").replace(os.getcwd(), "<REPO>")
    text = re.sub(r"search wall time: [0-9.]+ s", "search wall time: <T> s", text)
    return re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\+00:00|Z)?", "<TIME>", text)


def _run(example: str, backend: str = "simulate") -> dict[str, Any]:
    from autotune.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = os.path.join(tmp, "runs")
        name = "golden-run"
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(["run", example, "--backend", backend, "--seed", "0", "--out", out_dir, "--name", name])
        run_dir = os.path.join(out_dir, name)
        rec: dict[str, Any] = {"rc": rc, "stdout": _scrub(stdout.getvalue(), out_dir, name),
                               "stderr": _scrub(stderr.getvalue(), out_dir, name)}
        for fname in ("front.json", "best.json", "best_ds_config.json", "run.json"):
            path = os.path.join(run_dir, fname)
            if os.path.exists(path):
                with open(path) as f:
                    rec[fname] = json.loads(_scrub(f.read(), out_dir, name))
        for path in sorted(glob.glob(os.path.join(run_dir, "ds_configs", "*.json"))):
            with open(path) as f:
                rec["ds_configs/" + os.path.basename(path)] = json.load(f)
        with open(os.path.join(run_dir, "trials.csv"), newline="") as f:
            rec["trials.csv"] = list(csv.reader(f))
        with open(os.path.join(run_dir, "summary.md")) as f:
            rec["summary.md"] = _scrub(f.read(), out_dir, name)
        return rec


def _help() -> dict[str, str]:
    """``autotune [COMMAND] --help`` at a fixed width."""
    from autotune.cli import main

    out = {}
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        for command in ("", "estimate", "run", "show", "compare", "worker"):
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                try:
                    main([command, "--help"] if command else ["--help"])
                except SystemExit:
                    pass
            out[command or "autotune"] = stdout.getvalue()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return out


def record() -> dict[str, Any]:
    examples = sorted(glob.glob("examples/*.yaml"))
    if not examples:
        raise SystemExit("golden: run from the repository root (examples/*.yaml not found)")
    tables = sorted(glob.glob("data/measured/*/config.yaml"))
    return {"help": _help(),
            "examples": {ex: {"estimates": _estimates(ex), "run": _run(ex)} for ex in examples},
            "replayed": {t: _run(t, "replay") for t in tables}}


def diff(a: Any, b: Any, path: str = "", out: list[str] | None = None) -> list[str]:
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'B' if k not in a else 'A'}")
            else:
                diff(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {str(a)[:300]!r} != {str(b)[:300]!r}")
    return out


def drop_knobs(obj: Any, names: tuple[str, ...]) -> Any:
    """``obj`` without the strategy knobs ``names`` (knobs added since a golden was recorded, taking
    their defaults): dict keys, trials.csv columns, ``name=value`` in Strategy reprs and
    ``"name": value`` lines of printed JSON."""
    if not names:
        return obj
    if isinstance(obj, dict):
        return {k: drop_knobs(v, names) for k, v in obj.items() if k not in names}
    if isinstance(obj, list):
        if obj and isinstance(obj[0], list) and any(c in names for c in obj[0]):  # a CSV with its header
            keep = [i for i, c in enumerate(obj[0]) if c not in names]
            return [[row[i] for i in keep if i < len(row)] for row in obj]
        return [drop_knobs(v, names) for v in obj]
    if isinstance(obj, str):
        alt = "|".join(names)
        obj = re.sub(rf"\b({alt})=[^,()]*, ", "", obj)
        obj = re.sub(rf", ({alt})=[^,()]*(?=\))", "", obj)  # the last field of a repr
        obj = re.sub(rf'(?m)^\s*"({alt})": [^\n]*\n', "", obj)
        return re.sub(r",(\n\s*[}\]])", r"\1", obj)  # the comma a dropped last JSON key leaves
    return obj


def counts(data: dict[str, Any]) -> str:
    ex = data["examples"]
    n_est = sum(len(v["estimates"]) for v in ex.values())
    n_ok = sum("json" in r for v in ex.values() for r in v["estimates"])
    n_cli = sum("cli" in r for v in ex.values() for r in v["estimates"])
    n_front = sum(len(v["run"].get("front.json", {}).get("front", [])) for v in ex.values())
    replayed = data.get("replayed", {})
    n_replayed = sum(len(v.get("front.json", {}).get("front", [])) for v in replayed.values())
    return (f"{len(ex)} examples, {n_est} (config, strategy) pairs ({n_ok} estimated, {n_est - n_ok} refused, "
            f"{n_cli} through the CLI), {len(ex)} simulated runs with {n_front} front points, "
            f"{len(replayed)} replayed measured tables with {n_replayed} front points")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("record").add_argument("out")
    c = sub.add_parser("check")
    c.add_argument("golden")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    for q in (c, d):
        q.add_argument("--ignore-knobs", default="", metavar="K1,K2",
                       help="strategy knobs added since the golden was recorded (left at their defaults): "
                       "compared as if absent")
        q.add_argument("--show", type=int, default=40, metavar="N", help="differences printed (default 40)")
    args = p.parse_args(argv)
    if args.cmd == "record":
        data = record()
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        print(f"golden: recorded {counts(data)} -> {args.out}")
        return 0
    if args.cmd == "check":
        with open(args.golden) as f:
            a = json.load(f)
        b = json.loads(json.dumps(record()))
    else:
        with open(args.a) as f:
            a = json.load(f)
        with open(args.b) as f:
            b = json.load(f)
    ignored = tuple(k for k in args.ignore_knobs.split(",") if k)
    problems = diff(drop_knobs(a, ignored), drop_knobs(b, ignored))
    for line in problems[:args.show]:
        print(line)
    print(f"golden: {counts(a)}: " + ("IDENTICAL" if not problems else f"{len(problems)} DIFFERENCES"))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
