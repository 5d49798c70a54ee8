#!/usr/bin/env python
"""Thin entry point: see bench/fault_check.py (python scripts/fault_check.py --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fault_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
