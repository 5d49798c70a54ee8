"""Shared pytest setup."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests build their own checkpoints; never touch the user's cache.
os.environ.setdefault("GLM_FUSED_CACHE", str(ROOT / ".pytest_cache" / "glm_fused"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and FlashInfer for kernel tests); skipped on CPU")
    config.addinivalue_line("markers", "slow: multi-process or large; still part of the suite")
