#!/usr/bin/env python
"""Thin entry point: see bench/bench_fusion.py (python scripts/bench_fusion.py --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_fusion import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
