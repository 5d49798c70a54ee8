#!/usr/bin/env python
"""Run the same tests many times in a row and count the runs that failed: a flaky test is a defect.

    python scripts/repeat_tests.py --runs 20                  # the multi-process start-up/teardown tests
    python scripts/repeat_tests.py --runs 5 tests/test_server.py

Each run is a fresh ``python -m pytest -q`` process (fresh ranks, fresh ports). Prints one line
per run and a summary; exits 1 when any run failed. The logs of failed runs are kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every test file that starts ranks and lets them end: communication, launcher, TP models, CLI.
DEFAULT_TESTS = ["tests/test_comm_backend.py", "tests/test_launcher.py", "tests/test_model.py",
                 "tests/test_torch_model.py", "tests/test_paddle_model.py", "tests/test_cli.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="*", help=f"pytest arguments (default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("--runs", type=int, default=20, help="how many runs in a row (default 20)")
    opts = parser.parse_args(argv)
    tests = opts.tests or [t for t in DEFAULT_TESTS if (ROOT / t).exists()]
    logs = Path(tempfile.mkdtemp(prefix="repeat_tests-"))
    failed: list[int] = []
    start = time.monotonic()
    for run in range(1, opts.runs + 1):
        t0 = time.monotonic()
        log = logs / f"run{run}.log"
        with log.open("wb") as f:
            code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                   cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        summary = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"run {run:3d}/{opts.runs}: {'ok  ' if code == 0 else 'FAIL'} {time.monotonic() - t0:6.1f} s  "
              f"{summary[0]}", flush=True)
        if code:
            failed.append(run)
        else:
            log.unlink()
    print(f"{opts.runs - len(failed)} of {opts.runs} runs passed, {len(failed)} failed "
          f"({time.monotonic() - start:.0f} s; {' '.join(tests)})")
    if failed:
        print(f"logs of failed runs {failed}: {logs}")
        return 1
    logs.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
