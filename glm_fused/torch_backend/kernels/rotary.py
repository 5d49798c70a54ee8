"""Partial NeoX RoPE on q and k, and the KV-cache write, in one launch.

One program per (token, block of 16 heads): q heads are rotated in place; k heads are rotated
and stored, with the matching v heads, at the token's cache row ``slot_mapping[t]`` (``block *
block_size + offset`` of the paged cache; -1: not stored, for CUDA-graph padding). Same
arithmetic as ``Ops.rope``: fp32 rotation of the first ``rotary_dim`` dims, rounded back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels import next_pow2
from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cs, stride_crow, stride_ch,
                       NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, HALF_B: tl.constexpr,
                       HEAD_DIM: tl.constexpr, D_B: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    Q_BLOCKS: tl.constexpr = (NUM_HEADS + HB - 1) // HB
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, HALF_B)
    jm = j < HALF
    cos = tl.load(cos_ptr + pos * stride_cs + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + j, mask=jm, other=0.0)[None, :]
    hh = tl.arange(0, HB)
    if blk < Q_BLOCKS:  # a block of q heads, rotated in place
        heads = blk * HB + hh
        hm = heads < NUM_HEADS
        src = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        dst = src
    else:  # a block of kv heads: rotated k and plain v go to the cache
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = (blk - Q_BLOCKS) * HB + hh
        hm = (heads < NUM_KV) & (slot >= 0)
        src = k_ptr + t * stride_kt + heads[:, None] * stride_kh
        row = slot * stride_crow + heads[:, None] * stride_ch
        dst = kc_ptr + row
        d = tl.arange(0, D_B)[None, :]
        dm = hm[:, None] & (d < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d, mask=dm)
        tl.store(vc_ptr + row + d, v, mask=dm)
        rest = dm & (d >= 2 * HALF)  # the dims past the rotary part pass through unchanged
        tl.store(dst + d, tl.load(src + d, mask=rest), mask=rest)
    m2 = hm[:, None] & jm[None, :]
    x1 = tl.load(src + j[None, :], mask=m2, other=0.0)
    x2 = tl.load(src + HALF + j[None, :], mask=m2, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + j[None, :], (f1 * cos - f2 * sin).to(x1.dtype), mask=m2)
    tl.store(dst + HALF + j[None, :], (f2 * cos + f1 * sin).to(x1.dtype), mask=m2)


HEADS_PER_PROGRAM = 16


def rope_and_store(positions: torch.Tensor, slot_mapping: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``q [T, heads, D]`` in place and write rotated ``k`` and ``v`` ``[T, kv_heads, D]``
    into the paged cache ``[num_blocks, block_size, kv_heads, D]`` at row ``slot_mapping[t]``
    of its flattened ``[num_blocks * block_size]`` positions (skipped where -1); returns ``q``.
    ``cos_cache``: ``[positions, rotary_dim/2]``."""
    T, nh, D = q.shape
    nkv = k.shape[1]
    half = cos_cache.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and cos_cache.stride() == sin_cache.stride()
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "blocks must be laid out back to back"
    hb = HEADS_PER_PROGRAM
    if T:
        _rope_store_kernel[(T, triton.cdiv(nh, hb) + triton.cdiv(nkv, hb))](
            q, k, v, positions, slot_mapping, cos_cache, sin_cache, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_HEADS=nh, NUM_KV=nkv, HALF=half, HALF_B=next_pow2(half), HEAD_DIM=D, D_B=next_pow2(D), HB=hb,
            num_warps=2, **pdl_args(q))
    return q
