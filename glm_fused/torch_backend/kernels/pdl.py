"""Programmatic dependent launch (PDL, sm90 and later): a kernel starts while the one before it ends.

A decode step is a chain of short kernels (eleven per MoE layer at batch 1, 2-35 µs each), and
without PDL each one's start - its blocks dispatched, their addresses computed, the first
weight tile requested - waits on the last block of the kernel before. Launched with PDL, a
kernel's blocks start as soon as every block of the kernel before has started, then wait
(``griddepcontrol.wait``) until that kernel has completed and its writes are visible.

The rule every kernel launched this way keeps: ``pdl_wait`` comes before its first read of
anything the step writes and before any early return, so each kernel completes only after the
one before it did, and the chain stays in order. Reads of weights (never written during a step)
may come before it: the weight-only Linear requests its first tile there. So may reads of what
the host uploaded before the step's first kernel (a full dependency, not a programmatic one):
decode attention reads its lengths and block table there.

``GLM_FUSED_PDL=0`` (or ``set_pdl(False)``) launches every kernel the ordinary way, for
comparisons.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_switch = {"on": os.environ.get("GLM_FUSED_PDL", "1") != "0"}


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(x: torch.Tensor) -> bool:
    """Launch the kernels working on ``x`` with PDL? A CUDA tensor on sm90 or later, not turned off."""
    return _switch["on"] and x.is_cuda and _capable(x.device.index if x.device.index is not None
                                                    else torch.cuda.current_device())


def pdl_args(x: torch.Tensor, wanted: bool = True) -> dict:
    """The launch keywords: the kernel's ``PDL`` constexpr and Triton's launch option (which the
    CPU interpreter ignores). ``wanted=False``: an ordinary launch (see the Linear's tiles)."""
    on = wanted and use_pdl(x)
    return {"PDL": on, "launch_pdl": on}


def set_pdl(on: bool) -> bool:
    """Turn PDL on or off for this process; returns the previous setting."""
    previous, _switch["on"] = _switch["on"], bool(on)
    return previous


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernel before to complete, then let the next one start its blocks (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
