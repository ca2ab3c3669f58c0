"""Start one worker job through a real launcher, bound its time and logs, read its results.

``launch(job_path, nproc=N, ...)`` runs::

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m autotune.backends.launch JOB.json            # launcher "torchrun" (one node)
    python -m deepspeed.launcher.runner --num_gpus N --master_port P --no_local_rank \\
        --module autotune.backends.launch JOB.json      # launcher "deepspeed" (one node: no pdsh/ssh)
    ... --hostfile H --num_nodes K --master_addr A      # launcher "deepspeed", several nodes

in a new session (``start_new_session=True``, so the launcher is the leader of its own process
group). Each rank runs this module's *rank shim* (``python -m autotune.backends.launch JOB.json``,
stdlib only), which starts the real worker ``python -m autotune.worker JOB.json`` as its
child (with the optional address-space limit set by ``resource.setrlimit(RLIMIT_AS)`` in a
``preexec_fn`` and PR_SET_PDEATHSIG so it dies with the shim), then writes the worker's exit
status to ``exit.rank<r>.json``. That is where a crash's reason comes from: torchrun itself only
exits 1 for any child failure and puts its workers into sessions of their own.

Killing: on timeout (or when a rank reported a failure and the others do not finish within
``abort_grace_s``) every process of the launch gets SIGTERM, then SIGKILL after ``kill_grace_s``:
the launcher's process group and every process whose environment carries this launch's
``AUTOTUNE_LAUNCH_ID`` (torchrun's workers live in sessions of their own, and orphans are
re-parented to init). The same cleanup runs at exit and on SIGTERM/SIGHUP of the parent.

Logs: stdout/stderr of all ranks go to ``stdout.log`` / ``stderr.log`` (first and last ``log_limit_bytes``).

Failure is data: :func:`failure_of` turns the per-rank result and exit JSON, the launcher's exit status
and the timeout flag into ``(status, reason)``; a rank dead without a result adds its log's last
exception line (autotune.backends.logs).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from autotune.backends.logs import last_error_line
from autotune.worker.dist_env import free_port  # noqa: F401  (re-exported: the tests launch with it)

LAUNCH_ENV = "AUTOTUNE_LAUNCH_ID"
MEMORY_ENV = "AUTOTUNE_WORKER_RLIMIT_AS"
ENTRY_ENV = "AUTOTUNE_WORKER_ENTRY"
"""Test hook: the shim runs ``python <this script> JOB.json`` instead of the worker module."""
LOG_LIMIT_BYTES = 1 << 20
WORKER_MODULE = "autotune.worker"

_LIVE: dict[str, "subprocess.Popen[bytes]"] = {}
_LIVE_LOCK = threading.Lock()


# ---------------------------------------------------------------- results


@dataclass
class LaunchResult:
    """What one launch left behind."""

    nproc: int  # processes (ranks) started
    returncode: Optional[int]
    """The launcher's exit status (negative: killed by that signal; None: never exited)."""
    timed_out: bool
    elapsed_s: float
    log_dir: str
    results: dict[int, dict] = field(default_factory=dict)
    """rank -> result JSON written by the worker (autotune.worker.main docstring)."""
    exits: dict[int, dict] = field(default_factory=dict)
    """rank -> {"returncode": int, "signal": name|None} written by the rank shim."""
    aborted: str = ""
    """Why the launch was cut short before the timeout (a rank reported a failure), if it was."""
    command: list[str] = field(default_factory=list)
    launch_id: str = ""
    """Value of AUTOTUNE_LAUNCH_ID in every process of the launch (see alive())."""
    pid: int = 0  # the launcher's pid (= its process-group id)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def failure_of(res: LaunchResult) -> Optional[tuple[str, str]]:
    """``(status, reason)`` of a failed launch, or None when every rank reported ``ok`` (even if the
    processes then hung in teardown and were killed).

    Precedence: a structured failure reported by a rank (oom, nan, error: the root cause, even if
    the other ranks then hung or were killed) > a rank that died without a result (crash, reason
    from its exit status) > the timeout > a launcher failure with no rank information.
    """
    if len(res.results) == res.nproc and all(r.get("status") == "ok" for r in res.results.values()):
        return None  # every rank measured; a hang or kill during teardown does not void that
    for status in ("oom", "nan", "error"):
        for rank in sorted(res.results):
            r = res.results[rank]
            if r.get("status") == status:
                phase = f" in {r['phase']}" if r.get("phase") else ""
                reason = (r.get("reason") or status).strip()
                return status, f"rank {rank}{phase}: {reason}"[:400]
    missing = [rank for rank in range(res.nproc) if rank not in res.results]
    # The root cause first: a rank killed by a signal of its own (SIGSEGV, SIGABRT...), then a
    # non-zero exit, then SIGKILL (e.g. the kernel OOM killer), last SIGTERM/SIGINT, which the
    # launcher sends to the surviving ranks once one has failed. After our own kill (timeout or
    # abort) the TERM/KILL/INT deaths are ours, not causes.
    ours = ("SIGTERM", "SIGINT", "SIGKILL")

    def rank_order(rank: int) -> int:
        sig = res.exits[rank].get("signal")
        return ({"SIGTERM": 3, "SIGINT": 3, "SIGKILL": 2}.get(sig, 0)) if sig else 1

    dead = [r for r in missing if r in res.exits and res.exits[r].get("returncode") not in (0, None)
            and not ((res.timed_out or res.aborted) and res.exits[r].get("signal") in ours)]
    cause = last_error_line(res.log_dir)
    cause = f" ({cause})" if cause else ""
    for rank in sorted(dead, key=lambda r: (rank_order(r), r)):
        ex = res.exits[rank]
        if ex.get("signal"):
            return "crash", f"rank {rank} killed by {ex['signal']} before writing a result"
        return "crash", f"rank {rank} exited with status {ex['returncode']} without a result{cause}"[:400]
    if res.timed_out:
        return "timeout", f"no result after {res.elapsed_s:.0f} s; process group killed"
    if res.aborted:
        return "crash", res.aborted
    if missing:
        rc = res.returncode
        how = f"killed by {signal_name(-rc)}" if rc is not None and rc < 0 else f"exit status {rc}"
        return "crash", f"launcher {how}; no result from rank(s) {', '.join(map(str, missing))}{cause}"[:400]
    bad = [rank for rank, r in res.results.items() if r.get("status") != "ok"]
    if bad:
        r = res.results[bad[0]]
        return "error", f"rank {bad[0]}: unexpected status {r.get('status')!r}"
    return None


# ---------------------------------------------------------------- commands


def build_command(launcher: str, nproc: int, job_path: str, *, num_nodes: int = 1,
                  hostfile: Optional[str] = None, master_addr: str = "127.0.0.1",
                  master_port: Optional[int] = None, python: str = sys.executable) -> list[str]:
    """The launcher command line that runs the rank shim on ``nproc`` processes per node."""
    if nproc < 1 or num_nodes < 1:
        raise ValueError(f"need nproc >= 1 and num_nodes >= 1, but got {nproc} and {num_nodes}")
    shim = ["autotune.backends.launch", str(job_path)]
    if launcher == "torchrun":
        if num_nodes > 1:
            raise ValueError("launcher torchrun runs one node here; use launcher deepspeed with a hostfile")
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", *shim]
    if launcher == "deepspeed":
        port = master_port or free_port()
        cmd = [python, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
               "--no_local_rank", "--module"]
        if num_nodes > 1:
            if not hostfile:
                raise ValueError("a multi-node deepspeed launch needs a hostfile")
            # DeepSpeed's multi-node launcher (pdsh by default) starts the shim on every host.
            cmd[3:3] = ["--hostfile", hostfile, "--num_nodes", str(num_nodes), "--master_addr", master_addr]
        else:
            # One node: never consult /job/hostfile or ssh; run locally.
            cmd[3:3] = ["--hostfile", os.devnull if hostfile is None else hostfile]
        return cmd + shim
    raise ValueError(f"unknown launcher {launcher!r}; expected torchrun or deepspeed")


# ---------------------------------------------------------------- bounded logs


class _BoundedPump(threading.Thread):
    """Copy a pipe to a file keeping the first and the last ``limit`` bytes."""

    def __init__(self, pipe: Any, path: str, limit: int) -> None:
        super().__init__(daemon=True)
        self.pipe, self.path, self.limit = pipe, path, limit
        self.total = 0

    def run(self) -> None:
        tail = bytearray()
        with open(self.path, "wb") as fh:
            while True:
                chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
                if not chunk:
                    break
                self.total += len(chunk)
                room = max(0, self.limit - fh.tell())
                if room:
                    fh.write(chunk[:room])
                    chunk = chunk[room:]
                if chunk:
                    tail += chunk
                    if len(tail) > self.limit:
                        del tail[: len(tail) - self.limit]
            dropped = self.total - fh.tell() - len(tail)
            if dropped > 0:
                fh.write(f"\n[... {dropped} bytes truncated by autotune ...]\n".encode())
            fh.write(bytes(tail))
        self.pipe.close()


# ---------------------------------------------------------------- process cleanup


def _marked_pids(launch_id: str) -> list[int]:
    """Processes whose environment carries ``AUTOTUNE_LAUNCH_ID=launch_id`` (same user only)."""
    needle = f"{LAUNCH_ENV}={launch_id}".encode()
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _signal_all(proc: "subprocess.Popen[bytes]", launch_id: str, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _marked_pids(launch_id):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(launch_id: str, pgid: Optional[int] = None) -> list[int]:
    """Processes of a launch still running (zombies excluded): marked processes plus the group."""
    pids = set(_marked_pids(launch_id))
    if pgid is not None and _group_alive(pgid):
        pids.add(pgid)
    live = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            live.append(pid)
    return live


def kill_launch(proc: "subprocess.Popen[bytes]", launch_id: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process of the launch, then SIGKILL what is left after ``grace_s``."""
    _signal_all(proc, launch_id, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not alive(launch_id):
            break
        time.sleep(0.05)
    _signal_all(proc, launch_id, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
        pass
    deadline = time.monotonic() + 5
    while alive(launch_id) and time.monotonic() < deadline:
        time.sleep(0.05)


def _cleanup_all() -> None:
    with _LIVE_LOCK:
        items = list(_LIVE.items())
        _LIVE.clear()
    for launch_id, proc in items:
        kill_launch(proc, launch_id, grace_s=2.0)


_HANDLERS_INSTALLED = False


def _install_exit_handlers() -> None:
    """Kill running launches when this process exits (atexit) or is told to (SIGTERM/SIGHUP)."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old = signal.getsignal(sig)
        if old not in (signal.SIG_DFL, None):
            continue  # somebody else handles it; atexit still covers a normal exit

        def handler(signum: int, frame: Any, _sig: int = sig) -> None:
            _cleanup_all()
            signal.signal(_sig, signal.SIG_DFL)
            os.kill(os.getpid(), _sig)

        signal.signal(sig, handler)


# ---------------------------------------------------------------- launch


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def job_result_path(job_path: Path, job: dict) -> Path:
    """The job's ``result_path``; a relative one is relative to the job file's folder, which is the
    working directory the workers run in (so it means the same to the launcher and to every rank)."""
    path = Path(job.get("result_path") or "result.json")
    return path if path.is_absolute() else job_path.resolve().parent / path


def rank_file(result_path: Path, kind: str, rank: int) -> Path:
    """Rank ``rank``'s result file (as autotune.worker.main names it) or the shim's exit file."""
    if kind == "exit":
        return result_path.with_name(f"exit.rank{rank}.json")
    return result_path if rank == 0 else result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")


def _rank_files(result_path: Path, kind: str, nproc: int) -> dict[int, dict]:
    out = {}
    for rank in range(nproc):
        data = _read_json(rank_file(result_path, kind, rank))
        if data is not None:
            out[rank] = data
    return out


def launch(job_path: str, *, nproc: int, log_dir: str, timeout_s: float, launcher: str = "torchrun",
           memory_limit_bytes: Optional[int] = None, num_nodes: int = 1, hostfile: Optional[str] = None,
           env: Optional[dict[str, str]] = None, log_limit_bytes: int = LOG_LIMIT_BYTES,
           kill_grace_s: float = 5.0, abort_grace_s: float = 20.0, worker_entry: Optional[str] = None,
           command: Optional[Sequence[str]] = None, cwd: Optional[str] = None) -> LaunchResult:
    """Run the job file ``job_path`` (its ``result_path``, default ``result.json`` beside it) on
    ``nproc`` ranks; never raises for a failing job, only for bad arguments. ``command``: run it (in
    ``cwd``, under the memory limit) instead of launcher + rank shim; its ranks write the results."""
    job_path = str(Path(job_path).resolve())
    job = json.loads(Path(job_path).read_text())
    result_path = job_result_path(Path(job_path), job)
    for rank in range(nproc):  # stale files from an earlier attempt would read as this one's
        for kind in ("result", "exit"):
            rank_file(result_path, kind, rank).unlink(missing_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    cmd = list(command) if command else build_command(launcher, nproc, job_path, num_nodes=num_nodes,
                                                      hostfile=hostfile)
    launch_id = uuid.uuid4().hex
    penv = dict(os.environ)
    penv.update(env or {})
    penv[LAUNCH_ENV] = launch_id
    penv["PYTHONUNBUFFERED"] = "1"
    # torchrun sets OMP_NUM_THREADS=1 for nproc > 1, DeepSpeed's launcher does not: the ranks would
    # oversubscribe the cores (docs/profiling.md).
    penv.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc or 1))))
    # The shim must be importable on every rank the same way this package is.
    pkg_root = str(Path(__file__).resolve().parents[2])
    penv["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in penv.get("PYTHONPATH", "").split(os.pathsep) if p])
    if memory_limit_bytes:
        penv[MEMORY_ENV] = str(int(memory_limit_bytes))
    if worker_entry:
        penv[ENTRY_ENV] = worker_entry
    _install_exit_handlers()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=penv, cwd=cwd or str(Path(job_path).parent), start_new_session=True,
                            preexec_fn=_worker_preexec(memory_limit_bytes if command else None, signal.SIGTERM))
    with _LIVE_LOCK:
        _LIVE[launch_id] = proc
    pumps = [_BoundedPump(proc.stdout, os.path.join(log_dir, "stdout.log"), log_limit_bytes),
             _BoundedPump(proc.stderr, os.path.join(log_dir, "stderr.log"), log_limit_bytes)]
    for p in pumps:
        p.start()
    timed_out, aborted = False, ""
    failed_since: Optional[float] = None
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout_s:
                timed_out = True
                break
            if failed_since is None:
                done = _rank_files(result_path, "result", nproc)
                bad = [r for r, d in done.items() if d.get("status") != "ok"]
                died = [r for r in _rank_files(result_path, "exit", nproc) if r not in done]
                if bad or died or len(done) == nproc:  # a failure, or all results in: exit soon
                    failed_since = now
            elif now - failed_since > abort_grace_s:
                aborted = f"a rank failed and the others did not finish within {abort_grace_s:.0f} s"
                break
            time.sleep(0.1)
        # Kill when cut short, and also when the launcher exited but left processes behind.
        if proc.poll() is None or alive(launch_id):
            kill_launch(proc, launch_id, kill_grace_s)
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(launch_id, None)
        if proc.poll() is None:  # interrupted (KeyboardInterrupt...): leave nothing behind
            kill_launch(proc, launch_id, 1.0)
        for p in pumps:
            p.join(timeout=10)
    elapsed = time.monotonic() - t0
    return LaunchResult(nproc=nproc, returncode=proc.returncode, timed_out=timed_out, elapsed_s=elapsed,
                        log_dir=log_dir, results=_rank_files(result_path, "result", nproc),
                        exits=_rank_files(result_path, "exit", nproc), aborted=aborted, command=cmd,
                        launch_id=launch_id, pid=proc.pid)


# ---------------------------------------------------------------- rank shim


def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """prctl(PR_SET_PDEATHSIG, sig): this process gets ``sig`` when its parent dies (Linux; best
    effort). Used at every level: launcher (SIGTERM when ``autotune run`` dies, even by SIGKILL),
    rank shim (SIGTERM when the launcher dies) and worker (SIGKILL when its shim dies)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
    except Exception:
        pass


def _worker_preexec(limit: Optional[int], sig: int = signal.SIGKILL):
    def preexec() -> None:
        _set_pdeathsig(sig)
        if limit:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return preexec


def shim_main(argv: Sequence[str]) -> int:
    """One rank: run the worker as a child, forward SIGTERM/SIGINT, record how it exited."""
    if len(argv) != 1:
        print("usage: python -m autotune.backends.launch JOB.json", file=sys.stderr)
        return 2
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        return 1
    job_path = Path(argv[0])
    job = json.loads(job_path.read_text())
    rank = int(os.environ.get("RANK", "0"))
    result_path = job_result_path(job_path, job)
    limit = int(os.environ[MEMORY_ENV]) if os.environ.get(MEMORY_ENV) else None
    entry = os.environ.get(ENTRY_ENV)
    cmd = [sys.executable, entry, str(job_path)] if entry else [sys.executable, "-m", WORKER_MODULE, str(job_path)]
    child = subprocess.Popen(cmd, preexec_fn=_worker_preexec(limit))

    def forward(signum: int, frame: Any) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = child.wait()
    info = {"rank": rank, "returncode": rc, "signal": signal_name(-rc) if rc < 0 else None, "pid": child.pid}
    out = rank_file(result_path, "exit", rank)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(out)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(shim_main(sys.argv[1:]))
