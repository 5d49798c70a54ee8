"""Triton kernels of the torch backend's CUDA path.

Why they exist: the eager layers are plain PyTorch ops - right everywhere, but on a GPU a
decode step becomes hundreds of tiny launches and the MoE loops over experts with a host
sync. These kernels make the step a fixed, short list of launches with no host sync, so it
can be captured in a CUDA graph (``glm_fused.torch_backend.cuda_graph``).

* ``rmsnorm.py``        - residual add + RMSNorm in one pass (fp32 statistics);
* ``rotary.py``         - partial NeoX RoPE on q and k, and the KV-cache write, in one launch;
* ``decode_attention.py`` - one query per sequence over its cached keys (split-K, two stages);
* ``fused_moe.py``      - router top-k, token sort by expert, and the two expert GEMMs.
* ``pdl.py``            - programmatic dependent launch: each kernel starts while the one before ends.

Each kernel computes what the eager layer computes (tests compare them on the GPU and, small,
under Triton's CPU interpreter). ``enabled(tensor)`` is the one switch the layers ask: a CUDA
tensor, Triton importable, and not turned off with ``set_enabled(False)`` or
``GLM_FUSED_TRITON=0`` (the eager path, for comparisons).
"""

from __future__ import annotations

import functools
import os

import torch

_switch = {"on": os.environ.get("GLM_FUSED_TRITON", "1") != "0"}


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``): kernels run on CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def enabled(x: torch.Tensor) -> bool:
    """Use the Triton kernels for this tensor?"""
    if not _switch["on"] or not triton_available():
        return False
    return x.is_cuda or interpreting()


def set_enabled(on: bool) -> bool:
    """Turn the kernels on or off for this process; returns the previous setting."""
    previous, _switch["on"] = _switch["on"], bool(on)
    return previous


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models keep fp32 products (Triton's default for fp32 is tf32, ~1e-3 off)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreter_numpy2_fix() -> None:
    """Triton's CPU interpreter turns a one-element array into an int with ``int(array)``,
    which numpy 2 refuses for 1-d arrays (program ids are such arrays); index them instead.
    For tests and dry runs under ``TRITON_INTERPRET=1``."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_glm_fused_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._glm_fused_patched = True
