"""The README and docs/ are an executable contract: every command of their ``sh`` blocks runs verbatim,
in order (the README, then the pages of DOCS in that order), from the root of a fresh copy of the
repository with default paths, as a new user would type it.

Excepted, as the README says: installs (``pip ...``), the test command itself (``python -m pytest``)
and the GPU scripts (``benchmarks/gpu_*``). Each command must exit 0; afterwards the files the README
promises must be there, and the profiling examples must have measured trials.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = (re.compile(r"^pip\s"), re.compile(r"^python -m pytest\b"), re.compile(r"benchmarks/gpu_"))
DOCS = ("cli.md", "engines.md", "run-directory.md", "trainers.md", "profiling.md", "config.md", "search.md",
        "accuracy.md", "long-context.md", "simulate-long-context.md", "moe.md", "reliability.md", "architecture.md")
"""docs/ pages in the order their commands run (later pages may use the runs of earlier ones)."""
README_MAX_LINES = 250


def all_commands() -> list[str]:
    """The sh-block commands of the README, then of every page of DOCS."""
    pages = [ROOT / "README.md"] + [ROOT / "docs" / name for name in DOCS]
    return [c for page in pages for c in readme_commands(page.read_text())]


def test_every_docs_page_is_run_and_the_readme_is_short():
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(DOCS)
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
    for page in ["README.md"] + [f"docs/{name}" for name in DOCS]:  # relative links point at files
        text = (ROOT / page).read_text()
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", text):
            path = (ROOT / page).parent.joinpath(target) if target else ROOT / page
            assert path.exists(), (page, target)
            if anchor and path.suffix == ".md":  # the heading exists, as GitHub slugs it
                assert anchor in _slugs(path.read_text()), (page, target, anchor)


def _slugs(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces -."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def readme_commands(text: str) -> list[str]:
    """Every command line of the ``sh`` fenced blocks, trailing comments removed."""
    commands, block = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block == "sh" and line.strip():
            command = re.split(r"\s+#\s", line.strip(), maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def test_readme_command_extraction():
    text = "x\n```sh\npip install -e .   # light\nautotune run a.yaml  # note\n\n```\n```yaml\nkey: v\n```\n"
    assert readme_commands(text) == ["pip install -e .", "autotune run a.yaml"]


def fresh_copy(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked, plus new files git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def completed(run_dir: Path) -> list[dict[str, str]]:
    return [r for r in csv.DictReader(open(run_dir / "trials.csv")) if r["state"] == "COMPLETE"]


def check_fsdp2_profile_run(run: Path) -> None:
    """An FSDP2 example profiled with --trials 2: measured memory from both ranks, fsdp2_configs/<k>.json
    + .py per front point, a torchrun launch line, no DeepSpeed files."""
    assert json.loads((run / "run.json").read_text())["backend"] == "profile"
    front = json.loads((run / "front.json").read_text())
    assert front["backend"] == "profile" and front["trials"]["complete"] == 2
    rows = list(csv.DictReader(open(run / "trials.csv")))
    assert [r["engine"] for r in rows] == ["fsdp2", "fsdp2"]
    assert all(r["state"] == "COMPLETE" and float(r["peak_memory_gib"]) > 0 for r in rows)
    for k, point in enumerate(front["front"]):
        assert point["ds_config"] is None and point["fsdp2_config"] == f"fsdp2_configs/{k}.json"
        layout = json.loads((run / point["fsdp2_config"]).read_text())
        assert layout["engine"] == "fsdp2" and layout["mesh"]["shape"] == [2]
        assert layout["fully_shard"]["reshard_after_forward"] == point["strategy"]["reshard_after_forward"]
        compile((run / point["fsdp2_snippet"]).read_text(), point["fsdp2_snippet"], "exec")
        launch = point["launch"].split()  # the example script with the job's and the layout's absolute paths
        assert launch[:5] == ["torchrun", "--nproc_per_node", "2", "-m", "autotune.examples.train_fsdp2"]
        assert Path(launch[launch.index("--fsdp2") + 1]) == (run / point["fsdp2_config"]).absolute()
        assert Path(launch[launch.index("--job") + 1]).is_absolute()
    assert not (run / "ds_configs").exists()  # no DeepSpeed point, no empty DeepSpeed folder
    best = json.loads((run / "best.json").read_text())
    assert best["fsdp2_config"] == "best_fsdp2_config.json" and (run / "best_fsdp2.py").is_file()
    assert json.loads((run / "best_fsdp2_config.json").read_text()) == json.loads(
        (run / front["front"][[p["trial"] for p in front["front"]].index(best["trial"])]["fsdp2_config"]).read_text())
    measurement = json.loads((run / "trials" / "0" / "measurement.json").read_text())
    assert measurement["extra"]["optimizer"] == "AdamW" and measurement["peak_memory_bytes"] > 0
    assert len(measurement["extra"]["per_rank_peak_bytes"]) == 2


def check_measured_routing(run: Path) -> None:
    """A profiled MoE example with EP trials: each EP trial's measurement states the routing its steps measured
    and predicts its peak with it inside the memory benchmark's bounds (none under -2%, none over +3%), never
    above the job's factors' prediction (autotune's default bounds); front.json keeps the worst over them."""
    front = json.loads((run / "front.json").read_text())
    ep = [r for r in completed(run) if r["expert_parallel_size"] == "2"]
    assert ep and front["measured_routing"]["trials"] == [int(r["number"]) for r in ep]
    for row in ep:
        extra = json.loads((run / "trials" / row["number"] / "measurement.json").read_text())["extra"]
        assert 1.0 <= extra["routing"]["ep_step_imbalance"] <= extra["routing"]["ep_rank_imbalance"]
        assert extra["routing"]["ep_rank_imbalance"] <= extra["routing"]["moe_load_imbalance"]
        for key, value in extra["routing"].items():  # the worst over the trials covers each
            worst = front["measured_routing"]["factors"][key]
            assert value >= worst if key == "moe_min_load" else value <= worst, (key, value, worst)
        assert -2.0 <= extra["memory_error_at_routing_pct"] <= 3.0, extra
        assert extra["predicted_peak_at_routing_bytes"] <= extra["predicted_peak_bytes"]
    assert "## Routing measured" in (run / "summary.md").read_text()
    assert "<h2>Routing measured</h2>" in (run / "report.html").read_text()


@pytest.mark.slow
def test_readme_commands_run_verbatim(tmp_path):
    commands = all_commands()
    runnable = [c for c in commands if not any(p.search(c) for p in SKIPPED)]
    assert len(runnable) >= 15, runnable  # the README's examples did not silently disappear
    repo = fresh_copy(tmp_path / "repo")
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for command in runnable:
        proc = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"README command failed ({proc.returncode}): {command}\n{proc.stderr[-3000:]}"

    runs = repo / "runs"
    # the files `autotune run` promises (quick start, simulate backend)
    llama = runs / "latest-llama2-7b"
    front = json.loads((llama / "front.json").read_text())
    # the engine's files: a DeepSpeed config, or an FSDP2 layout and snippet (default space: both engines)
    fsdp2 = [p["strategy"]["engine"] == "fsdp2" for p in (front["front"][0], front["best"])]
    for name in ("study.journal", "run.json", "trials.csv", "front.json", "best.json", "summary.md", "report.html",
                 "front.png", "fsdp2_configs/0.py" if fsdp2[0] else "ds_configs/0.json",
                 "best_fsdp2.py" if fsdp2[1] else "best_ds_config.json"):
        assert (llama / name).exists(), name
    assert front["front"] and front["best"]["why"] and front["best"]["checkpointing"]
    # the nightly runs compared against their baseline (the README's `ls` checked the artefacts)
    nightly = sorted(runs.glob("llama2-7b-*/compare.json"))
    assert len(nightly) == 2 and all(json.loads(p.read_text())["verdict"] == "ok" for p in nightly)
    # the profiling examples measured real trials on this CPU
    (tiny,) = runs.glob("tiny-cpu-2*")  # `autotune run examples/tiny-cpu.yaml --trials 3`, default name
    for run_dir in (tiny, runs / "latest-custom-model"):
        done = completed(run_dir)
        assert done, f"{run_dir.name}: no measured trial"
        for row in done:
            m = json.loads((run_dir / "trials" / row["number"] / "measurement.json").read_text())
            assert m["status"] == "ok" and m["peak_memory_bytes"] > 0 and m["tokens_per_s_per_gpu"] > 0
        assert (run_dir / "study.db").is_file()
    # docs/profiling.md's `autotune run examples/tiny-cpu-fsdp2.yaml --backend profile --trials 2`
    # (default name): real FSDP2 trials on 2 CPU ranks, the one end-to-end run of this path
    (fsdp2_run,) = runs.glob("tiny-cpu-fsdp2-2*")
    check_fsdp2_profile_run(fsdp2_run)
    # docs/moe.md's `autotune run examples/tiny-cpu-moe.yaml`: its EP trials measured their routing
    (moe_run,) = runs.glob("tiny-cpu-moe-2*")
    check_measured_routing(moe_run)
    # the profiled tiny example: the memory model's prediction within 2% of every measured peak (the
    # reference decoder it predicts is the model that ran; the custom model is the user's own)
    for row in completed(tiny):
        m = json.loads((tiny / "trials" / row["number"] / "measurement.json").read_text())
        error = m["extra"]["predicted_peak_bytes"] / m["peak_memory_bytes"] - 1
        assert abs(error) <= 0.02, (row["strategy"], error)
    assert "Predicted vs measured" in (tiny / "report.html").read_text()
    # the shared-study example: the run, the worker and the resumed run each profiled a candidate
    shared = runs / "shared"
    assert len(completed(shared)) >= 2 and json.loads((shared / "front.json").read_text())["front"]
    assert not (ROOT / "runs" / "shared").exists() or ROOT == repo  # nothing written into the checkout
