"""Decode attention alone on one GPU: the paged kernel (per block size) against the contiguous
one-slot-per-sequence kernel the engine used before paging, at GLM-4.5-Air's attention sizes.

For each batch x context: the same keys and values laid out both ways (the paged copy's
blocks shuffled over the cache, as a busy server leaves them), both kernels checked against
each other, then timed as served: replayed from a CUDA graph, each replay running the kernel
over enough separate caches ("layers") that they do not fit in L2 together, as in a real step
where 46 layers' weights pass between two reads of one layer's cache. Prints microseconds per
call and the paged / contiguous ratio (the target: at most 1.1x).

``--prompt-lens``: also one fresh prompt of each length, per layer, through the batched prompt
kernel (``kernels/prefill_attention.py``) and through the per-sequence path it replaces for
short prompts (gather the blocks, then torch's SDPA), timed eagerly as prompt steps run.

``--chunks``: also prompt chunks as the CUDA graphs replay them, a row per token over the
chunk's sequence (``CONTEXT:ROWS``: ROWS new tokens after CONTEXT cached ones; ``:N:C`` adds N
decodes of C keys beside it), through the decode kernel one program per row and with the
chunk's rows grouped (``lead``), timed as served; prints grouped / per row.

    python scripts/bench_attention.py                       # GPU: batch 1/8/32/64 x context 512..4096
    python scripts/bench_attention.py --prompt-lens 128,512,1024,2048,4096
    python scripts/bench_attention.py --batches 1 --contexts 512 --chunks 2048:32,512:32,0:32,1024:32:32:1024
    python scripts/bench_attention.py --device cpu --dry-run   # Triton's CPU interpreter, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from glm_fused.errors import UserError

L2_FLUSH_BYTES = 256 * 2**20  # the caches one replay walks through (H100/H200 L2: 50-60 MB)
MAX_LAYERS = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/bench_attention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: Triton's CPU interpreter (checks the script and kernels; times mean nothing)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, one timed call (with --device cpu)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--contexts", default="512,1024,2048,4096")
    p.add_argument("--block-sizes", default="16,32,64,128")
    p.add_argument("--heads", type=int, default=96, help="query heads (GLM-4.5-Air: 96)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GLM-4.5-Air: 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=50, help="timed replays per case")
    p.add_argument("--prompt-lens", default=None,
                   help="also time one fresh prompt of each length: batched kernel vs gather + SDPA (block 16)")
    p.add_argument("--chunks", default=None,
                   help="also prompt chunks replayed as rows, CONTEXT:ROWS[:DECODES:DECODE_CONTEXT],...: "
                        "per-row vs grouped decode kernel (block 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: positive integers")
    return values


def case(torch, kernels, B: int, C: int, pages: list[int], args, device, dtype) -> dict:
    """One batch x context: contiguous and every paged layout, checked, then timed."""
    g = torch.Generator(device="cpu").manual_seed(args.seed + B * 7919 + C)
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    per_layer = 2 * B * C * KV * D * (2 if dtype == torch.bfloat16 else 4)
    layers = 1 if args.dry_run else max(1, min(MAX_LAYERS, -(-L2_FLUSH_BYTES // per_layer)))
    q = torch.randn(B, H, D, generator=g).to(device, dtype)
    seq_lens = torch.full((B,), C, dtype=torch.int64, device=device)
    slots = torch.arange(B, device=device)
    # Contiguous: [B, C, kv, D] per layer (sequence s in slot s).
    kc = [torch.randn(B, C, KV, D, generator=g).to(device, dtype) for _ in range(layers)]
    vc = [torch.randn(B, C, KV, D, generator=g).to(device, dtype) for _ in range(layers)]
    scale = D ** -0.5
    row = {"batch": B, "context": C, "layers_per_replay": layers}
    ref = kernels.contiguous_decode_attention(q, kc[0], vc[0], slots, seq_lens, scale)
    row["contiguous_us"] = timed(torch, lambda: [kernels.contiguous_decode_attention(q, k, v, slots, seq_lens, scale)
                                                 for k, v in zip(kc, vc)], device, args) / layers
    for page in pages:
        width = -(-C // page)
        num_blocks = B * width
        perm = torch.randperm(num_blocks, generator=g).to(device)
        tables = perm.view(B, width).to(torch.int32)  # sequence s's i-th block is perm[s * width + i]
        pk, pv = [], []
        for k, v in zip(kc, vc):
            padded = [torch.zeros(B, width * page, KV, D, dtype=dtype, device=device) for _ in range(2)]
            padded[0][:, :C], padded[1][:, :C] = k, v
            paged = [torch.empty(num_blocks, page, KV, D, dtype=dtype, device=device) for _ in range(2)]
            paged[0][perm] = padded[0].view(num_blocks, page, KV, D)
            paged[1][perm] = padded[1].view(num_blocks, page, KV, D)
            pk.append(paged[0])
            pv.append(paged[1])
            del padded
        out = kernels.decode_attention(q, pk[0], pv[0], tables, seq_lens, scale)
        row[f"page{page}_max_rel_diff"] = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        row[f"page{page}_us"] = timed(torch, lambda: [kernels.decode_attention(q, k, v, tables, seq_lens, scale)
                                                      for k, v in zip(pk, pv)], device, args) / layers
        row[f"page{page}_ratio"] = row[f"page{page}_us"] / row["contiguous_us"]
        del pk, pv
    return row


def timed(torch, fn, device, args) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (on CPU: one plain call)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from bench.common import graphed

    replay = graphed(fn, device)
    for _ in range(3):
        replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / args.iters * 1e3


def prompt_case(torch, n: int, args, device, dtype, page: int = 16) -> dict:
    """One fresh prompt of n tokens: the batched kernel and gather + SDPA on the same cache."""
    import torch.nn.functional as TF

    from glm_fused.torch_backend.kernels.prefill_attention import prefill_attention

    g = torch.Generator(device="cpu").manual_seed(args.seed + n)
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    nb = -(-n // page)
    kc = torch.randn(nb + 8, page, KV, D, generator=g).to(device, dtype)
    vc = torch.randn(nb + 8, page, KV, D, generator=g).to(device, dtype)
    blocks = torch.randperm(nb + 8, generator=g)[:nb].to(device)
    q = torch.randn(n, H, D, generator=g).to(device, dtype)
    chunks = torch.tensor([[0], [n], [0], [0]], device=device)
    out = torch.empty_like(q)
    scale = D ** -0.5

    def kernel():
        return prefill_attention(q, kc, vc, chunks, blocks, n, scale, out)

    def sdpa():  # the per-sequence path (TorchOps.attend_seq)
        k, v = (c[blocks].reshape(-1, KV, D)[:n].transpose(0, 1)[None] for c in (kc, vc))
        return TF.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale,
                                               enable_gqa=H != KV)[0].transpose(0, 1)

    from bench.common import time_ms

    a, b = kernel().float(), sdpa().float()
    cuda = device.type == "cuda"  # launched eagerly, as prompt steps run; on CPU one call

    def us(fn):
        return time_ms(fn, device, 2 if cuda else 0, args.iters if cuda else 1) * 1e3

    return {"prompt_len": n, "kernel_us": us(kernel), "sdpa_us": us(sdpa),
            "max_rel_diff": float((a - b).abs().max() / b.abs().max())}


def _chunk_specs(text: str) -> list[tuple[int, int, int, int]]:
    specs = []
    for item in text.split(","):
        try:
            parts = [int(x) for x in item.split(":")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 4) or min(parts) < 0 or parts[1] < 1 or (len(parts) == 4 and parts[3] < 1):
            raise UserError(f"--chunks {item!r}: CONTEXT:ROWS or CONTEXT:ROWS:DECODES:DECODE_CONTEXT "
                            f"(ROWS and DECODE_CONTEXT at least 1)")
        specs.append(tuple(parts) if len(parts) == 4 else (*parts, 0, 1))
    return specs


def chunk_case(torch, kernels, spec, args, device, dtype, page: int = 16) -> dict:
    """A chunk of ROWS tokens after CONTEXT cached ones (and DECODES decodes beside it), a row
    per token: one program per row, then the chunk's rows grouped; over enough layers' caches
    that a replay does not run from L2."""
    import numpy as np

    context, n, decodes, decode_context = spec
    g = torch.Generator(device="cpu").manual_seed(args.seed + context + n)
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    seq = np.r_[np.arange(decodes), np.full(n, decodes)]  # the decodes' sequences, then the chunk's
    lens = np.r_[np.full(decodes, decode_context), np.arange(context + 1, context + n + 1)]
    width = -(-int(lens.max()) // page)
    num_blocks = (decodes + 1) * width
    per_layer = 2 * num_blocks * page * KV * D * (2 if dtype == torch.bfloat16 else 4)
    layers = 1 if args.dry_run else max(1, min(MAX_LAYERS, -(-L2_FLUSH_BYTES // per_layer)))
    caches = [[torch.randn(num_blocks, page, KV, D, generator=g).to(device, dtype) for _ in range(2)]
              for _ in range(layers)]
    perm = torch.randperm(num_blocks, generator=g).view(decodes + 1, width).to(torch.int32)
    tables = perm[torch.as_tensor(seq)].to(device)
    q = torch.randn(len(seq), H, D, generator=g).to(device, dtype)
    seq_lens = torch.as_tensor(lens, device=device)
    lead = torch.as_tensor(kernels.row_groups(seq), device=device)
    scale = D ** -0.5
    a = kernels.decode_attention(q, *caches[0], tables, seq_lens, scale).float()
    b = kernels.decode_attention(q, *caches[0], tables, seq_lens, scale, lead=lead).float()
    row = {"context": context, "rows": n, "decodes": decodes, "decode_context": decode_context,
           "max_rel_diff": float((a - b).abs().max() / a.abs().max())}
    row["per_row_us"] = timed(torch, lambda: [kernels.decode_attention(q, k, v, tables, seq_lens, scale)
                                              for k, v in caches], device, args) / layers
    row["grouped_us"] = timed(torch, lambda: [kernels.decode_attention(q, k, v, tables, seq_lens, scale, lead=lead)
                                              for k, v in caches], device, args) / layers
    return row


def format_table(rows: list[dict], pages: list[int]) -> str:
    head = f"{'batch':>5} {'context':>7} {'contiguous us':>14}" + "".join(
        f"{f'paged {p} us':>14}{'ratio':>7}" for p in pages)
    lines = [head]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['context']:>7} {r['contiguous_us']:>14.1f}" + "".join(
            f"{r[f'page{p}_us']:>14.1f}{r[f'page{p}_ratio']:>7.3f}" for p in pages))
    for p in pages:
        ratios = [r[f"page{p}_ratio"] for r in rows]
        lines.append(f"block size {p}: paged / contiguous worst {max(ratios):.3f}x, mean "
                     f"{sum(ratios) / len(ratios):.3f}x, largest output difference "
                     f"{max(r[f'page{p}_max_rel_diff'] for r in rows):.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batches, contexts = _ints(args.batches, "--batches"), _ints(args.contexts, "--contexts")
        pages = _ints(args.block_sizes, "--block-sizes")
        prompt_lens = _ints(args.prompt_lens, "--prompt-lens") if args.prompt_lens else []
        chunks = _chunk_specs(args.chunks) if args.chunks else []
        if any(p & (p - 1) for p in pages):
            raise UserError(f"--block-sizes {args.block_sizes}: powers of two")
        if args.dry_run:
            if args.device != "cpu":
                raise UserError("--dry-run: the tiny sizes are for --device cpu")
            batches, contexts, pages, prompt_lens, chunks = [2], [100], [16, 64], [40], [(70, 9, 0, 1), (40, 5, 2, 30)]
            args.heads, args.kv_heads, args.head_dim, args.dtype = 8, 2, 32, "float32"
        if args.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        import torch

        if args.device == "gpu" and not torch.cuda.is_available():
            raise UserError("--device gpu: no CUDA GPU visible (use --device cpu --dry-run to check the script)")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    from glm_fused.torch_backend import kernels as switch
    from glm_fused.torch_backend.kernels import decode_attention as kernels

    if args.device == "cpu":
        switch.interpreter_numpy2_fix()
    device = torch.device("cuda", 0) if args.device == "gpu" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    rows = []
    for B in batches:
        for C in contexts:
            rows.append(case(torch, kernels, B, C, pages, args, device, dtype))
            print(f"batch {B} context {C}: contiguous {rows[-1]['contiguous_us']:.1f} us, " + ", ".join(
                f"paged {p} {rows[-1][f'page{p}_ratio']:.3f}x" for p in pages), file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(format_table(rows, pages))
    prompts = [prompt_case(torch, n, args, device, dtype) for n in prompt_lens]
    for r in prompts:
        print(f"fresh prompt {r['prompt_len']:>6} tokens: batched kernel {r['kernel_us']:9.1f} us, gather + SDPA "
              f"{r['sdpa_us']:9.1f} us, kernel / SDPA {r['kernel_us'] / r['sdpa_us']:.2f}x, "
              f"largest output difference {r['max_rel_diff']:.1e}")
    chunk_rows = [chunk_case(torch, kernels, spec, args, device, dtype) for spec in chunks]
    for r in chunk_rows:
        beside = f" beside {r['decodes']} decodes of {r['decode_context']}" if r["decodes"] else ""
        print(f"chunk of {r['rows']:>4} after {r['context']:>6}{beside}: per row {r['per_row_us']:8.1f} us, grouped "
              f"{r['grouped_us']:8.1f} us, grouped / per row {r['grouped_us'] / r['per_row_us']:.3f}x, "
              f"largest output difference {r['max_rel_diff']:.1e}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}; {args.heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, {args.dtype}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "args": vars(args), "rows": rows, "prompts": prompts, "chunks": chunk_rows},
                      f, indent=2)
    return 0
