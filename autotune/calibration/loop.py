"""The calibration loop: compare every profiled trial with the analytical prediction and re-fit the
simulator's efficiency parameters from the measured trials.

``Calibrator(cfg, run_dir)``:

* ``add(strategy, measurement)`` records the trial with the prediction made *before* it was
  measured (memory model peak and simulated tokens/s with the parameters current at that time, so
  the reported errors are out-of-sample), then re-fits the parameters on every ``ok`` trial so far
  with ``autotune.calibration.fit.fit_efficiency`` (MAP fit with a prior towards the GPU preset's
  parameters, or ``initial``);
* ``current_params()`` is the dict to pass to ``simulate(..., params=...)`` for the candidates not
  yet profiled;
* ``report()`` gives per-trial and overall predicted vs measured errors (%);
* ``save()`` writes ``calibration.json`` in the run directory; ``load_calibration(run_dir)`` reads
  the parameters back (``--calibration runs/<name>``) and checks they were fitted for the same GPU.

Re-fitting is incremental (``FAST_NFEV`` trust-region steps from the previous solution, no
restarts), so the loop stays cheap after every measurement; ``refit(full=True)`` does the
multi-start fit.

Memory is calibrated per family (same ZeRO stage, offload and precision): the median of measured /
predicted peak over the family's measured trials multiplies the memory model's peak of the family's
unprofiled candidates (``corrected_peak``); the factors are in ``report()["memory_correction"]``.

A measured throughput is the median over measured steps (the worker's); its spread
(``throughput_spread``: half the range of the per-step times over their median) is recorded per
trial, and the median spread (``noise()``) is the level below which differences are not chased.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Optional

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.strategy import MEMORY_FAMILY, Strategy

FILE_NAME = "calibration.json"
FORMAT_VERSION = 2
FAST_NFEV = 6
"""Trust-region steps of one incremental re-fit (see autotune.calibration.fit.fit_efficiency)."""


def family(strategy: Strategy) -> tuple:
    """Candidates whose memory-model error is shared: the same values of MEMORY_FAMILY's knobs."""
    return tuple(getattr(strategy, k) for k in MEMORY_FAMILY)


def throughput_spread(measurement: Any) -> Optional[float]:
    """Relative spread of a measured throughput: half the range of the measured step times over
    their median (a Measurement, or its ``as_dict()``); ``extra["tokens_per_s_spread"]`` (replay
    tables) is taken as is. None when unknown."""
    extra = measurement.get("extra") if isinstance(measurement, dict) else getattr(measurement, "extra", None)
    extra = extra or {}
    given = extra.get("tokens_per_s_spread")
    if isinstance(given, (int, float)) and math.isfinite(given) and given >= 0:
        return float(given)
    times = [t for t in (extra.get("step_times_s") or []) if isinstance(t, (int, float)) and t > 0]
    if len(times) < 2:
        return None
    return (max(times) - min(times)) / 2.0 / statistics.median(times)


@dataclass(frozen=True)
class Comparison:
    """One profiled trial against the prediction made before it ran."""

    strategy: dict
    status: str
    predicted_peak_bytes: Optional[int]
    measured_peak_bytes: Optional[int]
    memory_error_pct: Optional[float]
    predicted_tokens_per_s_per_gpu: float
    measured_tokens_per_s_per_gpu: Optional[float]
    tokens_error_pct: Optional[float]
    """100 x (predicted / measured - 1), with the parameters current before this trial."""
    tokens_spread_pct: Optional[float] = None
    """100 x throughput_spread of the measurement (step-to-step noise), None when unknown."""
    corrected_peak_bytes: Optional[int] = None
    """The memory prediction after the family's correction current before this trial (None: no
    measured trial of the family yet)."""


def _err(pred: Optional[float], meas: Optional[float]) -> Optional[float]:
    if pred is None or not meas:
        return None
    return round(100.0 * (pred / meas - 1.0), 3)


def _stats(errs: list[Optional[float]]) -> dict[str, Any]:
    vals = [abs(e) for e in errs if e is not None]
    if not vals:
        return {"n": 0, "median_abs_pct": None, "max_abs_pct": None}
    return {"n": len(vals), "median_abs_pct": round(statistics.median(vals), 3), "max_abs_pct": round(max(vals), 3)}


class Calibrator:
    """Measured-vs-predicted bookkeeping and simulator re-fitting for one job (one GPU type)."""

    def __init__(self, cfg: Config, run_dir: Optional[str] = None, *, initial: Optional[dict] = None,
                 min_runs: int = 1, autosave: bool = True) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.initial = dict(initial) if initial else (dict(cfg.hardware.gpu.efficiency)
                                                      if cfg.hardware.gpu.efficiency else None)
        """Starting point and prior centre of the fit (None: the GPU's datasheet defaults)."""
        self.min_runs = min_runs
        self.autosave = autosave and run_dir is not None
        self.comparisons: list[Comparison] = []
        self._runs: list[Any] = []  # autotune.calibration.fit.MeasuredRun of the ok trials
        self._params: Optional[dict] = None
        self._memory: dict[tuple, list[tuple[int, int]]] = {}  # family -> [(predicted, measured) peak]
        self._spreads: list[float] = []
        self.keys: set[tuple] = set()
        """Strategy keys of every trial added (the sampler feeds the ones other processes measured)."""
        self.refit_seconds: list[float] = []
        """Wall time of each re-fit (benchmarks/calibration_speed.py)."""

    # ---------------------------------------------------------------- predictions

    def current_params(self) -> dict:
        """Efficiency parameters for ``simulate(..., params=...)``: fitted when there are enough
        measured trials, else the initial / preset ones."""
        from autotune.simulate import efficiency_params

        if self._params is not None:
            return dict(self._params)
        return efficiency_params(self.cfg.hardware.gpu, self.initial)[0]

    @property
    def fitted(self) -> bool:
        return self._params is not None

    def predict(self, strategy: Strategy) -> tuple[Optional[int], float]:
        """(memory model peak bytes or None if that model is unavailable, simulated tokens/s/GPU)."""
        from autotune.simulate import simulate

        cfg = self.cfg
        peak = None
        try:
            from autotune.memory import estimate_memory

            peak = int(estimate_memory(cfg.model, cfg.training, cfg.hardware, strategy).gpu["peak"])
        except ImportError:
            pass
        tps = simulate(cfg.model, cfg.training, cfg.hardware, strategy, self.current_params()).tokens_per_s_per_gpu
        return peak, tps

    def memory_factor(self, strategy: Strategy) -> Optional[float]:
        """Median measured / predicted peak of the strategy's family (None: none measured yet)."""
        pairs = self._memory.get(family(strategy))
        if not pairs:
            return None
        return statistics.median(m / p for p, m in pairs)

    def corrected_peak(self, strategy: Strategy, predicted: float) -> float:
        """The memory model's ``predicted`` peak corrected by the family's measured ratio."""
        factor = self.memory_factor(strategy)
        return predicted * factor if factor is not None else predicted

    def memory_sd(self, strategy: Strategy) -> float:
        """Sd of log(measured / corrected peak) expected for an unprofiled candidate: the pooled
        spread within families (median absolute deviation x 1.4826), plus the spread of the family
        factors when the strategy's family has not been measured yet. 0 until measurements show it."""
        logs = [[math.log(m / p) for p, m in pairs] for pairs in self._memory.values()]
        dev = [abs(v - statistics.median(g)) for g in logs if len(g) >= 2 for v in g]
        within = 1.4826 * statistics.median(dev) if dev else 0.0
        if family(strategy) in self._memory:
            return within
        centres = [statistics.median(g) for g in logs]
        between = statistics.pstdev(centres) if len(centres) >= 2 else 0.0
        return math.hypot(within, between)

    def noise(self) -> float:
        """Median relative throughput spread of the measured trials (0 when unknown)."""
        return statistics.median(self._spreads) if self._spreads else 0.0

    # ---------------------------------------------------------------- the loop

    def add(self, strategy: Strategy, measurement: Any) -> Comparison:
        """Record one profiled trial (any status); re-fit when it measured something."""
        peak, tps = self.predict(strategy)
        ok = measurement.status == "ok" and measurement.tokens_per_s_per_gpu and \
            math.isfinite(measurement.tokens_per_s_per_gpu) and measurement.tokens_per_s_per_gpu > 0
        spread = throughput_spread(measurement) if ok else None
        factor = self.memory_factor(strategy)
        self.keys.add(strategy.key())
        comp = Comparison(
            strategy=strategy.as_dict(), status=measurement.status, predicted_peak_bytes=peak,
            measured_peak_bytes=measurement.peak_memory_bytes if ok else None,
            memory_error_pct=_err(peak, measurement.peak_memory_bytes) if ok else None,
            predicted_tokens_per_s_per_gpu=tps,
            measured_tokens_per_s_per_gpu=measurement.tokens_per_s_per_gpu if ok else None,
            tokens_error_pct=_err(tps, measurement.tokens_per_s_per_gpu) if ok else None,
            tokens_spread_pct=round(100.0 * spread, 3) if spread is not None else None,
            corrected_peak_bytes=int(peak * factor) if peak and factor is not None else None,
        )
        self.comparisons.append(comp)
        if ok and peak and measurement.peak_memory_bytes:
            self._memory.setdefault(family(strategy), []).append((int(peak), int(measurement.peak_memory_bytes)))
        if spread is not None:
            self._spreads.append(spread)
        if ok:
            from autotune.calibration.fit import MeasuredRun

            cfg = self.cfg
            self._runs.append(MeasuredRun(cfg.model, cfg.training, cfg.hardware, strategy,
                                          float(measurement.tokens_per_s_per_gpu), label=f"trial {len(self.comparisons) - 1}"))
            if len(self._runs) >= self.min_runs:
                self.refit()
        if self.autosave:
            self.save()
        return comp

    def refit(self, full: bool = False) -> dict:
        """Fit the efficiency parameters on every measured trial so far: incrementally from the
        previous fit (``FAST_NFEV`` steps), or from scratch with restarts when ``full``. Without
        scipy (the ``profile`` extra) the parameters stay the initial ones."""
        import time

        if not self._runs:
            raise ValueError("no measured trials to fit")
        try:
            from autotune.calibration.fit import fit_efficiency
            import scipy  # noqa: F401
        except ImportError:
            return self.current_params()
        t0 = time.perf_counter()
        if full:
            self._params = fit_efficiency(self._runs, self.initial)
        else:
            self._params = fit_efficiency(self._runs, self.initial, start=self._params, max_nfev=FAST_NFEV,
                                          restarts=0)
        self.refit_seconds.append(time.perf_counter() - t0)
        return dict(self._params)

    # ---------------------------------------------------------------- reports and files

    def report(self) -> dict[str, Any]:
        """Per-trial comparisons, the out-of-sample errors overall, and the in-sample errors of the
        final parameters on the measured trials."""
        from autotune.simulate import simulate

        params = self.current_params()
        fit_errs = [_err(simulate(r.model, r.training, r.hardware, r.strategy, params).tokens_per_s_per_gpu,
                         r.tokens_per_s_per_gpu) for r in self._runs]
        corrections = [{**dict(zip(MEMORY_FAMILY, f)), "n": len(pairs),
                        "factor": round(statistics.median(m / p for p, m in pairs), 5)}
                       for f, pairs in sorted(self._memory.items(), key=lambda kv: str(kv[0]))]
        return {
            "memory_correction": corrections,
            "throughput_noise_pct": round(100.0 * self.noise(), 3),
            "trials": [asdict(c) for c in self.comparisons],
            "overall": {"memory": _stats([c.memory_error_pct for c in self.comparisons]),
                        "tokens_per_s": _stats([c.tokens_error_pct for c in self.comparisons]),
                        "tokens_per_s_after_fit": _stats(fit_errs)},
        }

    def to_json(self) -> dict[str, Any]:
        hw = self.cfg.hardware
        return {"version": FORMAT_VERSION, "gpu": hw.gpu.name, "model": self.cfg.model.name,
                "gpus_per_node": hw.gpus_per_node, "num_nodes": hw.num_nodes, "fitted": self.fitted,
                "num_measured": len(self._runs), "params": self.current_params(), "initial": self.initial,
                **self.report()}

    def save(self, path: Optional[str] = None) -> str:
        path = path or os.path.join(self.run_dir or ".", FILE_NAME)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_json(), fh, indent=1, default=str)
            fh.write("\n")
        os.replace(tmp, path)
        return path


def load_calibration(run_dir: str, gpu_name: Optional[str] = None) -> dict:
    """The fitted parameters saved in ``run_dir/calibration.json`` (or that file itself).

    Raises a one-line ConfigError (path ``--calibration``) when the file is missing or malformed,
    or was fitted for a different GPU than ``gpu_name``.
    """
    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, FILE_NAME)
    where = "--calibration"
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"no {FILE_NAME} in {run_dir} (was it a profiled run?)", path=where) from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"cannot read {path} ({type(err).__name__})", path=where) from None
    from autotune.simulate import EFFICIENCY_KEYS

    params = data.get("params") if isinstance(data, dict) else None
    if not isinstance(params, dict) or not all(
            isinstance(params.get(k), (int, float)) and math.isfinite(params[k]) and params[k] > 0
            for k in EFFICIENCY_KEYS):
        raise ConfigError(f"{path} has no valid params (positive numbers for {', '.join(EFFICIENCY_KEYS)})",
                          path=where)
    if gpu_name is not None and data.get("gpu") != gpu_name:
        raise ConfigError(f"{path} was fitted on {data.get('gpu')!r}, but this job runs on {gpu_name!r}", path=where)
    return {k: float(params[k]) for k in EFFICIENCY_KEYS}
