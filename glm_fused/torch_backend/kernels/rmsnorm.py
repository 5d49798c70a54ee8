"""Residual add + RMSNorm in one pass over each row.

Same maths as ``layers.layernorm.rms_norm`` after ``x + residual``: the sum is rounded to the
model dtype (it is the residual stream the next layer gets), statistics are fp32, the normed
row is rounded to the model dtype before the weight multiply (as transformers does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels import next_pow2
from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                        stride_x, stride_res, stride_out, stride_sum,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait (PDL)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)``; with no residual the second is ``x``.

    Rows are the last dimension; any leading shape (``[T, H]``, or ``[T, heads, D]`` for qk-norm).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        summed = torch.empty_like(out)
    else:
        r2, summed = x2, x2
    block = next_pow2(n)
    if rows:
        _add_rmsnorm_kernel[(rows,)](x2, r2, weight, out, summed, n, eps, x2.stride(0), r2.stride(0),
                                     out.stride(0), summed.stride(0), HAS_RES=residual is not None,
                                     BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl_args(x2))
    return out.view(shape), (summed.view(shape) if residual is not None else x)
