"""A sampler that keeps proposing evaluated candidates of a small space does not make the run ask
MAX_ASKS_PER_EVALUATION x n_trials trials: after STALL_ASKS asks without a new evaluation the
best-predicted candidate that fits and was never evaluated is queued, so a budget larger than the
space ends with every fitting candidate evaluated."""

import csv
import os

from autotune import search
from autotune.cli import main
from autotune.config import load_config
from autotune.screen import screen
from autotune.space import space_for
from conftest import EXAMPLES


def test_a_small_space_with_a_large_budget_ends_evaluating_every_fitting_candidate(tmp_path):
    job = os.path.join(EXAMPLES, "tiny-cpu.yaml")
    cfg = load_config(job)
    fits = {s.strategy.key() for s in screen(cfg, space_for(cfg), cfg.search.headroom) if s.memory.fits}
    n_trials = 3 * len(fits)  # more than the space holds
    assert main(["run", job, "--backend", "simulate", "--trials", str(n_trials), "--sampler", "nsga2",
                 "--out", str(tmp_path), "--name", "small", "--json"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "small" / "trials.csv")))
    complete = {r["strategy"] for r in rows if r["state"] == "COMPLETE"}
    assert len(complete) == len(fits)
    # NSGA-II alone asked the 20 x n_trials cap (6000 trials for 300 here) before stopping
    assert len(rows) < search.MAX_ASKS_PER_EVALUATION * n_trials / 2
