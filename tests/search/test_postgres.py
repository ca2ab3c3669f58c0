"""Four `autotune worker` processes on a real PostgreSQL server (throwaway cluster on loopback).

Skips only when the PostgreSQL server binaries are absent (Debian: apt-get install -y postgresql);
psycopg2-binary must be installed.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from test_workers import check_study, job, run_workers


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return cands[-1] if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url():
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed")
    import psycopg2  # noqa: F401  (required: pip install psycopg2-binary)

    base = tempfile.mkdtemp(prefix="autotune-pg-")
    data = os.path.join(base, "data")
    run_as: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres")
        os.chmod(base, 0o755)
    port = _free_port()
    subprocess.run([*run_as, initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"], check=True,
                   capture_output=True, timeout=120)
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off"
    subprocess.run([*run_as, pg_ctl, "-D", data, "-o", opts, "-l", os.path.join(base, "log"), "-w", "start"],
                   check=True, capture_output=True, timeout=120)
    try:
        subprocess.run([*run_as, _bin("createdb") or "createdb", "-h", "127.0.0.1", "-p", str(port), "-U",
                        "postgres", "autotune"], check=True, capture_output=True, timeout=60)
        yield f"postgresql://postgres@127.0.0.1:{port}/autotune"
    finally:
        subprocess.run([*run_as, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_four_workers_postgresql(postgres_url, tmp_path):
    config = job(tmp_path)
    summaries = run_workers(postgres_url, "pg", config, 4, tmp_path)
    front, n = check_study(postgres_url, "pg")
    assert sum(s["evaluations"] for s in summaries) == n
    assert front
