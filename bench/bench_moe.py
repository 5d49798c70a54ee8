"""The MoE block alone on one GPU: the Triton fused MoE's tile configurations, torch's
grouped GEMM and the per-expert loop, at GLM-4.5-Air sizes, side by side.

For each token count: the router's ids for random tokens (so the experts hit are what a real
batch hits), then every variant on the same inputs, each checked against the expert loop and
timed (decode sizes replayed from a CUDA graph, as served). Prints ms, the ratio to the memory
floor (the hit experts' bytes / copy bandwidth) or the matrix floor, and the fastest tile
configuration per size, ready for ``GATE_UP_CONFIGS`` / ``DOWN_CONFIGS`` in
``glm_fused/torch_backend/kernels/fused_moe.py``.

``--fp8``: the experts' weights quantized per row (e4m3), the fp8 kernels (at decode sizes
both the weight-only and the quantize-in-kernel mode; swapped tiles, and at one token FMA
tiles, weight-only), the floor at 1 byte per weight, each variant checked against the expert
loop on the dequantized weights within 5e-2 (activation quantization; the fp8 rule), the best
mode and tile per size ready for ``FP8_DECODE_MODES`` / ``_FP8_DECODE_TILES`` (no grouped GEMM
row).

``python scripts/bench_moe.py [--tokens 1,8,32,64,256,512,1024,2048] [--fp8] [--json OUT]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.common import (AIR_CONFIG, copy_bandwidth, graphed, int_list, load_config, matmul_rate, time_ms,
                          torch_device, write_json)
from bench.reference import rel_error

# (block_m, block_n, block_k, group_m, warps, stages). Small sizes: one config for both GEMMs.
# Large sizes: the gate_up GEMM's candidates with the down GEMM fixed at the first of its
# list, then the down GEMM's candidates with the best gate_up. The 32- and 64-row tiles are the
# candidates for prompt chunks of a few hundred tokens (a few dozen rows per expert); on an H100
# none beat the 128-row tiles there (docs/speed.md).
SMALL = [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
         (16, 64, 128, 1, 8, 4), (32, 64, 128, 1, 4, 4)]
# fp8 tiles read half the bytes: wider K steps and narrower N (more programs at batch 1).
# A seventh field: TileConfig.kind (1 swapped: the weight tile as the MMA's A operand; 2 FMA: no
# tensor cores, one pair per program, for one token).
SMALL_FP8 = [(16, 32, 256, 1, 4, 4), (16, 64, 256, 1, 4, 4), (16, 128, 256, 1, 4, 3),
             (16, 64, 128, 1, 4, 4, 1), (16, 128, 128, 1, 4, 3, 1), (16, 64, 256, 1, 4, 3, 1),
             (16, 128, 64, 1, 4, 4, 1), (16, 64, 128, 1, 8, 4, 1), (16, 128, 128, 1, 8, 4, 1),
             (16, 64, 64, 1, 4, 4, 1)]
FMA_FP8 = [(1, bn, bk, 1, w, 3, 2) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)]
LARGE_GATE_UP = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4),
                 (128, 64, 128, 8, 8, 3), (64, 128, 64, 8, 4, 4), (128, 128, 64, 4, 8, 3), (128, 128, 64, 16, 8, 3),
                 (256, 64, 64, 8, 8, 3), (64, 128, 64, 8, 8, 4), (64, 128, 128, 8, 8, 3), (64, 256, 64, 8, 8, 3),
                 (64, 64, 128, 8, 4, 4), (32, 64, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4), (32, 128, 128, 8, 4, 3),
                 (64, 128, 64, 8, 4, 3)]
LARGE_DOWN = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
              (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (128, 128, 64, 4, 8, 4),
              (256, 128, 64, 8, 8, 3), (64, 128, 64, 8, 8, 4), (64, 128, 128, 8, 8, 3), (64, 64, 128, 8, 4, 4),
              (32, 64, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4), (32, 128, 128, 8, 4, 3), (32, 256, 64, 8, 8, 3)]


def grouped_mm_moe(x, w_gate_up, w_down, weights, ids):
    """torch's grouped GEMM: pairs sorted by expert (argsort), offsets per expert, no host sync."""
    import torch.nn.functional as F

    T, k = ids.shape
    E = w_gate_up.shape[0]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    offs = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, w_gate_up.transpose(-2, -1), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y.float())
    return out.to(x.dtype)


def run(args) -> dict:
    from glm_fused.torch_backend import LAYERS, OPS
    from glm_fused.torch_backend.kernels import fused_moe as fm

    dev = torch_device("gpu")
    dtype = torch.bfloat16
    c = load_config(args.config)
    E, H, I, k = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    bw, rate = copy_bandwidth(dev, 2048), matmul_rate(dev, 8192, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    experts = LAYERS.Experts((0, E), H, I, dtype="bfloat16").to(dev)
    experts.gate_up_proj.data.normal_(0, 0.02, generator=g)
    experts.down_proj.data.normal_(0, 0.02, generator=g)
    w_gate_up, w_down, scales, tol, w_bytes = experts.gate_up_proj, experts.down_proj, None, 2e-2, 2
    if args.fp8:  # the same weights quantized per row; the loop reference gets them dequantized
        q_gate_up, q_down = (OPS.quantize_fp8(w) for w in (w_gate_up, w_down))
        w_gate_up, w_down, scales, tol, w_bytes = q_gate_up.codes, q_down.codes, (q_gate_up.scale, q_down.scale), 5e-2, 1
        experts.gate_up_proj.data.copy_(OPS.dequantize_fp8(q_gate_up, "bfloat16"))
        experts.down_proj.data.copy_(OPS.dequantize_fp8(q_down, "bfloat16"))
    router = torch.randn(E, H, generator=g, device=dev) * (2.4 / H ** 0.5)
    bias = 0.2 * torch.rand(E, generator=g, device=dev)
    out = {"copy_bandwidth_GBps": bw / 1e9, "matrix_TFLOPs": rate / 1e12, "sizes": []}
    print(f"copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s; E={E} H={H} I={I} top-{k}"
          f"{' fp8 weights' if args.fp8 else ''}", flush=True)
    for T in args.tokens:
        x = torch.randn(T, H, generator=g, device=dev).to(dtype)
        weights, ids = fm.router_topk(x.float() @ router.T, bias, k, True, 1.0)
        hit = int(torch.unique(ids).numel())
        floor_ms = max(hit * 3 * I * H * w_bytes / bw, 2 * T * k * 3 * I * H / rate) * 1e3
        with torch.inference_mode():
            ref = OPS.routed_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids.long(), (0, E))
        small = T <= 256
        rows = []

        def measure(name, fn):
            row = {"variant": name}
            try:
                with torch.inference_mode():
                    if small and name != "loop":
                        fn = graphed(fn, dev)
                    y = fn()
                    row["max_rel"] = rel_error(y, ref.float())
                    row["ms"] = time_ms(fn, dev, 5, 20 if small else 10)
                    row["x_floor"] = row["ms"] / floor_ms
            except Exception as exc:  # a config that does not compile must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            rows.append(row)
            print(f"  T={T:5} {name:60} " + (f"{row['ms']:.4f} ms  {row['x_floor']:.2f}x floor  rel {row['max_rel']:.1e}"
                                               if "ms" in row else row["error"]), flush=True)
            return row

        def triton_fn(gu, dn, mode=None):
            return lambda: fm.fused_experts(x, w_gate_up, w_down, weights, ids, scales=scales, mode=mode,
                                            gate_up_cfg=fm.TileConfig(*gu), down_cfg=fm.TileConfig(*dn))

        measure("loop", lambda: OPS.routed_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids.long(), (0, E)))
        if not args.fp8:
            measure("grouped_mm", lambda: grouped_mm_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids))
        if small and args.fp8:  # both decode modes (fused_moe's docstring) in every tile; swapped and
            # FMA tiles take unquantized rows: weight-only
            for cand in SMALL + SMALL_FP8 + (FMA_FP8 if T == 1 else []):
                modes = [(fm.WEIGHT_ONLY, "weight-only")] + [(fm.QUANT_IN_KERNEL, "quant-in-kernel")] * (len(cand) == 6)
                for mode, tag in modes:
                    measure(f"triton {tag} gate_up={cand} down={cand}", triton_fn(cand, cand, mode))
        elif small:
            for cand in SMALL:
                measure(f"triton gate_up={cand} down={cand}", triton_fn(cand, cand))
        else:
            phase1 = {cand: measure(f"triton gate_up={cand} down={LARGE_DOWN[0]}", triton_fn(cand, LARGE_DOWN[0]))
                      for cand in LARGE_GATE_UP}
            good = {c: r["ms"] for c, r in phase1.items() if "ms" in r}
            best_gu = min(good, key=good.get) if good else LARGE_GATE_UP[0]
            for cand in LARGE_DOWN[1:]:
                measure(f"triton gate_up={best_gu} down={cand}", triton_fn(best_gu, cand))
        ok = [r for r in rows if "ms" in r and r["variant"].startswith("triton") and r["max_rel"] < tol]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        out["sizes"].append({"tokens": T, "experts_hit": hit, "floor_ms": floor_ms, "rows": rows,
                             "best": best and best["variant"]})
    print("\ntokens  hit  floor ms  loop ms  grouped_mm ms  best triton ms (x floor)  best config")
    for s in out["sizes"]:
        r = {x["variant"]: x for x in s["rows"]}
        b = r.get(s["best"], {})
        print(f"{s['tokens']:6}  {s['experts_hit']:3}  {s['floor_ms']:8.4f}  {r['loop'].get('ms', float('nan')):7.3f}  "
              f"{r.get('grouped_mm', {}).get('ms', float('nan')):13.4f}  {b.get('ms', float('nan')):9.4f} "
              f"({b.get('x_floor', float('nan')):.2f})           {s['best']}")
    if args.json:
        write_json(args.json, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=AIR_CONFIG)
    p.add_argument("--tokens", type=int_list, default=[1, 8, 32, 64, 256, 512, 1024, 2048])
    p.add_argument("--fp8", action="store_true", help="fp8 weights (e4m3, one scale per row) and the fp8 kernels")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
