"""The tables of benchmarks/search_cost.py in which the simulator is wrong for one level (issue 22).

Built from the measured tables that vary that knob (``level_sources``: every data/measured table but
the ``-loaded`` stress tests, whose fronts are set by load spikes):

* ``level-precision[:DIR]``: the job file's fp32 peak set to half its bf16 peak (the job says fp32 is
  2x slower than bf16; measured on that CPU, it is faster);
* ``level-engine[:DIR]``: the measured FSDP2 throughputs x1.3 (an engine 30% faster than predicted),
  and in a second table x0.7 (30% slower);
* ``offload-slow-link``: no measured table has offload, so the simulated table of search_cost's job
  with the host link (pcie_bandwidth_gbps) at a quarter of what the job file states: every offload
  candidate slower than predicted.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from tables import build_table, load_measured

from autotune.strategy import Strategy

LEVEL_KINDS = {"level-precision": "precision", "level-engine": "engine"}
"""level table kind -> the knob its source table must vary."""
ENGINE_FACTORS = (1.3, 0.7)
"""level-engine: the measured FSDP2 throughputs scaled by each."""
SLOW_LINK = 0.25
"""offload-slow-link: the host link's real bandwidth / the job file's."""


def level_tables(folder: str, kind: str, dest: str) -> list[tuple[str, str]]:
    """(label, folder) of the perturbed copies of the measured table in ``folder`` (none when it does
    not vary the kind's knob): level-precision: config.yaml's hardware.gpu.peak_tflops_fp32 set to
    half of peak_tflops_bf16; level-engine: the FSDP2 rows' tokens/s x each ENGINE_FACTORS."""
    import shutil

    import yaml

    _, _, _, rows = load_measured(folder)
    knob = LEVEL_KINDS[kind]
    if len({getattr(s, knob) for s, *_ in rows}) < 2:
        return []
    base = os.path.basename(os.path.normpath(folder))
    out = []
    for factor in (ENGINE_FACTORS if kind == "level-engine" else (None,)):
        where = os.path.join(dest, f"{base}-{kind}{'' if factor is None else f'-x{factor}'}")
        os.makedirs(where, exist_ok=True)
        for f in os.listdir(folder):
            if f.endswith(".yaml") or f == "trials.csv":
                shutil.copy(os.path.join(folder, f), where)
        if factor is None:
            with open(os.path.join(where, "config.yaml")) as fh:
                job = yaml.safe_load(fh)
            gpu = job["hardware"]["gpu"]
            gpu["peak_tflops_fp32"] = gpu["peak_tflops_bf16"] / 2.0
            with open(os.path.join(where, "config.yaml"), "w") as fh:
                yaml.safe_dump(job, fh, sort_keys=False)
            out.append((f"{base} fp32 peak stated 2x slower", where))
            continue
        with open(os.path.join(folder, "trials.csv"), newline="") as fh:
            table = list(csv.DictReader(fh))
        with open(os.path.join(where, "trials.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(table[0]))
            w.writeheader()
            for r in table:
                if r.get("engine") == "fsdp2" and r.get("state") == "COMPLETE":
                    r = {**r, "tokens_per_s_per_gpu": repr(float(r["tokens_per_s_per_gpu"]) * factor)}
                w.writerow(r)
        out.append((f"{base} fsdp2 x{factor}", where))
    return out


def slow_link_table(cfg: Any, screened: list, path: str) -> list[tuple[Strategy, float, float, float]]:
    """The simulated table of ``cfg`` measured over a host link SLOW_LINK x the stated one (exact
    otherwise): the offload candidates are slower than the job file predicts."""
    import dataclasses

    gpu = dataclasses.replace(cfg.hardware.gpu, pcie_bandwidth_gbps=cfg.hardware.gpu.pcie_bandwidth_gbps * SLOW_LINK)
    slow = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpu=gpu))
    return build_table(slow, screened, path, "exact")


def level_sources(root: str) -> list[str]:
    """The measured tables the level tables are built from: all but the ``-loaded`` stress tests."""
    return sorted(os.path.join(root, d) for d in os.listdir(root)
                  if os.path.isfile(os.path.join(root, d, "trials.csv")) and not d.endswith("-loaded"))
