"""Run outputs: trials.csv, front.json, ds_configs/, best.json and summary.md in runs/<name>/.

An fsdp2 front point gets ``fsdp2_configs/<k>.json`` (autotune.engine_configs.to_fsdp2_config) and
``fsdp2_configs/<k>.py`` (autotune.models.fsdp2.snippet, ready to paste) instead of ``ds_configs/<k>.json``,
and a torchrun launch line; the best point's files are ``best_fsdp2_config.json`` / ``best_fsdp2.py``.
Every front point also gets ``trainers/<k>/``: its files for HF Trainer, accelerate, Lightning and
(fsdp2) torchtitan, and the checkpointing the plain-DeepSpeed launch line passes (autotune.trainers).

Everything here is derived from the study (the source of truth) plus the pure models, so outputs
can be rewritten at any time (``autotune show`` does) without re-running anything.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from autotune.config import Config
from autotune.memory import GPU_COMPONENTS, MemoryEstimate, estimate_memory, overhead_bytes
from autotune.pareto import pareto_front
from autotune.reason import kind_of
from autotune.backends.factory import backend_class
from autotune.runfiles import (FRONT_FILE, TRIALS_FILE, RunData, TrialRecord, point_memory_gib, write_json,
                               write_trials_csv)
from autotune.space import SearchSpace
from autotune.spec import GIB
from autotune.strategy import Strategy
from autotune.engine_configs import (fsdp_equivalent, fsdp_equivalent_text, gradient_accumulation_steps,
                                     to_deepspeed_config, to_fsdp2_config)
from autotune.trainers import checkpointing_call, deepspeed_launch, fsdp2_launch, write_trainer_files
from autotune.trial_attrs import TrialAttrs

if TYPE_CHECKING:
    from optuna import Study


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
    fail_status: str = ""
    """oom | crash | timeout | error | nan for a failed evaluation ("" otherwise)."""
    log_dir: str = ""
    """Where the backend kept the evaluation's logs ("" when it keeps none)."""
    measured: Optional[dict[str, Any]] = None
    """A measured trial's Measurement.extra (None for the simulate backend's and for unmeasured trials)."""


def collect_rows(study: Study, space: SearchSpace, cfg: Config) -> list[TrialRow]:
    from autotune.claim import fail_status
    from autotune.search import trial_strategy

    rows = []
    built: dict[tuple, Strategy] = {}  # params -> strategy: trials repeat candidates
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in ("COMPLETE", "PRUNED", "FAIL"):
            continue
        try:
            params = tuple(t.params.items())
            strategy = built.get(params) or built.setdefault(params, trial_strategy(t, space, cfg))
        except ValueError:
            if TrialAttrs.of(t).interrupted:  # cut short while its knobs were being chosen: nothing ran
                continue
            raise
        attrs = TrialAttrs.of(t)
        meas = attrs.measurement or {}
        values = t.values if t.state.name == "COMPLETE" else None
        rows.append(TrialRow(
            number=t.number, state=t.state.name, strategy=strategy,
            peak_memory_gib=values[0] if values else None, tokens_per_s_per_gpu=values[1] if values else None,
            step_time_s=meas.get("step_time_s"), mfu=meas.get("mfu"),
            prune_reason=attrs.prune_reason or "", fail_reason=attrs.fail_reason or "",
            duplicate_of=attrs.duplicate_of,
            fail_status=fail_status(t),
            log_dir=(meas.get("extra") or {}).get("log_dir") or "",
            measured=meas.get("extra") if meas.get("status") == "ok" else None,
        ))
    return rows


Memory = Callable[[TrialRow], float]
"""A completed row's memory figure, GiB: the one its front is drawn on."""


def allocated_gib(row: TrialRow) -> float:
    """The row's allocated peak (its objective value)."""
    return row.peak_memory_gib


def front_rows(rows: list[TrialRow], memory: Memory = allocated_gib) -> list[TrialRow]:
    """The Pareto front of the completed, distinct trials on (``memory``, tokens/s), memory ascending.
    write_outputs draws it on what the GPU must hold (``gpu_memory_gib``), the figure users read and
    ``fits`` checks: engines differ in what they hold outside the allocated peak (FSDP2's side-stream
    pool), so a front on the allocated peak can list a point that needs more memory than a faster one."""
    done = [r for r in rows if r.state == "COMPLETE" and r.duplicate_of is None]
    return [done[i] for i in pareto_front([(memory(r), r.tokens_per_s_per_gpu) for r in done])]


EQUIVALENCE_TOLERANCE = 0.01
"""Measurement resolution of both objectives (step-time noise on a GPU is about 1%): front points
closer than this are not different choices, so listing them separately only buries the real ones."""


@dataclass
class _Group:
    rep: TrialRow
    """The group's fastest point: the one front.json lists."""
    members: list[TrialRow]
    """Its equivalents: within the tolerance of the group in both objectives."""
    anchor_gib: float
    """The least memory of any point the group stands for (its own or one it displaced)."""


def collapse_front(front: list[TrialRow], tol: float = EQUIVALENCE_TOLERANCE,
                   memory: Memory = allocated_gib) -> list[tuple[TrialRow, list[TrialRow]]]:
    """The front at measurement resolution, as ``(representative, equivalents)`` pairs, memory ascending.

    One sweep, memory ascending (a front's speed then ascends too). A point that is not more than
    ``tol`` faster than the last kept group joins it as an equivalent when its memory is within ``tol``
    of the group's, and is dropped otherwise (bucket-size twins: 2% more memory for 0.4% speed). A
    point more than ``tol`` faster displaces the groups whose memory is within ``tol`` of its own
    (selective checkpointing that saves 0.01 GiB and costs 5% speed), and inherits their least memory,
    so displacement never chains beyond ``tol``. Every dropped point thus has a listed point within
    ``tol`` of it (or better) in both objectives."""
    groups: list[_Group] = []
    for r in sorted(front, key=lambda r: (memory(r), -r.tokens_per_s_per_gpu)):
        last = groups[-1] if groups else None
        if last and r.tokens_per_s_per_gpu <= last.rep.tokens_per_s_per_gpu * (1 + tol):
            if memory(r) <= last.anchor_gib * (1 + tol):
                if r.tokens_per_s_per_gpu > last.rep.tokens_per_s_per_gpu:
                    last.members.append(last.rep)
                    last.rep = r
                else:
                    last.members.append(r)
            continue
        anchor = memory(r)
        while groups and groups[-1].anchor_gib * (1 + tol) >= memory(r):
            anchor = min(anchor, groups.pop().anchor_gib)
        groups.append(_Group(r, [], anchor))
    return [(g.rep, sorted(g.members, key=memory)) for g in groups]


def pick_best(front: list[TrialRow], memory: Memory = allocated_gib) -> Optional[TrialRow]:
    """The recommended point: the fastest that fits with the headroom (every front point does),
    lower memory on ties."""
    if not front:
        return None
    return max(front, key=lambda r: (r.tokens_per_s_per_gpu, -memory(r)))


def write_fsdp2_files(run_dir: str, cfg: Config, s: Strategy, json_rel: str, py_rel: str) -> dict[str, Any]:
    """Write an fsdp2 point's layout (JSON) and snippet (Python); the keys its front.json point
    carries instead of the DeepSpeed config."""
    from autotune.models.fsdp2 import snippet

    layout = to_fsdp2_config(s, cfg.model, cfg.training, cfg.hardware)
    os.makedirs(os.path.dirname(os.path.join(run_dir, json_rel)), exist_ok=True)
    write_json(os.path.join(run_dir, json_rel), layout)
    with open(os.path.join(run_dir, py_rel), "w", encoding="utf-8") as fh:
        fh.write(snippet(layout))
    return {"ds_config": None, "fsdp2_config": json_rel, "fsdp2_snippet": py_rel,
            "launch": fsdp2_launch(run_dir, cfg, json_rel),
            "checkpointing": f'autotune.apply(model, json.load(open("{json_rel}")))  # checkpointing + fully_shard'}


def gpu_memory_gib(cfg: Config, row: TrialRow, predicted: bool, mem: Optional[MemoryEstimate] = None) -> float:
    """What the GPU must hold for this trial's step, the figure ``fits`` compares with the usable
    capacity: a predicted peak with the memory model's whole overhead (context, allocator slack and
    its measured worst-case error), exactly as ``fits`` counts it; a measured peak with the context
    and allocator slack (a measurement needs no allowance for the model's error). ``mem``: the
    strategy's estimate when the caller already has it."""
    if predicted:
        mem = mem or estimate_memory(cfg.model, cfg.training, cfg.hardware, row.strategy)
        return mem.total_gpu_bytes / GIB
    return row.peak_memory_gib + overhead_bytes(cfg.hardware, row.peak_memory_gib * GIB) / GIB


Estimator = Callable[[Strategy], MemoryEstimate]
"""The job's estimate_memory of one strategy."""


def estimator(cfg: Config) -> Estimator:
    """The job's estimate_memory, once per strategy: writing a run's files reads each trial's estimate
    several times (front, points, trials.csv), and trials repeat strategies."""
    return functools.lru_cache(maxsize=None)(lambda s: estimate_memory(cfg.model, cfg.training, cfg.hardware, s))


def equivalent_dict(cfg: Config, row: TrialRow, predicted: bool, est: Estimator) -> dict[str, Any]:
    """A front point's near-identical twin (see collapse_front), as front.json lists it."""
    return {"trial": row.number, "strategy": row.strategy.as_dict(),
            "strategy_text": row.strategy.describe(cfg.model.num_hidden_layers),
            "peak_memory_gib": row.peak_memory_gib,
            "gpu_memory_gib": gpu_memory_gib(cfg, row, predicted, est(row.strategy) if predicted else None),
            "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu}


def point_dict(cfg: Config, row: TrialRow, ds_file: Optional[str], equivalents: Sequence[TrialRow], predicted: bool,
               est: Estimator) -> dict[str, Any]:
    s = row.strategy
    mem = est(s)
    return {
        "trial": row.number,
        "strategy": s.as_dict(),
        "strategy_text": s.describe(cfg.model.num_hidden_layers),
        "gpu_memory_gib": gpu_memory_gib(cfg, row, predicted, mem),
        "peak_memory_gib": row.peak_memory_gib,
        "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
        "step_time_s": row.step_time_s,
        "mfu": row.mfu,
        "gradient_accumulation_steps": gradient_accumulation_steps(s, cfg.training, cfg.hardware),
        "predicted_memory_gib": {k: v / GIB for k, v in mem.gpu.items()},
        "cpu_memory_gib_per_node": mem.cpu_bytes_per_node / GIB,
        "fsdp": fsdp_equivalent(s, cfg.hardware),
        "ds_config": ds_file,
        "launch": None,  # write_trainer_files: the example script's line
        "checkpointing": checkpointing_call(cfg, s),
        "equivalents": [equivalent_dict(cfg, r, predicted, est) for r in equivalents],
    }


def config_dirs(front: dict[str, Any]) -> list[str]:
    """The config folders a front.json's points use (``ds_configs``, ``fsdp2_configs``, ``trainers``), in that order."""
    return [d for d, key in (("ds_configs", "ds_config"), ("fsdp2_configs", "fsdp2_config"), ("trainers", "trainers"))
            if any(p.get(key) for p in front["front"])]


def write_outputs(run_dir: str, cfg: Config, space: SearchSpace, study: Study, backend: str,
                  extra_summary: Optional[dict[str, Any]] = None, confidence: Optional[str] = None) -> dict[str, Any]:
    """Write every output file; returns the front.json object. ``confidence``: how sure the sampler
    is of the front, in words (front.json ``front_confidence``), when it says."""
    rows = collect_rows(study, space, cfg)
    predicted = not backend_class(backend).measures  # the objective values are the models' predictions
    est = estimator(cfg)
    needed = {r.number: gpu_memory_gib(cfg, r, predicted, est(r.strategy) if predicted else None) for r in rows
              if r.state == "COMPLETE" and r.peak_memory_gib is not None}

    def needed_gib(r: TrialRow) -> float:  # what the GPU must hold: the figure the front is drawn on
        return needed[r.number]

    front = front_rows(rows, needed_gib)
    collapsed = collapse_front(front, memory=needed_gib)
    on_front = {r.number for rep, equivalents in collapsed for r in (rep, *equivalents)}
    points = []
    for k, (row, equivalents) in enumerate(collapsed):
        if row.strategy.engine == "fsdp2":
            point = point_dict(cfg, row, None, equivalents, predicted, est)
            point.update(write_fsdp2_files(run_dir, cfg, row.strategy, f"fsdp2_configs/{k}.json",
                                           f"fsdp2_configs/{k}.py"))
            point.update(write_trainer_files(run_dir, cfg, row.strategy, k, f"fsdp2_configs/{k}.json"))
            points.append(point)
            continue
        rel = f"ds_configs/{k}.json"
        os.makedirs(os.path.join(run_dir, "ds_configs"), exist_ok=True)  # only when a DeepSpeed point needs it
        write_json(os.path.join(run_dir, rel), to_deepspeed_config(row.strategy, cfg.model, cfg.training,
                                                                     cfg.hardware))
        point = point_dict(cfg, row, rel, equivalents, predicted, est)
        point.update(write_trainer_files(run_dir, cfg, row.strategy, k, rel))  # HF, accelerate, Lightning files
        points.append(point)
    best = pick_best([rep for rep, _ in collapsed], memory=needed_gib)
    front_obj = {
        "config": os.path.abspath(cfg.path),
        "model": cfg.model.name,
        "num_parameters": cfg.model.num_parameters,
        "hardware": {"gpu": cfg.hardware.gpu.name, "gpus_per_node": cfg.hardware.gpus_per_node,
                     "num_nodes": cfg.hardware.num_nodes},
        "backend": backend,
        "space": space.name,
        "metric_names": ["peak_memory_gib", "tokens_per_s_per_gpu"],
        "usable_gpu_memory_gib": cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom) / GIB,
        "trials": trial_counts(rows),
        "failures": failure_summary(rows),
        "front_confidence": confidence,
        "front": points,
        "best": next((p for p in points if best is not None and p["trial"] == best.number), None),
    }
    routing = measured_routing_summary(rows, cfg.model, cfg.profile.tokens)
    if routing is not None:
        front_obj["measured_routing"] = routing
    assumed = assumed_routing_summary(points, cfg.model)
    if assumed is not None:
        front_obj["assumed_routing"] = assumed
    if not points:
        front_obj["smallest_pruned"] = smallest_pruned(cfg, rows, est)
    if front_obj["best"] is not None:
        front_obj["best"]["why"] = why_recommended(front_obj["best"], points, front_obj["usable_gpu_memory_gib"])
    write_json(os.path.join(run_dir, FRONT_FILE), front_obj)
    write_trials_csv(os.path.join(run_dir, TRIALS_FILE), _trial_records(cfg, rows, on_front, predicted, est))
    if best is not None and best.strategy.engine == "fsdp2":
        write_json(os.path.join(run_dir, "best.json"), {**front_obj["best"], **write_fsdp2_files(
            run_dir, cfg, best.strategy, "best_fsdp2_config.json", "best_fsdp2.py")})
    elif best is not None:
        best_point = front_obj["best"]
        write_json(os.path.join(run_dir, "best_ds_config.json"),
                    to_deepspeed_config(best.strategy, cfg.model, cfg.training, cfg.hardware))
        write_json(os.path.join(run_dir, "best.json"), {**best_point, "ds_config": "best_ds_config.json",
                                                         "launch": deepspeed_launch(run_dir, cfg, "best_ds_config.json",
                                                                                    best_point["trainers"])})
    _write_summary(os.path.join(run_dir, "summary.md"), cfg, space, front_obj, rows, extra_summary or {})
    return front_obj


def measured_routing_summary(rows: list[TrialRow], model: Any, tokens: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The routing the measured expert-parallel trials dispatched (front.json ``measured_routing``): the trials,
    the worst of their factors (the largest upper factors, the smallest least load: what covers every one), the
    range of their memory errors at the job's factors and at each trial's own measured routing, and
    ``exceeds``: each factor a trial measured beyond what ``model`` sizes its layout with (an upper factor above,
    the least load below: the job's EP points may be under-predicted) and ``tokens``: the .npy of ids the trials
    read (profile.tokens; None: uniform random ids); None without such a trial."""
    from autotune.backends.base import MEMORY_ERROR_AT_ROUTING_KEY, MEMORY_ERROR_KEY, ROUTING_KEY
    from autotune.memory.expert_parallel import STATED_LOAD_KEYS, MeasuredRouting, sized_routing

    done = [r for r in rows if r.state == "COMPLETE" and r.duplicate_of is None and r.measured
            and r.measured.get(ROUTING_KEY)]
    if not done:
        return None

    def span(key: str) -> Optional[list[float]]:
        errs = [r.measured[key] for r in done if r.measured.get(key) is not None]  # type: ignore[index]
        return [min(errs), max(errs)] if errs else None

    exceeds: dict[str, dict[str, float]] = {}
    for r in done:
        sized = sized_routing(model, r.strategy.expert_parallel_size)
        measured = MeasuredRouting(**r.measured[ROUTING_KEY])  # type: ignore[index]
        for k in measured.beyond(sized):
            v, at = getattr(measured, k), getattr(sized, k)
            if k not in exceeds or abs(v - at) > abs(exceeds[k]["measured"] - exceeds[k]["sized"]):
                exceeds[k] = {"measured": v, "sized": at}
    return {"trials": [r.number for r in done],
            "factors": {k: (min if k in MeasuredRouting.LOWER else max)(r.measured[ROUTING_KEY][k]  # type: ignore[index]
                                                                 for r in done) for k in STATED_LOAD_KEYS},
            "memory_error_pct": span(MEMORY_ERROR_KEY), "memory_error_at_routing_pct": span(MEMORY_ERROR_AT_ROUTING_KEY),
            "exceeds": exceeds, "tokens": tokens}


def measured_routing_lines(summary: Optional[dict[str, Any]]) -> list[str]:
    """front.json's ``measured_routing`` for people: what was measured, how the predictions did with it, and
    the lines that state it in a job file."""
    from autotune.memory.expert_parallel import MeasuredRouting

    if not summary:
        return []
    worst = MeasuredRouting(**summary["factors"])
    trials = ", ".join(map(str, summary["trials"]))
    line = (f"routing measured (expert-parallel trial{'s' if len(summary['trials']) > 1 else ''} {trials}, the worst "
            f"over them): {worst.describe()}")
    at, own = summary.get("memory_error_pct"), summary.get("memory_error_at_routing_pct")
    if at and own:
        line += (f"; the memory model's error on their peaks {_pct_span(at)} with the job's factors, "
                 f"{_pct_span(own)} with their own routing")
    beyond = summary.get("exceeds") or {}
    warn = ["  WARNING: the routing measured is beyond what this job sizes its expert-parallel points with ("
            + ", ".join(f"{k} {v['measured']:g} against {v['sized']:g}" for k, v in beyond.items())
            + "): their memory may be under-predicted"] if beyond else []
    batches = (f"on {summary['tokens']} (profile.tokens)" if summary.get("tokens")
               else "on uniform random ids, not your data: profile.tokens feeds it yours")
    return [line, *warn, f"  to size expert-parallel candidates at it, state in the job file (the profiled model's "
            f"router {batches}; a sample of its steps, not a bound: docs/moe.md, \"Measuring the routing\"):",
            *(f"    {x}" for x in worst.statement())]


def assumed_routing_summary(points: list[dict[str, Any]], model: Any) -> Optional[dict[str, Any]]:
    """front.json's ``assumed_routing``: the front's expert-parallel points (trial numbers) sized at autotune's
    default routing for the factors the job leaves unstated; None without such a point or such a factor."""
    from autotune.memory.expert_parallel import STATED_LOAD_KEYS

    ep = [p["trial"] for p in points if int(p["strategy"].get("expert_parallel_size") or 1) > 1]
    unstated = [k for k in STATED_LOAD_KEYS if getattr(model, k, None) is None]
    if not ep or not unstated:
        return None
    return {"trials": ep, "unstated": unstated}


def assumed_routing_lines(summary: Optional[dict[str, Any]]) -> list[str]:
    """front.json's ``assumed_routing`` for people: which points are sized at the default routing, and how to
    size them at the job's own."""
    if not summary:
        return []
    n = len(summary["trials"])
    return [f"expert-parallel points ({n} on the front) are sized at autotune's default routing where the job "
            f"states none ({', '.join(summary['unstated'])}): the busiest expert takes every token of a rank and the "
            "busiest rank what it gets when every token picks the same experts, as routers that see text can; "
            "state your model's routing on your data to size them at it (an EP point's launch script measures it; "
            "docs/moe.md, \"Load imbalance\")"]


def _pct_span(span: list[float]) -> str:
    lo, hi = span
    return f"{lo:+.2f}%" if lo == hi else f"{lo:+.2f}%..{hi:+.2f}%"


def trial_counts(rows: list[TrialRow]) -> dict[str, int]:
    """Distinct candidates by how they ended (repeats of an evaluated strategy are not counted)."""
    first = [r for r in rows if r.duplicate_of is None]
    return {"complete": sum(r.state == "COMPLETE" for r in first), "pruned": sum(r.state == "PRUNED" for r in first),
            "failed": sum(r.state == "FAIL" for r in first)}


def failure_summary(rows: list[TrialRow]) -> dict[str, Any]:
    """Failed evaluations counted by status, and the first one with its reason and log folder."""
    failed = [r for r in rows if r.state == "FAIL" and r.duplicate_of is None]
    by_status: dict[str, int] = {}
    for r in failed:
        status = r.fail_status or "error"  # "": lost before it had a result
        by_status[status] = by_status.get(status, 0) + 1
    first = min(failed, key=lambda r: r.number, default=None)
    return {"by_status": by_status,
            "first": first and {"trial": first.number, "reason": first.fail_reason, "log_dir": first.log_dir}}


def smallest_pruned(cfg: Config, rows: list[TrialRow], est: Estimator) -> Optional[dict[str, Any]]:
    """The pruned candidate that needs the least GPU memory (of those that break no rule), with the
    component that dominates it: what "no candidate fits" names."""
    best: Optional[tuple[int, TrialRow, MemoryEstimate]] = None
    for r in rows:
        if r.state != "PRUNED" or r.duplicate_of is not None:
            continue
        mem = est(r.strategy)
        if any(kind_of(reason) == "rule" for reason in mem.reasons):
            continue
        if best is None or mem.total_gpu_bytes < best[0]:
            best = (mem.total_gpu_bytes, r, mem)
    if best is None:
        return None
    total, row, mem = best
    part = max((k for k in mem.gpu if k not in ("peak", "overhead")), key=mem.gpu.__getitem__)
    return {"trial": row.number, "strategy_text": row.strategy.describe(cfg.model.num_hidden_layers),
            "gpu_memory_gib": total / GIB, "largest_part": part, "largest_part_gib": mem.gpu[part] / GIB}


def why_recommended(best: dict[str, Any], points: list[dict[str, Any]], usable_gib: float) -> str:
    """One sentence: why this front point is the recommended one."""
    text = (f"fastest configuration that fits: {best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU using "
            f"{format_gib(best['gpu_memory_gib'])} of {format_gib(usable_gib)} usable per GPU")
    cheaper = [p for p in points if p["gpu_memory_gib"] < best["gpu_memory_gib"]]
    if cheaper:
        nxt = max(cheaper, key=lambda p: p["gpu_memory_gib"])
        slower = 1 - nxt["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"]
        text += (f"; the next point down saves {format_gib(best['gpu_memory_gib'] - nxt['gpu_memory_gib'])} "
                 f"but is {100 * slower:.0f}% slower")
    return text + "."


def format_gib(gib: float) -> str:
    """A memory figure in GiB, or in MiB below a quarter GiB (tiny models would read 0.00 GiB)."""
    return f"{gib:.2f} GiB" if abs(gib) >= 0.25 else f"{gib * 1024:.1f} MiB"


def _trial_records(cfg: Config, rows: list[TrialRow], on_front: set[int], predicted: bool,
                   est: Estimator) -> Iterator[TrialRecord]:
    """trials.csv records: each trial's strategy, predicted memory breakdown and outcome."""
    for r in rows:
        mem = est(r.strategy)
        yield TrialRecord(
            number=r.number, state=r.state, strategy=r.strategy,
            predicted_gib={k: mem.gpu[k] / GIB for k in (*GPU_COMPONENTS, "peak")},
            predicted_cpu_gib=mem.cpu_bytes_per_node / GIB, predicted_fits=mem.fits,
            peak_memory_gib=r.peak_memory_gib,
            gpu_memory_gib=None if r.peak_memory_gib is None else gpu_memory_gib(cfg, r, predicted, mem),
            tokens_per_s_per_gpu=r.tokens_per_s_per_gpu, step_time_s=r.step_time_s, mfu=r.mfu,
            on_front=r.number in on_front, prune_reason=r.prune_reason, fail_status=r.fail_status,
            fail_reason=r.fail_reason,
            duplicate_of=r.duplicate_of, strategy_text=r.strategy.describe(cfg.model.num_hidden_layers))


def format_front(front_obj: dict[str, Any]) -> str:
    """The front as a terminal table: memory is what the GPU must hold (allocated peak + context and
    allocator overhead), the figure compared with the usable capacity."""
    small = all(point_memory_gib(p) < 0.25 for p in front_obj["front"])
    unit, scale = ("MiB", 1024.0) if small else ("GiB", 1.0)
    lines = [f"{'#':>3} {'memory ' + unit:>11} {'tokens/s/GPU':>13} {'MFU':>6}  strategy"]
    for k, p in enumerate(front_obj["front"]):
        mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "-"
        star = " *" if front_obj.get("best") and p["trial"] == front_obj["best"]["trial"] else ""
        same = f"  (+{len(p['equivalents'])} equivalent)" if p.get("equivalents") else ""
        lines.append(f"{k:>3} {point_memory_gib(p) * scale:>11.2f} {p['tokens_per_s_per_gpu']:>13,.0f} {mfu:>6}  "
                     f"{p['strategy_text']}{star}{same}")
    if not front_obj["front"]:
        lines.append(f"    (empty: {empty_front_reason(front_obj)})")
    return "\n".join(lines)


def empty_front_reason(front_obj: dict[str, Any]) -> str:
    """Why a run has no front, in words: everything pruned, every evaluation failed, or neither."""
    counts = front_obj.get("trials") or {}
    failures = front_obj.get("failures") or {}
    if counts.get("failed"):
        by = ", ".join(f"{n} {status}" for status, n in sorted(failures.get("by_status", {}).items(),
                                                                 key=lambda kv: -kv[1]))
        first = failures.get("first") or {}
        text = f"every evaluation failed ({by}); first: trial {first.get('trial')}: {first.get('reason')}"
        return text + (f"; logs in {first['log_dir']}" if first.get("log_dir") else "")
    if counts.get("pruned") and not counts.get("complete"):
        small = front_obj.get("smallest_pruned")
        # smallest_pruned skips the candidates that break a strategy rule: none left, every one broke one
        by = "the memory model" if small else "strategy rules (each breaks one; none can run as given)"
        text = f"no candidate fits: all {counts['pruned']} candidates were pruned by {by}"
        if small:
            text += (f"; the smallest, trial {small['trial']} ({small['strategy_text']}), needs "
                     f"{small['gpu_memory_gib']:.1f} GiB of {front_obj['usable_gpu_memory_gib']:.1f} GiB usable, most "
                     f"of it {small['largest_part'].replace('_', ' ')} ({small['largest_part_gib']:.1f} GiB)")
        return text + "; see the prune reasons in summary.md and trials.csv"
    return "no candidate was evaluated"


def _write_summary(path: str, cfg: Config, space: SearchSpace, front_obj: dict[str, Any], rows: list[TrialRow],
                   extra: dict[str, Any]) -> None:
    counts = {state: sum(r.state == state for r in rows) for state in ("COMPLETE", "PRUNED", "FAIL")}
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
        lines += ["## Recommended", "", f"{best['strategy_text']}: {format_gib(point_memory_gib(best))}, "
                  f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU. Why: {best['why']}", "", "```",
                  f"{best['launch']}", "```", f"Checkpointing in the model: `{best['checkpointing']}`",
                  f"FSDP: {fsdp_equivalent_text(best['fsdp'])}", ""]
        if best.get("equivalents"):
            lines += ["Equivalent within 1% in memory and speed: "
                      + "; ".join(e["strategy_text"] for e in best["equivalents"]), ""]
    if front_obj.get("measured_routing"):
        lines += ["## Routing measured", "", "```", *measured_routing_lines(front_obj["measured_routing"]), "```", ""]
    if front_obj.get("assumed_routing"):
        lines += ["## Routing assumed", "", *assumed_routing_lines(front_obj["assumed_routing"]), ""]
    if reasons:
        lines += ["## Why candidates were pruned", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:15]]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------- show (read back from the files)

def recommendation_lines(best: Optional[dict[str, Any]], run_dir: str) -> list[str]:
    """The recommended point, why, and how to reproduce it (DeepSpeed config + model-side call)."""
    if not best:
        return ["recommended: none"]
    lines = [f"recommended (*): {best['strategy_text']}: {format_gib(point_memory_gib(best))}, "
             f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"]
    if best.get("why"):
        lines.append(f"  why: {best['why']}")
    if best.get("ds_config"):
        lines.append(f"  DeepSpeed config: {os.path.join(run_dir, best['ds_config'])}")
    if best.get("fsdp2_config"):
        lines.append(f"  FSDP2 layout: {os.path.join(run_dir, best['fsdp2_config'])}; snippet: "
                     f"{os.path.join(run_dir, best['fsdp2_snippet'])}")
    if best.get("checkpointing"):
        lines.append(f"  checkpointing in the model: {best['checkpointing']}")
    if best.get("trainers"):
        lines.append(f"  HF Trainer, accelerate, Lightning files: {os.path.join(run_dir, best['trainers'])}/ "
                     "(docs/trainers.md)")
    if best.get("launch"):
        lines.append(f"  launch: {best['launch']}")
    return lines


def format_show(run: RunData) -> str:
    f = run.front
    hw = f.get("hardware") or {}
    gpus = (hw.get("gpus_per_node") or 1) * (hw.get("num_nodes") or 1)
    counts = {s: sum(t.get("state") == s for t in run.trials) for s in ("COMPLETE", "PRUNED", "FAIL")}
    lines = [
        f"run {run.name}: {f.get('model', '?')} on {gpus} x {hw.get('gpu', '?')}, backend {f.get('backend', '?')}, "
        f"space {f.get('space', '?')}",
        f"trials: {len(run.trials)} ({counts['COMPLETE']} complete, {counts['PRUNED']} pruned, "
        f"{counts['FAIL']} failed)",
        "",
        format_front(f),
        "",
    ]
    lines += recommendation_lines(run.best, run.run_dir)
    lines += measured_routing_lines(f.get("measured_routing")) + assumed_routing_lines(f.get("assumed_routing"))
    if f.get("front_confidence"):
        lines.append(f["front_confidence"])
    report = os.path.join(run.run_dir, "report.html")
    if os.path.isfile(report):
        lines.append(f"report: {report}")
    return "\n".join(lines)
