"""autotune: simulation-based training-strategy autotuner.

The pieces, in the order data flows (cli -> search -> {memory, simulate, profile} -> config/strategy):

- ``autotune.config``    job file (YAML) -> typed specs, one-line key-path errors
- ``autotune.presets``   model and GPU presets (``model_from_name``, ``gpu_from_name``)
- ``autotune.strategy``  one strategy value -> DeepSpeed config / FSDP equivalent
- ``autotune.memory``    analytical per-GPU memory model (pure math)
- ``autotune.simulate``  throughput simulator (pure math); ``autotune.calibration`` fits it
- ``autotune.space`` / ``autotune.search``  the Optuna search
- ``autotune.profile``   measurement backends (simulate, deepspeed, replay) and the worker

Importing ``autotune`` never imports torch or deepspeed.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

from autotune.checkpointing import apply_checkpointing
from autotune.errors import ConfigError
from autotune.presets import gpu_from_name, model_from_name
from autotune.spec import GPUSpec, HardwareSpec, ModelSpec, NVMeSpec, TrainingSpec
from autotune.strategy import Strategy, to_deepspeed_config

try:
    __version__ = _version("autotune")
except _NotInstalled:  # imported from a source tree that was never installed
    __version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GPUSpec",
    "HardwareSpec",
    "ModelSpec",
    "NVMeSpec",
    "Strategy",
    "TrainingSpec",
    "apply_checkpointing",
    "gpu_from_name",
    "model_from_name",
    "to_deepspeed_config",
]
