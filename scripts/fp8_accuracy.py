#!/usr/bin/env python
"""Thin entry point: see bench/fp8_accuracy.py (python scripts/fp8_accuracy.py --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fp8_accuracy import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
