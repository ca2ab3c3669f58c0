"""report.html's figures equal what plotly.graph_objects builds for the same traces; front.png draws
every category. The graph_objects code below is the report's code before it wrote the dicts itself."""

import json
import os
import re

import pytest

from autotune import report, report_plotly
from autotune.report import BREAKDOWN_DIV, PARETO_DIV, load_run

import test_report

go = pytest.importorskip("plotly.graph_objects")


def make_run(tmp, name, gpus=8, space="default", trials=40, status=0):
    """test_report's run (its job text and CLI call), without writing the report."""
    return test_report.make_run(tmp, name, gpus, space, trials, status, report=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("figures"), "r8")


@pytest.fixture(scope="module")
def nofit_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("nofit"), "nofit", gpus=1, space="no-offload", trials=5, status=1)


def go_pareto(run, capacity, headroom):
    pts = report.plot_points(run, report._clip(run, capacity))
    best = (run.best or {}).get("trial")
    label = report.evaluated_label(run)
    fig = go.Figure()
    styles = {
        "front": dict(name=f"Pareto front ({label})", mode="lines+markers", line=dict(color="#d62728", width=1.5, shape="hv"),
                      marker=dict(size=[15 if p["trial"] == best else 10 for p in pts["front"]],
                                  symbol=["star" if p["trial"] == best else "circle" for p in pts["front"]],
                                  color="#d62728", line=dict(width=1, color="black"))),
        "dominated": dict(name=f"{label}, dominated", mode="markers", marker=dict(size=7, color="#1f77b4", opacity=0.6)),
        "failed": dict(name="failed (at predicted memory, 0 tokens/s)", mode="markers",
                       marker=dict(size=9, color="black",
                                   symbol=["triangle-right" if p["clipped"] else "x" for p in pts["failed"]])),
        "pruned": dict(name="pruned (at predicted memory, 0 tokens/s; \u25b7 = beyond the axis)", mode="markers",
                       marker=dict(size=7, color="#7f7f7f", symbol=["triangle-right-open" if p["clipped"]
                                                                    else "circle-open" for p in pts["pruned"]])),
    }
    for cat in ("pruned", "failed", "dominated", "front"):
        ps = pts[cat]
        fig.add_trace(go.Scatter(
            x=[p["memory_gib"] for p in ps], y=[p["tokens_per_s"] for p in ps],
            customdata=[[p["trial"], p["strategy"], p["note"]] for p in ps],
            hovertemplate=("trial %{customdata[0]}<br><b>%{customdata[1]}</b><br>"
                           + ("" if cat in ("pruned", "failed") else "GPU memory %{x:.2f} GiB<br>")
                           + "%{y:,.0f} tokens/s/GPU<br>%{customdata[2]}<extra>" + cat + "</extra>"),
            **styles[cat]))
    if capacity:
        fig.add_vline(x=capacity, line=dict(color="black", dash="dash"), annotation_text="GPU memory",
                      annotation_position="top left")
        if headroom:
            fig.add_vline(x=capacity * (1 - headroom), line=dict(color="#7f7f7f", dash="dot"),
                          annotation_text=f"with {100 * headroom:g}% headroom", annotation_position="bottom left")
    fig.update_layout(template="plotly_white", height=520, margin=dict(l=70, r=30, t=40, b=60),
                      xaxis_title=report.MEMORY_AXIS, yaxis_title="tokens/s per GPU",
                      legend=dict(orientation="h", y=-0.18), title="Memory vs throughput (star: recommended)")
    return fig


def go_breakdown(run, capacity, headroom):
    front = run.front["front"]
    comps = report._components(front)
    labels = [f"#{k} (trial {p['trial']})" for k, p in enumerate(front)]
    texts = [p.get("strategy_text", "") for p in front]
    fig = go.Figure()
    for comp in comps:
        fig.add_trace(go.Bar(
            name=comp.replace("_", " "), x=labels, y=[(p.get("predicted_memory_gib") or {}).get(comp, 0.0) for p in front],
            marker_color=report.COLORS.get(comp), customdata=texts,
            hovertemplate="%{customdata}<br>" + comp.replace("_", " ") + " %{y:.2f} GiB<extra></extra>"))
    label = f"{report.evaluated_label(run)} peak allocated"
    fig.add_trace(go.Scatter(
        name=label, x=labels, y=[p.get("peak_memory_gib") for p in front], mode="markers",
        marker=dict(symbol="diamond", size=11, color="black"), customdata=texts,
        hovertemplate="%{customdata}<br>" + label + " %{y:.2f} GiB<extra></extra>"))
    if capacity:
        fig.add_hline(y=capacity, line=dict(color="#d62728", dash="dash"), annotation_text=f"GPU capacity "
                      f"{capacity:.1f} GiB", annotation_position="top left")
        if headroom:
            fig.add_hline(y=capacity * (1 - headroom), line=dict(color="#7f7f7f", dash="dot"),
                          annotation_text=f"with {100 * headroom:g}% headroom", annotation_position="bottom left")
    fig.update_layout(template="plotly_white", barmode="stack", height=460, margin=dict(l=70, r=30, t=40, b=60),
                      yaxis_title="GiB per GPU (predicted)", title="Predicted memory breakdown of each front point")
    return fig


def embedded(text, div_id):
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', text)
    data, end = json.JSONDecoder().raw_decode(text, m.end())
    layout, _ = json.JSONDecoder().raw_decode(text, re.compile(r",\s*").match(text, end).end())
    return data, layout


CFG = {"displaylogo": False, "responsive": True}


@pytest.mark.parametrize("headroom", [0.05, None])
@pytest.mark.parametrize("capacity", [80.0, None])
def test_figures_equal_plotly_graph_objects(run_dir, capacity, headroom):
    run = load_run(run_dir)
    for ours, theirs, div in ((report.pareto_figure, go_pareto, PARETO_DIV),
                              (report.breakdown_figure, go_breakdown, BREAKDOWN_DIV)):
        fig = ours(run, capacity, headroom)
        ref = theirs(run, capacity, headroom)
        assert json.loads(json.dumps(fig)) == json.loads(ref.to_json())
        # the div plotly.io.to_html writes: the same markup around the same (parsed) figure
        mine = report_plotly.figure_div(fig, div, CFG)
        html = ref.to_html(full_html=False, include_plotlyjs=False, div_id=div, config=CFG)
        assert embedded(mine, div) == embedded(html, div)
        strip = re.compile(r"Plotly\.newPlot\(.*\)", re.S)
        assert strip.sub("", mine) == strip.sub("", html)


def test_no_front_figure_equals_plotly(nofit_dir):
    run = load_run(nofit_dir)
    fig = report.pareto_figure(run, 80.0, 0.05)
    assert json.loads(json.dumps(fig)) == json.loads(go_pareto(run, 80.0, 0.05).to_json())


def test_json_escapes_as_plotly():
    import plotly.io.json as pj

    value = {"a": "</script><b>x</b>", "n": [float("nan"), float("inf"), 1.5, None], "s": "\u25b7"}
    assert report_plotly.to_json(value) == pj.to_json_plotly(value, engine="json")


def test_plotly_js_and_version_are_the_packages():
    import plotly
    from plotly.offline import get_plotlyjs

    assert report_plotly.plotly_version() == plotly.__version__
    assert report_plotly.plotly_js() == get_plotlyjs()


def _pixels(path):
    from PIL import Image

    img = Image.open(path).convert("RGB")
    raw = img.tobytes()
    return img.size, [tuple(raw[i:i + 3]) for i in range(0, len(raw), 3)]


def _near(pixels, rgb, tol=40):
    return sum(all(abs(a - b) <= tol for a, b in zip(p, rgb)) for p in pixels)


def test_front_png_draws_each_category(run_dir, nofit_dir):
    report.write_report(run_dir)
    size, px = _pixels(os.path.join(run_dir, "front.png"))
    assert size == (880, 550)
    assert _near(px, (0xd6, 0x27, 0x28)) > 200  # the front's red markers and step line
    assert _near(px, (0xff, 0xd7, 0x00)) > 50  # the recommended point's gold star
    assert _near(px, (0x1f, 0x77, 0xb4), tol=60) + _near(px, (0x79, 0xad, 0xd2), tol=30) > 100  # dominated
    report.write_report(nofit_dir)
    size, px = _pixels(os.path.join(nofit_dir, "front.png"))
    assert size == (880, 550)
    assert _near(px, (0xd6, 0x27, 0x28)) == 0 and _near(px, (0xff, 0xd7, 0x00)) == 0  # no front, no star
    assert _near(px, (0x7f, 0x7f, 0x7f), tol=20) > 50  # the pruned points' grey rings


def test_nice_ticks_follow_matplotlib_steps():
    from autotune.report_png import nice_ticks, tick_label

    assert nice_ticks(0.1, 125.7, 8) == [20, 40, 60, 80, 100, 120]
    assert nice_ticks(-220.0, 4640.0, 8) == [0, 1000, 2000, 3000, 4000]
    ticks = nice_ticks(0.0, 1.0, 8)
    assert ticks[1] - ticks[0] == pytest.approx(0.2) and [tick_label(v, 0.2) for v in ticks][:2] == ["0", "0.2"]


def test_report_imports_neither_plotly_nor_matplotlib(run_dir):
    import subprocess
    import sys

    code = ("import sys; from autotune.report import write_report; write_report(sys.argv[1]); "
            "bad = [m for m in ('plotly', 'matplotlib', 'torch') if m in sys.modules]; assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code, run_dir], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
