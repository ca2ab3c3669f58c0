"""The ``script`` backend: every candidate is trained by the user's own training script.

``ScriptBackend(cfg, run_dir).evaluate(strategy)`` writes the point's files into
``runs/<name>/trials/<n>/`` (the engine config from autotune.engine_configs; every trainer's files
from autotune.trainers, under ``trainers/``), expands ``profile.command``'s placeholders with their
paths (autotune.backends.script_command) and runs the command through autotune.backends.launch in
its own process group, in the job file's folder, with the profile backend's timeout, memory limit,
logs and cleanup. The script's autotune callback (autotune.callbacks.hf / .lightning) finds its result
file, warm-up and measured steps in the environment and writes one WorkerResult per rank; the
Measurement, its failures and the calibration are the profile backend's (DeepSpeedBackend), so the
report compares each measured peak with the prediction, labelled as the script's own loop.

A script that crashes, exits without writing a result, or runs past ``profile.timeout_s`` is a failed
trial with that reason; one whose last error line is an out-of-memory error is an ``oom``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from autotune.backends.base import Measurement
from autotune.backends.launch import LaunchResult, launch, signal_name
from autotune.backends.logs import last_error_line
from autotune.backends.profiled import DeepSpeedBackend, _number_of
from autotune.backends.script_command import MEASURED_ENV, RESULT_ENV, TOKENS_ENV, WARMUP_ENV, expand
from autotune.engine_configs import to_deepspeed_config, to_fsdp2_config
from autotune.runfiles import write_json
from autotune.strategy import Strategy

LOOP = "the training script's own loop"
"""What a script trial measured (Measurement.extra["loop"]; the report's label says it too)."""
_OOM_WORDS = ("outofmemoryerror", "memoryerror", "out of memory", "can't allocate memory", "not enough memory")
"""An error line that is an out-of-memory error (the texts autotune.models.sources.is_oom accepts)."""


class ScriptBackend(DeepSpeedBackend):
    """Real training steps of the user's script per candidate (see the module docstring)."""

    name = "script"
    launches_workers = True
    builds_model = False  # the user's script builds its own model
    evaluated_as = "measured in your script"

    def __init__(self, cfg: Any, run_dir: str, **kwargs: Any) -> None:
        super().__init__(cfg, run_dir, **kwargs)
        self.command = cfg.profile.command or ""

    def point_files(self, strategy: Strategy, trial_dir: Path) -> dict[str, str]:
        """Write the point's files into ``trial_dir``; placeholder name -> value for this point."""
        from autotune.trainers import FILES, Point, trainer_files

        cfg = self.cfg
        folder = trial_dir / "trainers"
        folder.mkdir(exist_ok=True)
        values = {"python": sys.executable, "nproc": str(self.nproc), "job_file": os.path.abspath(cfg.path),
                  "trial_dir": str(trial_dir),
                  "max_steps": str(cfg.profile.warmup_steps + cfg.profile.measure_steps),
                  "seq_len": str(cfg.training.seq_len)}
        if cfg.hf_config:
            values["model_config"] = os.path.abspath(cfg.hf_config)
        ds = strategy.engine == "deepspeed"
        engine_path = trial_dir / ("ds_config.json" if ds else "fsdp2_config.json")
        if ds:
            ds_config = to_deepspeed_config(strategy, cfg.model, cfg.training, cfg.hardware)
            write_json(str(engine_path), ds_config)
            values["deepspeed_config"] = str(engine_path)
        else:
            write_json(str(engine_path), to_fsdp2_config(strategy, cfg.model, cfg.training, cfg.hardware))
            values["fsdp2_config"] = str(engine_path)
        point = Point(cfg, strategy, ds_config if ds else None, str(engine_path) if ds else None,
                      None if ds else str(engine_path), str(folder))
        for name, content in trainer_files(point).items():
            path = folder / name
            if isinstance(content, str):
                path.write_text(content, encoding="utf-8")
            else:
                write_json(str(path), content)
        for key, name in (("trainer_args", "hf_args"), ("hf_deepspeed_config", "hf_ds_config"),
                          ("accelerate_config", "accelerate"), ("lightning_args", "lightning"),
                          ("torchtitan_toml", "torchtitan"), ("checkpointing", "checkpointing")):
            if (folder / FILES[name]).exists():
                values[key] = str(folder / FILES[name])
        return values

    def evaluate(self, strategy: Strategy, trial_number: Optional[int] = None) -> Measurement:
        cfg = self.cfg
        trial_dir = self._trial_dir(trial_number)
        number = trial_number if trial_number is not None else _number_of(trial_dir)
        job = self.job(strategy, trial_dir, number)
        job_path = trial_dir / "job.json"
        job_path.write_text(json.dumps(job.to_json(), indent=1))
        values = self.point_files(strategy, trial_dir)
        try:
            argv = expand(self.command, values)
        except KeyError as err:
            m = Measurement(status="error", reason=f"profile.command: {{{err.args[0]}}} has no value for this "
                            f"{strategy.engine} point", extra={"loop": LOOP})
        else:
            env = dict(self.env)
            env.update({RESULT_ENV: str(job.result_path), WARMUP_ENV: str(cfg.profile.warmup_steps),
                        MEASURED_ENV: str(cfg.profile.measure_steps),
                        TOKENS_ENV: str(cfg.training.global_batch_size * cfg.training.seq_len)})
            if self.device == "cpu":
                env.setdefault("DS_ACCELERATOR", "cpu")
            res = launch(str(job_path), nproc=self.nproc, log_dir=str(trial_dir / "logs"),
                         timeout_s=cfg.profile.timeout_s, memory_limit_bytes=self.memory_limit_bytes, env=env,
                         command=argv, cwd=os.path.dirname(os.path.abspath(cfg.path)))
            m = self.script_measurement(strategy, res)
            m.extra["command"] = argv
        (trial_dir / "measurement.json").write_text(json.dumps(m.as_dict(), indent=1, default=str))
        if self.calibrator is not None:
            self.calibrator.add(strategy, m)
        return m

    def script_measurement(self, strategy: Strategy, res: LaunchResult) -> Measurement:
        """The profile backend's Measurement of the launch, with the script's failures said as such."""
        m = self.measurement(strategy, res)
        m.extra.update(launcher="script", loop=LOOP)
        missing = [r for r in range(res.nproc) if r not in res.results]
        if m.ok or not missing or res.timed_out or m.status != "crash":
            return m
        cause = last_error_line(res.log_dir)
        rc = res.returncode
        ranks = ", ".join(map(str, missing))
        if cause and any(w in cause.lower() for w in _OOM_WORDS):
            return dataclasses.replace(m, status="oom", reason=f"the script ran out of memory: {cause}"[:400])
        if rc == 0:
            reason = (f"the script exited (status 0) without writing a result for rank(s) {ranks}: does its "
                      "trainer have autotune's callback (autotune.callbacks.hf / .lightning)?")
        elif rc is not None and rc < 0:
            reason = f"the script was killed by {signal_name(-rc)} without writing a result for rank(s) {ranks}"
        else:
            reason = f"the script exited with status {rc} without writing a result for rank(s) {ranks}"
            reason += f" ({cause})" if cause else ""
        return dataclasses.replace(m, reason=reason[:400])
