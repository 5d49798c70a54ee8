#!/usr/bin/env python
"""Fused vs unfused logits on the same weights and ranks: see --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glm_fused.cli.logit_diff import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
