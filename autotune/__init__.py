"""autotune: simulation-based training-strategy autotuner.

The pieces, in the order data flows (cli -> commands -> search -> {memory, simulate, profile} ->
strategy/spec; README "Where things are" maps every file):

- ``autotune.cli`` / ``autotune.commands``  the command line, one module per command
- ``autotune.config``    job file (YAML) -> typed specs, one-line key-path errors
- ``autotune.presets``   model and GPU presets (``model_from_name``, ``gpu_from_name``)
- ``autotune.strategy``  one strategy value (its fields are the knob list) -> DeepSpeed config / FSDP2 layout
- ``autotune.memory``    analytical per-GPU memory model (pure math)
- ``autotune.simulate``  throughput simulator (pure math); ``autotune.calibration`` corrects it
- ``autotune.space`` / ``autotune.screen`` / ``autotune.search``  the Optuna search
- ``autotune.backends`` measurement backends (simulate, profile, replay) and the launcher
- ``autotune.worker``   one measurement inside a launched process (torch side)
- ``autotune.models``   reference / HF / user models, checkpointing, fsdp2 applied to a model (torch side)
- ``autotune.calibration`` / ``autotune.samplers``  simulator fits; the search's EHVI sampler
- ``autotune.runfiles`` / ``autotune.output``  the run directory's files

Importing ``autotune`` never imports torch or deepspeed.
"""

from autotune.models.checkpointing import apply_checkpointing
from autotune.errors import ConfigError
from autotune.models.fsdp2 import apply
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import GPUSpec, HardwareSpec, ModelSpec, NVMeSpec, TrainingSpec
from autotune.engine_configs import to_deepspeed_config
from autotune.strategy import Strategy



def __getattr__(name: str) -> str:
    """``__version__``, read from the installed metadata when first asked (importlib.metadata costs
    tens of milliseconds of every command's start otherwise)."""
    if name != "__version__":
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autotune")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0.1.0"

__all__ = [
    "ConfigError",
    "GPUSpec",
    "HardwareSpec",
    "ModelSpec",
    "NVMeSpec",
    "Strategy",
    "TrainingSpec",
    "apply",
    "apply_checkpointing",
    "gpu_from_name",
    "model_from_name",
    "to_deepspeed_config",
]
