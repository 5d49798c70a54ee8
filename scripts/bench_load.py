#!/usr/bin/env python
"""Checkpoint load speed, plain safetensors against from_pretrained: see --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_load import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
