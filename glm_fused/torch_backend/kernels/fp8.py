"""FP8 activations: per-token quantization (Triton), and the fp8 Linear of the CUDA path.

An fp8 Linear has two ways, chosen by the number of rows:

* up to WEIGHT_ONLY_MAX_ROWS rows (decode): weight-only. One Triton launch reads the e4m3
  weight tiles, widens them in registers and multiplies them with the activations as they come
  (fp32 sums), then applies each output row's scale. Decode is bound by the weight bytes, which
  are the same either way; quantizing the activations adds a launch, and on an H200 cuBLAS's
  fp8 GEMM at one row ran at 3.0x its memory floor against 1.4x here (docs/speed.md).
* above: each token's activations are quantized on the fly with one scale per token
  (``scale = max|x| / 448``, the rule ``Ops.quantize_fp8`` applies per weight row), the weights
  carry one scale per output row, and ``torch._scaled_mm`` applies both scales to the fp32
  products (cuBLAS's row-wise scaling on sm90).

``token_scale`` and ``to_fp8`` are the same rule inside other kernels (the fused MoE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glm_fused.quantization import AMAX_EPS, FP8_MAX
from glm_fused.torch_backend.kernels import next_pow2
from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait

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
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
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
                                      num_warps=4, **pdl_args(x))
    return q, s


def scaled_mm_fits(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """What row-wise ``_scaled_mm`` takes on CUDA: both matrix sizes multiples of 16 and a bf16
    result (CPU's ``_scaled_mm``, under the interpreter, takes any)."""
    out_features, in_features = codes.shape
    return not x.is_cuda or (in_features % 16 == 0 and out_features % 16 == 0 and x.dtype == torch.bfloat16)


def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """``x [..., K] @ (codes * scale[:, None])^T (+ bias)``: ``codes [N, K]`` e4m3, ``scale [N]``
    float32; the result in ``x``'s dtype. Up to WEIGHT_ONLY_MAX_ROWS rows weight-only, above
    with fp8 products (``x`` quantized per token)."""
    x2 = x.reshape(-1, x.shape[-1])
    way = linear_fp8_weight_only if x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS else linear_fp8_scaled_mm
    return way(x2, codes, scale, bias).reshape(*x.shape[:-1], codes.shape[0])


def linear_fp8_scaled_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` quantized per token, then ``torch._scaled_mm`` with both row-wise scales."""
    xq, xs = per_token_quant(x)
    return torch._scaled_mm(xq, codes.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=x.dtype,
                            bias=bias)


# ---------------------------------------------------------------------------- weight-only
# How a tile multiplies (constexpr KIND; here and in the fused MoE): MMA, tensor cores with
# the activation rows as the MMA's A operand; SWAP, the weight tile as A (its rows fill the
# MMA's 64-row side where a decode step's few rows would be padding); FMA, no tensor cores, one
# activation row per program, multiply-adds in fp32 (for one row, where an MMA tile is mostly
# padding). SWAP and FMA take unquantized activations.
MMA, SWAP, FMA = 0, 1, 2


@triton.jit
def zeros_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr):
    """The fp32 accumulator: ``[BLOCK_M, BLOCK_N]``; transposed for SWAP; for FMA the products
    ``[BLOCK_N, BLOCK_K]``, summed over K once after the loop (``finish_acc``)."""
    if KIND == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    elif KIND == 2:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return acc


@triton.jit
def finish_acc(acc, KIND: tl.constexpr):
    """The accumulator as ``[BLOCK_M, BLOCK_N]``."""
    if KIND == 1:
        out = tl.trans(acc)
    elif KIND == 2:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = acc
    return out


@dataclass(frozen=True)
class GemvConfig:
    kind: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


WEIGHT_ONLY_MAX_ROWS = 16  # up to this many rows the weight-only kernel (see the module docstring)
# Keyed by the most rows, then the most K (None: any); chosen on an H200 with
# scripts/bench_linear.py at GLM-4.5-Air's shapes (one row: 512-wide K steps won at K 4096,
# qkv and the dense gate_up, 1024-wide at K 10944 and 12288).
GEMV_CONFIGS = [
    ((1, 4096), GemvConfig(FMA, 1, 8, 512, 4, 3)),
    ((1, None), GemvConfig(FMA, 1, 8, 1024, 4, 3)),
    ((4, None), GemvConfig(MMA, 16, 32, 256, 4, 4)),
    ((8, None), GemvConfig(MMA, 16, 32, 256, 4, 4)),
    ((16, None), GemvConfig(MMA, 16, 32, 512, 4, 3)),
]


@triton.jit
def _gemv_tile(x_ptrs, w_ptrs, rm, cm, kk, k0, K, EVEN_K: tl.constexpr):
    """The activation and weight tiles at K offset ``k0`` (the pointers already there)."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=rm[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=cm[:, None], other=0.0)
    else:
        km = kk < K - k0
        x = tl.load(x_ptrs, mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=cm[:, None] & km[None, :], other=0.0)
    return x, w


@triton.jit
def _gemv_step(acc, x, w, KIND: tl.constexpr):
    if KIND == 0:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    elif KIND == 1:
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    else:
        acc += w.to(tl.float32) * x.to(tl.float32)
    return acc


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = rows < M, cols < N
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + kk[None, :]  # [BLOCK_N, BLOCK_K], as stored
    # the first K step's weights are requested before waiting for the kernel that writes x (PDL)
    w = tl.load(w_ptrs, mask=cm[:, None] & (kk < K)[None, :], other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_ptrs, mask=rm[:, None] & (kk < K)[None, :], other=0.0)
    acc = _gemv_step(zeros_acc(BLOCK_M, BLOCK_N, BLOCK_K, KIND), x, w, KIND)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x, w = _gemv_tile(x_ptrs, w_ptrs, rm, cm, kk, k0, K, EVEN_K)
        acc = _gemv_step(acc, x, w, KIND)
    y = finish_acc(acc, KIND) * tl.load(s_ptr + cols, mask=cm, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])


def pick_gemv(rows: int, K: int) -> GemvConfig:
    for (most_rows, most_k), cfg in GEMV_CONFIGS:
        if rows <= most_rows and (most_k is None or K <= most_k):
            return cfg
    return GEMV_CONFIGS[-1][1]


def linear_fp8_weight_only(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, cfg: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ (codes * scale[:, None])^T (+ bias)``, the weights widened in registers and
    the activations as they are (no quantization): one launch."""
    M, K = x.shape
    N = codes.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = cfg or pick_gemv(M, K)
    # PDL for one-row (FMA) tiles only: there it measured 7% off a dense fp8 layer at batch 1; the
    # MMA tiles of 2-16 rows (128 programs for o_proj, one per multiprocessor) launched early were
    # packed onto the multiprocessors attention freed first, and a batch-8 layer took 20% longer.
    assert cfg.kind != FMA or cfg.block_m == 1, "an FMA tile holds one activation row"
    x = x if x.stride(-1) == 1 else x.contiguous()
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n))
    _weight_only_kernel[grid](x, codes, scale, bias if bias is not None else scale, out, M, N, K, x.stride(0),
                              codes.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                              EVEN_K=K % cfg.block_k == 0, KIND=cfg.kind, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              **pdl_args(x, cfg.kind == FMA))
    return out
