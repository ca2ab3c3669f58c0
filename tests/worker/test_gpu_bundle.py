"""The offline GPU bundle's pin list (benchmarks/gpu_bundle.txt) against the project's declared
dependencies (pyproject.toml) and the requirements of what it pins, so it cannot go stale silently.

The typical GPU host (issue 16) has torch, transformers, scipy, rich and tqdm, hence everything
those require; the bundle must hold the rest, pinned, and no second copy of the host's packages
(except a pin marked "override-host"). Requirement metadata comes from the installed
distributions (the test environment installs the project with its profile and hf extras).
The real offline install is exercised by `benchmarks/gpu_check.sh --device cpu --tiny`.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIST = os.path.join(ROOT, "benchmarks", "gpu_bundle.txt")
BUNDLE_SH = os.path.join(ROOT, "benchmarks", "gpu_bundle.sh")
HOST_BASE = {"torch", "transformers", "scipy", "rich", "tqdm"}  # issue 16's typical host
# ... which the issue says has none of these (a newer transformers pulls pydantic through typer:
# the closure below stops at them, and the bundle's copy comes first on PYTHONPATH there)
HOST_LACKS = {"deepspeed", "optuna", "pydantic", "hjson", "sqlalchemy"}
# the GPU host's interpreter and platform, for requirement markers
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def parse_list(path: str = LIST) -> tuple[dict[str, str], list[str], set[str]]:
    """(pins name -> version, '#host:' names, names marked override-host), names canonical."""
    pins: dict[str, str] = {}
    host: list[str] = []
    override: set[str] = set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"#host:\s*(\S+)", line)
            if m:
                host.append(canonicalize_name(m.group(1)))
                continue
            body, _, comment = line.partition("#")
            body = body.strip()
            if not body:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", body)
            assert m, f"{path}: {body!r} is not pinned as name==version"
            name = canonicalize_name(m.group(1))
            assert name not in pins, f"{path}: {name} pinned twice"
            pins[name] = m.group(2)
            if "override-host" in comment:
                override.add(name)
    return pins, host, override


def active(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(TARGET)


def requires(name: str) -> list[Requirement]:
    """The installed distribution's active requirements on the GPU host's platform."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        pytest.fail(f"{name} is not installed here: install the project with its profile and hf extras")
    return [r for r in (Requirement(t) for t in dist.requires or []) if active(r)]


def host_closure(roots) -> set[str]:
    """The roots and everything they require, transitively (installed metadata), but HOST_LACKS."""
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in HOST_LACKS:
            continue
        seen.add(name)
        todo += [canonicalize_name(r.name) for r in requires(name)]
    return seen


def project_requirements() -> list[Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    return [Requirement(t) for t in project["dependencies"] + project["optional-dependencies"]["profile"]]


def test_list_is_pinned_and_names_the_host():
    pins, host, override = parse_list()
    assert HOST_LACKS <= set(pins)
    assert HOST_BASE <= set(host)
    assert override <= set(pins)


def test_project_runtime_and_profile_dependencies_are_bundled_or_on_the_host():
    pins, host, _ = parse_list()
    for req in project_requirements():
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"gpu_bundle.txt pins {name}=={pins[name]}, pyproject.toml declares {req}"
        else:
            assert name in host, f"pyproject.toml requires {req}: neither pinned in gpu_bundle.txt nor a '#host:' package"


def test_host_lines_are_what_such_a_host_has():
    _, host, _ = parse_list()
    closure = host_closure(HOST_BASE)
    extra = [h for h in host if h not in closure]
    assert not extra, f"'#host:' names {extra} are neither torch/transformers/scipy/rich/tqdm nor required by them"


def test_no_second_copy_of_the_hosts_packages():
    pins, _, override = parse_list()
    closure = host_closure(HOST_BASE)
    doubled = sorted(set(pins) & closure - override)
    assert not doubled, f"gpu_bundle.txt bundles {doubled}, which the host already has (torch/transformers closure)"
    # an override is justified only if a bundled package needs more than torch guarantees (the one
    # package every such host has; what transformers pulls in varies across its releases)
    for name in override:
        host_floor = [Version(s.version) for r in requires("torch") if canonicalize_name(r.name) == name
                      for s in r.specifier if s.operator in (">=", "==", "~=")]
        bundle_specs = [r.specifier for p in pins for r in requires(p) if canonicalize_name(r.name) == name]
        assert bundle_specs, f"{name} is marked override-host but no bundled package requires it"
        guaranteed = max(host_floor, default=Version("0"))
        assert any(not s.contains(guaranteed, prereleases=True) for s in bundle_specs), \
            f"{name} is marked override-host, but torch's requirements already guarantee >= {guaranteed}"


def test_bundle_is_closed_over_its_requirements():
    """Every requirement of a pinned package is pinned too or on the host; pinned versions fit the ranges."""
    pins, _, _ = parse_list()
    closure = host_closure(HOST_BASE)
    checked = 0
    for name in pins:
        for req in requires(name):
            dep = canonicalize_name(req.name)
            assert dep in pins or dep in closure, f"{name} requires {req}: neither pinned nor on the host"
            if dep in pins and md.version(name) == pins[name]:  # this metadata is the pinned release's
                assert req.specifier.contains(pins[dep], prereleases=True), \
                    f"{name}=={pins[name]} requires {req}, but gpu_bundle.txt pins {dep}=={pins[dep]}"
                checked += 1
    assert checked > 0


def test_gpu_bundle_sh_refuses_an_unpinned_list(tmp_path):
    bad = tmp_path / "list.txt"
    bad.write_text("#host: torch\ndeepspeed==0.19.8\noptuna>=4\n")
    res = subprocess.run(["bash", BUNDLE_SH, "--list", str(bad), "--dest", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == f"gpu_bundle.sh: error: {bad}: 'optuna>=4' is not pinned (name==version)"
    assert not (tmp_path / "b").exists()
    res = subprocess.run(["bash", BUNDLE_SH, "--python-version", "twelve"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--python-version" in res.stderr
