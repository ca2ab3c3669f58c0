"""The model-based sampler: profile next the candidate with the largest expected hypervolume improvement.

``FrontSampler`` is an Optuna ``BaseSampler`` (so storage, ``--resume``, ``autotune worker`` and the
dashboard work unchanged). Before each trial it rebuilds its state from the study itself:

* every feasible candidate of the screened space (the memory model's verdict) is a choice;
* the measured trials (COMPLETE: peak memory and tokens/s; FAIL with an ``oom`` reason: larger
  micro-batches of that strategy are left out, as the search prunes them) are folded into the
  calibrator (autotune.calibration.loop.Calibrator: simulator re-fit, per-family memory
  correction, measured noise), including trials that other processes or an earlier run measured;
* throughput of each unprofiled candidate: log tokens/s ~ Normal(mu, s^2) with mu = log of the
  calibrated simulator's prediction + the posterior mean of a Gaussian process on the residuals
  log(measured / predicted) over strategy features, and s^2 its posterior variance plus the
  residual noise (Rasmussen & Williams 2006, eq. 2.22-2.24; hyper-parameters by marginal likelihood
  over a small grid, eq. 2.30); each level of each categorical knob adds its own offset, prior sd
  autotune.samplers._levels.LEVEL_PRIOR_SD (docs/search.md), so one level's residuals do not shrink another's;
* memory of each unprofiled candidate: the memory model's peak times its family's measured ratio;
* EHVI: with the memory coordinate known, the hypervolume improvement of a new point (x, Y) over the
  current measured front is sum_j len_j(x) * max(0, Y - h_j) over the front's staircase segments j
  right of x, so E[HVI] is a sum of log-normal call prices, exp(mu + s^2/2) Phi(d1) - h Phi(d2)
  (Black & Scholes 1973 eq. 13; the 2-D EHVI of Emmerich et al. 2006 with one deterministic
  objective). Staircase heights are raised by the measured noise, so gains within noise are not
  chased. The hypervolume itself is Optuna's (compute_hypervolume, through autotune._optuna_compat).

The residual model's amplitude is at least the out-of-sample error its predictions have shown
over the more recent half of the measurements (a model fitted on a handful of points is not trusted
beyond its track record), both for the choice and for the stopping rule. The candidate with the
largest EHVI is profiled next. ``assess(study)`` gives the stopping statistic: the expected
hypervolume improvement of profiling *every* remaining candidate (Monte Carlo over the same
predictive distributions, widened by ``sd_scale`` where the model's recent errors exceeded the sd it
stated, draws lowered by the noise), as a fraction of the current hypervolume; the search stops when
it falls below ``stop_gain`` (``--trials`` stays the hard budget) and states it ("front stable: ...").
A level never measured whose candidates could reach the front (autotune.samplers._levels.reachable) is
measured first, and until it is the front is not stable ("front not stable: precision=fp32 never
measured, could reach the front; ...").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
from optuna.samplers import BaseSampler

from autotune.samplers import _levels
from autotune.samplers._ehvi import _staircase_area, expected_hvi, expected_remaining_gain, hypervolume  # noqa: F401
from autotune.claim import fail_status, has_result
from autotune.config import Config
from autotune.space import SearchSpace
from autotune import knobs
from autotune.strategy import Strategy
from autotune.trial_attrs import TrialAttrs

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial, TrialState

GIB = float(1 << 30)
DEFAULT_STOP_GAIN = 0.01
"""Stop when profiling every remaining candidate is expected to add less than 1% to the front's
hypervolume beyond the measured noise (expected_remaining_gain)."""
MIN_PROFILED = 3
"""Never stop before this many candidates were measured (the residual model needs a few points)."""

# GP hyper-parameter grid (log-throughput residuals): kernel amplitude, length scale in feature units,
# residual noise. The constant term lets the model absorb an overall bias of the simulator.
_AMPLITUDES = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
_LENGTHS = (0.35, 0.7, 1.4)
_NOISES = (0.005, 0.02, 0.05, 0.1, 0.2, 0.4)
_BIAS_SD = 0.2
_HERMITE = (np.array([-2.8569700, -1.3556262, 0.0, 1.3556262, 2.8569700]),
            np.array([0.0112574, 0.2220759, 0.5333333, 0.2220759, 0.0112574]))
"""5-point Gauss-Hermite nodes and weights for a standard normal (probabilists' form)."""
_PRIOR_AMPLITUDE = 0.2
"""Prior sd of the simulator's log error before anything is measured (20%)."""


@dataclass(frozen=True)
class Assessment:
    """Where the search stands after the measurements so far."""

    gain: float
    """Expected hypervolume improvement beyond noise of profiling every remaining candidate / current
    hypervolume (expected_remaining_gain): the stopping statistic."""
    hypervolume: float
    profiled: int
    """Feasible candidates measured (ok or failed)."""
    feasible: int
    """Candidates the memory model lets through."""
    remaining: int
    """Candidates still eligible (not measured, not excluded by an OOM of a smaller micro-batch)."""
    noise: float
    """Relative throughput noise used (median measured spread)."""
    best: float = 0.0
    """Largest expected hypervolume improvement of one unprofiled candidate / current hypervolume."""
    unmeasured: tuple[str, ...] = ()
    """Levels ("precision=fp32") no candidate was measured at, that could reach the front under the
    level prior (autotune.samplers._levels): while there is one, the front is not stable."""

    def stable(self, stop_gain: float) -> bool:
        """Nothing left to profile, or the remaining gain below ``stop_gain`` with no level unmeasured
        that could reach the front."""
        return self.remaining == 0 or (self.gain < stop_gain and not self.unmeasured)

    def statement(self, stop_gain: float) -> str:
        word = ("front stable" if self.stable(stop_gain) else "front not yet stable") + ":"
        if self.remaining and self.unmeasured:
            n = len(self.unmeasured) - 6
            more = f" and {n} more level{'s' * (n > 1)}" if n > 0 else ""
            word = f"front not stable: {', '.join(self.unmeasured[:6])}{more} never measured, could reach the front;"
        return (f"{word} expected remaining hypervolume gain {100 * self.gain:.1f}% "
                f"(best single candidate {100 * self.best:.1f}%); "
                f"{self.profiled} of {self.feasible} feasible candidates profiled")


def features(strategy: Any, num_layers: int, spans: dict[str, tuple[float, float]]) -> list[float]:
    """Strategy -> numeric features for the residual model (each knob spans at most ~1 unit), as the
    knobs' ``feature`` metadata says (autotune.knobs.features)."""
    return knobs.features(Strategy, strategy, num_layers, spans)


def _matern52(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    """Matern 5/2 correlation (Rasmussen & Williams 2006, eq. 4.17)."""
    d = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0)) / length
    s = math.sqrt(5.0) * d
    return (1.0 + s + s * s / 3.0) * np.exp(-s)


def gp_posterior(x: np.ndarray, y: np.ndarray, xs: np.ndarray, noise_floor: float = 0.0,
                 amplitude_floor: float = 0.0, g: Optional[np.ndarray] = None, gs: Optional[np.ndarray] = None,
                 level_sd: float = 0.0) -> tuple[np.ndarray, np.ndarray, float]:
    """Posterior mean and variance of the *observed* residual at ``xs`` (noise included), and the
    chosen noise sd. Hyper-parameters maximise the log marginal likelihood over the grid above
    (amplitudes below ``amplitude_floor`` are replaced by it). ``g`` / ``gs``: level membership of
    ``x`` / ``xs`` (autotune.samplers._levels.level_matrix); each level adds an independent offset of sd
    ``level_sd`` (kernel term level_sd^2 * shared levels, an additive kernel: R&W 2006 sec. 4.2.4),
    so a level without data keeps its whole prior variance."""
    lev = level_sd * level_sd
    prior_lev = lev * gs.sum(1) if gs is not None else 0.0
    if len(y) == 0:
        noise = max(noise_floor, _NOISES[0])
        return np.zeros(len(xs)), _PRIOR_AMPLITUDE ** 2 + noise ** 2 + prior_lev + np.zeros(len(xs)), noise
    best = None
    d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    shared = lev * (g @ g.T) if g is not None else 0.0
    for length in _LENGTHS:
        s = math.sqrt(5.0) * np.sqrt(d2) / length
        corr = (1.0 + s + s * s / 3.0) * np.exp(-s)
        for amp in sorted({max(a, amplitude_floor) for a in _AMPLITUDES}):
            for noise in _NOISES:
                noise = max(noise, noise_floor)
                k = amp * amp * corr + _BIAS_SD ** 2 + shared + (noise * noise + 1e-10) * np.eye(len(y))
                try:
                    chol = np.linalg.cholesky(k)
                except np.linalg.LinAlgError:
                    continue
                alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
                lml = -0.5 * float(y @ alpha) - float(np.log(np.diag(chol)).sum())
                if best is None or lml > best[0]:
                    best = (lml, length, amp, noise, chol, alpha)
    assert best is not None
    _, length, amp, noise, chol, alpha = best
    ks = amp * amp * _matern52(xs, x, length) + _BIAS_SD ** 2 + (lev * (gs @ g.T) if gs is not None else 0.0)
    mean = ks @ alpha
    v = np.linalg.solve(chol, ks.T)
    var = amp * amp + _BIAS_SD ** 2 + prior_lev - (v * v).sum(0) + noise * noise
    return mean, np.maximum(var, 1e-12), noise


class FrontSampler(BaseSampler):
    """Optuna sampler choosing the candidate of largest expected hypervolume improvement (module doc)."""

    chooses_front = True
    """search._run: no predicted-front seeding and no re-seeding; the sampler re-predicts each trial."""

    def __init__(self, cfg: Config, space: SearchSpace, screened: Sequence[Any], *, headroom: float,
                 calibrator: Any = None, seed: int = 0, stop_gain: Optional[float] = None) -> None:
        import optuna

        from autotune.calibration.loop import Calibrator, family

        self.cfg, self.space = cfg, space
        self.stop_gain = DEFAULT_STOP_GAIN if stop_gain is None else stop_gain
        self.calibrator = calibrator if calibrator is not None else Calibrator(cfg, None, autosave=False)
        self._fallback = optuna.samplers.RandomSampler(seed=seed)
        self._rng = np.random.RandomState(seed)
        feasible = [s for s in screened if s.memory.fits]
        self.strategies = [s.strategy for s in feasible]
        self.index = {s.key(): i for i, s in enumerate(self.strategies)}
        self.pred_mem = np.array([s.memory.gpu["peak"] / GIB for s in feasible])
        self.families = [family(s) for s in self.strategies]
        L = cfg.model.num_hidden_layers
        spans = knobs.feature_spans(Strategy, self.strategies)
        self.x = np.array([features(s, L, spans) for s in self.strategies]).reshape(len(feasible), -1)
        self.ref_x = cfg.hardware.gpu.memory_bytes * (1 - headroom) / GIB
        self._params: dict[int, dict] = {}
        self._chosen: dict[int, int] = {}
        self._predicted: dict[int, float] = {}
        """Candidate -> mean log tokens/s predicted when it was chosen (out_of_sample_error), in order."""
        self._predicted_sd: dict[int, float] = {}  # candidate -> sd of that prediction (sd_scale)
        self._last_pred: Optional[tuple] = None
        """predict()'s answer behind the cached score (_score keeps one entry)."""
        self._folded: set[int] = set()
        self._sim_for: Optional[tuple] = None
        self._log_sim = np.zeros(len(feasible))
        # study-derived state
        self.measured: dict[int, tuple[float, float]] = {}  # candidate -> (GiB, tokens/s)
        self.failed: set[int] = set()
        self.oom_at: dict[tuple, int] = {}
        self._scored: Optional[tuple] = None
        self.history: list[Assessment] = []
        """The assessment after each measurement of this process (benchmarks/search_cost.py)."""
        self.levels, self.g = _levels.level_matrix(self.strategies)
        """Levels of the categorical knobs, and which candidate has which (autotune.samplers._levels)."""
        self._broken: set[int] = set()  # failed for a reason other than memory: its levels count as tried

    # ------------------------------------------------------------------ Optuna interface

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial, search_space: dict) -> dict:
        return {}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        idx = self._chosen.get(trial.number)
        if idx is None:
            idx = self._choose(study, trial.number)
            self._chosen[trial.number] = idx
        if idx >= 0:
            params = self._params_of(idx)
            choices = getattr(param_distribution, "choices", None)
            # None is a value too (a bucket size left to autotune): only a parameter the candidate
            # does not have falls back to the random sampler
            if param_name in params and (choices is None or params[param_name] in choices):
                return params[param_name]
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._fallback.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Optional[Sequence[float]]) -> None:
        self._fallback.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    # ------------------------------------------------------------------ state from the study

    def _params_of(self, idx: int) -> dict:
        if idx not in self._params:
            from autotune.space import strategy_params

            self._params[idx] = strategy_params(self.strategies[idx], self.space, self.cfg.model)
        return self._params[idx]

    def _strategy_of(self, t: FrozenTrial) -> Optional[Strategy]:
        import optuna

        try:
            return self.space.suggest(optuna.trial.FixedTrial(t.params), self.cfg.model)
        except Exception:  # incomplete params (a trial still being sampled) or another space
            return None

    def observe(self, study: Study) -> set[int]:
        """Fold finished trials into the measured / failed sets and the calibrator; returns the
        candidates held by running trials."""
        from optuna.trial import TrialState

        from autotune.backends.base import Measurement

        running: set[int] = set()
        for t in study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                s = self._strategy_of(t) if t.params else None
                if s is not None and s.key() in self.index:
                    running.add(self.index[s.key()])
                continue
            if t.number in self._folded or not t.state.is_finished():
                continue
            self._folded.add(t.number)
            attrs = TrialAttrs.of(t)
            if attrs.duplicate_of is not None:
                continue
            s = self._strategy_of(t)
            if s is None:
                continue
            idx = self.index.get(s.key())
            status = fail_status(t) if has_result(t) else ""  # a lost trial's measurement is no result
            if status == "oom":
                no_mbs = s.replace(micro_batch_size=0).key()
                self.oom_at[no_mbs] = min(s.micro_batch_size, self.oom_at.get(no_mbs, s.micro_batch_size))
            if idx is None:
                continue
            m = attrs.measurement or {}
            if t.state == TrialState.COMPLETE and t.values:
                self.measured[idx] = (float(t.values[0]), float(t.values[1]))
                meas = Measurement(status="ok", peak_memory_bytes=int(t.values[0] * GIB),
                                   tokens_per_s_per_gpu=float(t.values[1]), extra=m.get("extra") or {})
            elif t.state == TrialState.FAIL and has_result(t):
                self.failed.add(idx)
                if status != "oom":
                    self._broken.add(idx)
                meas = Measurement(status=status or "error", reason=attrs.fail_reason or "")
            else:  # pruned, or lost (re-run later)
                if t.state == TrialState.PRUNED:
                    self.failed.add(idx)
                continue
            if s.key() not in self.calibrator.keys:  # measured by another process or an earlier run
                self.calibrator.add(s, meas)
        return running

    def _eligible(self, running: set[int]) -> np.ndarray:
        ok = np.ones(len(self.strategies), dtype=bool)
        for i in list(self.measured) + list(self.failed) + list(running):
            ok[i] = False
        if self.oom_at:
            for i, s in enumerate(self.strategies):
                at = self.oom_at.get(s.replace(micro_batch_size=0).key())
                if at is not None and s.micro_batch_size >= at:
                    ok[i] = False
        return ok

    # ------------------------------------------------------------------ prediction and choice

    def _log_simulated(self) -> np.ndarray:
        from autotune.simulate import simulate

        params = self.calibrator.current_params()
        key = tuple(sorted(params.items()))
        if key != self._sim_for:
            cfg = self.cfg
            self._log_sim = np.array([math.log(max(1e-30, simulate(cfg.model, cfg.training, cfg.hardware, s,
                                                                   params).tokens_per_s_per_gpu))
                                      for s in self.strategies])
            self._sim_for = key
        return self._log_sim

    def out_of_sample_error(self) -> float:
        """RMS log error of the predictions made before each measurement, over the more recent half
        of them (the model as it stands now, not the uncalibrated one of the first trials): how wrong
        the model has actually been on candidates it had not seen. The sampler's own predictions
        (calibrated simulator + residual model) where it made them, else the calibrator's record."""
        errs = [math.log(self.measured[i][1]) - mu for i, mu in self._predicted.items()
                if i in self.measured and self.measured[i][1] > 0]
        if len(errs) < MIN_PROFILED:
            errs = [math.log1p(c.tokens_error_pct / 100.0) for c in self.calibrator.comparisons
                    if c.tokens_error_pct is not None and c.tokens_error_pct > -100.0]
        errs = errs[len(errs) // 2:]
        return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else _PRIOR_AMPLITUDE

    def sd_scale(self) -> float:
        """RMS of the standardised out-of-sample errors (measured - predicted mean) / predicted sd over
        the recent half of the chosen candidates, at least 1: how much wider the stopping rule's
        predictive distributions must be to match their record (Kuleshov et al. 2018, sec. 3)."""
        z = [(math.log(self.measured[i][1]) - mu) / self._predicted_sd[i] for i, mu in self._predicted.items()
             if i in self.measured and self.measured[i][1] > 0 and self._predicted_sd.get(i, 0.0) > 0]
        z = z[len(z) // 2:]
        return 1.0 if len(z) < MIN_PROFILED else max(1.0, math.sqrt(sum(v * v for v in z) / len(z)))

    def predict(self, honest: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray]:
        """(memory GiB, mean log tokens/s, sd of log tokens/s, noise, sd of log memory) of every
        feasible candidate. ``honest``: the residual model's amplitude is at least the out-of-sample
        error seen so far (the stopping rule must not trust a model fitted on a handful of points
        more than its track record)."""
        log_sim = self._log_simulated()
        noise = self.calibrator.noise()
        done = [i for i, (_, t) in self.measured.items() if t > 0]
        y = np.array([math.log(self.measured[i][1]) - log_sim[i] for i in done])
        floor = self.out_of_sample_error() if honest else 0.0
        mean, var, _ = gp_posterior(self.x[done], y, self.x, noise_floor=noise, amplitude_floor=floor,
                                    g=self.g[done], gs=self.g, level_sd=_levels.LEVEL_PRIOR_SD)
        factors: dict[tuple, tuple[float, float]] = {}
        mem = self.pred_mem.copy()
        mem_sd = np.zeros(len(mem))
        for i, (f, s) in enumerate(zip(self.families, self.strategies)):
            if f not in factors:
                factors[f] = (self.calibrator.memory_factor(s) or 1.0, self.calibrator.memory_sd(s))
            mem[i] *= factors[f][0]
            mem_sd[i] = factors[f][1]
        return mem, log_sim + mean, np.sqrt(var), noise, mem_sd

    def _score(self, running: set[int], honest: bool = False) -> tuple[np.ndarray, np.ndarray, float, float]:
        key = (len(self._folded), len(self.measured), len(self.failed), tuple(sorted(running)),
               len(self.calibrator.comparisons), honest)
        if self._scored is not None and self._scored[0] == key:
            return self._scored[1]
        self._scored = (key, self._score_now(running, honest))
        return self._scored[1]

    def _score_now(self, running: set[int], honest: bool = False) -> tuple[np.ndarray, np.ndarray, float, float]:
        eligible = self._eligible(running)
        front = list(self.measured.values())
        if not eligible.any():
            return eligible, np.zeros(len(eligible)), hypervolume(front, self.ref_x), 0.0
        mem, mu, sd, noise, mem_sd = self.predict(honest)
        self._last_pred = (mem, mu, sd, noise, mem_sd)
        ehvi = np.zeros(len(eligible))
        idx = np.flatnonzero(eligible)
        # memory uncertain too (log-normal, sd from the calibrator): Gauss-Hermite quadrature over it
        for z, w in zip(*_HERMITE):
            ehvi[idx] += w * expected_hvi(mem[idx] * np.exp(mem_sd[idx] * z), mu[idx], sd[idx], front, self.ref_x,
                                          noise)
        return eligible, ehvi, hypervolume(front, self.ref_x), noise

    def _open(self, eligible: np.ndarray, ehvi: Optional[np.ndarray] = None) -> tuple[list[int], np.ndarray]:
        """(levels never measured that an eligible candidate which could reach the front has, those
        eligible candidates): the last prediction, its sd widened by the track record (sd_scale).
        With ``ehvi``: the levels by their best candidate's EHVI, largest first."""
        if not self.levels or not eligible.any() or self._last_pred is None:
            return [], np.zeros(len(eligible), dtype=bool)
        mem, mu, sd, noise, mem_sd = self._last_pred
        reach = eligible & _levels.reachable(mem, mu, sd * self.sd_scale(), mem_sd, list(self.measured.values()),
                                             self.ref_x, noise)
        resolved = np.zeros(len(eligible), dtype=bool)
        resolved[list(self.measured) + list(self._broken)] = True
        levels = _levels.unmeasured(self.levels, self.g, resolved, eligible, reach)
        if ehvi is not None:
            levels.sort(key=lambda j: -float(np.max(np.where(reach & (self.g[:, j] > 0), ehvi, -1.0))))
        return levels, reach

    def _choose(self, study: Study, number: int) -> int:
        running = self.observe(study)
        eligible, ehvi, _, _ = self._score(running, honest=True)
        # levels never measured that could reach the front are measured first: a candidate that could
        # reach it and carries as many of them as any, the most promising of those
        levels, reach = self._open(eligible)
        pick = eligible
        if levels:
            carried = np.where(reach, self.g[:, levels].sum(1), 0.0)
            pick = carried == carried.max()
        if pick.any() and (ehvi[pick].max() > 0 or levels):
            mem, mu, sd, _, _ = self._last_pred
            score = ehvi if ehvi[pick].max() > 0 else mu + _levels.REACH_Z * sd
            idx = int(np.argmax(np.where(pick, score, -np.inf)))
            self._predicted[idx] = float(mu[idx])
            self._predicted_sd[idx] = float(sd[idx])
            return idx
        rest = [i for i in range(len(self.strategies)) if i not in self.measured and i not in self.failed]
        return int(self._rng.choice(rest)) if rest else -1

    def assess(self, study: Study) -> Assessment:
        """The stopping statistic after the measurements so far (see the module docstring)."""
        running = self.observe(study)
        eligible, ehvi, hv, noise = self._score(running, honest=True)
        best = float(ehvi.max() / hv) if hv > 0 and eligible.any() else (0.0 if not eligible.any() else math.inf)
        gain = best
        if hv > 0 and eligible.any():
            mem, mu, sd, noise, mem_sd = self._last_pred if self._last_pred is not None else self.predict(True)
            idx = np.flatnonzero(eligible)
            # the stopping rule trusts the predictive sd only as far as its track record (sd_scale)
            gain = expected_remaining_gain(mem[idx], mu[idx], sd[idx] * self.sd_scale(), list(self.measured.values()),
                                           self.ref_x, noise, mem_sd[idx]) / hv
        profiled = len(self.measured) + len(self.failed)
        unmeasured = tuple(_levels.label(self.levels[j]) for j in self._open(eligible, ehvi)[0])
        return Assessment(gain=gain, hypervolume=hv, profiled=profiled, feasible=len(self.strategies),
                          remaining=int(eligible.sum()), noise=noise, best=best, unmeasured=unmeasured)

    def should_stop(self, study: Study) -> tuple[bool, Assessment]:
        a = self.assess(study)
        self.history.append(a)
        return (len(self.measured) >= MIN_PROFILED and a.stable(self.stop_gain)) or a.remaining == 0, a
