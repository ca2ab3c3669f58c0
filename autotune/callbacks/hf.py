"""The autotune callback for Hugging Face Trainer: ``Trainer(..., callbacks=[AutotuneCallback()])``.

Under ``autotune run`` with the ``script`` backend it times the optimizer steps, reads the peak memory
of the measured ones, writes the trial's result and stops training after the warm-up plus measured
steps (``control.should_training_stop``); run on its own it does nothing. Import this module before
building the model: on the CPU the allocation tally counts from the import (_meter.arm)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from autotune.callbacks._meter import StepMeter, arm

arm()


class AutotuneCallback(TrainerCallback):
    """Step timing, peak memory and the stop, for the ``script`` backend (module docstring)."""

    def __init__(self, **meter: Any) -> None:
        self.meter = StepMeter("hf_trainer", **meter)
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.meter.gas = args.gradient_accumulation_steps
        if model is not None and self.meter.enabled:
            # the forward's end is the backward's start (the first micro-batch's)
            self._hook = model.register_forward_hook(lambda *a: self.meter.mark("backward"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.meter.step_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.meter.mark("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.meter.step_end() and self.meter.enabled:
            control.should_training_stop = True
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs and self.meter.enabled:
            self.meter.losses.append(float(logs["loss"]))
