"""Render a run's report.html in headless Chromium and check it.

    python benchmarks/check_report_chromium.py runs/<name>          # or .../report.html

Checks: the page logs nothing to the console (no errors, no warnings: every console message
from the page fails the check), the Pareto plot was drawn with one marker per trial in
trials.csv, and the memory-breakdown plot has one bar per (front point, component). Exit 0 when
all hold, 1 otherwise, 2 when Chromium or the files are missing. Needs Debian's ``chromium``
(``apt-get install -y chromium``); runs offline (file:// URL, background networking disabled).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CONSOLE_RE = re.compile(r":CONSOLE[:(]\d*\)?\] (.*)")
POINT_RE = re.compile(r'<path class="point[" ]')
BAR_RE = re.compile(r'<g class="point"')


def find_chromium() -> Optional[str]:
    for path in CHROMIUM_CANDIDATES:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def render(html_path: str, chromium: str, timeout: float = 120) -> tuple[str, list[str]]:
    """(DOM after load, console messages of the page) from headless Chromium."""
    with tempfile.TemporaryDirectory(prefix="autotune-chromium-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
               "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom",
               "file://" + os.path.abspath(html_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"chromium exited with {proc.returncode}: {proc.stderr[-2000:]}")
    console = [m.group(1) for line in proc.stderr.splitlines() if (m := CONSOLE_RE.search(line))]
    return proc.stdout, console


def _div(dom: str, div_id: str) -> str:
    """The DOM text of one plot div (up to the next plot div or the end)."""
    start = dom.find(f'id="{div_id}"')
    if start < 0:
        return ""
    nxt = dom.find('class="plotly-graph-div', dom.find(">", start))
    return dom[start:nxt if nxt > 0 else len(dom)]


def check(run_or_report: str, chromium: Optional[str] = None) -> dict[str, Any]:
    """Render and check; returns {'ok', 'problems', 'console', 'points', 'expected_points', ...}."""
    html_path = run_or_report if run_or_report.endswith(".html") else os.path.join(run_or_report, "report.html")
    run_dir = os.path.dirname(os.path.abspath(html_path))
    if not os.path.isfile(html_path):
        raise FileNotFoundError(f"{html_path}: no report.html (autotune show RUN_DIR --report writes it)")
    chromium = chromium or find_chromium()
    if not chromium:
        raise FileNotFoundError("chromium not found (apt-get install -y chromium)")
    with open(os.path.join(run_dir, "trials.csv"), newline="") as fh:
        expected_points = sum(1 for r in csv.DictReader(fh) if r["state"] in ("COMPLETE", "PRUNED", "FAIL"))
    with open(os.path.join(run_dir, "front.json")) as fh:
        front = json.load(fh)["front"]
    components = {k for p in front for k in (p.get("predicted_memory_gib") or {}) if k != "peak"}
    dom, console = render(html_path, chromium)
    points = len(POINT_RE.findall(_div(dom, "autotune-pareto")))
    bars = len(BAR_RE.findall(_div(dom, "autotune-breakdown")))
    problems = [f"console: {m}" for m in console]
    if points != expected_points:
        problems.append(f"Pareto plot shows {points} points, expected {expected_points} (one per trial)")
    if front and bars != len(front) * len(components):
        problems.append(f"breakdown plot shows {bars} bars, expected {len(front)} x {len(components)}")
    return {"ok": not problems, "problems": problems, "console": console, "points": points,
            "expected_points": expected_points, "bars": bars}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        result = check(argv[0])
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"check_report_chromium: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
