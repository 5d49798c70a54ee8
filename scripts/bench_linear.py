#!/usr/bin/env python
"""Thin entry point: see bench/bench_linear.py (python scripts/bench_linear.py --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_linear import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
