"""A built wheel is self-contained: installed apart from the repository, it runs the default job from
a folder outside the repository (the search spaces ship inside it)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_wheel_runs_the_default_job_outside_the_repository(tmp_path):
    wheels, target, job_dir = tmp_path / "wheels", tmp_path / "site", tmp_path / "job"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), ROOT], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("autotune-*.whl")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    job_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "llama2-7b.yaml"), job_dir)
    # the wheel's copy, not the repository's (PYTHONPATH is searched before the editable install's finder)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import autotune; print(autotune.__file__)"], cwd=job_dir,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr
    run = subprocess.run([sys.executable, "-m", "autotune", "run", "llama2-7b.yaml"], cwd=job_dir, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (job_dir / "runs" / "latest" / "front.json").is_file()
    assert "search_spaces" in {p.name for p in (target / "autotune").iterdir()}
