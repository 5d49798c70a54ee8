"""Fused MoE: router top-k, token sort by expert, and the two expert GEMMs (Triton).

For T tokens with top-k experts each there are N = T * k (token, expert) pairs; pair
``t * k + j`` is token t's j-th choice.

1. ``router_topk``: sigmoid scores; top-k on score + correction bias; weights are the
   un-biased scores, renormalised and scaled. One program per token. ``route_tokens`` (up
   to ROUTER_GEMV_MAX_TOKENS tokens): the fp32 logits from the hidden states and the same
   choice in one launch.
2. ``align``: pairs sorted by expert and each expert's run padded to ``BLOCK_M`` rows, so the
   ``BLOCK_M`` rows of a GEMM program share one expert (``block_expert``; -1 = no work).
   Padding rows hold the sentinel N. Three launches, no host sync, fixed shapes. Blocks of
   one pair (FMA tiles) need no sort (``rows_by_expert``).
3. ``gate_up``: ``h[pair] = silu(x[tok] Wg[e]^T) * (x[tok] Wu[e]^T)``, gate and up halves
   in the same program, so the activation is applied in fp32 and written once.
4. ``down``: ``y[pair] = weight[pair] * (h[pair] Wd[e]^T)``;
   ``combine``: ``out[t] = sum_j y[t, j] (+ shared[t])`` in fp32.

Each expert's weights are read once per BLOCK_M tokens routed to it - once in total at
decode sizes - which is what the memory floor counts.

fp8 weights (e4m3 codes with one float32 scale per weight row), three modes (``fp8_mode``):

* WEIGHT_ONLY: the weight tiles are widened to the activations' dtype in registers and
  multiplied in bf16 (or, in FMA tiles, in fp32 without tensor cores), each output column's
  scale applied after the K loop; the activations are not quantized.
* QUANT_IN_KERNEL: the GEMMs multiply in fp8, each program quantizing its own rows per row
  (``x`` per token in ``gate_up``, ``h`` per pair in ``down``) as it loads them (a first pass
  over K finds a row's largest magnitude), the fp32 products scaled by the row's scale and the
  column's once, after the K loop.
* QUANTIZED_INPUT, for prefill, where N-tiles would quantize the same rows many times over:
  ``x`` and ``h`` are quantized once (``kernels.fp8.per_token_quant``) and the GEMMs read e4m3
  rows with their scales.

Decode reads the same weight bytes in either decode mode; which one is faster at which token
count was measured (FP8_DECODE_MODES: weight-only up to 8 tokens, quantize-in-kernel above).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from glm_fused.torch_backend.kernels import dot_precision, next_pow2
from glm_fused.torch_backend.kernels.fp8 import FMA, MMA, SWAP  # noqa: F401  (the tile kinds, named here too)
from glm_fused.torch_backend.kernels.fp8 import finish_acc, per_token_quant, to_fp8, token_scale, zeros_acc
from glm_fused.torch_backend.kernels.pdl import pdl_args, pdl_wait

CHUNK = 64  # pairs per program in the align kernels
# fp8 modes of the GEMM kernels (constexpr FP8; the module docstring says when each runs)
NO_FP8, QUANT_IN_KERNEL, QUANTIZED_INPUT, WEIGHT_ONLY = 0, 1, 2, 3
# fp8 decode: (most tokens, mode), chosen on an H200 with scripts/bench_moe.py --fp8 (docs/fp8.md);
# above the last bound (prefill) x and h are quantized once per GEMM (QUANTIZED_INPUT).
FP8_DECODE_MODES = [(1, WEIGHT_ONLY), (8, WEIGHT_ONLY), (64, QUANT_IN_KERNEL)]


def fp8_mode(num_tokens: int) -> int:
    """The fp8 mode a step of ``num_tokens`` tokens runs in."""
    for bound, mode in FP8_DECODE_MODES:
        if num_tokens <= bound:
            return mode
    return QUANTIZED_INPUT


# ---------------------------------------------------------------------------- router
@triton.jit
def _select(score, e, em, t, bias_ptr, w_ptr, ids_ptr, E, scale, TOP_K: tl.constexpr, K_B: tl.constexpr,
            NORM: tl.constexpr, SHARED: tl.constexpr):
    """Token t's choice from its sigmoid scores ``[E_B]``: top-k on score + bias, weights the
    un-biased scores (renormalised, scaled), and the shared expert's column when SHARED."""
    choice = tl.where(em, score + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
    kk = tl.arange(0, K_B)
    ids = tl.zeros([K_B], tl.int32)
    ws = tl.zeros([K_B], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        ids = tl.where(kk == j, best, ids)
        ws = tl.where(kk == j, tl.sum(tl.where(e == best, score, 0.0), axis=0), ws)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scale
    if SHARED:  # one more column: the shared expert (id E), weight 1
        ids = tl.where(kk == TOP_K, E, ids)
        ws = tl.where(kk == TOP_K, 1.0, ws)
    width = TOP_K + SHARED
    km = kk < width
    tl.store(ids_ptr + t * width + kk, ids, mask=km)
    tl.store(w_ptr + t * width + kk, ws, mask=km)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, scale, stride_l,
                        TOP_K: tl.constexpr, K_B: tl.constexpr, E_B: tl.constexpr, NORM: tl.constexpr,
                        SHARED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_B)
    em = e < E
    score = tl.sigmoid(tl.load(logits_ptr + t * stride_l + e, mask=em, other=0.0))
    _select(score, e, em, t, bias_ptr, w_ptr, ids_ptr, E, scale, TOP_K, K_B, NORM, SHARED)


def router_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool, scale: float,
                append_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` fp32 -> ``(weights [T, top_k] fp32, ids [T, top_k] int32)`` (no expert
    groups), one program per token.

    ``append_shared``: a last column with id E and weight 1, the shared expert folded into the
    routed GEMMs (``fused_experts(shared_weights=...)``)."""
    T, E = logits.shape
    weights, ids = _choice_buffers(T, top_k + int(append_shared), logits.device)
    if T:
        _router_topk_kernel[(T,)](logits, bias, weights, ids, E, float(scale), logits.stride(0), TOP_K=top_k,
                                  K_B=next_pow2(ids.shape[1]), E_B=next_pow2(E), NORM=norm_topk_prob,
                                  SHARED=append_shared, num_warps=1, **pdl_args(logits))
    return weights, ids


def _choice_buffers(T: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(T, width, dtype=torch.float32, device=device),
            torch.empty(T, width, dtype=torch.int32, device=device))


# Decode-sized steps: the router's logits straight from the hidden states, where eager runs a
# cast of x to fp32 and cuBLAS's fp32 GEMV with its split-K reduction (three launches, 8.6 us at
# one token on an H200), with the top-k in the same launch. Keyed by the most tokens:
# (BLOCK_E, BLOCK_K, num_warps), from sweeps on an H200 (docs/speed.md); above the last bound
# cuBLAS is as fast.
ROUTER_TILES = [(8, (1, 4096, 4)), (16, (2, 512, 4)), (32, (4, 1024, 4))]
ROUTER_GEMV_MAX_TOKENS = ROUTER_TILES[-1][0]
_arrivals: dict = {}  # per device: how many programs of each token's row have finished (zero between launches)


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, bias_ptr, wts_ptr, ids_ptr, arrived_ptr, E, K, scale, stride_x, stride_w,
                   SELECT: tl.constexpr, TOP_K: tl.constexpr, K_B: tl.constexpr, E_B: tl.constexpr,
                   NORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """Logits of BLOCK_E experts for token t (fp32 products of x, widened, and the fp32 weights);
    with SELECT, the last of the token's programs to finish makes its choice from all E."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1).to(tl.int64)
    em = e < E
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e[:, None].to(tl.int64) * stride_w + kk[None, :]
    # the first K step's weights (at one token, the whole row) requested before the wait (PDL)
    w = tl.load(w_ptrs, mask=em[:, None] & (kk < K)[None, :], other=0.0)
    pdl_wait(PDL)
    x = tl.load(x_ptr + t * stride_x + kk, mask=kk < K, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        km = kk < K - k0
        x = tl.load(x_ptr + t * stride_x + k0 + kk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=em[:, None] & km[None, :], other=0.0)
        acc += w * x[None, :]
    tl.store(logits_ptr + t * E + e, tl.sum(acc, axis=1), mask=em)
    if SELECT:
        # The pattern of a grid barrier (torch inductor's): every thread's stores before the
        # release, the count read back with acquire; the last arrival sees all E logits in L2.
        tl.debug_barrier()
        done = tl.atomic_add(arrived_ptr + t, 1, sem="acq_rel")
        tl.debug_barrier()
        if done == tl.num_programs(0) - 1:
            tl.store(arrived_ptr + t, 0)  # ready for the next launch (graph replays included)
            ee = tl.arange(0, E_B)
            em2 = ee < E
            logit = tl.load(logits_ptr + t * E + ee, mask=em2, other=0.0, cache_modifier=".cg")
            _select(tl.sigmoid(logit), ee, em2, t, bias_ptr, wts_ptr, ids_ptr, E, scale, TOP_K, K_B, NORM, SHARED)


def router_logits(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [T, H]`` (any float dtype) times the fp32 router ``weight [E, H]``: fp32 logits ``[T, E]``
    in one launch (T up to ROUTER_GEMV_MAX_TOKENS; ``tile`` overrides ROUTER_TILES)."""
    return _router(x, weight, None, 0, False, 1.0, False, tile)[0]


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, norm_topk_prob: bool,
                 scale: float, append_shared: bool = False,
                 tile: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_topk(router_logits(x, weight), ...)`` in one launch, for T up to
    ROUTER_GEMV_MAX_TOKENS: ``(weights, ids)`` as ``router_topk`` gives them."""
    _, weights, ids = _router(x, weight, bias, top_k, norm_topk_prob, scale, append_shared, tile)
    return weights, ids


def _router(x, weight, bias, top_k, norm, scale, shared, tile):
    T, K = x.shape
    E = weight.shape[0]
    assert T <= ROUTER_GEMV_MAX_TOKENS and weight.stride(-1) == 1
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    weights, ids = _choice_buffers(T, top_k + int(shared), x.device)
    arrived = _arrivals.get(x.device)
    if arrived is None:  # made once per device, on the first (eager) call: the warm-up runs before any capture
        arrived = _arrivals[x.device] = torch.zeros(ROUTER_GEMV_MAX_TOKENS, dtype=torch.int32, device=x.device)
    if T:
        be, bk, warps = tile or next(t for bound, t in ROUTER_TILES if T <= bound)
        x = x if x.stride(-1) == 1 else x.contiguous()
        _router_kernel[(triton.cdiv(E, be), T)](
            x, weight, logits, bias if bias is not None else logits, weights, ids, arrived, E, K, float(scale),
            x.stride(0), weight.stride(0), SELECT=top_k > 0, TOP_K=top_k, K_B=next_pow2(max(1, top_k + int(shared))),
            E_B=next_pow2(E), NORM=norm, SHARED=shared, BLOCK_E=be, BLOCK_K=min(bk, next_pow2(K)), num_warps=warps,
            **pdl_args(x))
    return logits, weights, ids


# ---------------------------------------------------------------------------- align
# The align kernels here and the GEMM kernels below take the step's pair and block counts as
# plain arguments (Triton's ``do_not_specialize``): specialised, each new combination of
# "is 1" / "a multiple of 16" among them compiled a variant in the middle of serving (0.5-1.4 s
# each, docs/speed.md).
@triton.jit
def _onehot(ids_ptr, offs, N, E, E_B: tl.constexpr):
    """Expert ids of pairs ``offs`` (E past the end: no expert's column counts it) and their
    one-hot rows ``[len(offs), E_B]``."""
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=E)
    return ids, (ids[:, None] == tl.arange(0, E_B)[None, :]).to(tl.int32)


@triton.jit
def _write_blocks(pend, block_expert_ptr, sorted_ptr, N, E, max_blocks, BLOCK_M: tl.constexpr,
                  B_CHUNK: tl.constexpr):
    """Expert of each BLOCK_M-row block (the number of experts' runs ending at or before its
    first row; -1 past the last run), and the padding sentinel N in every row."""
    for b0 in range(0, max_blocks, B_CHUNK):
        b = b0 + tl.arange(0, B_CHUNK)
        done = tl.sum((pend[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(done < E, done, -1), mask=b < max_blocks)
        for r in tl.static_range(BLOCK_M):
            tl.store(sorted_ptr + b * BLOCK_M + r, N, mask=b < max_blocks)


@triton.jit(do_not_specialize=["N"])
def _count_kernel(ids_ptr, counts_ptr, N, E, CHUNK_: tl.constexpr, E_B: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs = c * CHUNK_ + tl.arange(0, CHUNK_)
    _, onehot = _onehot(ids_ptr, offs, N, E, E_B)
    tl.store(counts_ptr + c * E_B + tl.arange(0, E_B), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["N", "n_chunks", "max_blocks"])
def _offsets_kernel(counts_ptr, chunk_base_ptr, pstart_ptr, block_expert_ptr, sorted_ptr, N, E, n_chunks,
                    max_blocks, BLOCK_M: tl.constexpr, E_B: tl.constexpr, B_CHUNK: tl.constexpr,
                    C_TILE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    e = tl.arange(0, E_B)
    em = e < E
    # pairs of each expert in the chunks before chunk c (an exclusive running sum over
    # chunks, C_TILE chunks per step: a prefill has hundreds of chunks)
    running = tl.zeros([E_B], tl.int32)
    for c0 in range(0, n_chunks, C_TILE):
        c = c0 + tl.arange(0, C_TILE)
        cm = c < n_chunks
        offs = c[:, None] * E_B + e[None, :]
        tile = tl.load(counts_ptr + offs, mask=cm[:, None], other=0)
        tl.store(chunk_base_ptr + offs, running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=cm[:, None])
        running += tl.sum(tile, axis=0)
    padded = tl.where(em, (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    tl.store(pstart_ptr + e, pstart)  # first row of each expert's run
    _write_blocks(pend, block_expert_ptr, sorted_ptr, N, E, max_blocks, BLOCK_M, B_CHUNK)


@triton.jit(do_not_specialize=["N"])
def _scatter_kernel(ids_ptr, chunk_base_ptr, pstart_ptr, sorted_ptr, N, E, CHUNK_: tl.constexpr,
                    E_B: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    c = tl.program_id(0)
    offs = c * CHUNK_ + tl.arange(0, CHUNK_)
    ids, onehot = _onehot(ids_ptr, offs, N, E, E_B)
    valid = ids < E  # padding lanes, and pairs of experts held elsewhere (id E), have no row
    e = tl.arange(0, E_B)
    before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
    base = tl.load(chunk_base_ptr + c * E_B + e) + tl.load(pstart_ptr + e)
    dest = tl.sum(onehot * (before + base[None, :]), axis=1)
    tl.store(sorted_ptr + dest, offs, mask=valid)


@triton.jit(do_not_specialize=["N", "max_blocks"])
def _align_one_program_kernel(ids_ptr, block_expert_ptr, sorted_ptr, N, E, max_blocks, BLOCK_M: tl.constexpr,
                              E_B: tl.constexpr, CHUNK_: tl.constexpr, B_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The three kernels above in one program, for N <= CHUNK pairs (decode): one launch, not three."""
    pdl_wait(PDL)
    offs = tl.arange(0, CHUNK_)
    ids, onehot = _onehot(ids_ptr, offs, N, E, E_B)
    e = tl.arange(0, E_B)
    counts = tl.sum(onehot, axis=0)
    padded = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    _write_blocks(pend, block_expert_ptr, sorted_ptr, N, E, max_blocks, BLOCK_M, B_CHUNK)
    tl.debug_barrier()  # the padding sentinels are written before the pairs overwrite their rows
    before = tl.cumsum(onehot, axis=0) - onehot
    dest = tl.sum(onehot * (before + pstart[None, :]), axis=1)
    tl.store(sorted_ptr + dest, offs, mask=ids < E)


@dataclass
class Alignment:
    sorted_pairs: torch.Tensor   # [max_blocks * BLOCK_M] int32, pair index or N (padding)
    block_expert: torch.Tensor   # [max_blocks] int32, expert of each block or -1
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded blocks: every expert that gets pairs adds at most block_m - 1 rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1) + block_m - 1) // block_m


def rows_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, partial: bool) -> Alignment:
    """The GEMMs' row blocks: ``align``'s sorted, padded runs; or, for blocks of one pair (FMA
    tiles, one-token steps), no sort at all, a launch fewer: block i is pair i and its expert
    the pair's id, -1 (no work) where ``partial`` marked the pair's expert as held elsewhere."""
    if block_m != 1:
        return align(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    if partial:
        flat = torch.where(flat < num_experts, flat, -1)
    return Alignment(flat, flat, 1)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    flat = ids.reshape(-1)
    N = flat.numel()
    E_B = next_pow2(num_experts)
    n_chunks = triton.cdiv(N, CHUNK)
    nb = max_blocks(N, num_experts, block_m)
    dev = ids.device
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    if N and n_chunks == 1:
        _align_one_program_kernel[(1,)](flat, block_expert, sorted_pairs, N, num_experts, nb, BLOCK_M=block_m,
                                        E_B=E_B, CHUNK_=CHUNK, B_CHUNK=64, num_warps=4, **pdl_args(flat))
    elif N:
        counts = torch.empty(n_chunks, E_B, dtype=torch.int32, device=dev)
        chunk_base = torch.empty_like(counts)
        pstart = torch.empty(E_B, dtype=torch.int32, device=dev)
        _count_kernel[(n_chunks,)](flat, counts, N, num_experts, CHUNK_=CHUNK, E_B=E_B, num_warps=4, **pdl_args(flat))
        _offsets_kernel[(1,)](counts, chunk_base, pstart, block_expert, sorted_pairs, N, num_experts, n_chunks,
                              nb, BLOCK_M=block_m, E_B=E_B, B_CHUNK=64, C_TILE=16, num_warps=4, **pdl_args(flat))
        _scatter_kernel[(n_chunks,)](flat, chunk_base, pstart, sorted_pairs, N, num_experts, CHUNK_=CHUNK,
                                     E_B=E_B, num_warps=4, **pdl_args(flat))
    return Alignment(sorted_pairs, block_expert, block_m)


# ---------------------------------------------------------------------------- expert GEMMs
@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order of (m, n) tiles: neighbouring programs share weight tiles in L2."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _block_rows(block_expert_ptr, sorted_ptr, pid_m, N, BLOCK_M: tl.constexpr):
    """The expert of row block ``pid_m`` (-1: no work) and its pair indices (N: padding).
    A block of one pair (BLOCK_M 1, FMA tiles) is pair ``pid_m`` itself, unsorted:
    ``block_expert_ptr`` is then the pairs' expert ids (``rows_by_expert``)."""
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if BLOCK_M == 1:
        pair = pid_m + tl.arange(0, 1)
    else:
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, pair, pair < N


@triton.jit
def _expert_weights(w_ptr, sh_ptr, e, shared_id, stride_we):
    """Start of expert e's weights; the folded shared expert has its own tensor, same layout."""
    if e == shared_id:
        base = sh_ptr
    else:
        base = w_ptr + e * stride_we
    return base


@triton.jit
def _row_scales(a_ptrs, as_ptr, rows, mask, K, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 scales of the activation rows at ``a_ptrs`` (their first BLOCK_K columns): given
    (QUANTIZED_INPUT: ``as_ptr[rows]``), or found here (QUANT_IN_KERNEL: a pass over K for each
    row's largest magnitude); ones for WEIGHT_ONLY, unused without fp8."""
    scale = tl.zeros([BLOCK_M], tl.float32)
    if FP8 == 1:
        kk = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0, mask=mask[:, None] & (kk < K - k0)[None, :], other=0.0)
            scale = tl.maximum(scale, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        scale = token_scale(scale)
    elif FP8 == 2:
        scale = tl.load(as_ptr + rows, mask=mask, other=0.0)
    elif FP8 == 3:
        scale += 1.0
    return scale


# How a tile multiplies: TileConfig.kind, constexpr KIND, one of kernels.fp8's MMA, SWAP, FMA
# (an FMA tile holds one (token, expert) pair: BLOCK_M 1).


@triton.jit
def _weight_tile(w_base, cols, kk, stride_wn, KIND: tl.constexpr):
    """Pointers to a weight tile: ``[BLOCK_K, BLOCK_N]`` (W^T, the MMA's B operand), or as
    stored, ``[BLOCK_N, BLOCK_K]`` (SWAP, FMA)."""
    if KIND == 0:
        ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn + kk[:, None]
    else:
        ptrs = w_base + cols[:, None].to(tl.int64) * stride_wn + kk[None, :]
    return ptrs


@triton.jit
def _load_weight_tile(ptrs, km, cm, KIND: tl.constexpr):
    if KIND == 0:
        w = tl.load(ptrs, mask=km[:, None] & cm[None, :], other=0.0)
    else:
        w = tl.load(ptrs, mask=cm[:, None] & km[None, :], other=0.0)
    return w


@triton.jit
def _dot(a, b, acc, a_scale, FP8: tl.constexpr, PREC: tl.constexpr, KIND: tl.constexpr):
    """``acc + a @ b``; fp8: ``a`` (quantized here with its row scales, or given in e4m3) times
    e4m3 ``b``, or (WEIGHT_ONLY) ``a`` times ``b`` widened to ``a``'s dtype (the scales are
    applied to ``acc`` after the K loop). SWAP: ``acc + b @ a^T``; FMA: ``acc + b * a`` (one row
    ``a``, summed later); ``b`` then a ``[BLOCK_N, BLOCK_K]`` tile."""
    if KIND == 1:
        out = tl.dot(b.to(a.dtype), tl.trans(a), acc, input_precision=PREC)
    elif KIND == 2:
        out = acc + b.to(tl.float32) * a.to(tl.float32)
    elif FP8 == 1:
        out = tl.dot(to_fp8(a.to(tl.float32), a_scale[:, None]), b, acc)
    elif FP8 == 2:
        out = tl.dot(a, b, acc)
    elif FP8 == 3:
        out = tl.dot(a, b.to(a.dtype), acc, input_precision=PREC)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit(do_not_specialize=["N", "num_m"])
def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, sh_ptr, ws_ptr, sh_s_ptr, h_ptr, sorted_ptr, block_expert_ptr, N, K, I, num_m,
                    shared_id, stride_x, stride_we, stride_wn, stride_se, stride_h, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    PREC: tl.constexpr, FP8: tl.constexpr, KIND: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, pair, valid = _block_rows(block_expert_ptr, sorted_ptr, pid_m, N, BLOCK_M)
    if e < 0:
        return
    tok = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < I
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + kk[None, :]
    w_base = _expert_weights(w_ptr, sh_ptr, e, shared_id, stride_we)
    g_ptrs = _weight_tile(w_base, cols, kk, stride_wn, KIND)
    u_ptrs = g_ptrs + I * stride_wn
    a_scale = _row_scales(a_ptrs, xs_ptr, tok, valid, K, FP8, BLOCK_M, BLOCK_K)  # fp8: per token
    acc_g = zeros_acc(BLOCK_M, BLOCK_N, BLOCK_K, KIND)
    acc_u = zeros_acc(BLOCK_M, BLOCK_N, BLOCK_K, KIND)
    for k0 in range(0, K, BLOCK_K):
        km = kk < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
        g = _load_weight_tile(g_ptrs, km, cm, KIND)
        u = _load_weight_tile(u_ptrs, km, cm, KIND)
        acc_g = _dot(a, g, acc_g, a_scale, FP8, PREC, KIND)
        acc_u = _dot(a, u, acc_u, a_scale, FP8, PREC, KIND)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    acc_g, acc_u = finish_acc(acc_g, KIND), finish_acc(acc_u, KIND)
    if FP8 != 0:  # the row scales of this expert's gate and up rows
        s_base = _expert_weights(ws_ptr, sh_s_ptr, e, shared_id, stride_se)
        acc_g = acc_g * a_scale[:, None] * tl.load(s_base + cols, mask=cm, other=0.0)[None, :]
        acc_u = acc_u * a_scale[:, None] * tl.load(s_base + I + cols, mask=cm, other=0.0)[None, :]
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["N", "num_m"])
def _down_kernel(h_ptr, hs_ptr, w_ptr, sh_ptr, ws_ptr, sh_s_ptr, y_ptr, pw_ptr, sorted_ptr, block_expert_ptr, N, K, H,
                 num_m,
                 shared_id, stride_h, stride_we, stride_wn, stride_se, stride_y,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 PREC: tl.constexpr, FP8: tl.constexpr, KIND: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    e, pair, valid = _block_rows(block_expert_ptr, sorted_ptr, pid_m, N, BLOCK_M)
    if e < 0:
        return
    rows = pair.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < H
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_h + kk[None, :]
    w_base = _expert_weights(w_ptr, sh_ptr, e, shared_id, stride_we)
    b_ptrs = _weight_tile(w_base, cols, kk, stride_wn, KIND)
    a_scale = _row_scales(a_ptrs, hs_ptr, rows, valid, K, FP8, BLOCK_M, BLOCK_K)  # fp8: per pair
    acc = zeros_acc(BLOCK_M, BLOCK_N, BLOCK_K, KIND)
    for k0 in range(0, K, BLOCK_K):
        km = kk < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & km[None, :], other=0.0)
        b = _load_weight_tile(b_ptrs, km, cm, KIND)
        acc = _dot(a, b, acc, a_scale, FP8, PREC, KIND)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = finish_acc(acc, KIND)
    if FP8 != 0:
        s_base = _expert_weights(ws_ptr, sh_s_ptr, e, shared_id, stride_se)
        acc = acc * a_scale[:, None] * tl.load(s_base + cols, mask=cm, other=0.0)[None, :]
    acc = acc * tl.load(pw_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & cm[None, :])


@triton.jit
def _combine_kernel(y_ptr, shared_ptr, out_ptr, H, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=cm, other=0.0).to(tl.float32)
    if HAS_SHARED:
        # the routed sum is rounded to the model dtype first, as the eager layer adds two tensors
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(shared_ptr + t * H + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    kind: int = MMA  # MMA, SWAP or FMA (kernels.fp8; FMA takes block_m 1)


# Chosen on an H200 with scripts/bench_moe.py at GLM-4.5-Air sizes (docs/speed.md has the
# sweep); keyed by the most tokens of the step. Decode sizes are memory-bound and nearly
# indifferent to the tile (within 5%); prefill is not.
GATE_UP_CONFIGS = [
    (1, TileConfig(16, 128, 128, 1, 4, 3)),
    (8, TileConfig(16, 64, 256, 1, 4, 3)),
    (64, TileConfig(16, 32, 128, 1, 4, 4)),
    (256, TileConfig(32, 64, 128, 1, 4, 4)),
    (1 << 62, TileConfig(128, 128, 64, 8, 8, 4)),
]
DOWN_CONFIGS = [
    (1, TileConfig(16, 128, 128, 1, 4, 3)),
    (8, TileConfig(16, 64, 256, 1, 4, 3)),
    (64, TileConfig(16, 32, 128, 1, 4, 4)),
    (256, TileConfig(32, 64, 128, 1, 4, 4)),
    (1 << 62, TileConfig(128, 128, 64, 8, 8, 3)),
]


# fp8 weights: decode tiles from scripts/bench_moe.py --fp8 (docs/fp8.md; fp8's dot wants
# BLOCK_K >= 32), prefill the bf16 tiles.
_FP8_DECODE_TILES = [
    (1, TileConfig(1, 8, 512, 1, 4, 3, kind=FMA)),
    (8, TileConfig(16, 32, 128, 1, 4, 4)),
    (64, TileConfig(16, 128, 128, 1, 4, 3)),
]
FP8_GATE_UP_CONFIGS = _FP8_DECODE_TILES + GATE_UP_CONFIGS[-2:]
FP8_DOWN_CONFIGS = _FP8_DECODE_TILES + DOWN_CONFIGS[-2:]


def pick(configs, num_tokens: int) -> TileConfig:
    for bound, cfg in configs:
        if num_tokens <= bound:
            return cfg
    return configs[-1][1]


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, shared: torch.Tensor | None = None, *,
                  shared_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                  expert_range: tuple[int, int] | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  shared_scales: tuple[torch.Tensor, torch.Tensor] | None = None, mode: int | None = None,
                  gate_up_cfg: TileConfig | None = None, down_cfg: TileConfig | None = None) -> torch.Tensor:
    """Routed experts (+ the shared expert) for ``x [T, H]``.

    ``w_gate_up [E, 2I, H]`` (gate rows, then up rows), ``w_down [E, H, I]``; ``weights``/``ids``
    ``[T, top_k]`` from the router. The shared expert comes either as its output ``shared``
    (added in the final sum) or folded in: ``shared_weights=(gate_up [2I, H], down [H, I])``
    with ids/weights carrying one more column (``router_topk(append_shared=True)``: id
    = the number of routed experts, weight 1), so its GEMMs ride in the routed launches.
    ``expert_range=(first, last)`` says the weights hold only those experts of a larger set
    (an expert-parallel shard): pairs routed elsewhere add zero.

    fp8: the weights are e4m3 codes and ``scales=(gate_up [E, 2I], down [E, H])`` their float32
    row scales (``shared_scales=(gate_up [2I], down [H])`` for folded shared weights), run in
    ``mode`` (default ``fp8_mode(T)``; the module docstring has the three).
    """
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    width = ids.shape[1]  # top_k, or top_k + 1 with the shared column
    N = T * width
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    local = ids.to(torch.int32)
    partial = expert_range is not None
    if partial:  # local experts 0..E-1, shared E, held elsewhere E + 1 (align gives it no row)
        shifted = local - expert_range[0]
        outside = (shifted < 0) | (shifted >= E)
        local = torch.where(outside, E + 1, shifted)
        if shared_weights is not None:  # the shared column is the last one: it is never outside
            local[:, -1] = E
    slots = E + (shared_weights is not None)
    fp8 = scales is not None
    assert fp8 == (w_gate_up.dtype == torch.float8_e4m3fn) == (w_down.dtype == torch.float8_e4m3fn)
    s_gate_up, s_down = scales if fp8 else (w_gate_up, w_down)  # (unused pointers without fp8)
    if shared_weights is not None:
        sh_gate_up, sh_down = shared_weights
        assert sh_gate_up.shape == (two_i, H) and sh_down.shape == (H, I)
        assert sh_gate_up.stride(0) == w_gate_up.stride(1) and sh_down.stride(0) == w_down.stride(1)
        assert sh_gate_up.dtype == w_gate_up.dtype and (shared_scales is not None) == fp8
        sh_s_gate_up, sh_s_down = shared_scales if fp8 else (sh_gate_up, sh_down)
        shared_id = E
    else:
        sh_gate_up, sh_down, shared_id = w_gate_up, w_down, -1
        sh_s_gate_up, sh_s_down = s_gate_up, s_down
    if fp8:
        assert s_gate_up.shape == (E, two_i) and s_down.shape == (E, H)
        assert s_gate_up.stride(1) == s_down.stride(1) == 1
        assert sh_s_gate_up.shape[-1] == two_i and sh_s_down.shape[-1] == H
    x = x if x.stride(-1) == 1 else x.contiguous()
    prec = dot_precision(x.dtype)
    cu = gate_up_cfg or pick(FP8_GATE_UP_CONFIGS if fp8 else GATE_UP_CONFIGS, T)
    cd = down_cfg or pick(FP8_DOWN_CONFIGS if fp8 else DOWN_CONFIGS, T)
    if x.element_size() == 4 and not fp8:  # fp32 (reference runs): half the K step keeps the
        # bf16 tiles' shared memory (the prefill tile's 4 stages needed 288 KiB of the H200's 227)
        cu, cd = (replace(c, block_k=max(16, c.block_k // 2)) for c in (cu, cd))

    mode = NO_FP8 if not fp8 else fp8_mode(T) if mode is None else mode
    if mode in (QUANT_IN_KERNEL, QUANTIZED_INPUT):  # swapped and FMA tiles take the rows unquantized
        cu, cd = (c if c.kind == MMA else replace(c, kind=MMA, block_m=max(16, c.block_m)) for c in (cu, cd))
    assert all(c.kind != FMA or c.block_m == 1 for c in (cu, cd)), "an FMA tile holds one pair"
    a, a_scale = per_token_quant(x) if mode == QUANTIZED_INPUT else (x, x)  # (x: an unused pointer)

    al = rows_by_expert(local, slots, cu.block_m, partial)
    h = torch.empty(N, I, dtype=x.dtype, device=x.device)
    num_m = al.block_expert.numel()
    _gate_up_kernel[(num_m * triton.cdiv(I, cu.block_n),)](
        a, a_scale, w_gate_up, sh_gate_up, s_gate_up, sh_s_gate_up, h, al.sorted_pairs, al.block_expert, N, H, I, num_m,
        shared_id, a.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), s_gate_up.stride(0), h.stride(0),
        TOP_K=width, BLOCK_M=cu.block_m, BLOCK_N=cu.block_n, BLOCK_K=cu.block_k, GROUP_M=cu.group_m, PREC=prec,
        FP8=mode, KIND=cu.kind, num_warps=cu.num_warps, num_stages=cu.num_stages, **pdl_args(x))

    if cd.block_m != cu.block_m:
        al = rows_by_expert(local, slots, cd.block_m, partial)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if partial:
        y.zero_()  # rows of pairs routed elsewhere are never written
    num_m = al.block_expert.numel()
    # each pair's row quantized once (rows of pairs routed to experts held elsewhere hold garbage: unread)
    h, h_scale = per_token_quant(h) if mode == QUANTIZED_INPUT else (h, h)
    _down_kernel[(num_m * triton.cdiv(H, cd.block_n),)](
        h, h_scale, w_down, sh_down, s_down, sh_s_down, y, weights.reshape(-1), al.sorted_pairs, al.block_expert, N, I, H,
        num_m, shared_id, h.stride(0), w_down.stride(0), w_down.stride(1), s_down.stride(0), y.stride(0),
        BLOCK_M=cd.block_m, BLOCK_N=cd.block_n, BLOCK_K=cd.block_k, GROUP_M=cd.group_m, PREC=prec,
        FP8=mode, KIND=cd.kind, num_warps=cd.num_warps, num_stages=cd.num_stages, **pdl_args(x))

    block = min(1024, next_pow2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](y, shared if shared is not None else y, out, H, TOP_K=width,
                                                HAS_SHARED=shared is not None, BLOCK=block, num_warps=4,
                                                **pdl_args(x))
    return out
