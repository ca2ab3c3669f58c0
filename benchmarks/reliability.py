"""Reliability figures for the README: configs fuzzed, faults injected, trials lost.

    python benchmarks/reliability.py [--quick]

Runs tests/spec/test_fuzz.py (hypothesis; AUTOTUNE_FUZZ_EXAMPLES per property, default 120) and the
fault-injection tests (SIGINT, SIGTERM, KeyboardInterrupt in a fast in-memory run, SIGKILL of
`autotune run` mid-profile through a real torchrun launch then --resume, 4 concurrent workers on
SQLite and on PostgreSQL). Every fault test asserts that no finished trial is lost and no candidate
is evaluated twice, so "trials lost" is 0 exactly when they all pass.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = {
    "tests/search/test_interrupt.py": "SIGINT, SIGTERM, KeyboardInterrupt (in-memory), SIGKILL mid-profile + resume",
    "tests/search/test_workers.py": "4 workers racing on one SQLite study; worker joining a run's study",
    "tests/search/test_postgres.py": "4 workers racing on one PostgreSQL study",
}


class Count:
    def __init__(self) -> None:
        self.passed, self.failed, self.skipped, self.xfailed = [], [], [], []

    def pytest_runtest_logreport(self, report):  # noqa: D401 - pytest hook
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if hasattr(report, "wasxfail"):
                self.xfailed.append(report.nodeid)
            else:
                getattr(self, report.outcome).append(report.nodeid)


def main() -> int:
    os.chdir(ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    t0 = time.perf_counter()
    fuzz = Count()
    pytest.main(["-q", "-p", "no:cacheprovider", "tests/spec/test_fuzz.py"], plugins=[fuzz])
    import test_fuzz

    counts = dict(test_fuzz.FUZZ_COUNTS)
    faults = Count()
    if "--quick" not in sys.argv:
        pytest.main(["-q", "-p", "no:cacheprovider", *FAULTS], plugins=[faults])
    lost = len(faults.failed)
    print()
    print(f"configs fuzzed:   {counts['configs']} job files + {counts['spaces']} search spaces; "
          f"{counts['rejected']} rejected with a one-line error and exit 2; {len(fuzz.failed)} failures "
          "(tracebacks, hangs, multi-line errors)")
    print(f"faults injected:  {len(faults.passed) + len(faults.failed) + len(faults.xfailed)} scenarios "
          f"({'; '.join(FAULTS.values())})")
    print(f"trials lost:      {lost if not faults.failed else 'see failures: ' + ', '.join(faults.failed)}")
    if faults.xfailed:
        print(f"known gaps:       {', '.join(faults.xfailed)}")
    if faults.skipped:
        print(f"skipped:          {', '.join(faults.skipped)}")
    print(f"wall time:        {time.perf_counter() - t0:.0f} s")
    return 1 if fuzz.failed or faults.failed else 0


if __name__ == "__main__":
    sys.exit(main())
