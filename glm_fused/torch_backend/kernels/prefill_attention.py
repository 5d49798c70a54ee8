"""Prompt attention: every prompt chunk of a step in one launch, over the paged KV cache.

A chunk of ``query_len`` tokens after ``context_len`` cached positions: query i (at position
``context_len + i``) attends keys 0 .. ``context_len + i``, which the step has already written
to the cache (fresh prompts, chunked prefill and prefix-cache hits alike). Each program takes
BLOCK_M queries of one sequence and one head, and walks that sequence's keys through its block
list in tiles of BLOCK_N with an online softmax (flash attention), stopping at its last query's
position.

Why a kernel of our own: the per-sequence path (gather the keys, then torch's SDPA) costs
~8 launches per sequence per layer, so a step of 58 short prompts spent 160 ms launching, and
first traffic ran 3x slower than the same shapes again with no Triton compile involved (most
likely SDPA's masked path meeting each new (query, key) length pair; gone with this kernel,
docs/speed.md). Here the sequence count, lengths and block lists are plain
data: one compiled build per dtype and page size serves every step. It is simpler than
FlashAttention and slower on long fresh prompts, which go to torch's SDPA instead
(``TorchOps.SDPA_FRESH_MIN``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels import dot_precision, next_pow2

BLOCK_M = 64
BLOCK_N = 64


@triton.jit(do_not_specialize=["max_tiles", "stride_chunks"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, chunks_ptr, blocks_ptr, scale, max_tiles,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cblock, stride_cpos, stride_ch,
                    stride_chunks, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    c = pid // max_tiles  # the chunk
    m0 = (pid % max_tiles) * BLOCK_M
    h = tl.program_id(1)
    first = tl.load(chunks_ptr + c).to(tl.int64)              # its first row of q
    n_q = tl.load(chunks_ptr + stride_chunks + c).to(tl.int32)          # its queries
    context = tl.load(chunks_ptr + 2 * stride_chunks + c).to(tl.int32)  # keys before them
    block0 = tl.load(chunks_ptr + 3 * stride_chunks + c)                 # its first block in blocks_ptr
    if m0 >= n_q:  # programs past a shorter chunk's end: nothing to do
        return
    m = m0 + tl.arange(0, BLOCK_M)
    mm = m < n_q
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (first + m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=mm[:, None], other=0.0)
    pos = context + m  # each query's position: it sees keys 0 .. pos
    end = context + tl.minimum(m0 + BLOCK_M, n_q)  # keys this tile needs
    base = (h // GROUP) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        page = tl.load(blocks_ptr + block0 + n // PAGE, mask=nm, other=0).to(tl.int64)
        rows = base + page * stride_cblock + (n % PAGE).to(tl.int64) * stride_cpos
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=nm[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=nm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where((n[None, :] <= pos[:, None]) & nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # key 0 is in the first tile: finite from there
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (first + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mm[:, None])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: torch.Tensor,
                      blocks: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``q [T, heads, D]``; ``chunks [4, C]`` int: per chunk its first row of q, its query count,
    its context length and the index in ``blocks`` of its first block; ``blocks``: the chunks'
    block lists, concatenated; ``max_query_len``: the longest chunk (the launch shape). Writes
    the chunks' rows of ``out [T, heads, D]`` (others untouched) and returns it."""
    C = chunks.shape[1]
    _, nh, D = q.shape
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    assert D == next_pow2(D) and page == next_pow2(page), "head_dim and block_size must be powers of two"
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    if C == 0 or max_query_len == 0:
        return out
    tiles = triton.cdiv(max_query_len, BLOCK_M)
    _prefill_kernel[(C * tiles, nh)](
        q, k_cache, v_cache, out, chunks, blocks, scale, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), chunks.stride(0), GROUP=nh // nkv, HEAD_DIM=D, PAGE=page, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, PREC=dot_precision(q.dtype), num_warps=4, num_stages=2)
    return out
