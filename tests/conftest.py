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
