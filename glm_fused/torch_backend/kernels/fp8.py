"""FP8 activations: per-token quantization (Triton), and the fp8 Linear of the CUDA path.

An fp8 Linear multiplies e4m3 activations by e4m3 weights: each token's activations are
quantized on the fly with one scale per token (``scale = max|x| / 448``, the rule
``Ops.quantize_fp8`` applies per weight row), the weights carry one scale per output row, and
``torch._scaled_mm`` applies both scales to the fp32 products (cuBLAS's row-wise scaling on
sm90). ``token_scale`` and ``to_fp8`` are the same rule inside other kernels (the fused MoE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_fused.quantization import AMAX_EPS, FP8_MAX
from glm_fused.torch_backend.kernels import next_pow2

FP8 = torch.float8_e4m3fn
_EPS = tl.constexpr(AMAX_EPS)  # a jitted function reads module constants only as constexpr
_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def token_scale(amax):
    """One token's (or weight row's) scale from its largest magnitude."""
    return tl.maximum(amax, _EPS) / _MAX


@triton.jit
def to_fp8(x, scale):
    """``x / scale`` (fp32, ``scale`` broadcast) rounded to e4m3, saturating at +-448."""
    return tl.minimum(tl.maximum(x / scale, -_MAX), _MAX).to(tl.float8e4nv)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=cols < K - k0, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = token_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK):
        m = cols < K - k0
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + cols, to_fp8(x, scale), mask=m)
    tl.store(s_ptr + row, scale)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, float32 scales ``[M]``), one launch."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        x = x if x.stride(-1) == 1 else x.contiguous()
        _per_token_quant_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=min(1024, next_pow2(K)),
                                      num_warps=4)
    return q, s


def scaled_mm_fits(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """What row-wise ``_scaled_mm`` takes on CUDA: both matrix sizes multiples of 16 and a bf16
    result (CPU's ``_scaled_mm``, under the interpreter, takes any)."""
    out_features, in_features = codes.shape
    return not x.is_cuda or (in_features % 16 == 0 and out_features % 16 == 0 and x.dtype == torch.bfloat16)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """``x [..., K] @ (codes * scale[:, None])^T (+ bias)`` with fp8 products: ``x`` quantized
    per token, ``codes [N, K]`` e4m3, ``scale [N]`` float32; the result in ``x``'s dtype."""
    lead = x.shape[:-1]
    xq, xs = per_token_quant(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(xq, codes.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=x.dtype,
                           bias=bias)
    return out.reshape(*lead, codes.shape[0])
