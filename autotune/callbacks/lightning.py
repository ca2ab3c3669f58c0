"""The autotune callback for Lightning: ``Trainer(..., callbacks=[AutotuneCallback()])``.

Under ``autotune run`` with the ``script`` backend it times the optimizer steps (``accumulate_grad_batches``
training batches each), reads the peak memory of the measured ones, writes the trial's result and stops
training after the warm-up plus measured steps (``trainer.should_stop``); a training exception is
written as the trial's failure (``on_exception``). Run on its own it does nothing. Import this module
before building the model: on the CPU the allocation tally counts from the import (_meter.arm)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from autotune.callbacks._meter import StepMeter, arm

arm()


class AutotuneCallback(Callback):
    """Step timing, peak memory and the stop, for the ``script`` backend (module docstring)."""

    def __init__(self, **meter: Any) -> None:
        self.meter = StepMeter("lightning", **meter)
        self._loss = 0.0

    def _accumulate(self, trainer: Any) -> int:
        return max(1, int(trainer.accumulate_grad_batches))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        gas = self._accumulate(trainer)
        self.meter.gas = gas
        if batch_idx % gas == 0:
            self.meter.step_begin()
            self._loss = 0.0

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self.meter.mark("backward")
        if self.meter.enabled:
            self._loss += float(loss.detach().float()) / self._accumulate(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.meter.mark("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self._accumulate(trainer) == 0 and self.meter.step_end(self._loss):
            trainer.should_stop = True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.meter.fail(exception)
