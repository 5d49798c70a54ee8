#!/usr/bin/env python
"""Thin entry point: see bench/bench_serve.py (python scripts/bench_serve.py --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
