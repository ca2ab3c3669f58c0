"""The ehvi sampler (autotune/samplers/front.py): closed-form EHVI, the choice it makes, stopping, resume."""

from __future__ import annotations

import os

import numpy as np
import pytest

from autotune.config import load_config
from autotune.pareto import hypervolume as hv_pareto
from autotune.backends.base import SimulateBackend
from autotune.samplers.front import (FrontSampler, _staircase_area, expected_hvi, expected_remaining_gain, gp_posterior,
                              hypervolume)
from autotune.search import run_study, screen, trial_strategy
from autotune.space import load_space

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _candidates():
    """A 3-point front (memory, tokens/s), the reference memory, and 4 candidates' memory with the
    mean and spread of their log throughput."""
    front = [(10.0, 100.0), (20.0, 150.0), (35.0, 180.0)]
    return (front, 50.0, np.array([5.0, 15.0, 30.0, 45.0]), np.log(np.array([90.0, 160.0, 170.0, 200.0])),
            np.array([0.2, 0.1, 0.05, 0.3]))


def test_closed_form_ehvi_matches_monte_carlo_with_optunas_hypervolume():
    rng = np.random.default_rng(0)
    front, ref, x, mu, sd = _candidates()
    got = expected_hvi(x, mu, sd, front, ref)
    base = hypervolume(front, ref)
    assert base == pytest.approx(hv_pareto(front, (ref, 0.0)))
    for i in range(len(x)):
        ys = np.exp(mu[i] + sd[i] * rng.standard_normal(1500))
        mc = np.mean([hypervolume(front + [(x[i], y)], ref) - base for y in ys])
        assert got[i] == pytest.approx(mc, rel=0.08, abs=1.0), i


def test_remaining_gain_is_the_expected_improvement_of_profiling_everything_left():
    rng = np.random.default_rng(1)
    front, ref, x, mu, sd = _candidates()
    base = hypervolume(front, ref)
    # the vectorised staircase is Optuna's hypervolume
    sets = [[(float(m), float(t)) for m, t in zip(rng.uniform(0, 60, 12), rng.uniform(0, 200, 12))] for _ in range(5)]
    areas = _staircase_area(np.array([[p[0] for p in q] for q in sets]), np.array([[p[1] for p in q] for q in sets]), ref)
    assert areas == pytest.approx([hypervolume(q, ref) for q in sets])
    got = expected_remaining_gain(x, mu, sd, front, ref, samples=4000)
    draws = np.exp(mu + sd * rng.standard_normal((3000, len(x))))
    mc = np.mean([hypervolume(front + list(zip(x, y)), ref) - base for y in draws])
    assert got == pytest.approx(mc, rel=0.05)
    # more than the best single candidate, less than their sum (improvements overlap)
    single = expected_hvi(x, mu, sd, front, ref)
    assert single.max() < got < single.sum()
    # draws lowered by the noise: gains within noise count for nothing
    lowered = expected_remaining_gain(x, mu, sd, front, ref, noise=0.05, samples=4000)
    assert lowered == pytest.approx(expected_remaining_gain(x, mu - np.log(1.05), sd, front, ref, samples=4000))
    assert lowered < got
    assert expected_remaining_gain(x[:0], mu[:0], sd[:0], front, ref) == 0.0


def test_gains_within_noise_are_not_chased():
    front = [(10.0, 100.0)]
    x, mu, sd = np.array([5.0]), np.log(np.array([103.0])), np.array([1e-6])
    assert expected_hvi(x, mu, sd, front, 50.0)[0] == pytest.approx(5.0 * 103.0 + 40.0 * 3.0, rel=1e-6)
    # 3% better than the front point is within a 5% step-to-step noise: only the new memory range counts
    assert expected_hvi(x, mu, sd, front, 50.0, noise=0.05)[0] == pytest.approx(5.0 * 103.0, rel=1e-6)


def test_residual_model_learns_and_shrinks():
    x = np.array([[0.0], [0.5], [1.0]])
    mean, var, _ = gp_posterior(x, np.array([0.1, 0.1, 0.1]), np.array([[0.25], [0.5]]))
    assert mean == pytest.approx([0.1, 0.1], abs=0.02)
    _, prior, _ = gp_posterior(x[:0], np.array([]), np.array([[0.25]]))
    assert var[0] < prior[0]


@pytest.fixture(scope="module")
def job():
    cfg = load_config(os.path.join(ROOT, "examples", "llama2-7b.yaml"))
    space = load_space("no-offload", ROOT)
    return cfg, space


def _points(study, space, cfg):
    return [(t.values[0], t.values[1]) for t in study.get_trials() if t.state.name == "COMPLETE"
            and "duplicate_of" not in t.user_attrs]


def test_exact_simulator_reaches_the_front_in_fewer_trials_than_its_size_and_stops(job):
    cfg, space = job
    screened = screen(cfg, space, cfg.search.headroom)
    feasible = [s for s in screened if s.memory.fits]
    pts = [(s.memory.gpu["peak"] / 2**30, s.tokens_per_s_per_gpu) for s in feasible]
    ref = (cfg.hardware.gpu.memory_bytes * (1 - cfg.search.headroom) / 2**30, 0.0)
    from autotune.pareto import pareto_front

    front_size = len(pareto_front(pts))
    out = run_study(cfg, space, SimulateBackend(cfg.model, cfg.training, cfg.hardware), storage=None,
                    study_name="e", n_trials=front_size, seed=0, sampler="ehvi", headroom=cfg.search.headroom)
    got = _points(out.study, space, cfg)
    hv = [hv_pareto(got[:k], ref) for k in range(1, len(got) + 1)]
    total = hv_pareto(pts, ref)
    first = next(k for k, h in enumerate(hv, start=1) if h >= 0.95 * total)
    assert first <= front_size
    assert out.stopped_early and out.evaluations < front_size
    assert hv[-1] >= 0.95 * total
    assert out.confidence.startswith("front stable") and f"of {len(feasible)} feasible" in out.confidence
    assert out.study.user_attrs["front_confidence"] == out.confidence


def test_trust_in_the_model_is_its_recent_out_of_sample_record(job):
    cfg, space = job
    screened = screen(cfg, space, cfg.search.headroom)
    sampler = FrontSampler(cfg, space, screened, headroom=cfg.search.headroom)
    # six of the sampler's own predictions, then the measurements: the first three 50% off (an
    # uncalibrated model), the recent three within 2%
    for i, err in enumerate([0.5, -0.5, 0.5, 0.02, -0.02, 0.02]):
        sampler._predicted[i] = np.log(1000.0)
        sampler.measured[i] = (10.0, 1000.0 * np.exp(err))
    assert sampler.out_of_sample_error() == pytest.approx(0.02)
    sampler.measured[6] = (10.0, 1000.0)
    sampler._predicted[6] = np.log(1000.0) - 0.4  # a miss now counts
    assert sampler.out_of_sample_error() > 0.15


def test_the_stopping_rule_widens_a_model_that_was_overconfident(job):
    """sd_scale: the RMS of the recent standardised errors, at least 1; it widens the stopping rule's
    predictive distributions, so an overconfident model does not declare the front stable early."""
    cfg, space = job
    screened = screen(cfg, space, cfg.search.headroom)
    sampler = FrontSampler(cfg, space, screened, headroom=cfg.search.headroom)
    assert sampler.sd_scale() == 1.0  # nothing predicted yet
    for i, err in enumerate([0.3, -0.3, 0.3, 0.1, -0.1, 0.1]):  # stated sd 0.05; recent errors 2 sd
        sampler._predicted[i], sampler._predicted_sd[i] = np.log(1000.0), 0.05
        sampler.measured[i] = (10.0, 1000.0 * np.exp(err))
    assert sampler.sd_scale() == pytest.approx(2.0)
    for i in range(3, 6):  # errors within the stated sd: never narrowed below it
        sampler.measured[i] = (10.0, 1000.0 * np.exp(0.01))
    assert sampler.sd_scale() == 1.0


def test_resume_keeps_the_measurements_and_never_reprofiles(job, tmp_path):
    cfg, space = job
    storage = str(tmp_path / "study.journal")
    from autotune.storage import make_storage

    kw = dict(study_name="r", seed=0, sampler="ehvi", headroom=cfg.search.headroom, write_through=False)
    be = SimulateBackend(cfg.model, cfg.training, cfg.hardware)
    run_study(cfg, space, be, storage=make_storage(storage), n_trials=3, **kw)
    out = run_study(cfg, space, be, storage=make_storage(storage), n_trials=3, resume=True, **kw)
    evaluated = [trial_strategy(t, space, cfg).key() for t in out.study.get_trials()
                 if t.state.name == "COMPLETE" and "duplicate_of" not in t.user_attrs]
    assert len(evaluated) == len(set(evaluated)) >= 4
    sampler = out.study.sampler
    assert isinstance(sampler, FrontSampler)
    # the resumed sampler folded the first run's measurements in (the calibrator too)
    assert len(sampler.measured) == len(evaluated) and len(sampler.calibrator.keys) == len(evaluated)


def test_auto_is_ehvi_for_profiling_backends_and_nsga2_for_simulate(job, tmp_path):
    import optuna

    from autotune.backends.replay import ReplayBackend

    cfg, space = job
    sim = run_study(cfg, space, SimulateBackend(cfg.model, cfg.training, cfg.hardware), storage=None,
                    study_name="a", n_trials=1, seed=0, sampler="auto", headroom=cfg.search.headroom)
    assert isinstance(sim.study.sampler, optuna.samplers.NSGAIISampler)
    (tmp_path / "t.csv").write_text("zero_stage,micro_batch_size,checkpointing,offload_optimizer,offload_params,"
                                    "precision,state,peak_memory_gib,tokens_per_s_per_gpu\n")
    rep = run_study(cfg, space, ReplayBackend(str(tmp_path / "t.csv"), cfg), storage=None, study_name="b",
                    n_trials=1, seed=0, sampler="auto", headroom=cfg.search.headroom)
    assert isinstance(rep.study.sampler, FrontSampler)
    # an empty table answers "not in replay table": a failed measurement, recorded as such
    assert [t.user_attrs.get("fail_reason") for t in rep.study.get_trials()][:1] == ["error: not in replay table"]


def test_search_cost_counts_a_front_point_reached_within_noise():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from search_cost import credited, trials_to_target

    front = [(10.0, 100.0, 0.05), (20.0, 200.0, 0.0)]
    near = (9.0, 96.0, 0.0)  # 4% short of the first point, whose own noise is 5%: within it
    assert credited([near], front) == [(9.0, 96.0), (10.0, 100.0)]
    assert credited([(9.0, 95.0, 0.02)], front)[-1] == (10.0, 100.0)  # 5.1% < sqrt(0.05^2 + 0.02^2) = 5.4%
    assert credited([(9.0, 95.0, 0.0)], front) == [(9.0, 95.0)]  # 5.1%: beyond the noise
    assert credited([(11.0, 100.0, 0.0)], front) == [(11.0, 100.0)]  # more memory: not the same point
    assert credited([(19.0, 199.0, 0.0)], front) == [(19.0, 199.0)]  # no noise recorded: strict
    # the count: 95% of the strict front's hypervolume either way, the noisy point credited when reached
    front = [(10.0, 100.0, 0.2), (25.0, 200.0, 0.0)]
    ref = (30.0, 0.0)
    hv_true = hv_pareto([(10.0, 100.0), (25.0, 200.0)], ref)
    points = [(10.0, 85.0, 0.0), None, (25.0, 200.0, 0.0)]
    assert trials_to_target(points, hv_true, ref) == (None, pytest.approx((15 * 85 + 5 * 200) / hv_true))
    assert trials_to_target(points, hv_true, ref, front) == (3, pytest.approx(1.0))


def test_the_trial_profiles_exactly_the_chosen_candidate_auto_bucket_sizes_included(job):
    cfg, _ = job
    space = load_space("default", ROOT)  # bucket sizes: auto (None) or fixed
    out = run_study(cfg, space, SimulateBackend(cfg.model, cfg.training, cfg.hardware), storage=None,
                    study_name="c", n_trials=6, seed=3, sampler="ehvi", headroom=cfg.search.headroom)
    sampler = out.study.sampler
    trials = [t for t in out.study.get_trials() if t.state.name == "COMPLETE"]
    assert len(trials) >= 6
    chosen = [sampler.strategies[sampler._chosen[t.number]] for t in trials]
    assert [trial_strategy(t, space, cfg).key() for t in trials] == [s.key() for s in chosen]
    assert any(s.reduce_bucket_size is None and s.zero_stage >= 1 for s in chosen)


def test_search_trajectory_reports_the_replayed_path():
    """benchmarks/search_trajectory.py: one row per profiled trial, the measured value is the table's,
    the error is measured vs the prediction made before it, and the hypervolume never falls."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import math

    from search_cost import load_measured
    from search_trajectory import trajectory

    folder = os.path.join(ROOT, "data", "measured", "tiny-llama-1rank")
    rows = trajectory(folder, 5)
    assert [r["trial"] for r in rows] == [1, 2, 3, 4, 5]
    cfg, _, _, measured = load_measured(folder)
    table = {s.describe(cfg.model.num_hidden_layers): t for s, _, t, _ in measured}
    for r in rows:
        assert r["measured"] == table[r["strategy"]]
        assert r["error"] == pytest.approx(math.log(r["measured"] / r["predicted"]))
    hv = [r["hv"] for r in rows]
    assert hv == sorted(hv) and 0 < hv[-1] <= 1
    assert len({r["strategy"] for r in rows}) == 5  # no candidate profiled twice
