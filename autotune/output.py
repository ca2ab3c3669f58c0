"""Run outputs: trials.csv, front.json, ds_configs/, best.json and summary.md in runs/<name>/.

Everything here is derived from the study (the source of truth) plus the pure models, so outputs
can be rewritten at any time (``autotune show`` does) without re-running anything.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from autotune.config import Config
from autotune.memory import GPU_COMPONENTS, estimate_memory
from autotune.pareto import pareto_front
from autotune.space import SearchSpace
from autotune.strategy import Strategy, fsdp_equivalent, gradient_accumulation_steps, to_deepspeed_config

GIB = float(1 << 30)
STRATEGY_COLUMNS = ["zero_stage", "offload_optimizer", "offload_params", "micro_batch_size", "checkpointing",
                    "checkpoint_layers", "precision", "reduce_bucket_size", "allgather_bucket_size",
                    "prefetch_bucket_size"]
CSV_COLUMNS = (["number", "state"] + STRATEGY_COLUMNS
               + [f"pred_{k}_gib" for k in (*GPU_COMPONENTS, "peak")]
               + ["pred_cpu_gib", "pred_fits", "peak_memory_gib", "tokens_per_s_per_gpu", "step_time_s", "mfu",
                  "on_front", "prune_reason", "fail_reason", "duplicate_of", "strategy"])


@dataclass(frozen=True)
class TrialRow:
    """One finished trial, flattened."""

    number: int
    state: str
    strategy: Strategy
    peak_memory_gib: Optional[float]
    tokens_per_s_per_gpu: Optional[float]
    step_time_s: Optional[float]
    mfu: Optional[float]
    prune_reason: str
    fail_reason: str
    duplicate_of: Optional[int]


def collect_rows(study: Any, space: SearchSpace, cfg: Config) -> list[TrialRow]:
    from autotune.search import trial_strategy

    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in ("COMPLETE", "PRUNED", "FAIL"):
            continue
        meas = t.user_attrs.get("measurement") or {}
        values = t.values if t.state.name == "COMPLETE" else None
        rows.append(TrialRow(
            number=t.number, state=t.state.name, strategy=trial_strategy(t, space, cfg),
            peak_memory_gib=values[0] if values else None, tokens_per_s_per_gpu=values[1] if values else None,
            step_time_s=meas.get("step_time_s"), mfu=meas.get("mfu"),
            prune_reason=t.user_attrs.get("prune_reason", ""), fail_reason=t.user_attrs.get("fail_reason", ""),
            duplicate_of=t.user_attrs.get("duplicate_of"),
        ))
    return rows


def front_rows(rows: list[TrialRow]) -> list[TrialRow]:
    """The Pareto front of the completed, distinct trials, memory ascending."""
    done = [r for r in rows if r.state == "COMPLETE" and r.duplicate_of is None]
    return [done[i] for i in pareto_front([(r.peak_memory_gib, r.tokens_per_s_per_gpu) for r in done])]


def pick_best(front: list[TrialRow]) -> Optional[TrialRow]:
    """The recommended point: the fastest that fits with the headroom (every front point does),
    lower memory on ties."""
    if not front:
        return None
    return max(front, key=lambda r: (r.tokens_per_s_per_gpu, -r.peak_memory_gib))


def launch_command(cfg: Config, ds_config_file: str) -> str:
    hw = cfg.hardware
    if hw.num_nodes > 1:
        return (f"deepspeed --hostfile hostfile --num_nodes {hw.num_nodes} --num_gpus {hw.gpus_per_node} "
                f"train.py --deepspeed {ds_config_file}")
    return f"deepspeed --num_gpus {hw.gpus_per_node} train.py --deepspeed {ds_config_file}"


def point_dict(cfg: Config, row: TrialRow, ds_file: Optional[str]) -> dict[str, Any]:
    s = row.strategy
    mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, s)
    return {
        "trial": row.number,
        "strategy": s.as_dict(),
        "strategy_text": s.describe(cfg.model.num_hidden_layers),
        "peak_memory_gib": row.peak_memory_gib,
        "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
        "step_time_s": row.step_time_s,
        "mfu": row.mfu,
        "gradient_accumulation_steps": gradient_accumulation_steps(s, cfg.training, cfg.hardware),
        "predicted_memory_gib": {k: v / GIB for k, v in mem.gpu.items()},
        "cpu_memory_gib_per_node": mem.cpu_bytes_per_node / GIB,
        "fsdp": fsdp_equivalent(s, cfg.hardware),
        "ds_config": ds_file,
        "launch": launch_command(cfg, ds_file) if ds_file else None,
    }


def write_outputs(run_dir: str, cfg: Config, space: SearchSpace, study: Any, backend: str,
                  extra_summary: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Write every output file; returns the front.json object."""
    rows = collect_rows(study, space, cfg)
    front = front_rows(rows)
    on_front = {r.number for r in front}
    ds_dir = os.path.join(run_dir, "ds_configs")
    os.makedirs(ds_dir, exist_ok=True)
    points = []
    for k, row in enumerate(front):
        rel = f"ds_configs/{k}.json"
        _write_json(os.path.join(run_dir, rel), to_deepspeed_config(row.strategy, cfg.model, cfg.training,
                                                                     cfg.hardware))
        points.append(point_dict(cfg, row, rel))
    best = pick_best(front)
    front_obj = {
        "config": os.path.abspath(cfg.path),
        "model": cfg.model.name,
        "num_parameters": cfg.model.num_parameters,
        "hardware": {"gpu": cfg.hardware.gpu.name, "gpus_per_node": cfg.hardware.gpus_per_node,
                     "num_nodes": cfg.hardware.num_nodes},
        "backend": backend,
        "space": space.name,
        "metric_names": ["peak_memory_gib", "tokens_per_s_per_gpu"],
        "front": points,
        "best": next((p for p in points if best is not None and p["trial"] == best.number), None),
    }
    _write_json(os.path.join(run_dir, "front.json"), front_obj)
    _write_trials_csv(os.path.join(run_dir, "trials.csv"), cfg, rows, on_front)
    if best is not None:
        best_point = front_obj["best"]
        _write_json(os.path.join(run_dir, "best_ds_config.json"),
                    to_deepspeed_config(best.strategy, cfg.model, cfg.training, cfg.hardware))
        _write_json(os.path.join(run_dir, "best.json"), {**best_point, "ds_config": "best_ds_config.json",
                                                         "launch": launch_command(cfg, "best_ds_config.json")})
    counts = {state: sum(r.state == state for r in rows) for state in ("COMPLETE", "PRUNED", "FAIL")}
    _write_summary(os.path.join(run_dir, "summary.md"), cfg, space, front_obj, rows, counts, extra_summary or {})
    return front_obj


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def _fmt(value: Any) -> Any:
    return "" if value is None else value  # floats keep full precision (replay reads them back)


def _write_trials_csv(path: str, cfg: Config, rows: list[TrialRow], on_front: set[int]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in rows:
            mem = estimate_memory(cfg.model, cfg.training, cfg.hardware, r.strategy)
            rec: dict[str, Any] = {"number": r.number, "state": r.state, **{k: getattr(r.strategy, k)
                                                                            for k in STRATEGY_COLUMNS}}
            rec.update({f"pred_{k}_gib": mem.gpu[k] / GIB for k in (*GPU_COMPONENTS, "peak")})
            rec.update(pred_cpu_gib=mem.cpu_bytes_per_node / GIB, pred_fits=mem.fits,
                       peak_memory_gib=r.peak_memory_gib, tokens_per_s_per_gpu=r.tokens_per_s_per_gpu,
                       step_time_s=r.step_time_s, mfu=r.mfu, on_front=r.number in on_front,
                       prune_reason=r.prune_reason, fail_reason=r.fail_reason, duplicate_of=r.duplicate_of,
                       strategy=r.strategy.describe(cfg.model.num_hidden_layers))
            writer.writerow({k: _fmt(v) for k, v in rec.items()})
    os.replace(tmp, path)


def format_front(front_obj: dict[str, Any]) -> str:
    """The front as a terminal table."""
    small = all(p["peak_memory_gib"] < 0.25 for p in front_obj["front"])
    unit, scale = ("MiB", 1024.0) if small else ("GiB", 1.0)
    lines = [f"{'#':>3} {'memory ' + unit:>10} {'tokens/s/GPU':>13} {'MFU':>6}  strategy"]
    for k, p in enumerate(front_obj["front"]):
        mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "-"
        star = " *" if front_obj.get("best") and p["trial"] == front_obj["best"]["trial"] else ""
        lines.append(f"{k:>3} {p['peak_memory_gib'] * scale:>10.2f} {p['tokens_per_s_per_gpu']:>13,.0f} {mfu:>6}  "
                     f"{p['strategy_text']}{star}")
    if not front_obj["front"]:
        lines.append("    (empty: no candidate fits; see the prune reasons in trials.csv)")
    return "\n".join(lines)


def _write_summary(path: str, cfg: Config, space: SearchSpace, front_obj: dict[str, Any], rows: list[TrialRow],
                   counts: dict[str, int], extra: dict[str, Any]) -> None:
    reasons: dict[str, int] = {}
    for r in rows:
        if r.state == "PRUNED" and r.duplicate_of is None:
            first = r.prune_reason.split(";")[0]
            reasons[first] = reasons.get(first, 0) + 1
    best = front_obj.get("best")
    lines = [
        f"# autotune run: {cfg.model.name} on {cfg.hardware.num_gpus} x {cfg.hardware.gpu.name}",
        "",
        f"- config: `{cfg.path}`; space: `{space.name}`; backend: `{front_obj['backend']}`",
        f"- trials: {len(rows)} ({counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL']} failed)",
    ]
    lines += [f"- {k}: {v}" for k, v in extra.items()]
    lines += ["", "## Pareto front (memory ascending; * = recommended)", "", "```", format_front(front_obj), "```", ""]
    if best:
        lines += ["## Recommended", "", f"{best['strategy_text']}: {best['peak_memory_gib']:.2f} GiB, "
                  f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU.", "", "```", f"{best['launch']}", "```",
                  f"FSDP: {best['fsdp']['sharding_strategy']}", ""]
    if reasons:
        lines += ["## Why candidates were pruned", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
