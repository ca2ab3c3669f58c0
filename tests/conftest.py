import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def write(tmp_path):
    """Write a YAML/JSON text to a temp file and return its path."""

    def _write(text: str, name: str = "job.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return _write


BASE = """
model: {preset: llama2-7b}
training: {seq_len: 4096, global_batch_size: 64}
hardware: {gpu: a100-80gb, gpus_per_node: 8}
"""


@pytest.fixture
def group():
    """A 1-process gloo group (the default group) for the test, destroyed afterwards."""
    import tempfile

    dist = pytest.importorskip("torch.distributed")
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    fd, store = tempfile.mkstemp(prefix="gloo_store_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

