"""The fp8 Linear alone on one GPU at GLM-4.5-Air's shapes: cuBLAS's row-wise ``_scaled_mm``
(activations quantized per token first), the weight-only Triton kernel in each tile
configuration, and the bf16 matmul, side by side, against the HBM floor.

Decode multiplies a few rows by a whole weight matrix, so its time is the weight bytes over
the memory bandwidth; the floor here is (weight + scale + activation + output bytes) / the
copy bandwidth measured in the same run. Each variant runs COPIES different weight tensors in
turn (their bytes well beyond the 50 MB L2, as a model's layers are) inside one CUDA graph,
so the figure is a served decode step's, without launch gaps. Prints ms per call, the ratio to
the floor, the fastest weight-only configuration per shape and per row count, ready for
``GEMV_CONFIGS`` (keyed by rows and K) in ``glm_fused/torch_backend/kernels/fp8.py``, and what
that table picks now ("table"); and from how many rows
``_scaled_mm`` wins (``WEIGHT_ONLY_MAX_ROWS``).

``python scripts/bench_linear.py [--rows 1,4,8,16,32,64] [--json OUT]``
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from bench.common import AIR_CONFIG, copy_bandwidth, int_list, load_config, time_ms, torch_device, write_json
from bench.reference import rel_error

COPIES = 4
# (kind, block_m, block_n, block_k, warps, stages); kinds: kernels.fp8's DOT, SWAP, FMA
CANDIDATES = ([(0, 16, bn, bk, 4, st) for bn, bk, st in itertools.product((32, 64), (256, 512), (3, 4))]
              + [(1, 16, bn, bk, w, st) for bn, bk, w, st in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))]
              + [(2, 1, bn, bk, w, 3) for bn, bk, w in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8))])


def shapes(config) -> dict[str, tuple[int, int]]:
    """(N, K) of each fp8 Linear of a GLM-4.5 layer at TP 1."""
    H, D = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    return {"qkv": (q + 2 * kv, H), "o_proj": (H, q), "dense gate_up": (2 * config.intermediate_size, H),
            "dense down": (H, config.intermediate_size)}


def graphed_calls(fns, device, reps: int = 5):
    """One CUDA graph replaying ``fns`` in turn ``reps`` times; returns (replay, calls per replay)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    return graph.replay, reps * len(fns)


def run(args) -> dict:
    from glm_fused.torch_backend import OPS
    from glm_fused.torch_backend.kernels import fp8

    dev = torch_device("gpu")
    config = load_config(args.config)
    bw = copy_bandwidth(dev, 2048)
    g = torch.Generator(device=dev).manual_seed(0)
    out = {"copy_bandwidth_GBps": bw / 1e9, "cases": []}
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    for name, (N, K) in shapes(config).items():
        ws = [OPS.quantize_fp8(0.02 * torch.randn(N, K, generator=g, device=dev)) for _ in range(COPIES)]
        bf16 = [OPS.dequantize_fp8(w, "bfloat16") for w in ws]
        for M in args.rows:
            x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), OPS.dequantize_fp8(ws[0]))
            floor_ms = (N * K + 4 * N + 2 * M * (K + N)) / bw * 1e3
            rows = []

            def measure(variant, make, bytes_per_weight=1):
                row = {"variant": variant}
                try:
                    with torch.inference_mode():
                        row["max_rel"] = rel_error(make(0)(), ref)
                        replay, calls = graphed_calls([make(i) for i in range(COPIES)], dev)
                        row["ms"] = time_ms(replay, dev, 3, 20) / calls
                        row["x_floor"] = row["ms"] / (floor_ms * bytes_per_weight)
                except Exception as exc:  # a config that does not compile must not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                rows.append(row)
                return row

            measure("scaled_mm", lambda i: lambda: fp8.linear_fp8_scaled_mm(x, ws[i].codes, ws[i].scale))
            measure("bf16 matmul", lambda i: lambda: torch.nn.functional.linear(x, bf16[i]), bytes_per_weight=2)
            if M <= fp8.WEIGHT_ONLY_MAX_ROWS:  # what GEMV_CONFIGS picks for this shape
                measure("table", lambda i: lambda: fp8.linear_fp8_weight_only(x, ws[i].codes, ws[i].scale))
            for cand in CANDIDATES:
                if cand[0] == fp8.FMA and M > 1:  # one row per program: the weights read M times
                    continue
                cfg = fp8.GemvConfig(*cand)
                measure(f"weight-only {cand}",
                        lambda i, cfg=cfg: lambda: fp8.linear_fp8_weight_only(x, ws[i].codes, ws[i].scale, cfg=cfg))
            ok = [r for r in rows if "ms" in r and r["variant"].startswith("weight-only") and r["max_rel"] < 2e-2]
            best = min(ok, key=lambda r: r["ms"]) if ok else {}
            byname = {r["variant"]: r for r in rows}
            case = {"linear": name, "N": N, "K": K, "rows": M, "floor_ms": floor_ms, "variants": rows,
                    "best": best.get("variant")}
            out["cases"].append(case)
            nan = float("nan")
            sm, mm = byname["scaled_mm"], byname["bf16 matmul"]
            print(f"{name:14} M={M:3}  floor {floor_ms * 1e3:6.1f} us  scaled_mm {sm.get('ms', nan) * 1e3:6.1f} us "
                  f"({sm.get('x_floor', nan):.2f}x)  bf16 {mm.get('ms', nan) * 1e3:6.1f} us  weight-only best "
                  f"{best.get('ms', nan) * 1e3:6.1f} us ({best.get('x_floor', nan):.2f}x) {best.get('variant')}; "
                  f"table {byname.get('table', {}).get('x_floor', nan):.2f}x", flush=True)
    # the one configuration per row count that is best over the four shapes (sum of ratios)
    print("\nrows  best weight-only config over all shapes (mean x floor)  (scaled_mm's)")
    for M in args.rows:
        totals = {}
        for case in (c for c in out["cases"] if c["rows"] == M):
            for r in case["variants"]:
                if "ms" in r and r["variant"].startswith("weight-only"):
                    totals.setdefault(r["variant"], []).append(r["x_floor"])
        full = {v: sum(t) / len(t) for v, t in totals.items() if len(t) == len(shapes(config))}
        sm = [r["x_floor"] for c in out["cases"] if c["rows"] == M for r in c["variants"]
              if r["variant"] == "scaled_mm" and "x_floor" in r]
        if full:
            v = min(full, key=full.get)
            out.setdefault("best_per_rows", {})[M] = {"variant": v, "mean_x_floor": full[v],
                                                      "scaled_mm_mean_x_floor": sum(sm) / len(sm) if sm else None}
            print(f"{M:4}  {v}  {full[v]:.2f}   (scaled_mm {sum(sm) / max(1, len(sm)):.2f})")
    if args.json:
        write_json(args.json, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_linear.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=AIR_CONFIG)
    p.add_argument("--rows", type=int_list, default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
