"""Each Triton kernel against the eager layer it replaces, on fresh random inputs.

Used by tests/test_triton_kernels.py on the GPU (real sizes) and, small, under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, set before triton is imported: run this file as a
script). The eager maths is what tests/test_model.py proves against transformers.

``python tests/triton_checks.py [cpu|cuda] [float32|bfloat16]`` prints one JSON line per check.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch


def _interpreter_fp8_fix() -> None:
    """Triton's CPU interpreter rounds a float to e4m3 without carrying into the exponent
    (125.1 becomes 64, not 128: Triton 3.6's ``_convert_float``); round with torch's e4m3 instead,
    as the GPU's ``cvt.rn.satfinite`` does (the kernels clamp to +-448 first). Widening e4m3 is
    exact in the interpreter and is left alone."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def to_float32(data, dtype):
        if dtype == tl.bfloat16:
            return (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return np.asarray(data).view({32: np.float32, 16: np.float16}[dtype.primitive_bitwidth]).astype(np.float32)

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype.primitive_bitwidth > 8:
            x = torch.from_numpy(np.ascontiguousarray(to_float32(data, input_dtype)))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max |a - b| / max |b|


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in the kernel's output"
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_add_rmsnorm(device, dtype, rows=37, hidden=192, seed=0):
    from glm_fused.torch_backend import OPS
    from glm_fused.torch_backend.kernels.rmsnorm import add_rmsnorm

    rms_norm = OPS.rms_norm  # the maths written once in glm_fused.model.ops (no kernel behind it)

    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, hidden, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(device, dtype)
    out, summed = add_rmsnorm(x, r, w, 1e-5)
    ref_sum = x + r
    out2, same = add_rmsnorm(x.view(rows, 3, hidden // 3), None, w[: hidden // 3], 1e-5)  # qk-norm shape
    return {"normed": rel(out, rms_norm(ref_sum, w, 1e-5)), "sum": rel(summed, ref_sum),
            "no_residual": rel(out2, rms_norm(x.view(rows, 3, -1), w[: hidden // 3], 1e-5)),
            "no_residual_passthrough": float(same.data_ptr() != x.data_ptr())}


def check_rope_and_store(device, dtype, T=5, heads=6, kv_heads=2, head_dim=32, rotary_dim=16, seed=1):
    from glm_fused.torch_backend import LAYERS
    from glm_fused.torch_backend.kernels.rotary import rope_and_store

    g = torch.Generator().manual_seed(seed)
    rope = LAYERS.RotaryEmbedding(head_dim, rotary_dim, 64, 10000.0).to(device)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(T, width, generator=g).to(device, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim), v.view(T, kv_heads, head_dim)
    positions = torch.tensor([0, 3, 17, 40, 63][:T], device=device)
    # Paged cache of 6 blocks of 4 rows; the last token is CUDA-graph padding (row -1: not stored).
    slot_mapping = torch.tensor([5, 0, 22, 9, -1][:T], device=device)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    shape = (6, 4, kv_heads, head_dim)
    kc = torch.full(shape, 7.0, dtype=dtype, device=device)
    vc = torch.full(shape, 7.0, dtype=dtype, device=device)
    out_q = rope_and_store(positions, slot_mapping, q, k, v, rope.cos_cache, rope.sin_cache, kc, vc)
    stored = slot_mapping >= 0
    rows = slot_mapping[stored]
    flat_k, flat_v = kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[rows] = False
    return {"q": rel(out_q, ref_q), "k_cache": rel(flat_k[rows], ref_k[stored]),
            "v_cache": rel(flat_v[rows], v[stored]), "q_in_place": float(out_q.data_ptr() != q.data_ptr()),
            "other_rows_untouched": float(not (bool((flat_k[untouched] == 7.0).all())
                                               and bool((flat_v[untouched] == 7.0).all())))}


def check_silu_and_mul(device, dtype, T=7, inter=80, seed=5):
    import torch.nn.functional as F

    from glm_fused.torch_backend.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(T, 2 * inter, generator=g).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return {"out": rel(silu_and_mul(gate, up), F.silu(gate.float()) * up.float())}


def check_decode_attention(device, dtype, lens=(1, 70, 200, 33), heads=12, kv_heads=2, head_dim=32, page=16,
                           seed=2, contiguous=True):
    """The paged kernel, each sequence's blocks scattered over the cache, against an fp32
    reference; and the contiguous (one slot per sequence) kernel on the same keys."""
    from glm_fused.torch_backend.kernels.decode_attention import contiguous_decode_attention, decode_attention

    g = torch.Generator().manual_seed(seed)
    S, max_len = len(lens), max(lens) + 3
    width = -(-max_len // page)
    # Contiguous: [S + 2 slots, width * page]; paged: the same rows cut into blocks, shuffled.
    kc = torch.randn(S + 2, width * page, kv_heads, head_dim, generator=g).to(device, dtype)
    vc = torch.randn(S + 2, width * page, kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(S, heads, head_dim, generator=g).to(device, dtype)
    slots = torch.randperm(S + 2, generator=g)[:S].to(device)
    seq_lens = torch.tensor(lens, device=device)
    num_blocks = (S + 2) * width
    perm = torch.randperm(num_blocks, generator=g).to(device)  # logical block i lives in physical perm[i]
    paged_k = torch.empty(num_blocks, page, kv_heads, head_dim, dtype=dtype, device=device)
    paged_v = torch.empty_like(paged_k)
    paged_k[perm] = kc.reshape(num_blocks, page, kv_heads, head_dim)
    paged_v[perm] = vc.reshape(num_blocks, page, kv_heads, head_dim)
    tables = perm[slots[:, None] * width + torch.arange(width, device=device)[None, :]]
    scale = head_dim ** -0.5
    out = decode_attention(q, paged_k, paged_v, tables, seq_lens, scale)
    if contiguous:
        contiguous = contiguous_decode_attention(q, kc, vc, slots, seq_lens, scale)
    worst = worst_contiguous = 0.0
    for s, n in enumerate(lens):  # fp32 reference, GQA by repeating kv heads
        keys = kc[slots[s], :n].float().repeat_interleave(heads // kv_heads, dim=1)   # [n, heads, D]
        vals = vc[slots[s], :n].float().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].float(), keys) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", p, vals)
        worst = max(worst, rel(out[s], ref))
        if contiguous is not False:
            worst_contiguous = max(worst_contiguous, rel(contiguous[s], ref))
    return {"out": worst, "contiguous": worst_contiguous}


def _few_splits(check, **kwargs):
    """``check`` with the GPU-filling split count turned down to one split per program, so each
    program walks several key tiles (the page ids loaded a tile ahead); at the usual count these
    small checks give every split one tile."""
    from glm_fused.torch_backend.kernels import decode_attention as da

    def run(device, dtype):
        saved, da.TARGET_PROGRAMS = da.TARGET_PROGRAMS, 1
        try:
            return check(device, dtype, **kwargs)
        finally:
            da.TARGET_PROGRAMS = saved
    return run


def check_grouped_decode_attention(device, dtype, runs=((40, 7), (69, 1), (0, 5), (149, 6)), heads=12, kv_heads=2,
                                   head_dim=32, page=16, seed=4):
    """Rows that are prompt chunks' tokens (a run of rows per sequence: (context, rows)), the
    CUDA graphs' chunk layout: grouped rows (``lead``) against an fp32 reference per row, and
    the ungrouped kernel on the same rows."""
    from glm_fused.torch_backend.kernels.decode_attention import GROUP_ROWS, decode_attention, row_groups

    g = torch.Generator().manual_seed(seed)
    width = -(-max(c + n for c, n in runs) // page)
    S = len(runs)
    num_blocks = S * width
    k = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=g).view(S, width)  # each sequence's blocks, scattered
    seq = np.repeat(np.arange(S), [n for _, n in runs])
    lens = np.concatenate([np.arange(c + 1, c + n + 1) for c, n in runs])  # each row sees keys up to itself
    q = torch.randn(len(seq), heads, head_dim, generator=g).to(device, dtype)
    tables = perm[torch.as_tensor(seq)].to(device=device, dtype=torch.int32)
    seq_lens = torch.as_tensor(lens, device=device)
    scale = head_dim ** -0.5
    lead = row_groups(seq)
    grouped = decode_attention(q, k, v, tables, seq_lens, scale, lead=torch.as_tensor(lead, device=device))
    plain = decode_attention(q, k, v, tables, seq_lens, scale)
    worst = worst_plain = 0.0
    for r, (s, n) in enumerate(zip(seq, lens)):
        blocks = perm[s]
        keys = k[blocks].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        vals = v[blocks].reshape(-1, kv_heads, head_dim)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), keys) * scale, dim=-1)
        ref = torch.einsum("hn,nhd->hd", p, vals)
        worst, worst_plain = max(worst, rel(grouped[r], ref)), max(worst_plain, rel(plain[r], ref))
    assert lead.sum() == len(seq) and (lead > 0).sum() == sum(-(-n // GROUP_ROWS) for _, n in runs), lead
    return {"out": worst, "ungrouped": worst_plain}


def check_prefill_attention(device, dtype, chunks=((0, 5), (0, 70), (37, 1), (9, 3), (64, 64), (130, 20)), heads=12,
                            kv_heads=2, head_dim=32, page=16, seed=5):
    """Every prompt chunk ((context_len, query_len): fresh prompts, a lone decode, chunks after
    context that do and do not end on a tile edge) in one launch, each sequence's blocks
    scattered over the cache, against an fp32 causal reference; rows of q that belong to no
    chunk stay untouched."""
    from glm_fused.torch_backend.kernels.prefill_attention import prefill_attention

    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in chunks]
    widths = [-(-n // page) for n in lens]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g)
    blocks = perm[:sum(widths)]
    kc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    T = sum(n for _, n in chunks) + 2  # two rows that are no chunk's (a decode handled elsewhere)
    q = torch.randn(T, heads, head_dim, generator=g).to(device, dtype)
    first = [2 + sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    block0 = [sum(widths[:i]) for i in range(len(chunks))]
    table = torch.tensor([first, [n for _, n in chunks], [c for c, _ in chunks], block0], device=device)
    out = torch.full_like(q, 7.0)
    scale = head_dim ** -0.5
    prefill_attention(q, kc, vc, table, blocks.to(device), max(n for _, n in chunks), scale, out)
    worst = 0.0
    for (context, n), f, b0, w in zip(chunks, first, block0, widths):
        mine = blocks[b0:b0 + w].to(device)
        keys = kc[mine].reshape(-1, kv_heads, head_dim)[:context + n].float().repeat_interleave(heads // kv_heads, 1)
        vals = vc[mine].reshape(-1, kv_heads, head_dim)[:context + n].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[f:f + n].float(), keys) * scale
        visible = torch.arange(context + n, device=device)[None, :] <= torch.arange(n, device=device)[:, None] + context
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        worst = max(worst, rel(out[f:f + n], torch.einsum("hqk,khd->qhd", p, vals)))
    return {"out": worst, "other_rows_untouched": float(not bool((out[:2] == 7.0).all()))}


def check_fused_moe(device, dtype, T=9, hidden=64, inter=48, experts=16, top_k=4, seed=3, expert_range=None,
                    tile_kinds=False):
    """Router, align and the expert GEMMs against the eager maths; ``tile_kinds``: the swapped
    and FMA tiles too (one size is enough: they change how a tile multiplies, not the sort)."""
    from glm_fused.torch_backend.kernels.fused_moe import (ROUTER_GEMV_MAX_TOKENS, align, fused_experts,
                                                           route_tokens, router_logits, router_topk)

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).to(device, dtype)
    wg = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(device, dtype)
    wd = (0.1 * torch.randn(experts, hidden, inter, generator=g)).to(device, dtype)
    logits = (2.0 * torch.randn(T, experts, generator=g)).to(device)
    bias = (0.2 * torch.rand(experts, generator=g)).to(device)
    shared = torch.randn(T, hidden, generator=g).to(device, dtype)
    res = {}
    # router logits: the eager TopKRouter's fp32 product, here also over a width that leaves a
    # partial K tile and with strided rows
    w_router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    xr = x[:ROUTER_GEMV_MAX_TOKENS]
    res["router_logits"] = rel(router_logits(xr, w_router), xr.float() @ w_router.t())
    res["router_logits_partial_k"] = rel(router_logits(xr[:, :hidden - 5], w_router[:, :hidden - 5], (4, 32, 4)),
                                         xr[:, :hidden - 5].float() @ w_router[:, :hidden - 5].t())
    # router: the eager TopKRouter's maths (no expert groups)
    weights, ids = router_topk(logits, bias, top_k, True, 2.5)
    scores = logits.sigmoid()
    ref_ids = (scores + bias).topk(top_k, dim=-1).indices
    ref_w = scores.gather(1, ref_ids)
    ref_w = ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20) * 2.5
    res["router_ids_differ"] = float(not torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values))
    order = ids.long().argsort(-1)
    res["router_weights"] = rel(weights.gather(1, order), ref_w.gather(1, ref_ids.argsort(-1)))
    # align: every pair exactly once, in a block of its own expert
    for block_m in (1, 16):
        al = align(ids, experts, block_m)
        rows = al.sorted_pairs.cpu().view(-1, block_m)
        be = al.block_expert.cpu()
        flat = ids.reshape(-1).cpu()
        seen = sorted(int(p) for p in rows.flatten() if p < T * top_k)
        ok = seen == list(range(T * top_k))
        for b in range(rows.shape[0]):
            for p in rows[b]:
                if p < T * top_k:
                    ok &= int(be[b]) == int(flat[p])
        res[f"align_bad_m{block_m}"] = float(not ok)
    # experts: the per-expert loop written once (Ops.routed_experts) on the same routing
    from glm_fused.torch_backend import OPS

    first, last = expert_range or (0, experts)

    def loop(w, i):
        return OPS.routed_experts(x, wg[first:last], wd[first:last], w, i, (first, last))

    ref = loop(weights, ids.long()) + shared
    out = fused_experts(x, wg[first:last], wd[first:last], weights, ids, shared,
                        expert_range=expert_range)
    res["experts"] = rel(out, ref)
    # the shared expert folded into the routed GEMMs: one more column from the router
    import torch.nn.functional as F

    sh_gu = (0.1 * torch.randn(2 * inter, hidden, generator=g)).to(device, dtype)
    sh_dn = (0.1 * torch.randn(hidden, inter, generator=g)).to(device, dtype)
    gate, up = F.linear(x, sh_gu).chunk(2, dim=-1)
    ref = loop(weights, ids.long()) + F.linear(F.silu(gate) * up, sh_dn)
    w2, ids2 = router_topk(logits, bias, top_k, True, 2.5, append_shared=True)
    res["router_shared_column_bad"] = float(not (bool((ids2[:, -1] == experts).all())
                                                 and bool((w2[:, -1] == 1).all())
                                                 and torch.equal(ids2[:, :-1], ids)))
    # logits and choice in one launch (decode sizes), at the table's tile and at 4 experts a program
    ref_w, ref_ids = router_topk(xr.float() @ w_router.t(), bias, top_k, True, 2.5, append_shared=True)
    for tile in (None, (4, 32, 4)):
        w3, ids3 = route_tokens(xr, w_router, bias, top_k, True, 2.5, append_shared=True, tile=tile)
        key = "table" if tile is None else "4_experts"
        res[f"route_tokens_ids_differ_{key}"] = float(not torch.equal(ids3, ref_ids))
        res[f"route_tokens_weights_{key}"] = rel(w3, ref_w)
    out = fused_experts(x, wg[first:last], wd[first:last], w2, ids2, shared_weights=(sh_gu, sh_dn),
                        expert_range=expert_range)
    res["experts_shared_folded"] = rel(out, ref)
    # swapped and FMA tiles (fused_moe.SWAP, fused_moe.FMA), as decode may pick them
    for name, kind in (("swapped", 1), ("fma", 2)) if tile_kinds else ():
        tile = _moe_tile(kind)
        out = fused_experts(x, wg[first:last], wd[first:last], w2, ids2, shared_weights=(sh_gu, sh_dn),
                            expert_range=expert_range, gate_up_cfg=tile, down_cfg=tile)
        res[f"experts_{name}_tiles"] = rel(out, ref)
    return res


# ---- fp8 ---------------------------------------------------------------------------------
# The fp8 kernels are checked two ways: against ``emulated_ops()`` - the same fp8 maths in plain
# torch (activations quantized per row by Ops.quantize_fp8's rule, then dequantized products in
# fp32) - to within the order of fp32 sums (keys without a prefix: the usual tolerance); and
# against fp32 on the dequantized weights (``fp8_vs_fp32`` keys: FP8_VS_FP32 in the tests, the
# issue's rule for what activation quantization may cost).


def emulated_ops(moe_mode=None):
    """TorchOps whose fp8 Linear does the fp8 kernels' maths in plain torch, in fp32: the input
    quantized per row first where the kernel quantizes it (an fp8 Linear above
    WEIGHT_ONLY_MAX_ROWS rows; the MoE's experts in their ``fp8_mode``, or ``moe_mode``), as it
    comes where the kernel is weight-only. Use with the kernels off: the composites then reach
    this Linear."""
    from glm_fused.torch_backend.kernels.fp8 import WEIGHT_ONLY_MAX_ROWS
    from glm_fused.torch_backend.kernels.fused_moe import WEIGHT_ONLY, fp8_mode
    from glm_fused.torch_backend.ops import TorchOps

    class Emulated(TorchOps):
        expert_mode = None  # inside moe(): the mode of its experts' GEMMs

        def linear_fp8(self, x, w, bias=None):
            x2 = x.reshape(-1, x.shape[-1])
            quantize = (x2.shape[0] > WEIGHT_ONLY_MAX_ROWS if self.expert_mode is None
                        else self.expert_mode != WEIGHT_ONLY)
            a = self.dequantize_fp8(self.quantize_fp8(x2)) if quantize else x2.float()
            y = self.linear(a, self.dequantize_fp8(w), None if bias is None else self.float32(bias))
            return y.reshape(*x.shape[:-1], -1).to(x.dtype)

        def moe(self, x, router_weight, bias, routing, gate_up, down, expert_range, shared_gate_up, shared_down):
            # the shared expert rides in the experts' GEMMs when as wide as one (TorchOps.moe)
            folded = shared_gate_up.shape[0] == gate_up.shape[1]
            weights, ids = self.route(self.router_logits(x, router_weight), bias, routing)
            self.expert_mode = fp8_mode(x.shape[0]) if moe_mode is None else moe_mode
            try:
                routed = self.routed_experts(x, gate_up, down, weights, ids, expert_range)
                shared = self.swiglu(x, shared_gate_up, shared_down) if folded else None
            finally:
                self.expert_mode = None
            return routed + (shared if folded else self.swiglu(x, shared_gate_up, shared_down))

    return Emulated()


def _off():
    import contextlib

    from glm_fused.torch_backend import kernels

    @contextlib.contextmanager
    def scope():
        previous = kernels.set_enabled(False)
        try:
            yield
        finally:
            kernels.set_enabled(previous)

    return scope()


def check_fp8_quant(device, dtype, rows=7, cols=300, seed=6):
    from glm_fused.torch_backend import OPS
    from glm_fused.torch_backend.kernels.fp8 import per_token_quant

    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, cols, generator=g)).to(device, dtype)
    x[2] = 0  # an all-zero token: codes 0, a finite scale
    q, scale = per_token_quant(x)
    ref = OPS.quantize_fp8(x)
    off = (q.view(torch.uint8) != ref.codes.view(torch.uint8)).float().mean()
    return {"scale": rel(scale, ref.scale), "codes_off": float(off), "zero_row_nan": float(bool(scale.isnan().any()))}


def check_linear_fp8(device, dtype, M=5, K=96, N=80, seed=7, cfg=None):
    """OPS.linear_fp8 on ``[2, M, K]``; ``cfg``: the weight-only tile (kernels.fp8.GemvConfig)."""
    from glm_fused.torch_backend import OPS
    from glm_fused.torch_backend.kernels import fp8

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, M, K, generator=g).to(device, dtype)
    w = OPS.quantize_fp8((0.1 * torch.randn(N, K, generator=g)).to(device))
    bias = (0.1 * torch.randn(N, generator=g)).to(device, dtype)
    default = fp8.pick_gemv
    if cfg is not None:
        fp8.pick_gemv = lambda _rows, _k: cfg
    try:
        out = OPS.linear_fp8(x, w, bias)
    finally:
        fp8.pick_gemv = default
    with _off():
        emulated = emulated_ops().linear_fp8(x, w, bias)
    fp32 = torch.nn.functional.linear(x.float(), OPS.dequantize_fp8(w), bias.float())
    return {"emulated": rel(out, emulated), "fp8_vs_fp32": rel(out, fp32)}


def check_moe_fp8(device, dtype, T=9, hidden=64, inter=48, experts=16, top_k=4, shared_width=None, expert_range=None,
                  seed=8, mode=None, tile=None):
    """TorchOps.moe with fp8 experts (the shared expert folded when as wide as a routed one), in
    ``mode`` (fused_moe's fp8 modes; default: the one for T tokens), with ``tile`` (default:
    the table's)."""
    from glm_fused.torch_backend.kernels import fused_moe

    from glm_fused.model.ops import Routing
    from glm_fused.torch_backend import OPS

    g = torch.Generator().manual_seed(seed)
    sw = shared_width or inter
    x = torch.randn(T, hidden, generator=g).to(device, dtype)
    first, last = expert_range or (0, experts)
    ws = [(0.1 * torch.randn(*shape, generator=g)).to(device) for shape in
          ((last - first, 2 * inter, hidden), (last - first, hidden, inter), (2 * sw, hidden), (hidden, sw))]
    gate_up, down, sh_gate_up, sh_down = (OPS.quantize_fp8(w) for w in ws)
    logits = 2.0 * torch.randn(T, experts, generator=g)
    # the router weights that give these logits (least squares; exact while T <= hidden)
    router = torch.linalg.lstsq(x.float().cpu(), logits).solution.t().contiguous().to(device)
    bias = (0.2 * torch.rand(experts, generator=g)).to(device)
    routing = Routing(experts, top_k, 1, 1, True, 2.5)
    args = (routing, gate_up, down, (first, last), sh_gate_up, sh_down)
    default = fused_moe.fp8_mode, fused_moe.pick
    if mode is not None:
        fused_moe.fp8_mode = lambda _tokens: mode
    if tile is not None:
        fused_moe.pick = lambda _configs, _tokens: tile
    try:
        out = OPS.moe(x, router, bias, *args)
    finally:
        fused_moe.fp8_mode, fused_moe.pick = default
    with _off():
        emulated = emulated_ops(mode).moe(x, router, bias, *args)
        deq = [OPS.dequantize_fp8(w, str(dtype).removeprefix("torch.")) for w in (gate_up, down, sh_gate_up, sh_down)]
        fp32 = OPS.moe(x.float(), router, bias, routing, deq[0].float(), deq[1].float(), (first, last), deq[2].float(),
                       deq[3].float())
    return {"emulated": rel(out, emulated), "fp8_vs_fp32": rel(out, fp32)}


def check_model_fp8(device, dtype, seed=9):
    """The tiny model with fp8 weights: the kernels (fp8 GEMMs, fused MoE, the rest) against the
    emulated fp8 maths with every kernel off, through prefill, decode and a chunked step."""
    from pathlib import Path

    from glm_fused.batch import ForwardBatch
    from glm_fused.config import Glm4MoeConfig
    from glm_fused.model.module import bind
    from glm_fused.torch_backend import LAYERS, OPS

    from bench.bench_layers import fill_random

    config = Glm4MoeConfig.from_json_file(Path(__file__).resolve().parents[1] / "configs" / "glm-4.5-air-tiny.json")
    name = str(dtype).removeprefix("torch.")
    with torch.device(device):
        source = LAYERS.Glm4MoeForCausalLM(config, dtype=name, max_position=64)
        fp8 = LAYERS.Glm4MoeForCausalLM(config, dtype=name, max_position=64, quantization="fp8")
        emulated = bind(emulated_ops()).Glm4MoeForCausalLM(config, dtype=name, max_position=64, quantization="fp8")
    assert fp8.fp8_params, "the fp8 model keeps no fp8 weights here"
    with torch.no_grad():
        fill_random(source, config, seed)
        params = dict(fp8.named_parameters())
        for n, p in source.named_parameters():
            if n in fp8.fp8_params:
                q = OPS.quantize_fp8(p)
                params[n].copy_(q.codes)
                params[n + "_scale"].copy_(q.scale)
            else:
                params[n].copy_(p)
        emulated.load_state_dict(fp8.state_dict())
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    a, b = [[7, 2, 10, 5], [1, 11, 4, 8]]  # blocks of 4 positions, scattered over a cache of 12
    steps = [ForwardBatch.prefill(prompts, [a, b]), ForwardBatch.decode([7, 8], [5, 9], [a, b]),
             ForwardBatch([11, 3, 4, 5], [6, 10, 11, 12], [1, 3], [6, 10], [0, 1, 2, 3], [a, b])]
    logits = {}
    for tag, model, on in (("fp8", fp8, True), ("emulated", emulated, False)):
        import contextlib

        with (contextlib.nullcontext() if on else _off()), torch.inference_mode():
            caches = model.make_kv_caches(12, 4)
            logits[tag] = [model.compute_logits(model(torch.as_tensor(s.input_ids, device=device),
                                                      torch.as_tensor(s.positions, device=device), s, caches))
                           for s in steps]
    return {f"step{i}": rel(a, b) for i, (a, b) in enumerate(zip(logits["fp8"], logits["emulated"]))}


CHECKS = {"add_rmsnorm": check_add_rmsnorm, "silu_and_mul": check_silu_and_mul, "rope_and_store": check_rope_and_store,
          "decode_attention": check_decode_attention,
          # pages smaller than the kernel's 64-key tile (several pages per tile) and larger
          "decode_attention_page4": lambda d, t: check_decode_attention(d, t, lens=(5, 70), heads=4, kv_heads=1,
                                                                         page=4, contiguous=False),
          # (head_dim 128: stage 2 merges one head per program, as at GLM-4.5-Air's size)
          "decode_attention_page128": lambda d, t: check_decode_attention(d, t, lens=(129, 3), heads=4, kv_heads=1,
                                                                           head_dim=128, page=128, contiguous=False),
          # 67 rows x 2 kv heads fill the GPU with one split each: stage 1 writes the output itself
          "decode_attention_one_split": lambda d, t: check_decode_attention(d, t, lens=tuple(range(1, 68)), heads=4,
                                                                             kv_heads=2, contiguous=False),
          "grouped_decode_attention": check_grouped_decode_attention,
          # one split per program: each walks up to four tiles (page ids loaded a tile ahead)
          "decode_attention_tiles_ahead": _few_splits(check_decode_attention),
          "decode_attention_tiles_ahead_page64": _few_splits(check_decode_attention, page=64, contiguous=False),
          "grouped_decode_attention_tiles_ahead": _few_splits(check_grouped_decode_attention),
          # a tile over 16 pages (its ids loaded as one vector), and one page holding a whole tile
          "grouped_decode_attention_page4": lambda d, t: check_grouped_decode_attention(d, t, page=4),
          "grouped_decode_attention_page64": lambda d, t: check_grouped_decode_attention(d, t, page=64),
          "prefill_attention": check_prefill_attention,
          "prefill_attention_page4": lambda d, t: check_prefill_attention(d, t, chunks=((3, 9), (0, 66)), heads=4,
                                                                           kv_heads=1, page=4),
          "fused_moe": lambda d, t: check_fused_moe(d, t, tile_kinds=True),
          "fused_moe_partial": lambda d, t: check_fused_moe(d, t, expert_range=(4, 12), tile_kinds=True),
          # 3 * 40 = 120 pairs: the three-kernel sort (more than one chunk of 64 pairs)
          "fused_moe_chunks": lambda d, t: check_fused_moe(d, t, T=40, top_k=3, hidden=32, inter=32),
          # 1200 pairs = 19 chunks: the running sum over chunks takes two tiles of 16
          "fused_moe_many_chunks": lambda d, t: check_fused_moe(d, t, T=300, top_k=4, hidden=32, inter=32)}


def run_all(device: str, dtype: torch.dtype) -> dict:
    return {name: fn(device, dtype) for name, fn in CHECKS.items()}


def check_model(device, dtype, qk_norm=False, seed=4, sdpa_fresh_min=None):
    """The tiny model with the kernels on and off: prefill of three prompts, then decode steps
    (one and two sequences) and a chunked-prefill step, through one KV cache each.
    ``sdpa_fresh_min``: fresh prompts from this length take SDPA beside the batched prompt
    kernel (``TorchOps.SDPA_FRESH_MIN``; 5: the 5- and 9-token prompts SDPA, the 4 the kernel)."""
    import dataclasses
    from pathlib import Path

    from glm_fused.batch import ForwardBatch
    from bench.bench_layers import fill_random
    from glm_fused.config import Glm4MoeConfig
    from glm_fused.torch_backend import Glm4MoeForCausalLM, kernels

    config = Glm4MoeConfig.from_json_file(Path(__file__).resolve().parents[1] / "configs" / "glm-4.5-air-tiny.json")
    config = dataclasses.replace(config, use_qk_norm=qk_norm)
    with torch.device(device):
        model = Glm4MoeForCausalLM(config, dtype=str(dtype).removeprefix("torch."), max_position=64)
    with torch.no_grad():
        fill_random(model, config, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 4)]
    # Blocks of 4 positions, each sequence's scattered over a cache of 12.
    a, b, c = [[7, 2, 10, 5], [1, 11, 4, 8], [0, 3, 6, 9]]
    steps = [ForwardBatch.prefill(prompts, [a, b, c]),
             ForwardBatch.decode([7, 8, 6], [5, 9, 4], [a, b, c]),
             ForwardBatch.decode([9], [6], [a]),
             # the second sequence continues with a 3-token chunk while the first and third decode
             # (the decodes of a mixed step take the decode kernel together)
             ForwardBatch([11, 3, 4, 5, 2], [7, 10, 11, 12, 5], [1, 3, 1], [7, 10, 5], [0, 1, 2, 3, 4], [a, b, c])]
    logits = {}
    from glm_fused.torch_backend.ops import TorchOps

    fresh_min = TorchOps.SDPA_FRESH_MIN
    for on in (False, True):
        previous = kernels.set_enabled(on)
        TorchOps.SDPA_FRESH_MIN = sdpa_fresh_min or fresh_min
        try:
            caches = model.make_kv_caches(12, 4)
            outs = []
            with torch.inference_mode():
                for b in steps:
                    hidden = model(torch.as_tensor(b.input_ids, device=device),
                                   torch.as_tensor(b.positions, device=device), b, caches)
                    outs.append(model.compute_logits(hidden))
            logits[on] = outs
        finally:
            kernels.set_enabled(previous)
            TorchOps.SDPA_FRESH_MIN = fresh_min
    return {f"step{i}": rel(a, b) for i, (a, b) in enumerate(zip(logits[True], logits[False]))}


def _moe_tile(kind):
    from glm_fused.torch_backend.kernels.fused_moe import FMA, TileConfig

    return TileConfig(1 if kind == FMA else 16, 32, 32, 1, 4, 2, kind=kind)


def _gemv_tile(kind, block_m, block_n):
    from glm_fused.torch_backend.kernels.fp8 import GemvConfig

    return GemvConfig(kind, block_m, block_n, 32, 4, 2)


CHECKS["model"] = lambda d, t: check_model(d, t, sdpa_fresh_min=5)
CHECKS["model_qk_norm"] = lambda d, t: check_model(d, t, qk_norm=True)
CHECKS.update({
    "fp8_quant": check_fp8_quant, "linear_fp8": check_linear_fp8, "moe_fp8": check_moe_fp8,
    # a shared expert twice as wide: not folded, it runs through the fp8 Linear
    "moe_fp8_shared_apart": lambda d, t: check_moe_fp8(d, t, shared_width=96),
    "moe_fp8_partial": lambda d, t: check_moe_fp8(d, t, expert_range=(4, 12)),
    "moe_fp8_chunks": lambda d, t: check_moe_fp8(d, t, T=40, top_k=3, hidden=32, inter=32),
    # above fused_moe.WEIGHT_ONLY_MAX_TOKENS tokens x and h are quantized once, before each GEMM
    "moe_fp8_prequantized": lambda d, t: check_moe_fp8(d, t, T=70, top_k=3, hidden=32, inter=32),
    "moe_fp8_quant_in_kernel": lambda d, t: check_moe_fp8(d, t, mode=1),
    "moe_fp8_weight_only": lambda d, t: check_moe_fp8(d, t, mode=3),
    "moe_fp8_weight_only_swapped": lambda d, t: check_moe_fp8(d, t, mode=3, tile=_moe_tile(1)),
    "moe_fp8_weight_only_fma": lambda d, t: check_moe_fp8(d, t, T=1, mode=3, tile=_moe_tile(2)),
    # an FMA tile asked for in a quantizing mode runs as an MMA tile
    "moe_fp8_fma_tile_quantized": lambda d, t: check_moe_fp8(d, t, T=1, mode=1, tile=_moe_tile(2)),
    "linear_fp8_mma": lambda d, t: check_linear_fp8(d, t, cfg=_gemv_tile(0, 16, 32)),
    "linear_fp8_swap": lambda d, t: check_linear_fp8(d, t, cfg=_gemv_tile(1, 16, 32)),
    "linear_fp8_fma": lambda d, t: check_linear_fp8(d, t, M=1, cfg=_gemv_tile(2, 1, 16)),
    # above WEIGHT_ONLY_MAX_ROWS rows: activations quantized per token, then _scaled_mm
    "linear_fp8_quantized": lambda d, t: check_linear_fp8(d, t, M=11),
    "linear_fp8_whole_k_tiles": lambda d, t: check_linear_fp8(d, t, M=3, K=512, N=48),
    "model_fp8": check_model_fp8,
})


if __name__ == "__main__":
    # triton_checks.py [device] [dtype] [claim folder]: with a claim folder, several processes share
    # the checks, each running those it is first to claim (a file per check; the interpreter test
    # runs one process per core); the tiny-model checks, the longest, first
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    dt = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float32")
    claims = sys.argv[3] if len(sys.argv) > 3 else None
    if dev == "cpu":
        from glm_fused.torch_backend.kernels import interpreter_numpy2_fix

        interpreter_numpy2_fix()
        _interpreter_fp8_fix()
    for name in sorted(CHECKS, key=lambda n: not n.startswith("model")):
        if claims:
            try:
                os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL))
            except FileExistsError:  # another process has it
                continue
        print(json.dumps({"check": name, **CHECKS[name](dev, dt)}), flush=True)
