"""Benchmarks and GPU checks of glm_fused: scripts of this repository, not part of the
installed package (setup.py installs ``glm_fused`` only). Run them as ``python scripts/<name>.py``
from a checkout; ``common.py`` is what they share.
"""
