"""runs/<name>/report.html (self-contained, interactive) and front.png (static) for a finished run.

Everything is read from the run directory's files (front.json, trials.csv, run.json), so a report
can be (re)written for any finished run: ``autotune show RUN_DIR --report``. The HTML embeds
plotly.js inline, so it opens from disk with no network; its figures are written as plotly.js
dicts (autotune.report_plotly) and front.png is drawn with Pillow (autotune.report_png), so a
report imports neither plotly's Python package nor matplotlib. Never imports torch.

Sections: the Pareto plot (every trial: front, dominated, failed and pruned distinguished; failed
and pruned trials have no measurement, so they sit at their *predicted* memory and 0 tokens/s),
the predicted memory breakdown of each front point against the GPU's capacity, the
predicted-vs-measured table when a real backend measured, and the prune/fail reasons summarised.
"""

from __future__ import annotations

import html
import json
import os
import re
from typing import Any, Optional

from autotune.config import Config
from autotune.output import (assumed_routing_lines, config_dirs, empty_front_reason, format_gib, measured_routing_lines,
                             point_memory_gib)
from autotune.errors import ConfigError
from autotune.backends.base import PREDICTED_PEAK_KEY, PREDICTED_TPS_KEY, Backend
from autotune.backends.factory import backend_class
from autotune.runfiles import RunData, TrialRecord, load_run, to_float
from autotune.spec import GIB
from autotune.trial_attrs import TrialAttrs

COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits", "buffers", "overhead")
"""Memory-breakdown components, bottom to top (memory.GPU_COMPONENTS; the front.json keys win)."""
COLORS = {"parameters": "#4c78a8", "gradients": "#f58518", "optimizer_states": "#e45756",
          "activations": "#72b7b2", "logits": "#54a24b", "buffers": "#eeca3b", "overhead": "#b279a2"}
PARETO_DIV = "autotune-pareto"
BREAKDOWN_DIV = "autotune-breakdown"


# ---------------------------------------------------------------- data

def _components(front: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for p in front:
        for k in (p.get("predicted_memory_gib") or {}):
            if k != "peak" and k not in keys:
                keys.append(k)
    ordered = [k for k in COMPONENTS if k in keys]
    return ordered + [k for k in keys if k not in ordered]


def gpu_capacity(run: RunData, cfg: Optional[Config] = None) -> tuple[Optional[float], Optional[float]]:
    """(GPU memory GiB, headroom fraction) from the config object, front.json, the GPU preset, or
    the run's config file; (None, None) when none of them is available."""
    if cfg is not None:
        return cfg.hardware.gpu.memory_bytes / GIB, cfg.search.headroom
    hw = run.front.get("hardware") or {}
    cap = to_float(hw.get("gpu_memory_gib"))
    headroom = to_float(run.front.get("headroom"))
    if cap is not None:
        return cap, headroom
    config_path = run.meta.get("config") or run.front.get("config")
    if config_path and os.path.isfile(config_path):
        try:
            from autotune.config import load_config

            c = load_config(config_path)
            if c.hardware.gpu.name == hw.get("gpu"):
                return c.hardware.gpu.memory_bytes / GIB, c.search.headroom
        except Exception:  # a moved or edited config must not break the report
            pass
    try:
        from autotune.presets import gpu_from_name

        return gpu_from_name(hw.get("gpu", "")).memory_bytes / GIB, headroom
    except (ValueError, TypeError):
        return None, headroom


def measurement_extras(run: RunData) -> dict[int, dict[str, Any]]:
    """trial number -> the ``measurement`` user attr, from the study (only for real backends; {} when
    the storage cannot be opened, e.g. a run directory copied without its study)."""
    storage = run.meta.get("storage")
    if not storage or not run_backend(run).measures:
        return {}
    if "://" not in storage and not os.path.isabs(storage) and not os.path.exists(storage):
        storage = os.path.join(run.run_dir, os.path.basename(storage))
    try:
        import optuna

        from autotune.storage import make_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=run.name, storage=make_storage(storage))
        return {t.number: TrialAttrs.of(t).measurement or {} for t in study.get_trials(deepcopy=False)}
    except Exception:
        return {}


def reason_summary(records: list[TrialRecord], state: str, column: str) -> list[tuple[str, int, list[int]]]:
    """(example reason, count, trial numbers) for distinct trials in ``state``, most common first. Reasons
    are grouped by their first clause with the numbers masked ("needs 92.3 GiB > 76.0 GiB" and "needs
    125.7 GiB > 76.0 GiB" are one group); the example is the first trial's reason."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for r in records:
        if r.state == state and not r.is_repeat:
            first = (getattr(r, column) or "(no reason recorded)").split(";")[0].strip()
            key = _NUMBER.sub("#", first)
            groups.setdefault(key, (first, []))[1].append(r.number)
    return sorted(((ex, len(nums), nums) for ex, nums in groups.values()), key=lambda x: -x[1])


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _category(r: TrialRecord) -> str:
    if r.state == "COMPLETE":
        return "front" if r.on_front else "dominated"
    return {"PRUNED": "pruned", "FAIL": "failed"}.get(r.state, "other")


def plot_points(run: RunData, clip_gib: Optional[float] = None) -> dict[str, list[dict[str, Any]]]:
    """Every trial as a plot point, by category (front, dominated, failed, pruned). Unmeasured points
    predicted above ``clip_gib`` are drawn at ``clip_gib`` (``clipped``: True) so that a few hopeless
    candidates do not squeeze the front into a corner; the hover text keeps the true prediction."""
    out: dict[str, list[dict[str, Any]]] = {"front": [], "dominated": [], "failed": [], "pruned": []}
    for r in run.records:
        cat = _category(r)
        if cat == "other":
            continue
        measured = cat in ("front", "dominated")
        if measured:  # what the GPU holds (fits' figure); older trials.csv files: the allocated peak
            mem = r.gpu_memory_gib or r.peak_memory_gib
        else:
            mem = (r.predicted_gib["peak"] or 0.0) + (r.predicted_gib["overhead"] or 0.0)
        tps = r.tokens_per_s_per_gpu if measured else 0.0
        note = ""
        if r.is_repeat:
            note = f"repeat of trial {r.duplicate_of}"
        if cat == "pruned":
            note = "; ".join(x for x in (note, "pruned: " + r.prune_reason) if x)
        if cat == "failed":
            note = "; ".join(x for x in (note, "failed: " + r.fail_reason) if x)
        mem = mem if mem is not None else 0.0
        clipped = bool(not measured and clip_gib and mem > clip_gib)
        if not measured:
            note = f"predicted {format_gib(mem)}; " + note
        out[cat].append({"trial": r.number, "memory_gib": clip_gib if clipped else mem, "clipped": clipped,
                         "tokens_per_s": tps or 0.0, "strategy": r.strategy_text, "note": note})
    out["front"].sort(key=lambda p: p["memory_gib"])
    return out


# ---------------------------------------------------------------- figures

def _clip(run: RunData, capacity: Optional[float]) -> Optional[float]:
    """Where unmeasured points are clipped: 1.5 x the larger of the GPU capacity and the largest
    measured peak (None: no capacity known and nothing measured)."""
    measured = [r.gpu_memory_gib or r.peak_memory_gib or 0.0 for r in run.records if r.state == "COMPLETE"]
    top = max([capacity or 0.0, *measured])
    return 1.5 * top if top > 0 else None


def run_backend(run: RunData) -> type[Backend]:
    """The class of the backend that evaluated the run (front.json ``backend``), whose attributes say
    what its points are; Backend itself (measured) for a name this version does not know."""
    try:
        return backend_class(str(run.front.get("backend")))
    except ConfigError:
        return Backend


def evaluated_label(run: RunData) -> str:
    """What the evaluated points are (Backend.evaluated_as): simulated, or some kind of measurement."""
    return run_backend(run).evaluated_as


MEMORY_AXIS = "GPU memory per GPU, incl. context and allocator (GiB)"


def pareto_figure(run: RunData, capacity: Optional[float], headroom: Optional[float]) -> dict[str, Any]:
    """The interactive Pareto plot as a plotly.js figure dict (autotune.report_plotly)."""
    from autotune.report_plotly import pareto_figure as figure

    return figure(plot_points(run, _clip(run, capacity)), (run.best or {}).get("trial"), evaluated_label(run),
                  MEMORY_AXIS, capacity, headroom)


def breakdown_figure(run: RunData, capacity: Optional[float], headroom: Optional[float]) -> dict[str, Any]:
    """The front's predicted memory breakdown as a plotly.js figure dict (autotune.report_plotly)."""
    from autotune.report_plotly import breakdown_figure as figure

    front = run.front["front"]
    return figure(front, _components(front), COLORS, evaluated_label(run), capacity, headroom)


def write_front_png(run: RunData, path: str, capacity: Optional[float] = None) -> str:
    """The static front plot (autotune.report_png, Pillow)."""
    from autotune.report_png import write_front_png as draw

    label = evaluated_label(run)
    labels = {"pruned": "pruned (predicted memory; clipped at the right edge)", "failed": "failed (predicted memory)",
              "dominated": label, "front": f"Pareto front ({label})"}
    best = run.best
    f = run.front
    hw = f.get("hardware") or {}
    title = (f"{f.get('model', '')} on {(hw.get('gpus_per_node') or 1) * (hw.get('num_nodes') or 1)} x "
             f"{hw.get('gpu', '')} ({f.get('backend', '')})")
    return draw(plot_points(run, _clip(run, capacity)), labels,
                (point_memory_gib(best), best["tokens_per_s_per_gpu"]) if best else None,
                capacity, title, MEMORY_AXIS, "tokens/s per GPU", path)


# ---------------------------------------------------------------- HTML

def _table(header: list[str], rows: list[list[Any]], cls: str = "") -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else esc(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class _Raw(str):
    """Already-escaped HTML for a table cell."""


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _err(measured: Optional[float], predicted: Optional[float]) -> str:
    if measured is None or predicted is None or measured == 0:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def predicted_vs_measured(run: RunData) -> list[list[Any]]:
    """Rows of the predicted-vs-measured table (empty for a backend that predicts)."""
    if not run_backend(run).measures:
        return []
    extras = measurement_extras(run)
    rows = []
    for r in run.records:
        if r.state not in ("COMPLETE", "FAIL") or r.is_repeat:
            continue
        n = r.number
        pred_mem, meas_mem = r.predicted_gib["peak"], r.peak_memory_gib
        meas_tps = r.tokens_per_s_per_gpu
        meas = extras.get(n, {})
        extra = meas.get("extra") or {}
        if to_float(extra.get(PREDICTED_PEAK_KEY)) is not None:
            pred_mem = to_float(extra.get(PREDICTED_PEAK_KEY)) / GIB
        pred_tps = to_float(extra.get(PREDICTED_TPS_KEY))
        status = "ok" if r.state == "COMPLETE" else (r.fail_reason or "failed")
        if extra.get("oom_phase"):
            status += f" (OOM in {extra['oom_phase']})"
        rows.append([n, r.strategy_text, "-" if pred_mem is None else format_gib(pred_mem),
                     "-" if meas_mem is None else format_gib(meas_mem), _err(meas_mem, pred_mem),
                     _num(pred_tps, ",.0f"), _num(meas_tps, ",.0f"), _err(meas_tps, pred_tps), status])
    return rows


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1200px;
color:#222;padding:0 16px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:0.9em;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left}th{background:#f4f4f4}td.num{text-align:right}.muted{color:#777}code{background:#f4f4f4;padding:1px 4px}
"""


def render_html(run: RunData, capacity: Optional[float], headroom: Optional[float]) -> str:
    """report.html's text."""
    from autotune.report_plotly import plotly_js

    head, tail = _html_around_plotly_js(run, capacity, headroom)
    return head + plotly_js() + tail


def _html_around_plotly_js(run: RunData, capacity: Optional[float], headroom: Optional[float]) -> tuple[str, str]:
    """report.html's text before and after the embedded plotly.js (which write_report copies as bytes)."""
    from autotune.report_plotly import figure_div, plotly_version

    esc = html.escape
    f = run.front
    hw = f.get("hardware") or {}
    gpus = (hw.get("gpus_per_node") or 1) * (hw.get("num_nodes") or 1)
    counts = {s: sum(t.get("state") == s for t in run.trials) for s in ("COMPLETE", "PRUNED", "FAIL")}
    repeats = sum(r.is_repeat for r in run.records)
    cfg = {"displaylogo": False, "responsive": True}
    pareto = figure_div(pareto_figure(run, capacity, headroom), PARETO_DIV, cfg)
    parts = [
        f"<h1>autotune: {esc(str(f.get('model', '')))} on {gpus} x {esc(str(hw.get('gpu', '')))}</h1>",
        f'<p class="muted">run <code>{esc(run.name)}</code>, backend <code>{esc(str(f.get("backend")))}</code>, '
        f"space <code>{esc(str(f.get('space')))}</code>, created {esc(str(run.meta.get('created', '?')))}; "
        f"{len(run.trials)} trials: {counts['COMPLETE']} {evaluated_label(run)}, {counts['PRUNED']} pruned, {counts['FAIL']} "
        f"failed ({repeats} repeats of an earlier strategy reuse its result).</p>",
    ]
    best = run.best
    if best:
        parts.append(f"<p><b>Recommended</b>: {esc(best['strategy_text'])}: "
                     f"{format_gib(point_memory_gib(best))}, {best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"
                     + (f", MFU {100 * best['mfu']:.1f}%" if best.get("mfu") is not None else "")
                     + (f". Why: {esc(best['why'])}" if best.get("why") else "")
                     + (f' FSDP2 snippet: <a href="{esc(best["fsdp2_snippet"])}">{esc(best["fsdp2_snippet"])}</a>; '
                        if best.get("fsdp2_snippet") else
                        ' DeepSpeed config: <a href="best_ds_config.json">best_ds_config.json</a>; ')
                     + f"checkpointing in the model: <code>{esc(best.get('checkpointing') or 'none')}</code>; "
                     f"<code>{esc(best.get('launch') or '')}</code></p>")
    else:
        parts.append(f"<p><b>No front.</b> {esc(empty_front_reason(f))}.</p>")
    parts += ["<h2>Pareto front</h2>", pareto]
    if f["front"]:
        rows = []
        for k, p in enumerate(f["front"]):
            ds = p.get("ds_config") or p.get("fsdp2_snippet")
            rows.append([k, p["trial"], format_gib(point_memory_gib(p)), f"{p['tokens_per_s_per_gpu']:,.0f}",
                         "-" if p.get("mfu") is None else f"{100 * p['mfu']:.1f}%",
                         p.get("gradient_accumulation_steps", "-"),
                         p["strategy_text"] + (" (recommended)" if best and p["trial"] == best["trial"] else ""),
                         "; ".join(e["strategy_text"] for e in p.get("equivalents", ())) or "-",
                         _Raw(f'<a href="{esc(ds)}">{esc(ds)}</a>') if ds else "-"])
        parts.append(_table(["#", "trial", "GPU memory", "tokens/s/GPU", "MFU", "grad. acc.", "strategy",
                             "equivalent within 1%", "DeepSpeed config"], rows))
        parts += ["<h2>Memory breakdown of the front</h2>",
                  figure_div(breakdown_figure(run, capacity, headroom), BREAKDOWN_DIV, cfg)]
    pvm = predicted_vs_measured(run)
    parts.append("<h2>Predicted vs measured</h2>")
    if pvm:
        parts.append(_table(["trial", "strategy", "predicted peak", "measured peak", "memory error",
                             "predicted tokens/s", "measured tokens/s", "throughput error", "status"], pvm))
        parts.append('<p class="muted">error = (predicted - measured) / measured. Predicted throughput comes '
                     "from the measurement record when the backend stored it.</p>")
    else:
        parts.append(f'<p class="muted">Not profiled: the {esc(str(f.get("backend")))} backend\'s numbers are '
                     "the models' predictions.</p>")
    for title, routing in (("Routing measured", measured_routing_lines(f.get("measured_routing"))),
                           ("Routing assumed", assumed_routing_lines(f.get("assumed_routing")))):
        if routing:
            parts.append(f"<h2>{title}</h2>")
            parts.append("<pre>" + esc("\n".join(routing)) + "</pre>")
    for title, state, column in (("Why candidates were pruned", "PRUNED", "prune_reason"),
                                 ("Why candidates failed", "FAIL", "fail_reason")):
        summary = reason_summary(run.records, state, column)
        if summary:
            parts.append(f"<h2>{title}</h2>")
            parts.append(_table(["trials", "reason (first clause; example)", "trial numbers"],
                                [[n, reason, ", ".join(map(str, nums[:8])) + (" ..." if len(nums) > 8 else "")]
                                 for reason, n, nums in summary]))
    configs = "".join(f"{d}/, " for d in config_dirs(f))
    parts.append(f'<p class="muted">Files: front.json, trials.csv, best.json, {configs}summary.md, front.png. '
                 f"plotly {esc(plotly_version())} embedded.</p>")
    data = {"trials": len(run.trials), "front": len(f["front"]), "pareto_div": PARETO_DIV}
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autotune report: {esc(run.name)}</title><style>{_CSS}</style>"
            "<script type=\"text/javascript\">",
            "</script>"
            f'<script type="application/json" id="autotune-summary">{json.dumps(data)}</script>'
            "</head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_report(run_dir: str, cfg: Optional[Config] = None) -> Optional[str]:
    """Write run_dir/report.html and run_dir/front.png from the run's files; returns report.html's path.
    ``cfg`` (the run's Config, when at hand) gives the exact GPU capacity and headroom. plotly and
    Pillow are the optional ``report`` extra: without one of them its file is skipped with a
    one-line note on stderr (None is returned when report.html could not be written)."""
    import importlib.util
    import sys

    run = load_run(run_dir)
    capacity, headroom = gpu_capacity(run, cfg)
    path: Optional[str] = os.path.join(run_dir, "report.html")
    if importlib.util.find_spec("plotly") is None:
        print("autotune: report.html skipped: plotly is not installed (pip install 'autotune[report]')",
              file=sys.stderr)
        path = None
    else:
        from autotune.report_plotly import plotly_js_bytes

        head, tail = _html_around_plotly_js(run, capacity, headroom)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as fh:  # render_html's text, encoded: plotly.js is copied as the file's bytes
            fh.write(head.encode("utf-8"))
            fh.write(plotly_js_bytes())
            fh.write(tail.encode("utf-8"))
        os.replace(tmp, path)
    if importlib.util.find_spec("PIL") is None:
        print("autotune: front.png skipped: Pillow is not installed (pip install 'autotune[report]')",
              file=sys.stderr)
    else:
        write_front_png(run, os.path.join(run_dir, "front.png"), capacity)
    return path
