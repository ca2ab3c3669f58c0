"""Turn a profiled run into a shipped measured table (data/measured/<name>/trials.csv + provenance.json).

The table itself comes from the ordinary profiling path, every candidate of the job's space measured
for real (DeepSpeed on whatever accelerator the machine has; here the CPU one, gloo):

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu nice -n -10 autotune run data/measured/<name>/config.yaml \\
        --backend profile --sampler sweep --trials <number of candidates> --out /tmp/measure --name <name>

(with ``hardware.gpu.memory_gib: 4`` while measuring; ``--sampler sweep``: every candidate once. One intra-op thread per rank and a
raised priority keep other jobs on a shared machine from stretching the steps: with torch's default
two threads on 2 busy cores, a step of tiny-llama's ZeRO-1 mbs 2 fp32 job took 0.1 s alone and 0.8-4.3 s
beside a test run)

then ``python benchmarks/measured_tables.py /tmp/measure/<name> data/measured/<name>`` copies the run's
trials.csv (only measured rows: COMPLETE and FAIL, no repeats or pruned rows) and adds
``tokens_per_s_spread`` (autotune.calibration.loop.throughput_spread of the trial's measured step
times, from trials/<n>/measurement.json) and ``step_times_s``; provenance.json records the command,
dates, commit and versions.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autotune.calibration.loop import throughput_spread  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: measured_tables.py RUN_DIR DEST_DIR [--started ISO] [--commit SHA]", file=sys.stderr)
        return 2
    run_dir, dest = argv[0], argv[1]
    opts = dict(zip(argv[2::2], argv[3::2]))
    with open(os.path.join(run_dir, "trials.csv"), newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if r["state"] in ("COMPLETE", "FAIL") and not r.get("duplicate_of")]
        fields = list(reader.fieldnames or [])
    for r in rows:
        path = os.path.join(run_dir, "trials", r["number"], "measurement.json")
        m = json.load(open(path)) if os.path.isfile(path) else {}
        spread = throughput_spread(m) if m.get("status") == "ok" else None
        r["tokens_per_s_spread"] = "" if spread is None else f"{spread:.5f}"
        times = (m.get("extra") or {}).get("step_times_s")
        r["step_times_s"] = " ".join(f"{t:.4f}" for t in times) if times else ""
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "trials.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields + ["tokens_per_s_spread", "step_times_s"])
        w.writeheader()
        w.writerows(rows)
    versions = {}
    for mod in ("torch", "deepspeed", "optuna"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # not installed here
            versions[mod] = None
    name = os.path.basename(os.path.normpath(dest))
    prov = {
        "command": f"OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu nice -n -10 autotune run data/measured/{name}/config.yaml "
                   f"--backend profile --sampler sweep --trials {len(rows)} --out /tmp/measure --name {name} (with "
                   f"hardware.gpu.memory_gib: 4); python "
                   f"benchmarks/measured_tables.py /tmp/measure/{name} data/measured/{name}",
        "started": opts.get("--started"), "written": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": opts.get("--commit"), "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "versions": versions,
        "rows": len(rows), "ok_rows": sum(r["state"] == "COMPLETE" for r in rows),
    }
    with open(os.path.join(dest, "provenance.json"), "w") as fh:
        json.dump(prov, fh, indent=1)
        fh.write("\n")
    print(f"{dest}: {len(rows)} measured rows ({prov['ok_rows']} ok)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
