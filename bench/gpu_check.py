"""GPU proof: the FlashInfer kernels this project uses against fp32 references, and the torch
model at GLM-4.5-Air's real sizes against transformers, fused with the real kernel, and timed.

Sections (``--only a,b``; default: all, in this order):

  build      build or load FlashInfer's JIT modules (trtllm_comm, norm) and time it
  norm       flashinfer.norm.fused_add_rmsnorm and rmsnorm vs fp32 (the TP=1 fused path)
  allreduce  the fused all-reduce + residual-add + RMSNorm at TP 2/4/8, run as TP processes
             sharing GPU 0 (gloo group for the workspace exchange), every token-count
             boundary, one-shot and two-shot, outputs poisoned with NaN before each call;
             plus calls past the workspace / size cap, which must take the reference path
  policy     glm_fused.fused_op.policy.choose_impl's decisions on this device's real KernelEnv
  bench      per-layer prefill / decode timing at real sizes, the project's layer and
             transformers', each as a ratio to the HBM / matrix-rate floor (bench_layers.py)
  model      a random GLM-4.5-Air of --layers layers at real sizes, written by transformers
             (bf16 safetensors), loaded by the torch backend at TP 1; logits of prefill and
             KV-cache decode vs transformers in bf16 and fp32 on the same GPU
  tp4        that checkpoint at TP 4 as four processes on GPU 0, FlashInfer-fused vs unfused,
             through scripts/logit_diff.py; every fused call must be served by the kernel

Prints one table per section and a summary table last; ``--out DIR`` writes (merges into)
DIR/gpu_check.json. Exit status 1 when a section fails. Sections are plain functions in
SECTIONS, so model-level checks slot in beside these.

Pass criterion for kernel outputs: max |out - ref| / max |ref| <= 1e-2 (bf16 keeps 8 bits of
mantissa; the kernel rounds the all-reduced sum and the residual to bf16 before the norm)
and every output element written (no NaN left from the poison).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import (AIR_CONFIG, CUDA_NORM_ENV, NO_MULTICAST_ENV, REPO, TINY_CONFIG, BenchRank, environment,
                          int_list, launch_ranks, load_config, name_list, read_json, text_table, token_counts,
                          token_list, write_json)
from glm_fused.errors import UserError
from bench.reference import StandInKernel, add_rms_norm_ref, allreduce_add_rms_norm_ref, digest, rel_error

# Set (unless the user set them) before anything imports flashinfer.norm; ranks inherit them.
_ENV_DEFAULTS = {**CUDA_NORM_ENV, **NO_MULTICAST_ENV}

REL_TOL = 1e-2
HIDDEN = 4096
EPS = 1e-5  # GLM-4.5's rms_norm_eps
DEFAULT_TPS = (2, 4, 8)
BOUNDARY_TOKENS = (1, "tp-1", "tp", "tp+1", 16, 64, 127, 128, 129, 255, 256, 257, 512, 1024, 2047, 2048)
# Fusion size caps in tokens at H=4096 bf16 per GPU arch and TP size, written out here
# independently of fusion.py's byte table so the policy section can state what it expects:
# sm90 (Hopper) and sm100/sm103 (Blackwell) are vLLM's caps, sm120 takes Hopper's. A TP size
# missing from an arch's row is never fused there.
_CAP_TOKENS_H4096 = {
    90: {2: 8192, 4: 256, 8: 64},
    100: {2: 8192, 4: 4096, 8: 128, 16: 8192},
    103: {2: 8192, 4: 8192, 8: 512, 16: 8192},
    120: {2: 8192, 4: 256, 8: 64},
}


def _setdefault_env() -> None:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def _need_kernels() -> str | None:
    """None when CUDA and flashinfer.comm are here; else why the kernel sections skip."""
    try:
        from glm_fused.fused_op import flashinfer as flashinfer_adapter
    except ImportError as exc:  # no torch
        return f"torch not importable ({exc})"
    return flashinfer_adapter.probe()


# ---------------------------------------------------------------------------- build
def run_build(args) -> dict:
    """Load (or JIT-build) the two FlashInfer modules in parallel, and time each."""
    reason = _need_kernels()
    if reason:
        return {"status": "skip", "summary": reason}
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.comm.trtllm_ar import gen_trtllm_comm_module, get_trtllm_comm_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.norm import get_norm_module

    def source(spec) -> str:
        if spec.is_aot:
            return "prebuilt"
        return "JIT cache" if spec.jit_library_path.exists() else "built now"

    jobs = {"trtllm_comm": (gen_trtllm_comm_module, get_trtllm_comm_module),
            "norm": (gen_norm_module, get_norm_module)}

    def load(name):
        gen, get = jobs[name]
        src = source(gen())
        t0 = time.perf_counter()
        get()
        return name, {"seconds": round(time.perf_counter() - t0, 1), "source": src,
                      "path": str(gen().get_library_path())}

    modules, errors = {}, {}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(load, name) for name in jobs]
        for name, fut in zip(jobs, futures):
            try:
                modules[name] = fut.result()[1]
            except Exception as exc:
                errors[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
    rows = [[name, m["source"], f"{m['seconds']:.1f} s"] for name, m in modules.items()]
    rows += [[name, "FAILED", err.splitlines()[-1][:80]] for name, err in errors.items()]
    _table(["module", "from", "load time"], rows)
    summary = ", ".join(f"{n} {m['seconds']:.0f} s ({m['source']})" for n, m in modules.items())
    return {"status": "fail" if errors else "ok", "summary": summary or "nothing loaded",
            "modules": modules, "errors": errors}


# ---------------------------------------------------------------------------- norm
NORM_CASES = (
    ("fused_add_rmsnorm", (1, HIDDEN), "bfloat16"),
    ("fused_add_rmsnorm", (7, HIDDEN), "bfloat16"),
    ("fused_add_rmsnorm", (128, HIDDEN), "bfloat16"),
    ("fused_add_rmsnorm", (2048, HIDDEN), "bfloat16"),
    ("fused_add_rmsnorm", (129, HIDDEN), "float16"),
    ("rmsnorm", (1, HIDDEN), "bfloat16"),
    ("rmsnorm", (129, HIDDEN), "bfloat16"),
    ("rmsnorm", (2048, HIDDEN), "bfloat16"),
    ("rmsnorm", (33, 24, 128), "bfloat16"),  # per-head q/k norm shape (GLM-4.5 qk-norm)
)


def run_norm(args) -> dict:
    reason = _need_kernels()
    if reason:
        return {"status": "skip", "summary": reason}
    import torch
    import flashinfer.norm as fnorm

    rows, results = [], []
    for i, (op, shape, dtype_name) in enumerate(NORM_CASES):
        dtype = getattr(torch, dtype_name)
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        x = torch.randn(shape, generator=g, device="cuda").to(dtype)
        w = (1 + 0.25 * torch.randn(shape[-1], generator=g, device="cuda")).to(dtype)
        rec = {"op": op, "shape": list(shape), "dtype": dtype_name}
        try:
            if op == "fused_add_rmsnorm":
                r = torch.randn(shape, generator=g, device="cuda").to(dtype)
                ref, ref_res = add_rms_norm_ref(x, r, w, EPS)
                xi, ri = x.clone(), r.clone()
                fnorm.fused_add_rmsnorm(input=xi, residual=ri, weight=w, eps=EPS)  # in place
                torch.cuda.synchronize()
                rec.update(normed_rel=rel_error(xi, ref), residual_rel=rel_error(ri, ref_res),
                           nan=bool(torch.isnan(xi).any() or torch.isnan(ri).any()))
            else:
                ref, _ = add_rms_norm_ref(x, None, w, EPS)
                out = torch.full_like(x, float("nan"))
                fnorm.rmsnorm(input=x, weight=w, eps=EPS, out=out)
                torch.cuda.synchronize()
                rec.update(normed_rel=rel_error(out, ref), residual_rel=None, nan=bool(torch.isnan(out).any()))
            worst = max(v for v in (rec["normed_rel"], rec["residual_rel"]) if v is not None)
            rec["pass"] = (not rec["nan"]) and worst <= REL_TOL
        except Exception as exc:
            rec["error"], rec["pass"] = _short_exc(exc), False
        results.append(rec)
        rows.append([op, "x".join(map(str, shape)), dtype_name, _fmt(rec.get("normed_rel")),
                     _fmt(rec.get("residual_rel")), "yes" if rec.get("nan") else "no",
                     "PASS" if rec["pass"] else "FAIL " + rec.get("error", "")[:60]])
    _table(["op", "shape", "dtype", "normed rel", "residual rel", "NaN", "result"], rows)
    ok = all(r["pass"] for r in results)
    worst = max(max(r.get("normed_rel") or 0, r.get("residual_rel") or 0) for r in results)
    return {"status": "pass" if ok else "fail", "cases": results,
            "summary": f"{len(results)} cases, max rel {worst:.1e} "
                       f"(FLASHINFER_USE_CUDA_NORM={os.environ.get('FLASHINFER_USE_CUDA_NORM')})"}


# ---------------------------------------------------------------------------- allreduce
def allreduce_worker(cfg: dict) -> None:
    """One TP rank of ``run_allreduce_tp``: saves its rows, or the error that stopped it."""
    ctx = BenchRank(cfg)
    try:
        ctx.save(result=_allreduce_checks(ctx, cfg))
    except Exception:
        ctx.save(error=traceback.format_exc(limit=8)[-3000:])
        raise


def _allreduce_checks(ctx: BenchRank, cfg: dict) -> dict:
    """Make the workspace, run every check in the same order as the peers."""
    import torch

    from glm_fused.fused_op import CommBackend, FallbackLog, FusionStats
    from glm_fused.fused_op import policy as fusion
    from glm_fused.fused_op import flashinfer as fa

    out = {"rows": [], "dispatch": []}
    dry, tp, rank, dev = cfg["dry_run"], ctx.world, ctx.rank, ctx.device
    hidden, max_tokens = cfg["hidden"], cfg["max_tokens"]
    t0 = time.perf_counter()
    if dry:
        kernel = StandInKernel(tp_rank=rank, tp_size=tp, max_num_tokens=max_tokens, hidden_size=hidden)
    else:  # the exchange through the TP group's comm backend, as the runner makes it
        kernel = fa.FlashInferAllReduceFusion(tp_rank=rank, tp_size=tp, max_num_tokens=max_tokens,
                                              hidden_size=hidden, dtype=torch.bfloat16, device=dev,
                                              group=CommBackend(ctx.comm), shared_gpu=ctx.shares_gpu)
    out["workspace_seconds"] = round(time.perf_counter() - t0, 2)
    out["workspace_mib"] = round(kernel.workspace_bytes / 2**20)
    sm = kernel.sm

    def inputs(seed: int, n: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        parts = torch.randn(tp, n, hidden, generator=g, device=dev).to(torch.bfloat16)
        residual = torch.randn(n, hidden, generator=g, device=dev).to(torch.bfloat16)
        weight = (1 + 0.25 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
        return parts, residual, weight

    check = 0
    for n in cfg["tokens"]:
        modes = ["oneshot"] + (["twoshot"] if n > tp else []) + ["auto-inplace"]
        for mode in modes:
            check += 1
            parts, residual, weight = inputs(seed=tp * 1_000_003 + check, n=n)  # fresh per check
            partial = parts[rank].contiguous()
            norm_out = torch.full_like(partial, float("nan"))
            if mode == "auto-inplace":
                res_buf = residual.clone()
                got_norm, got_res = kernel(partial, res_buf, weight, EPS, norm_out=norm_out,
                                           residual_out=res_buf)
                chosen = fusion.use_oneshot(tp, n, hidden, 2, sm=sm)
            else:
                res_out = torch.full_like(partial, float("nan"))
                chosen = mode == "oneshot"
                got_norm, got_res = kernel(partial, residual, weight, EPS, norm_out=norm_out,
                                           residual_out=res_out, use_oneshot=chosen)
            ctx.sync()
            ref_norm, ref_res = add_rms_norm_ref(parts.float().sum(0), residual, weight, EPS)
            out["rows"].append({
                "tokens": n, "mode": mode, "oneshot": chosen,
                "normed_rel": rel_error(got_norm, ref_norm), "residual_rel": rel_error(got_res, ref_res),
                "nan": bool(torch.isnan(got_norm).any() or torch.isnan(got_res).any()),
                "digest": [digest(got_norm), digest(got_res)],
            })
            del parts

    # Calls past the workspace or the size cap must take the reference path (choose_impl).
    if dry:  # pretend Hopper so the caps bite as they would there
        env = fusion.KernelEnv(device="cuda", sm=90, tp_size=tp, hidden_size=hidden,
                               flashinfer_error=None, workspace_max_tokens=max_tokens)
    else:
        env = fa.kernel_env(tp_size=tp, hidden_size=hidden, workspace_max_tokens=max_tokens)
    cap = fusion.size_cap_tokens(env.sm, tp, hidden, 2)
    stats, log = FusionStats(), FallbackLog()
    for n in sorted({1, min(cap, max_tokens), cap + 1, max_tokens + 1} - {0}):
        check += 1
        parts, residual, weight = inputs(seed=tp * 1_000_003 + check, n=n)
        partial = parts[rank].contiguous()
        impl, reason = fusion.choose_impl(env, dtype="bfloat16", num_tokens=n)
        stats.record(impl, reason)
        if reason:
            log.log_once(reason)
        if impl == "flashinfer":
            got_norm, got_res = kernel(partial, residual, weight, EPS)
        else:  # the fallback's outputs in the model dtype
            got_norm, got_res = (t.to(partial.dtype) for t in allreduce_add_rms_norm_ref(partial, residual, weight, EPS))
        ctx.sync()
        ref_norm, ref_res = add_rms_norm_ref(parts.float().sum(0), residual, weight, EPS)
        out["dispatch"].append({"tokens": n, "impl": impl, "reason": reason,
                                "normed_rel": rel_error(got_norm, ref_norm),
                                "residual_rel": rel_error(got_res, ref_res),
                                "nan": bool(torch.isnan(got_norm).any() or torch.isnan(got_res).any())})
        del parts
    out["stats"] = stats.as_dict()
    out["size_cap_tokens"] = cap
    kernel.close()
    return out


def run_allreduce_tp(tp: int, *, tokens, hidden: int = HIDDEN, max_tokens: int = 2048,
                     timeout: float = 240.0, dry_run: bool = False) -> dict:
    """``tp`` ranks sharing GPU 0 (CPU ranks for --dry-run), started by the launcher; their rows
    merged (worst over ranks)."""
    cfg = {"tokens": list(tokens), "hidden": hidden, "max_tokens": max_tokens, "dry_run": dry_run}
    t0 = time.perf_counter()
    code, reports = launch_ranks("bench.gpu_check:allreduce_worker", cfg, nprocs=tp,
                                 device="cpu" if dry_run else "gpu", num_gpus=None if dry_run else 1,
                                 timeout=timeout)
    seconds = round(time.perf_counter() - t0, 1)
    ranks = {r: v["result"] for r, v in reports.items() if "result" in v}
    errors = {r: v["error"] for r, v in reports.items() if "error" in v}
    silent = (f"no result within {timeout:.0f} s (hung or killed)" if code == 124
              else f"stopped without a result (launcher exit status {code})")
    errors.update({r: silent for r in range(tp) if r not in ranks and r not in errors})
    rows = _merge_rank_rows([ranks[r]["rows"] for r in sorted(ranks)])
    dispatch = _merge_rank_rows([ranks[r]["dispatch"] for r in sorted(ranks)], key=("tokens",))
    first = ranks.get(0, {})
    ok = not errors and bool(rows) and all(x["pass"] for x in rows) and all(x["pass"] for x in dispatch)
    return {"tp": tp, "status": "pass" if ok else "fail", "seconds": seconds, "rows": rows,
            "dispatch": dispatch, "errors": errors, "workspace_seconds": first.get("workspace_seconds"),
            "workspace_mib": first.get("workspace_mib"), "size_cap_tokens": first.get("size_cap_tokens"),
            "stats_rank0": first.get("stats")}


def _merge_rank_rows(per_rank: list[list[dict]], key=("tokens", "mode")) -> list[dict]:
    """Worst error over ranks per check; ``ranks_agree`` when every rank wrote identical bits."""
    if not per_rank:
        return []
    merged = []
    for rows in zip(*per_rank):
        first = dict(rows[0])
        assert all(tuple(r[k] for k in key) == tuple(first[k] for k in key) for r in rows)
        for k in ("normed_rel", "residual_rel"):
            first[k] = max(r[k] for r in rows)
        first["nan"] = any(r["nan"] for r in rows)
        if "digest" in first:
            first["ranks_agree"] = all(r["digest"] == first["digest"] for r in rows)
            del first["digest"]
        if "impl" in first:
            first["impl_agree"] = all(r["impl"] == first["impl"] for r in rows)
        first["pass"] = (not first["nan"] and first.get("impl_agree", True)
                         and max(first["normed_rel"], first["residual_rel"]) <= REL_TOL)
        merged.append(first)
    return merged


def run_allreduce(args) -> dict:
    reason = None if args.dry_run else _need_kernels()
    if reason:
        return {"status": "skip", "summary": reason}
    per_tp, rows_out, summaries = [], [], []
    for tp in args.tp:
        res = run_allreduce_tp(tp, tokens=token_counts(tp, args.max_tokens, args.tokens),
                               hidden=args.hidden, max_tokens=args.max_tokens, timeout=args.timeout,
                               dry_run=args.dry_run)
        per_tp.append(res)
        for x in res["rows"]:
            rows_out.append([tp, x["tokens"], x["mode"] + ("" if x["mode"] != "auto-inplace" else
                                                          (" (one)" if x["oneshot"] else " (two)")),
                             _fmt(x["normed_rel"]), _fmt(x["residual_rel"]), "yes" if x["nan"] else "no",
                             "yes" if x["ranks_agree"] else "NO", "PASS" if x["pass"] else "FAIL"])
        for x in res["dispatch"]:
            rows_out.append([tp, x["tokens"], f"dispatch->{x['impl']}", _fmt(x["normed_rel"]),
                             _fmt(x["residual_rel"]), "yes" if x["nan"] else "no", "-",
                             "PASS" if x["pass"] else "FAIL"])
        for r, err in res["errors"].items():
            rows_out.append([tp, "-", f"rank {r} error", "", "", "", "", str(err).strip().splitlines()[-1][:70]])
        worst_n = max((x["normed_rel"] for x in res["rows"]), default=float("nan"))
        worst_r = max((x["residual_rel"] for x in res["rows"]), default=float("nan"))
        summaries.append(f"tp{tp} {res['status']} ({len(res['rows'])} checks, max rel normed {worst_n:.1e} "
                         f"residual {worst_r:.1e}, {res['seconds']:.0f} s)")
    _table(["tp", "tokens", "mode", "normed rel", "residual rel", "NaN", "ranks agree", "result"], rows_out)
    ok = all(r["status"] == "pass" for r in per_tp)
    if args.dry_run:
        return {"status": "ok" if ok else "fail", "summary": "DRY RUN (no kernel): " + "; ".join(summaries),
                "per_tp": per_tp}
    return {"status": "pass" if ok else "fail", "summary": "; ".join(summaries), "per_tp": per_tp,
            "hidden": args.hidden, "workspace_tokens": args.max_tokens, "tolerance": REL_TOL}


# ---------------------------------------------------------------------------- policy
def run_policy(args) -> dict:
    """choose_impl on this device's real KernelEnv: fused inside the workspace and cap only.

    Expected values exist where they can be stated independently: FlashInfer unavailable
    (then every call takes the reference), or an arch in ``_CAP_TOKENS_H4096`` at H=4096.
    Elsewhere the decisions are listed without a verdict (status "ok").
    """
    try:
        from glm_fused.fused_op import flashinfer as fa
    except ImportError as exc:
        return {"status": "skip", "summary": f"torch not importable ({exc})"}
    from glm_fused.fused_op import KERNEL_TP_SIZES
    from glm_fused.fused_op import policy as fusion

    error = fa.probe()
    decisions, rows, mismatches = [], [], 0
    for tp in (1, *KERNEL_TP_SIZES):  # 1: no kernel at all
        env = fa.kernel_env(tp_size=tp, hidden_size=args.hidden, workspace_max_tokens=args.max_tokens,
                            flashinfer_error=error)
        cap = fusion.size_cap_tokens(env.sm, tp, args.hidden, 2)
        caps = _CAP_TOKENS_H4096.get(env.sm) if args.hidden == HIDDEN else None
        for dtype in ("bfloat16", "float32"):
            for n in sorted({0, 1, 64, 65, 256, 257, args.max_tokens, args.max_tokens + 1, 8192, 8193}):
                impl, reason = fusion.choose_impl(env, dtype=dtype, num_tokens=n)
                expected = None
                if error is not None or env.device != "cuda":
                    expected = "reference"
                elif caps is not None:  # an independent statement of the rule
                    fused = dtype == "bfloat16" and 0 < n <= min(args.max_tokens, caps.get(tp, 0))
                    expected = "flashinfer" if fused else "reference"
                mismatches += expected is not None and impl != expected
                decisions.append({"tp": tp, "dtype": dtype, "tokens": n, "impl": impl, "reason": reason,
                                  "expected": expected, "size_cap_tokens": cap})
                if dtype == "bfloat16" or n == 1:
                    rows.append([tp, dtype, n, impl, expected or "-", reason or ""])
    _table(["tp", "dtype", "tokens", "impl", "expected", "reason"], rows)
    env = fa.kernel_env(tp_size=4, hidden_size=args.hidden, workspace_max_tokens=args.max_tokens,
                        flashinfer_error=error)
    unjudged = sum(d["expected"] is None for d in decisions)
    status = "fail" if mismatches else ("ok" if unjudged else "pass")
    return {"status": status, "decisions": decisions, "probe": error, "env_tp4": dataclasses.asdict(env),
            "summary": (f"{len(decisions)} decisions on sm{env.sm} ({env.device}), {mismatches} mismatches"
                        + (f"; no expected values for sm{env.sm} at hidden {args.hidden}" if unjudged else ""))}


# ---------------------------------------------------------------------------- model (real sizes)
# bf16 pass rule of the model section (ours and transformers both in bf16, judged against
# transformers in fp32 on the same bf16-rounded weights). Each bf16 model rounds its residual
# stream, attention and experts at different points, so neither matches fp32 exactly and a few
# tokens whose top-2 logits (or router scores) sit closer than the rounding flip. The fair bar
# is transformers' own bf16 error: ours may be at most 1.5x as far from fp32 (mean per-row
# relative error, + 1e-3 slack) and lose at most 0.05 of top-1 agreement against it; and
# ours vs transformers bf16 must agree on top-1 for >= 90% of positions with the 90th
# percentile per-row error <= 5e-2. A real fault (a wrong cast, a misplaced norm, a broken KV
# cache, wrong expert weights) lands far outside: random logits agree on top-1 with
# probability ~1e-5 and differ by ~100% of scale.
MODEL_RULE = {"mean_rel_ratio": 1.5, "mean_rel_slack": 1e-3, "top1_drop": 0.05, "top1_vs_hf_bf16": 0.9,
              "p90_rel_vs_hf_bf16": 5e-2}


def _section_device(args):
    """``cuda`` on a GPU; ``cpu`` for --dry-run; None (skip) otherwise."""
    try:
        import torch
    except ImportError:
        return None
    if args.dry_run:
        return torch.device("cpu")
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def _model_config_path(args) -> Path:
    if args.model_config is not None:
        return args.model_config
    return TINY_CONFIG if args.dry_run else AIR_CONFIG


def _checkpoint_dir(args) -> Path:
    return Path(args.work_dir) / f"{_model_config_path(args).stem}-{args.layers}layers-seed{args.seed}"


def _random_hf_model(config, device, seed: int):
    """transformers' Glm4MoeForCausalLM at ``config``'s sizes, random, fp32, on ``device``.

    Perturbed so every piece matters: norms ``1 + 0.2 N(0,1)``, q/k/v biases ``N(0, 0.05)``,
    router logits spread (std 2.4) so routing depends on the token, selection bias ``0.2 U(0,1)``.
    """
    import torch
    import transformers

    from bench.bench_layers import hf_config

    cfg = hf_config(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0.0, 2.4 / config.hidden_size ** 0.5)
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.2 * torch.rand_like(bias))
    return model


def cast_keeping_rope(model, dtype) -> None:
    """``model.to(dtype)``, except that RoPE's frequencies stay exactly fp32.

    A plain ``.to(torch.bfloat16)`` also rounds transformers' ``inv_freq`` buffers to bf16
    (relative error up to 2^-9, so a rotation angle off by ~0.8 rad at position 400), and
    casting back to fp32 keeps the rounded values. ``from_pretrained(dtype=...)`` computes
    them in fp32 and leaves them so: this makes a model built in memory behave the same.
    """
    import torch

    keep = {}
    for module in model.modules():
        for attr in ("inv_freq", "original_inv_freq"):
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor):
                keep[(module, attr)] = value.detach().to(torch.float32).clone()
    model.to(dtype)
    for (module, attr), value in keep.items():
        setattr(module, attr, value)


def _save_checkpoint(model, ckpt: Path) -> dict:
    """bf16 safetensors checkpoint as transformers writes it; marked complete only at the end."""
    import shutil
    import torch

    if ckpt.exists():
        shutil.rmtree(ckpt)
    t0 = time.perf_counter()
    cast_keeping_rope(model, torch.bfloat16)
    model.save_pretrained(ckpt)
    (ckpt / "COMPLETE").write_text("written by gpu_check\n")
    files = sorted(ckpt.glob("*.safetensors"))
    return {"path": str(ckpt), "seconds": round(time.perf_counter() - t0, 1),
            "gib": round(sum(f.stat().st_size for f in files) / 2**30, 2), "files": len(files)}


def ensure_checkpoint(args, device) -> tuple[Path, dict]:
    """The random real-size checkpoint of the model section; made here if no complete one exists."""
    import torch

    ckpt = _checkpoint_dir(args)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    if (ckpt / "COMPLETE").exists():
        return ckpt, {"path": str(ckpt), "reused": True}
    config = load_config(_model_config_path(args), num_hidden_layers=args.layers)
    model = _random_hf_model(config, device, args.seed)
    info = _save_checkpoint(model, ckpt)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ckpt, info


def _random_ids(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def _compare(ref, test) -> dict:
    """glm_fused.metrics.compare_logits' figures (same definitions), in float64 on the device,
    plus per-row relative error percentiles (max |d| of a row / max |ref| of that row)."""
    import torch

    ref, test = ref.double(), test.double()
    diff = (ref - test).abs()
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(test, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    rows = diff.amax(-1) / ref.abs().amax(-1)
    top5 = (ref.topk(5, -1).indices[:, :, None] == test.topk(5, -1).indices[:, None, :]).any(-1).double()
    return {"positions": int(ref.shape[0]), "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "max_rel_diff": float(diff.max() / ref.abs().max()),
            "row_rel_mean": float(rows.mean()), "row_rel_p90": float(torch.quantile(rows, 0.9)),
            "row_rel_max": float(rows.max()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == test.argmax(-1)).double().mean()),
            "top5_agreement": float(top5.mean()), "nan": bool(torch.isnan(test).any())}


def run_model(args) -> dict:
    """(a) The torch backend at GLM-4.5-Air's real layer sizes vs transformers on the same GPU."""
    device = _section_device(args)
    if device is None:
        return {"status": "skip", "summary": "no CUDA device (--dry-run runs it small on the CPU)"}
    import numpy as np
    import torch

    from glm_fused.batch import ForwardBatch
    from glm_fused.config import Glm4MoeConfig

    timings = {}
    t0 = time.perf_counter()
    config = load_config(_model_config_path(args), num_hidden_layers=args.layers)
    model = _random_hf_model(config, device, args.seed)
    timings["build_transformers"] = round(time.perf_counter() - t0, 1)
    ckpt = _checkpoint_dir(args)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    saved = _save_checkpoint(model, ckpt)  # leaves the model in bf16
    timings["save"] = saved["seconds"]

    rng = np.random.default_rng(args.seed + 1)
    prompts = [_random_ids(rng, config.vocab_size, n) for n in args.prompt_lens]
    conts = [_random_ids(rng, config.vocab_size, args.decode_steps) for _ in prompts]
    seqs = [p + c for p, c in zip(prompts, conts)]

    def hf_logits():
        with torch.no_grad():
            return [model(torch.tensor([s], device=device)).logits[0].float() for s in seqs]

    t0 = time.perf_counter()
    hf_bf16 = hf_logits()
    cast_keeping_rope(model, torch.float32)  # the same bf16-rounded weights, now computed in fp32
    hf_fp32 = hf_logits()
    timings["transformers_forward"] = round(time.perf_counter() - t0, 1)
    attn_impl = getattr(model.config, "_attn_implementation", None)
    experts_impl = getattr(model.config, "_experts_implementation", None)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The project's runner: prompts prefilled together (one batch, two KV-cache slots), then
    # the continuation fed one token per step, both sequences in each decode batch.
    os.environ["GLM_FUSED_DEVICE"] = "gpu" if device.type == "cuda" else "cpu"
    os.environ["GLM_FUSED_DEVICE_ID"] = "0"
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    t0 = time.perf_counter()
    engine_args = EngineArgs(model=str(ckpt), backend="torch", device=os.environ["GLM_FUSED_DEVICE"],
                             dtype="bfloat16", max_num_seqs=len(prompts), max_model_len=max(len(s) for s in seqs),
                             max_num_batched_tokens=sum(map(len, prompts))).resolve()
    engine_args.num_gpu_blocks_override = engine_args.slot_blocks()  # one slot per prompt
    runner = ModelRunner(engine_args, Glm4MoeConfig.from_pretrained(ckpt), tp_rank=0, tp_size=1)
    timings["load_ours"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    try:
        tables = runner.slot_tables(range(len(prompts)))
        pre = runner.forward(ForwardBatch.prefill(prompts, tables, all_logits=True))
        stats_prefill = runner.fusion_stats()
        steps = []
        for k in range(args.decode_steps):
            steps.append(runner.forward(ForwardBatch.decode([c[k] for c in conts],
                                                            [len(p) + k for p in prompts], tables)))
        stats_decode = runner.fusion_stats() if steps else None
        graphs = runner.graphs is not None  # a checkpoint read through the weight writer, then the capture
    finally:
        runner.close()
    timings["ours_forward"] = round(time.perf_counter() - t0, 1)
    starts = np.concatenate([[0], np.cumsum(args.prompt_lens)])
    ours = [np.concatenate([pre[starts[i]:starts[i + 1]]] + [s[i:i + 1] for s in steps])
            for i in range(len(prompts))]

    dev = device
    cat = lambda xs: torch.cat([torch.as_tensor(x, device=dev).float() for x in xs])  # noqa: E731
    L = args.decode_steps
    sel = {"all": lambda xs: cat(xs),
           "prefill": lambda xs: cat([x[:len(x) - L] for x in xs]),
           "decode": lambda xs: cat([x[len(x) - L:] for x in xs])}
    pairs = {"ours_vs_hf_fp32": (hf_fp32, ours), "hf_bf16_vs_hf_fp32": (hf_fp32, hf_bf16),
             "ours_vs_hf_bf16": (hf_bf16, ours)}
    figures = {}
    for part, pick in sel.items():
        if part == "decode" and not L:
            continue
        figures[part] = {name: _compare(pick(ref), pick(test)) for name, (ref, test) in pairs.items()}
    a, b, c = (figures["all"][k] for k in ("ours_vs_hf_fp32", "hf_bf16_vs_hf_fp32", "ours_vs_hf_bf16"))
    r = MODEL_RULE
    checks = {
        "no NaN": not (a["nan"] or c["nan"]),
        "mean row rel vs fp32 <= 1.5x transformers bf16 + 1e-3":
            a["row_rel_mean"] <= r["mean_rel_ratio"] * b["row_rel_mean"] + r["mean_rel_slack"],
        "top-1 vs fp32 >= transformers bf16 - 0.05": a["top1_agreement"] >= b["top1_agreement"] - r["top1_drop"],
        "top-1 vs transformers bf16 >= 0.9": c["top1_agreement"] >= r["top1_vs_hf_bf16"],
        "p90 row rel vs transformers bf16 <= 5e-2": c["row_rel_p90"] <= r["p90_rel_vs_hf_bf16"],
    }
    expected_calls = 2 * config.num_hidden_layers + 1
    fused_ok = (stats_prefill["fused_allreduce_norm_calls"] == expected_calls
                and stats_prefill["plain_allreduce_calls"] == 0)
    checks[f"{expected_calls} fused calls, 0 plain all-reduces per forward"] = fused_ok
    if device.type == "cuda":
        checks["decode replays CUDA graphs (captured after the load)"] = graphs
    rows = []
    for part, figs in figures.items():
        for name, m in figs.items():
            rows.append([part, name, m["positions"], f"{m['max_rel_diff']:.2e}", f"{m['row_rel_mean']:.2e}",
                         f"{m['row_rel_p90']:.2e}", f"{m['kl_mean']:.2e}", f"{m['top1_agreement']:.4f}",
                         f"{m['top5_agreement']:.4f}"])
    _table(["positions", "pair", "n", "max rel", "mean row rel", "p90 row rel", "KL mean", "top1", "top5"], rows)
    _table(["check", "result"], [[k, "PASS" if v else "FAIL"] for k, v in checks.items()])
    ok = all(checks.values())
    return {"status": "pass" if ok else "fail", "config": str(_model_config_path(args)),
            "layers": config.num_hidden_layers, "checkpoint": saved, "prompt_lens": list(args.prompt_lens),
            "decode_steps": L, "transformers_attn": attn_impl, "transformers_experts": experts_impl,
            "figures": figures, "checks": checks, "rule": MODEL_RULE, "timings_s": timings,
            "fusion_prefill": stats_prefill, "fusion_decode": stats_decode,
            "summary": (f"{config.num_hidden_layers} layers, H {config.hidden_size}, {config.n_routed_experts} experts, "
                        f"V {config.vocab_size}: ours vs transformers bf16 max rel {c['max_rel_diff']:.1e}, "
                        f"KL {c['kl_mean']:.1e}, top1 {c['top1_agreement']:.3f}; vs fp32 mean row rel "
                        f"ours {a['row_rel_mean']:.1e} / transformers bf16 {b['row_rel_mean']:.1e}, top1 "
                        f"{a['top1_agreement']:.3f} / {b['top1_agreement']:.3f}")}


# ---------------------------------------------------------------------------- tp4 (whole model)
# Fused (kernel) vs unfused, both bf16, at real sizes. Each bf16 path alone is up to ~5e-2
# (max rel) and ~5% of top-1 away from fp32 at hidden 4096 (measured: ours 4.9e-2 / 0.948,
# transformers 4.2e-2 / 0.956, 2 layers, see docs/gpu-results.md), so two bf16 paths may
# differ by up to twice that: logit_diff's bf16 defaults. A broken kernel (garbage, a missed or
# doubled all-reduce) lands at ~100% of scale and ~0 top-1 agreement.
TP4_RULE = {"max_rel": 0.1, "min_top1": 0.85}


def run_tp4(args) -> dict:
    """(d) The whole torch model at TP 4 as processes sharing one GPU: FlashInfer-fused vs unfused,
    through scripts/logit_diff.py. Every fused call must be served by the kernel."""
    import signal

    device = _section_device(args)
    if device is None:
        return {"status": "skip", "summary": "no CUDA device (--dry-run runs it small on the CPU)"}
    dry = device.type != "cuda"
    if not dry:
        reason = _need_kernels()
        if reason:
            return {"status": "skip", "summary": reason}
    import numpy as np

    t0 = time.perf_counter()
    ckpt, made = ensure_checkpoint(args, device)
    config = load_config(ckpt / "config.json")
    rng = np.random.default_rng(args.seed + 2)
    prompt_file = Path(args.work_dir) / "tp4_prompt_ids.json"
    prompt_file.write_text(json.dumps([_random_ids(rng, config.vocab_size, n) for n in args.tp4_prompt_lens]))
    out_json = Path(args.work_dir) / "tp4_logit_diff.json"
    out_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "logit_diff.py"), "--backend", "torch",
           "--device", "cpu" if dry else "gpu", "--tp", str(args.tp4_size), "--model", str(ckpt),
           "--dtype", "bfloat16", "--prompt-ids", str(prompt_file),
           "--max-new-tokens", str(args.tp4_new_tokens), "--json", str(out_json),
           "--tolerance", str(args.tp4_tolerance), "--min-top1", str(args.tp4_min_top1)]
    if not dry:
        cmd.append("--enable-flashinfer-allreduce-fusion")
    print("$ " + " ".join(cmd), flush=True)
    t1 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.tp4_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the launcher stops its ranks on SIGINT
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = None
    run_seconds = round(time.perf_counter() - t1, 1)
    base = {"command": cmd, "exit_code": rc, "checkpoint": made, "logit_diff_seconds": run_seconds,
            "seconds_with_checkpoint": round(time.perf_counter() - t0, 1)}
    if rc is None or not out_json.exists():
        why = f"logit_diff timed out after {args.tp4_timeout:.0f} s" if rc is None else f"logit_diff exited {rc}"
        return dict(base, status="fail", summary=f"{why}, no JSON report (see the log above)")
    report = json.loads(out_json.read_text())
    f = report["fusion"]
    want = 2 * config.num_hidden_layers + 1
    kernel = "reference" if dry else "flashinfer"
    per_step = f.get("per_decode_step") or {}
    served = {
        "prefill": f.get("fused_impl", {}).get(kernel, 0) == want == f["fused_allreduce_norm_calls"],
        "decode": per_step.get("fused_impl", {}).get(kernel, 0) == want == per_step.get("fused_allreduce_norm_calls"),
    }
    checks = {f"prefill: {want} fused calls served by {kernel}": served["prefill"],
              f"decode step: {want} fused calls served by {kernel}": served["decode"],
              "0 plain all-reduces in the fused model": f["plain_allreduce_calls"] == 0
              and per_step.get("plain_allreduce_calls", 0) == 0,
              f"unfused model: {want} plain all-reduces": f["unfused_model"]["plain_allreduce_calls"] == want,
              f"fused vs unfused: max rel <= {args.tp4_tolerance:g}, top-1 >= {args.tp4_min_top1:g}":
                  bool(report["passed"]) and rc == 0}
    o = report["overall"]
    _table(["check", "result"], [[k, "PASS" if v else "FAIL"] for k, v in checks.items()])
    return dict(base, status="pass" if all(checks.values()) else "fail", report=report, checks=checks,
                summary=(f"TP {args.tp4_size} on one {'CPU' if dry else 'GPU'}, fused ({f.get('fused_impl')}) vs "
                         f"unfused: max rel {o['max_rel_diff']:.1e}, KL {o['kl_mean']:.1e}, top1 "
                         f"{o['top1_agreement']:.3f}, greedy {o['greedy_agreement']:.2f}; "
                         f"{f['plain_allreduce_calls']} plain all-reduces"))


# ---------------------------------------------------------------------------- bench
def run_bench(args) -> dict:
    """(e) Per-layer prefill/decode timing, ours vs transformers eager, against the HBM floor."""
    import shlex

    device = _section_device(args)
    if device is None:
        return {"status": "skip", "summary": "no CUDA device (--dry-run runs it small on the CPU)"}
    from bench import bench_layers

    extra = shlex.split(args.bench_args or "")
    if device.type != "cuda":
        extra = ["--device", "cpu", "--config", str(TINY_CONFIG), "--prefill", "32", "--decode-batches", "1,4",
                 "--context", "16", "--copy-mib", "16", "--matmul-n", "128", "--warmup", "1", "--iters", "2"] + extra
    out = bench_layers.run(bench_layers.parse_args(extra))
    failed = [f"{c['layer']} {c['step']} {i}" for c in out["cases"] for i, e in c["impls"].items() if "error" in e]
    ours_failed = any(i.endswith(" ours") for i in failed)
    bits = []
    for c in out["cases"]:
        e = c["impls"].get("ours", {})
        if "ms" in e:
            # against the fastest transformers variant: the smallest speed-up
            vs_best = min((x["ours_speedup"] for i, x in c["impls"].items()
                           if i.startswith("hf-") and "ours_speedup" in x), default=None)
            bits.append(f"{c['layer']} {c['step']} {e['ms']:.2f} ms = {e['x_floor']:.1f}x floor"
                        + (f", {vs_best:.2f}x vs fastest HF" if vs_best else ""))
    return {"status": "fail" if ours_failed else "ok", "bench": out, "failed": failed,
            "summary": f"{out['copy_bandwidth_GBps']:.0f} GB/s, {out['matrix_TFLOPs']:.0f} TFLOP/s; "
                       + "; ".join(bits[:4]) + (f"; failed: {', '.join(failed)}" if failed else "")}


SECTIONS = {"build": run_build, "norm": run_norm, "allreduce": run_allreduce, "policy": run_policy,
            "bench": run_bench, "model": run_model, "tp4": run_tp4}


# ---------------------------------------------------------------------------- output
def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2e}"


def _short_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _table(header: list, rows: list) -> None:
    print(text_table(header, rows) + "\n", flush=True)


def _write_json(out_dir: Path, meta: dict, sections: dict) -> Path:
    """Merged into the file's earlier sections (one section per run is common)."""
    path = out_dir / "gpu_check.json"
    data = read_json(path) or {}
    data.setdefault("sections", {}).update(sections)
    data["meta"] = meta
    return write_json(path, data)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections, run in this order (default {','.join(SECTIONS)})")
    p.add_argument("--out", type=Path, help="directory for gpu_check.json (merged with an existing one)")
    p.add_argument("--tp", type=int_list, default=list(DEFAULT_TPS), help="TP sizes for allreduce (2,4,8)")
    p.add_argument("--tokens", type=token_list, default=list(BOUNDARY_TOKENS),
                   help="token counts for allreduce (default: every boundary from 1 to 2048, with tp-1/tp/tp+1)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    p.add_argument("--max-tokens", type=int, default=2048, help="workspace tokens (default 2048)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per TP size before ranks are killed")
    g = p.add_argument_group("model, tp4 and bench sections")
    g.add_argument("--model-config", type=Path, default=None,
                   help="config.json whose sizes the model sections use (default configs/glm-4.5-air.json; "
                        "the tiny config under --dry-run)")
    g.add_argument("--layers", type=int, default=3, help="decoder layers of the random model (3 = 1 dense + 2 MoE)")
    g.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "glm_fused_gpu_check",
                   help="where the random checkpoint and the tp4 files go (default: the temp dir)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random model and prompts")
    g.add_argument("--prompt-lens", type=int_list, default=[96, 400],
                   help="model: prompt lengths, prefilled together (default 96,400)")
    g.add_argument("--decode-steps", type=int, default=4, help="model: decode steps through the KV cache (4)")
    g.add_argument("--tp4-size", type=int, default=4, help="tp4: TP ranks sharing GPU 0 (default 4)")
    g.add_argument("--tp4-prompt-lens", type=int_list, default=[40, 200],
                   help="tp4: prompt lengths (default 40,200: under the sm90 TP 4 size cap of 256 tokens, "
                        "so every fused call can be served by the kernel)")
    g.add_argument("--tp4-new-tokens", type=int, default=4, help="tp4: greedy tokens per prompt (4)")
    g.add_argument("--tp4-timeout", type=float, default=150.0, help="tp4: seconds before logit_diff is stopped")
    g.add_argument("--tp4-tolerance", type=float, default=TP4_RULE["max_rel"],
                   help=f"tp4: largest fused-vs-unfused max rel (default {TP4_RULE['max_rel']:g}, see TP4_RULE)")
    g.add_argument("--tp4-min-top1", type=float, default=TP4_RULE["min_top1"],
                   help=f"tp4: smallest fused-vs-unfused top-1 agreement (default {TP4_RULE['min_top1']:g})")
    g.add_argument("--bench-args", default="", help="bench: extra flags for bench_layers (quoted string)")
    p.add_argument("--dry-run", action="store_true",
                   help="allreduce on CPU with a reference stand-in for the kernel: checks the harness "
                        "and the adapter's argument checks, not the kernel; bench, model and tp4 run small "
                        "on the CPU (tiny config, tp4 without the kernel)")
    args = p.parse_args(argv)
    try:
        args.only = name_list(args.only, SECTIONS, "--only")
    except UserError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    _setdefault_env()
    args = parse_args(argv)
    meta = environment()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    results = {}
    for name in args.only:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            res = SECTIONS[name](args)
        except Exception as exc:
            traceback.print_exc()
            res = {"status": "fail", "summary": _short_exc(exc)}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        if args.out:
            _write_json(args.out, meta, {name: res})  # after each section: a later hang loses nothing
    print("== summary")
    _table(["section", "status", "seconds", "summary"],
           [[n, r["status"].upper(), f"{r['seconds']:.0f}", r.get("summary", "")] for n, r in results.items()])
    return 1 if any(r["status"] == "fail" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
