"""report.html / front.png written from a real simulate run's files; headless-Chromium render check."""

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import autotune.cli
from autotune.report import BREAKDOWN_DIV, PARETO_DIV, write_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = float(1 << 30)
JOB = """
model: {{preset: llama2-7b}}
training: {{seq_len: 4096, global_batch_size: 64}}
hardware: {{gpu: a100-80gb, gpus_per_node: {gpus}, cpu_memory_gib: 1024}}
search: {{space: {space}, trials: {trials}, headroom: 0.05, seed: 1}}
"""


def make_run(tmp, name, gpus=8, space="default", trials=80, status=0, report=True):
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(JOB.format(gpus=gpus, space=space, trials=trials))
    assert autotune.cli.main(["run", str(cfg), "--out", str(tmp / "runs"), "--name", name, "--json"]) == status
    run_dir = str(tmp / "runs" / name)
    if report:
        write_report(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("report"), "r8")


@pytest.fixture(scope="module")
def nofit(tmp_path_factory):
    """Llama-2-7B on one A100-80GB without offload: nothing fits, every trial is pruned."""
    return make_run(tmp_path_factory.mktemp("nofit"), "nofit", gpus=1, space="no-offload", trials=15, status=1)


def rows(run_dir):
    with open(os.path.join(run_dir, "trials.csv"), newline="") as fh:
        return list(csv.DictReader(fh))


def front(run_dir):
    with open(os.path.join(run_dir, "front.json")) as fh:
        return json.load(fh)


def html(run_dir):
    with open(os.path.join(run_dir, "report.html"), encoding="utf-8") as fh:
        return fh.read()


def figure_data(text, div_id):
    """The traces passed to Plotly.newPlot for one div (parsed from the embedded JSON)."""
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', text)
    assert m, f"no Plotly.newPlot for {div_id}"
    data, end = json.JSONDecoder().raw_decode(text, m.end())
    layout, _ = json.JSONDecoder().raw_decode(text, re.compile(r",\s*").match(text, end).end())
    return data, layout


def test_report_is_self_contained(run):
    text = html(run)
    assert re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=\s*[\"']?(https?:)?//", text, re.I) is None
    assert re.search(r"<script\b[^>]*\bsrc=", text, re.I) is None  # every script inline
    assert "Plotly.newPlot" in text and len(text) > 1_000_000  # plotly.js embedded (~4.7 MB)


def test_pareto_plot_has_every_trial(run):
    data, layout = figure_data(html(run), PARETO_DIV)
    trials = rows(run)
    assert sum(len(t["x"]) for t in data) == len(trials)
    by_name = {t["name"].split(" (")[0]: t for t in data}
    f = front(run)
    # every front point and its equivalents (within measurement resolution: output.collapse_front), which
    # trials.csv marks on_front too
    on_front = [p["gpu_memory_gib"] for p in f["front"]] + [e["gpu_memory_gib"] for p in f["front"]
                                                            for e in p.get("equivalents", [])]
    assert len(by_name["Pareto front"]["x"]) == len(on_front)
    # memory as fits counts it (allocated peak + context and allocator), the table's figure
    # (drawn in the order of that figure, which the overhead can reorder against the allocated peak)
    assert sorted(by_name["Pareto front"]["x"]) == pytest.approx(sorted(on_front), rel=1e-5)
    # the simulate backend's points are simulated, and the legend says so
    assert {t["name"] for t in data} >= {"Pareto front (simulated)", "simulated, dominated"}
    assert not any("measured" in t["name"] for t in data)
    assert len(by_name["pruned"]["x"]) == sum(r["state"] == "PRUNED" for r in trials) > 0
    assert all(y == 0 for y in by_name["pruned"]["y"])
    # hover carries the strategy in words
    hovered = {c[1] for t in data for c in t["customdata"]}
    assert {r["strategy"] for r in trials} <= hovered
    assert "%{customdata[1]}" in by_name["Pareto front"]["hovertemplate"]
    # the recommended point is the star
    best = f["best"]["trial"]
    stars = [c[0] for c, s in zip(by_name["Pareto front"]["customdata"], by_name["Pareto front"]["marker"]["symbol"])
             if s == "star"]
    assert stars == [best]
    # GPU capacity line at the preset's memory
    from autotune.presets import gpu_from_name

    cap = gpu_from_name("a100-80gb").memory_bytes / GIB
    assert any(abs(s.get("x0", -1) - cap) < 1e-9 for s in layout.get("shapes", []))


def test_breakdown_bars_per_front_point(run):
    data, layout = figure_data(html(run), BREAKDOWN_DIV)
    f = front(run)
    bars = [t for t in data if t["type"] == "bar"]
    names = [t["name"] for t in bars]
    assert names[:3] == ["parameters", "gradients", "optimizer states"]
    assert {"activations", "overhead"} <= set(names)
    for t in bars:
        assert len(t["y"]) == len(f["front"])
    key = {t["name"]: t for t in bars}
    assert key["optimizer states"]["y"] == pytest.approx(
        [p["predicted_memory_gib"]["optimizer_states"] for p in f["front"]])
    assert any(s.get("y0") and s["y0"] > 70 for s in layout["shapes"])  # capacity line
    assert layout["barmode"] == "stack"


def test_prune_reasons_summarised(run):
    text = html(run)
    assert "Why candidates were pruned" in text
    section = text[text.index("Why candidates were pruned"):]
    counts = [int(n) for n in re.findall(r"<tr><td>(\d+)</td>", section.split("</table>")[0])]
    assert sum(counts) == sum(r["state"] == "PRUNED" and not r["duplicate_of"] for r in rows(run))


def test_front_png(run):
    with open(os.path.join(run, "front.png"), "rb") as fh:
        head = fh.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(os.path.join(run, "front.png")) > 10_000


def test_no_fit_run_still_reports(nofit):
    assert front(nofit)["front"] == []
    text = html(nofit)
    assert "no candidate fits" in text and BREAKDOWN_DIV not in text
    data, _ = figure_data(text, PARETO_DIV)
    assert sum(len(t["x"]) for t in data) == len(rows(nofit)) > 0
    assert os.path.isfile(os.path.join(nofit, "front.png"))


def test_predicted_vs_measured_table_for_a_measuring_backend(run, tmp_path):
    """A run measured by a real backend gets the table (here: a copy relabelled as profile)."""
    import shutil

    copy = str(tmp_path / "measured")
    shutil.copytree(run, copy)
    f = front(copy)
    f["backend"] = "profile"
    with open(os.path.join(copy, "front.json"), "w") as fh:
        json.dump(f, fh)
    text = html(run)
    assert "Not profiled" in text
    write_report(copy)
    text = html(copy)
    section = text[text.index("Predicted vs measured"):].split("</table>")[0]
    measured = [r for r in rows(copy) if r["state"] in ("COMPLETE", "FAIL") and not r["duplicate_of"]]
    assert section.count("<tr><td>") == len(measured) > 0


def test_report_never_imports_torch(run):
    code = ("import sys; from autotune.report import write_report; write_report(sys.argv[1]); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code, run], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_missing_run_dir_is_a_config_error(tmp_path):
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError, match="no such run directory"):
        write_report(str(tmp_path / "nope"))


def _checker():
    spec = importlib.util.spec_from_file_location("check_report_chromium",
                                                  os.path.join(ROOT, "benchmarks", "check_report_chromium.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


needs_chromium = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                    reason="/usr/bin/chromium absent (apt-get install -y chromium)")


@needs_chromium
def test_report_renders_in_headless_chromium(run):
    result = _checker().check(run)
    assert result["console"] == []
    assert result["points"] == len(rows(run)) > 0
    assert result["ok"], result["problems"]


@needs_chromium
def test_chromium_check_catches_console_errors_and_missing_points(run, tmp_path):
    """The checker itself fails on a broken page: a script error and a plot that never drew."""
    import shutil

    broken = str(tmp_path / "broken")
    shutil.copytree(run, broken)
    text = html(broken).replace("Plotly.newPlot(", "Plotly.noSuchFunction(", 1)
    with open(os.path.join(broken, "report.html"), "w", encoding="utf-8") as fh:
        fh.write(text)
    result = _checker().check(broken)
    assert not result["ok"]
    assert any("noSuchFunction" in m for m in result["console"])
    assert result["points"] == 0


# ---------------------------------------------------------------- memory snapshots (autotune.worker.snapshot)

def test_oom_note_follows_the_seed_table():
    from autotune.worker.snapshot import oom_note

    assert oom_note("init").startswith("OOM in init: the model states do not fit") and "ZeRO-3" in oom_note("init")
    assert "activation checkpointing" in oom_note("forward")
    assert "gradient accumulation" in oom_note("backward")
    assert oom_note(None) == "out of memory (phase unknown)"


def test_snapshot_module_does_not_import_torch():
    code = "import sys, autotune.worker.snapshot; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_snapshot_is_a_no_op_without_cuda(tmp_path):
    if _cuda():
        pytest.skip("CUDA present: covered by the CUDA test")
    from autotune.worker.snapshot import memory_snapshot

    with memory_snapshot(str(tmp_path / "s.pickle")) as info:
        pass
    assert info["path"] is None and not (tmp_path / "s.pickle").exists()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_snapshot_records_allocations_and_survives_oom(tmp_path):
    import torch

    from autotune.worker.snapshot import memory_snapshot, summarize

    path = str(tmp_path / "s.pickle")
    with memory_snapshot(path) as info:
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del x
    assert info["path"] == path
    s = summarize(path)
    assert s["trace_events"] >= 2 and s["segments"] >= 1
    oom = str(tmp_path / "oom.pickle")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with memory_snapshot(oom):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert os.path.isfile(oom)
