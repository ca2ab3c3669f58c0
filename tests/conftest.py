import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# the hf parameter-count cache (autotune.hf_count.cache_path) of the tests, not the user's
os.environ.setdefault("AUTOTUNE_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "autotune-cache"))


def benchmark(name: str):
    """The module ``benchmarks/<name>.py`` (the memory benchmarks' rows and predictions)."""
    import importlib

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


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



def run_ranks(tmp_path, argv: list, timeout: float, nranks: int = 2, cwd=None) -> list:
    """``argv`` as ``nranks`` gloo ranks (RANK / WORLD_SIZE / MASTER_* in the environment), their output
    in files (no pipe to fill); a rank that fails leaves the others waiting in a collective, so all are
    stopped then. Asserts every rank exited 0; returns each rank's stdout."""
    import subprocess
    import time

    from autotune.backends.launch import free_port

    port = str(free_port())
    procs = []
    for rank in range(nranks):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(nranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        with open(tmp_path / f"out{rank}", "w") as out, open(tmp_path / f"err{rank}", "w") as err:
            procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err))
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            assert time.monotonic() < deadline, f"{nranks}-rank run timed out"
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, p in enumerate(procs):
        assert p.wait() == 0, (tmp_path / f"err{rank}").read_text()[-3000:]
    return [(tmp_path / f"out{rank}").read_text() for rank in range(nranks)]
