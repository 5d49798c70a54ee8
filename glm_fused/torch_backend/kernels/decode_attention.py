"""Decode attention: one new query per sequence over that sequence's cached keys.

Split-K ("flash decoding"): stage 1 gives each (sequence, kv head, split) program a slice of
the keys and all the query heads that share that kv head (GQA), with an online softmax;
stage 2 merges the splits by their log-sum-exp. Lengths and block tables are read on the
device, so one launch shape serves every step of a CUDA graph. Only ``seq_lens[s]`` keys are
read: no mask, no padding traffic.

The keys come from the paged cache (``decode_attention``: ``[num_blocks, block_size, kv_heads,
D]`` and a block table per sequence) or, for comparison, from the contiguous one-slot-per-sequence
cache the engine used before paging (``contiguous_decode_attention``: ``[slots, max_len, kv_heads,
D]``, scripts/bench_attention.py's baseline). One kernel serves both; the layout is a
compile-time switch, so the contiguous build does the earlier kernel's arithmetic and nothing more.

Rows that are the tokens of one prompt chunk (how the CUDA graphs replay a short chunk: a row
per token, each over the chunk's sequence) can be grouped (``lead``, from ``row_groups``): one
program then takes up to GROUP_ROWS consecutive rows, 4 x 12 query heads against each key tile
it loads, each row masked to its own length. 32 rows after 2,048 cached tokens took 0.56x the
time of one program per row on an H200 (docs/speed.md); with short contexts the per-row kernel
is faster, so the caller chooses (``cuda_graph.DecodeGraphs.grouped``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels import dot_precision, next_pow2
from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait

BLOCK_N = 64
TARGET_PROGRAMS = 264  # about two per multiprocessor of an H100/H200
MAX_SPLITS = 64
GROUP_ROWS = 4  # rows of one sequence per program, with lead (decode_attention); 8 was slower (docs/speed.md)
STAGE2_ELEMENTS = 8192  # fp32 partial outputs one stage-2 program merges (heads x splits x head_dim)

# Few compiled variants serve every step: the split count and the block table's width change
# with the batch, so they are plain arguments, not specialised on (each new value compiled in
# the middle of serving stalled a step for 0.5-0.9 s, docs/speed.md). A decode step of one
# split (large batches) writes its output from stage 1 (a build of its own) and has no stage 2;
# otherwise stage 2 merges up to MAX_SPLITS; the runner's warm-up runs every build. The log-sum-exp
# buffer is MAX_SPLITS wide whatever the split count, so its strides keep one alignment.


@triton.jit
def _split_range(length, split, splits, BLOCK: tl.constexpr):
    """Keys ``[start, end)`` of a split: whole BLOCKs, so short sequences use fewer splits."""
    per = tl.cdiv(tl.cdiv(length, splits), BLOCK) * BLOCK
    start = split * per
    return start, tl.minimum(start + per, length)


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_ptr, lse_ptr, scale, s, kvh, split, splits, n_rows,
            stride_qs, stride_qh, stride_table, stride_cblock, stride_cpos, stride_ch,
            stride_os, stride_oh, stride_osp, stride_ls, stride_lh,
            GROUP: tl.constexpr, GROUP_B: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
            PREC: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, R: tl.constexpr, DIRECT: tl.constexpr,
            PDL: tl.constexpr):
    """One split of rows ``s .. s + n_rows - 1`` (R == 1: row s alone) for kv head ``kvh``.
    DIRECT (R == 1, one split): the row's output itself, in ``o_ptr``'s dtype (zeros for a row
    without keys, a graph's padding row). The lengths and the block table come from the host,
    never from the kernel before: they are read before ``pdl_wait``, the first tile's page ids
    included, so only the query and the keys wait on the kernel before."""
    if R == 1:
        length = tl.load(len_ptr + s).to(tl.int32)
        start, end = _split_range(length, split, splits, BLOCK)
        g = tl.arange(0, GROUP_B)
        if DIRECT:
            gm = g < GROUP
        else:
            gm = (g < GROUP) & (start < end)  # a split past the end writes nothing: stage 2 skips it
        q_row, o_row, lse_row = s * stride_qs, s * stride_os, s * stride_ls
    else:  # R consecutive rows of one sequence share every key tile loaded
        i = tl.arange(0, R * GROUP_B)
        g = i % GROUP_B
        row = s + i // GROUP_B
        row_len = tl.load(len_ptr + row, mask=i // GROUP_B < n_rows, other=0).to(tl.int32)
        length = tl.max(row_len, axis=0)
        start, end = _split_range(length, split, splits, BLOCK)
        gm = (g < GROUP) & (i // GROUP_B < n_rows)  # every split writes, an empty one too: stage 2 reads them all
        q_row, o_row, lse_row = row[:, None] * stride_qs, row[:, None] * stride_os, row * stride_ls
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    if PAGED:  # page ids loaded one tile ahead, so the key loads never wait on the table (at
        # small batches that wait cost 12-15%); the first tile's before pdl_wait
        base = kvh * stride_ch
        table = table_ptr + s * stride_table
        if PAGE >= BLOCK:  # tiles start at multiples of BLOCK: one page holds the whole tile
            pages = tl.load(table + start // PAGE, mask=start < end, other=0)
        else:  # a tile spans BLOCK // PAGE whole pages: their ids, one load each
            pi = tl.arange(0, BLOCK // PAGE)
            first = start // PAGE + pi
            pages = tl.load(table + first, mask=first * PAGE < end, other=0)
    else:  # contiguous: the table holds one slot per sequence
        base = tl.load(table_ptr + s).to(tl.int64) * stride_cblock + kvh * stride_ch
    pdl_wait(PDL)
    q = tl.load(q_ptr + q_row + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
    m = tl.full([R * GROUP_B], float("-inf"), tl.float32)
    lsum = tl.zeros([R * GROUP_B], tl.float32)
    acc = tl.zeros([R * GROUP_B, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK):  # a split past the end runs no iteration
        n = n0 + tl.arange(0, BLOCK)
        nm = n < end
        if PAGED:
            page = pages.to(tl.int64)
            if PAGE >= BLOCK:
                pages = tl.load(table + (n0 + BLOCK) // PAGE, mask=n0 + BLOCK < end, other=0)
            else:
                ahead = (n0 + BLOCK) // PAGE + pi
                pages = tl.load(table + ahead, mask=ahead * PAGE < end, other=0)
        if PAGED and PAGE < BLOCK and R > 1:  # the tile as [pages, PAGE, D]: 32 rows after 2,048
            # keys took 0.81x the time of the per-key form; rows alone, up to 1.4x (H200)
            r = tl.arange(0, PAGE)
            offs = (base + page[:, None, None] * stride_cblock + (r.to(tl.int64) * stride_cpos)[None, :, None]
                    + d[None, None, :])
            m3 = ((n0 + pi[:, None] * PAGE + r[None, :]) < end)[:, :, None]
            k = tl.reshape(tl.load(k_ptr + offs, mask=m3, other=0.0), (BLOCK, HEAD_DIM))
            v = tl.reshape(tl.load(v_ptr + offs, mask=m3, other=0.0), (BLOCK, HEAD_DIM))
        else:
            if not PAGED:
                rows = n.to(tl.int64) * stride_cpos
            else:
                if PAGE < BLOCK:  # each key's page id, spread from the few loaded by warp shuffles
                    # (a load per key instead: batch 2 at 512 keys 1.13x the contiguous kernel, not 1.02x)
                    page = tl.gather(page, tl.arange(0, BLOCK) // PAGE, 0)
                rows = page * stride_cblock + (n % PAGE).to(tl.int64) * stride_cpos
            offs = base + rows[:, None] + d[None, :]
            k = tl.load(k_ptr + offs, mask=nm[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=nm[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        if R == 1:
            sc = tl.where(nm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])  # every block has a key, so m_new is finite
            alpha = tl.exp(m - m_new)
        else:  # each row sees the keys before its own length: a tile can hide all of a row's keys
            sc = tl.where(n[None, :] < tl.minimum(row_len, end)[:, None], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    has = lsum > 0
    out = acc / tl.where(has, lsum, 1.0)[:, None]
    if DIRECT:  # o_ptr is the output [S, heads, D] (strides stride_os, stride_oh)
        tl.store(o_ptr + o_row + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gm[:, None])
    else:
        tl.store(o_ptr + o_row + heads[:, None] * stride_oh + split * stride_osp + d[None, :], out,
                 mask=gm[:, None])
        tl.store(lse_ptr + lse_row + heads * stride_lh + split, tl.where(has, m + tl.log(lsum), float("-inf")),
                 mask=gm)


@triton.jit(do_not_specialize=["splits", "stride_table"])
def _stage1(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, lead_ptr, o_ptr, lse_ptr, scale, splits,
            stride_qs, stride_qh, stride_table, stride_cblock, stride_cpos, stride_ch,
            stride_os, stride_oh, stride_osp, stride_ls, stride_lh,
            GROUP: tl.constexpr, GROUP_B: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK: tl.constexpr, PREC: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
            PDL: tl.constexpr, ROWS: tl.constexpr, LONE: tl.constexpr, DIRECT: tl.constexpr):
    """ROWS == 1: a program per row (LONE: only the rows alone in their group); ROWS > 1: a
    program per group of more than one row. Two builds, so that a row alone runs exactly the
    decode kernel (one build with both paths would size every program's registers for the
    grouped one). Every program passes ``pdl_wait``: in ``_attend``, after its host-written
    reads, or here, where it has no work."""
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ROWS == 1:
        if LONE:
            n_rows = tl.load(lead_ptr + s).to(tl.int32)
        else:
            n_rows = 1
        if n_rows == 1:
            _attend(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_ptr, lse_ptr, scale, s, kvh, split, splits, 1,
                    stride_qs, stride_qh, stride_table, stride_cblock, stride_cpos, stride_ch,
                    stride_os, stride_oh, stride_osp, stride_ls, stride_lh, GROUP, GROUP_B, HEAD_DIM, BLOCK,
                    PREC, PAGED, PAGE, 1, DIRECT, PDL)
        else:
            pdl_wait(PDL)
    else:  # a group's first row holds its size, the others 0
        n_rows = tl.load(lead_ptr + s).to(tl.int32)
        if n_rows > 1:
            _attend(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_ptr, lse_ptr, scale, s, kvh, split, splits, n_rows,
                    stride_qs, stride_qh, stride_table, stride_cblock, stride_cpos, stride_ch,
                    stride_os, stride_oh, stride_osp, stride_ls, stride_lh, GROUP, GROUP_B, HEAD_DIM, BLOCK,
                    PREC, PAGED, PAGE, ROWS, False, PDL)
        else:
            pdl_wait(PDL)


@triton.jit(do_not_specialize=["splits", "splits1"])
def _stage2(o_ptr, lse_ptr, len_ptr, lead_ptr, out_ptr, splits, splits1, num_heads, stride_os, stride_oh, stride_osp,
            stride_ls, stride_lh, stride_outs, stride_outh, SPLITS_B: tl.constexpr, HEADS_B: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, GROUPED: tl.constexpr):
    """HEADS_B heads of row s per program: a program per (row, head) was thousands of tiny
    programs (10 µs for 32 rows x 96 heads x 4 splits on an H200). The lengths and ``lead``
    come from the host: read before ``pdl_wait``."""
    s = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_B)
    if GROUPED:  # a row of a group: every split of the group's was written (empty ones as -inf)
        lead = tl.load(lead_ptr + s)
        count = tl.where(lead == 1, splits1, splits)  # a row alone: its own split count, empty splits unwritten
        start, end = _split_range(tl.load(len_ptr + s).to(tl.int32), sp, count, BLOCK)
        spm = (sp < count) & ((start < end) | (lead != 1))
    else:
        start, end = _split_range(tl.load(len_ptr + s).to(tl.int32), sp, splits, BLOCK)
        spm = (sp < splits) & (start < end)  # only the splits that had keys (at batch 1 and 512 keys: 8 of 33)
    pdl_wait(PDL)
    d = tl.arange(0, HEAD_DIM)
    if HEADS_B == 1:  # one head, 1-D tiles (heads as a tile dimension cost +0.3 µs at batch 1, H200)
        h = tl.program_id(1)
        lse = tl.load(lse_ptr + s * stride_ls + h * stride_lh + sp, mask=spm, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, axis=0))
        w = w / tl.sum(w, axis=0)
        o = tl.load(o_ptr + s * stride_os + h * stride_oh + sp[:, None] * stride_osp + d[None, :], mask=spm[:, None],
                    other=0.0)
        out = tl.sum(o * w[:, None], axis=0)
        tl.store(out_ptr + s * stride_outs + h * stride_outh + d, out.to(out_ptr.dtype.element_ty))
    else:
        h = tl.program_id(1) * HEADS_B + tl.arange(0, HEADS_B)
        hm = h < num_heads
        m2 = hm[:, None] & spm[None, :]
        lse = tl.load(lse_ptr + s * stride_ls + h[:, None] * stride_lh + sp[None, :], mask=m2, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, axis=1)[:, None])
        w = w / tl.sum(w, axis=1)[:, None]
        o = tl.load(o_ptr + s * stride_os + h[:, None, None] * stride_oh + sp[None, :, None] * stride_osp
                    + d[None, None, :], mask=m2[:, :, None], other=0.0)
        out = tl.sum(o * w[:, :, None], axis=1)
        tl.store(out_ptr + s * stride_outs + h[:, None] * stride_outh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hm[:, None])


def num_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Enough programs to fill the GPU, from the launch shape alone (CUDA-graph friendly)."""
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)))


def row_groups(seq_of_row: np.ndarray, rows: int | None = None) -> np.ndarray:
    """``lead`` for ``decode_attention``: rows of one sequence are consecutive (a prompt chunk
    as one row per token); each run is cut into groups of at most ``rows``, whose first row
    holds the group's size and the others 0. A row alone (a decode) is a group of one."""
    rows = GROUP_ROWS if rows is None else rows  # (read now: the kernel's launch reads it too)
    n = len(seq_of_row)
    lead = np.zeros(n, dtype=np.int64)
    if n == 0:
        return lead
    edges = np.flatnonzero(seq_of_row[1:] != seq_of_row[:-1]) + 1
    if len(edges) == 0:  # one run, a lone prompt chunk: a few operations (on the way to its first token)
        at = np.arange(0, n, rows)
        lead[at] = np.minimum(rows, n - at)
        return lead
    starts, ends = np.concatenate(([0], edges)), np.append(edges, n)
    counts = (ends - starts + rows - 1) // rows  # groups per run
    first = np.cumsum(counts) - counts
    at = np.repeat(starts, counts) + rows * (np.arange(int(first[-1] + counts[-1])) - np.repeat(first, counts))
    lead[at] = np.minimum(rows, np.repeat(ends, counts) - at)
    return lead


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, lead: torch.Tensor | None = None) -> torch.Tensor:
    """``q [S, heads, D]``; row s attends to its first ``seq_lens[s]`` positions, found
    through ``block_tables [S, W]`` in the paged cache ``[num_blocks, block_size, kv_heads, D]``
    (new key already written). Returns ``[S, heads, D]``.

    ``lead [S]`` (from ``row_groups``): rows of one sequence in groups of up to GROUP_ROWS, one
    program per group reading each key tile once for all of them (a prompt chunk replayed as
    rows re-read its sequence's keys once per row before). The rows of a group share the first
    one's block table."""
    page = k_cache.shape[1]
    assert page == next_pow2(page), "block_size must be a power of two"
    return _launch(q, k_cache, v_cache, block_tables, block_tables.stride(0), seq_lens, scale, True, page, lead)


def contiguous_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same over a contiguous cache ``[slots, max_len, kv_heads, D]``: sequence s reads
    ``cache[slots[s], :seq_lens[s]]`` (the layout before paging; the benchmark's baseline)."""
    return _launch(q, k_cache, v_cache, slots, 0, seq_lens, scale, False, 1, None)


def _launch(q, k_cache, v_cache, table, stride_table, seq_lens, scale, paged, page, lead):
    S, nh, D = q.shape
    nkv = k_cache.shape[2]
    group = nh // nkv
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert D == next_pow2(D), "head_dim must be a power of two"
    rows = 1 if lead is None else GROUP_ROWS
    splits1 = num_splits(S, nkv)  # a program per row
    splits = splits1 if lead is None else num_splits(-(-S // rows), nkv)  # a program per group: at least as many
    out = torch.empty(S, nh, D, dtype=q.dtype, device=q.device)
    if S == 0:
        return out
    direct = lead is None and splits1 == 1  # one split: stage 1 writes the output, no stage 2
    o = out if direct else torch.empty(S, nh, splits, D, dtype=torch.float32, device=q.device)
    lse = out if direct else torch.empty(S, nh, MAX_SPLITS, dtype=torch.float32, device=q.device)  # (out: unused)
    args = (q, k_cache, v_cache, table, seq_lens, seq_lens if lead is None else lead, o, lse, scale)
    strides = (q.stride(0), q.stride(1), stride_table, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1))  # (DIRECT reads no split stride)
    consts = dict(GROUP=group, GROUP_B=max(16, next_pow2(group)), HEAD_DIM=D, BLOCK=BLOCK_N, PREC=dot_precision(q.dtype),
                  PAGED=paged, PAGE=page, num_warps=4, **pdl_args(q))
    # A deeper pipeline while the programs fit about two per multiprocessor: 10-24% faster for
    # batches of 2-33 at 1,024-4,096 keys (8 kv heads, H200); one sequence or more programs: 2.
    stages = 3 if lead is None and S > 1 and S * nkv * splits1 <= TARGET_PROGRAMS else 2
    _stage1[(S, nkv, splits1)](*args, splits1, *strides, ROWS=1, LONE=lead is not None, DIRECT=direct,
                               num_stages=stages, **consts)
    if direct:
        return out
    if lead is not None:  # (3 stages: 2-9% faster than 2 for 32-64 rows after 1,024-2,048 keys, H200)
        _stage1[(S, nkv, splits)](*args, splits, *strides, ROWS=rows, LONE=False, DIRECT=False, num_stages=3,
                                  **consts)
    # Grouped steps run only from CUDA graphs, every size compiled at capture: a build per split
    # count costs nothing later; a decode step's split count changes with its batch (two builds:
    # up to MAX_SPLITS, or one, where stage 1 writes the output).
    splits_b = MAX_SPLITS if rows == 1 else next_pow2(splits)
    heads_b = min(next_pow2(nh), max(1, STAGE2_ELEMENTS // (splits_b * D)))
    _stage2[(S, triton.cdiv(nh, heads_b))](
        o, lse, seq_lens, args[5], out, splits, splits1, nh, o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
        lse.stride(1), out.stride(0), out.stride(1), SPLITS_B=splits_b, HEADS_B=heads_b, HEAD_DIM=D, BLOCK=BLOCK_N,
        GROUPED=rows > 1, num_warps=4, **pdl_args(q))
    return out
