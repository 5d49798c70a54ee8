"""SwiGLU activation: ``silu(gate) * up`` in one pass (fp32 inside, one rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_out, BLOCK_: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_ + tl.arange(0, BLOCK_)
    m = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate``, ``up`` ``[T, I]`` (views of one gate_up output are fine) -> ``[T, I]``."""
    T, n = gate.shape
    assert gate.stride(1) == 1 and up.stride(1) == 1
    out = torch.empty(T, n, dtype=gate.dtype, device=gate.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(n, BLOCK))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                                   BLOCK_=BLOCK, num_warps=4, **pdl_args(out))
    return out
