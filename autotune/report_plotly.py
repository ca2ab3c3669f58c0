"""report.html's two interactive figures as plain plotly.js figure dicts, and the HTML that draws them.

The figures are what ``plotly.graph_objects`` builds for the same traces (tests/run/test_report_figures.py
compares them with it), written as dicts so that a report costs no import of plotly's Python
package and no validation of every point: ``plotly.io.to_html``'s div and script
(plotly/io/_html.py, ``to_html`` with ``full_html=False, include_plotlyjs=False``) and its JSON
encoding (plotly/io/_json.py, ``to_json_plotly``: compact, non-finite numbers as null, ``< > /``
escaped) are reproduced here. plotly.js itself and the ``plotly_white`` template are read from the
installed plotly package's data files, the ones ``plotly.offline.get_plotlyjs`` and
``plotly.io.templates`` read.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Optional

FRONT_RED = "#d62728"
PRUNED_GREY = "#7f7f7f"
TEMPLATE = "plotly_white"
_SWAP = (("<", "\\u003c"), (">", "\\u003e"), ("/", "\\u002f"))
"""to_json_plotly's replacements, so that a string in the JSON never closes the script element."""


def plotly_dir() -> Optional[str]:
    """The installed plotly package's folder (found without importing it), None when not installed."""
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def plotly_js() -> str:
    """plotly.min.js as shipped in the plotly package (what plotly.offline.get_plotlyjs returns)."""
    return plotly_js_bytes().decode("utf-8")


def plotly_js_bytes() -> bytes:
    """plotly.min.js's file, UTF-8."""
    with open(os.path.join(plotly_dir() or "", "package_data", "plotly.min.js"), "rb") as fh:
        return fh.read()


def plotly_version() -> str:
    from importlib.metadata import version

    return version("plotly")


@functools.lru_cache(maxsize=None)
def _template_text(name: str) -> str:
    with open(os.path.join(plotly_dir() or "", "package_data", "templates", f"{name}.json"), encoding="utf-8") as fh:
        return fh.read()


def template(name: str = TEMPLATE) -> dict[str, Any]:
    """A plotly.io template as plotly.js takes it in ``layout.template`` (a fresh copy)."""
    return json.loads(_template_text(name))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """JSON as plotly.io.json.to_json_plotly (engine json) writes it."""
    text = json.dumps(value, separators=(",", ":"))
    if "NaN" in text or "Infinity" in text:  # PlotlyJSONEncoder writes them as null
        text = json.dumps(_finite(value), separators=(",", ":"))
    for unsafe, safe in _SWAP:
        text = text.replace(unsafe, safe)
    return text


def vline(x: float, color: str, dash: str, text: str, position: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shape and annotation of plotly's ``fig.add_vline(x, annotation_position="top left" | "bottom
    left")`` (plotly/shapeannotation.py)."""
    top = position == "top left"
    shape = {"line": {"color": color, "dash": dash}, "type": "line", "x0": x, "x1": x, "xref": "x",
             "y0": 0, "y1": 1, "yref": "y domain"}
    note = {"showarrow": False, "text": text, "x": x, "xanchor": "right", "xref": "x", "y": 1 if top else 0,
            "yanchor": "top" if top else "bottom", "yref": "y domain"}
    return shape, note


def hline(y: float, color: str, dash: str, text: str, position: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shape and annotation of plotly's ``fig.add_hline(y, annotation_position=...)``."""
    top = position == "top left"
    shape = {"line": {"color": color, "dash": dash}, "type": "line", "x0": 0, "x1": 1, "xref": "x domain",
             "y0": y, "y1": y, "yref": "y"}
    note = {"showarrow": False, "text": text, "x": 0, "xanchor": "left", "xref": "x domain", "y": y,
            "yanchor": "bottom" if top else "top", "yref": "y"}
    return shape, note


def _lines(lines: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    return {"shapes": [s for s, _ in lines], "annotations": [a for _, a in lines]} if lines else {}


def _limits(capacity: Optional[float], headroom: Optional[float], line: Any, first: str) -> list[tuple[dict, dict]]:
    if not capacity:
        return []
    out = [line(capacity, *first)]
    if headroom:
        out.append(line(capacity * (1 - headroom), PRUNED_GREY, "dot", f"with {100 * headroom:g}% headroom",
                        "bottom left"))
    return out


def pareto_figure(pts: dict[str, list[dict[str, Any]]], best: Optional[int], label: str, memory_axis: str,
                  capacity: Optional[float], headroom: Optional[float]) -> dict[str, Any]:
    """Every trial by category (report.plot_points), the recommended front point (trial ``best``) as a
    star, the GPU capacity and the headroom limit as vertical lines."""
    front = pts["front"]
    markers = {
        "front": dict(color=FRONT_RED, line=dict(color="black", width=1),
                      size=[15 if p["trial"] == best else 10 for p in front],
                      symbol=["star" if p["trial"] == best else "circle" for p in front]),
        "dominated": dict(color="#1f77b4", opacity=0.6, size=7),
        "failed": dict(color="black", size=9,
                       symbol=["triangle-right" if p["clipped"] else "x" for p in pts["failed"]]),
        "pruned": dict(color=PRUNED_GREY, size=7,
                       symbol=["triangle-right-open" if p["clipped"] else "circle-open" for p in pts["pruned"]]),
    }
    names = {"front": f"Pareto front ({label})", "dominated": f"{label}, dominated",
             "failed": "failed (at predicted memory, 0 tokens/s)",
             "pruned": "pruned (at predicted memory, 0 tokens/s; \u25b7 = beyond the axis)"}
    data = []
    for cat in ("pruned", "failed", "dominated", "front"):
        ps = pts[cat]
        trace: dict[str, Any] = {
            "customdata": [[p["trial"], p["strategy"], p["note"]] for p in ps],
            "hovertemplate": ("trial %{customdata[0]}<br><b>%{customdata[1]}</b><br>"
                              + ("" if cat in ("pruned", "failed") else "GPU memory %{x:.2f} GiB<br>")
                              + "%{y:,.0f} tokens/s/GPU<br>%{customdata[2]}<extra>" + cat + "</extra>"),
        }
        if cat == "front":
            trace["line"] = {"color": FRONT_RED, "shape": "hv", "width": 1.5}
        trace.update(marker=markers[cat], mode="lines+markers" if cat == "front" else "markers", name=names[cat],
                     x=[p["memory_gib"] for p in ps], y=[p["tokens_per_s"] for p in ps], type="scatter")
        data.append(trace)
    layout = {"template": template(),
              **_lines(_limits(capacity, headroom, vline, ("black", "dash", "GPU memory", "top left"))),
              "margin": {"l": 70, "r": 30, "t": 40, "b": 60}, "legend": {"orientation": "h", "y": -0.18},
              "height": 520, "xaxis": {"title": {"text": memory_axis}},
              "yaxis": {"title": {"text": "tokens/s per GPU"}},
              "title": {"text": "Memory vs throughput (star: recommended)"}}
    return {"data": data, "layout": layout}


def breakdown_figure(front: list[dict[str, Any]], components: list[str], colors: dict[str, str], label: str,
                     capacity: Optional[float], headroom: Optional[float]) -> dict[str, Any]:
    """One stacked bar per front point (its predicted components, GiB), its peak as a diamond, the GPU
    capacity and the headroom limit as horizontal lines."""
    labels = [f"#{k} (trial {p['trial']})" for k, p in enumerate(front)]
    texts = [p.get("strategy_text", "") for p in front]
    data: list[dict[str, Any]] = []
    for comp in components:
        name = comp.replace("_", " ")
        marker = {"color": colors[comp]} if colors.get(comp) is not None else {}
        data.append({"customdata": texts, "hovertemplate": "%{customdata}<br>" + name + " %{y:.2f} GiB<extra></extra>",
                     "marker": marker, "name": name, "x": labels,
                     "y": [(p.get("predicted_memory_gib") or {}).get(comp, 0.0) for p in front], "type": "bar"})
    peak = f"{label} peak allocated"
    data.append({"customdata": texts, "hovertemplate": "%{customdata}<br>" + peak + " %{y:.2f} GiB<extra></extra>",
                 "marker": {"color": "black", "size": 11, "symbol": "diamond"}, "mode": "markers", "name": peak,
                 "x": labels, "y": [p.get("peak_memory_gib") for p in front], "type": "scatter"})
    first = (FRONT_RED, "dash", f"GPU capacity {capacity or 0:.1f} GiB", "top left")
    layout = {"template": template(), **_lines(_limits(capacity, headroom, hline, first)),
              "margin": {"l": 70, "r": 30, "t": 40, "b": 60}, "barmode": "stack", "height": 460,
              "yaxis": {"title": {"text": "GiB per GPU (predicted)"}},
              "title": {"text": "Predicted memory breakdown of each front point"}}
    return {"data": data, "layout": layout}


def figure_div(fig: dict[str, Any], div_id: str, config: dict[str, Any]) -> str:
    """``plotly.io.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id, config=config)``
    (its format strings, with no MathJax and no plotly.js)."""
    height = fig["layout"].get("height")
    height = f"{height}px" if height is not None else "100%"
    script = """\
                if (document.getElementById("{id}")) {{\
                    Plotly.newPlot(\
                        "{id}",\
                        {data},\
                        {layout},\
                        {config}\
                    )\
                }}""".format(id=div_id, data=to_json(fig["data"]), layout=to_json(fig["layout"]),
                             config=json.dumps(config))
    return """\
<div style="height:{height}; width:{width};">\
        {mathjax_script}\
        {load_plotlyjs}\
            <div id="{id}" class="plotly-graph-div" \
style="height:100%; width:100%;"></div>\
            <script>\
                window.PLOTLYENV=window.PLOTLYENV || {{}};\
                {script};\
            </script>\
        </div>""".format(mathjax_script="", load_plotlyjs="", id=div_id, width="100%", height=height,
                         script=script).strip()
