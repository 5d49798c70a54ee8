"""GPU proof: the FlashInfer kernels this project uses, checked against fp32 references.

Sections (``--only a,b``; default: all, in this order):

  build      build or load FlashInfer's JIT modules (trtllm_comm, norm) and time it
  norm       flashinfer.norm.fused_add_rmsnorm and rmsnorm vs fp32 (the TP=1 fused path)
  allreduce  the fused all-reduce + residual-add + RMSNorm at TP 2/4/8, run as TP processes
             sharing GPU 0 (gloo group for the workspace exchange), every token-count
             boundary, one-shot and two-shot, outputs poisoned with NaN before each call;
             plus calls past the workspace / size cap, which must take the reference path
  policy     glm_fused.fusion.choose_impl's decisions on this device's real KernelEnv

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
import platform
import queue as queue_mod
import socket
import subprocess
import sys
import time
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path

# Before anything imports flashinfer.norm: its CuTe-DSL kernels need nvidia-cutlass-dsl,
# which is not installed; the CUDA ones are the path this project uses. NVLink multicast
# stays off on shared machines (it can take a host's GPUs down for others).
_ENV_DEFAULTS = {
    "FLASHINFER_USE_CUDA_NORM": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

REL_TOL = 1e-2
HIDDEN = 4096
EPS = 1e-5  # GLM-4.5's rms_norm_eps
DEFAULT_TPS = (2, 4, 8)
BOUNDARY_TOKENS = (1, "tp-1", "tp", "tp+1", 16, 64, 127, 128, 129, 255, 256, 257, 512, 1024, 2047, 2048)
# Hopper (sm90) caps at H=4096 bf16, written out here independently of fusion.py's table.
_SM90_CAP_TOKENS_H4096 = {2: 8192, 4: 256, 8: 64}


def _setdefault_env() -> None:
    for k, v in _ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def token_counts(tp: int, max_tokens: int, tokens=BOUNDARY_TOKENS) -> list[int]:
    out = set()
    for t in tokens:
        n = {"tp-1": tp - 1, "tp": tp, "tp+1": tp + 1}.get(t, t) if isinstance(t, str) else int(t)
        if 0 < n <= max_tokens:
            out.add(n)
    return sorted(out)


def _rel(out, ref) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    denom = float(ref.abs().max())
    return float((out.float() - ref).abs().max()) / (denom if denom > 0 else 1.0)


def _ref_fused(parts_f32, residual, weight, eps):
    """fp32 reference: all-reduce by summing, add the residual, RMSNorm, gamma."""
    res = parts_f32.sum(0) + residual.float()
    normed = res * (res.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight.float()
    return normed, res


def _digest(t) -> int:
    """Order-sensitive checksum of a 16-bit tensor, computed on its device (ranks compare it)."""
    import torch

    bits = t.contiguous().view(torch.int16).reshape(-1).to(torch.int64)
    mult = torch.arange(bits.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
    return int((bits * mult).sum())


# ---------------------------------------------------------------------------- environment
def environment() -> dict:
    info = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["sm"] = p.major * 10 + p.minor
            info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            info["multiprocessors"] = p.multi_processor_count
    except Exception as exc:  # report, don't die: the sections say what they need
        info["torch_error"] = repr(exc)
    for mod in ("flashinfer", "tvm_ffi"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:
            info[mod] = f"not importable ({type(exc).__name__})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["driver"] = out.splitlines()[0] if out else None
    except Exception:
        info["driver"] = None
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
        info["nvcc"] = next((ln.strip() for ln in out.splitlines() if "release" in ln), None)
    except Exception:
        info["nvcc"] = None
    return info


def _need_kernels() -> str | None:
    """None when CUDA and flashinfer.comm are here; else why the kernel sections skip."""
    try:
        from glm_fused import flashinfer_adapter
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
                ref_res = x.float() + r.float()
                ref = ref_res * (ref_res.pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * w.float()
                xi, ri = x.clone(), r.clone()
                fnorm.fused_add_rmsnorm(input=xi, residual=ri, weight=w, eps=EPS)  # in place
                torch.cuda.synchronize()
                rec.update(normed_rel=_rel(xi, ref), residual_rel=_rel(ri, ref_res),
                           nan=bool(torch.isnan(xi).any() or torch.isnan(ri).any()))
            else:
                ref = x.float() * (x.float().pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * w.float()
                out = torch.full_like(x, float("nan"))
                fnorm.rmsnorm(input=x, weight=w, eps=EPS, out=out)
                torch.cuda.synchronize()
                rec.update(normed_rel=_rel(out, ref), residual_rel=None, nan=bool(torch.isnan(out).any()))
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
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_allreduce_norm(partial, residual, weight, eps, group):
    """The fallback path of a rank: fp32 all-reduce through gloo (host), add, RMSNorm."""
    import torch
    import torch.distributed as dist

    summed = partial.float().cpu()
    dist.all_reduce(summed, group=group)
    res = summed.to(partial.device) + residual.float()
    normed = res * (res.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight.float()
    return normed.to(partial.dtype), res.to(partial.dtype)


class _StandInKernel:
    """--dry-run only: the reference maths behind the adapter's real argument checks, so the
    harness (ranks, order of checks, poisoning, merging) can be exercised without a GPU."""

    def __init__(self, *, tp_rank, tp_size, max_num_tokens, hidden_size, group):
        import torch

        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.max_num_tokens, self.hidden_size = max_num_tokens, hidden_size
        self.dtype, self.device, self.sm = torch.bfloat16, torch.device("cpu"), 90
        self.workspace_bytes = 0

    def __call__(self, partial, residual, weight, eps, *, norm_out=None, residual_out=None, use_oneshot=None):
        from glm_fused.flashinfer_adapter import prepare_call

        kw = prepare_call(partial, residual, weight, eps, tp_rank=self.tp_rank, tp_size=self.tp_size,
                          max_num_tokens=self.max_num_tokens, hidden_size=self.hidden_size,
                          dtype=self.dtype, device=self.device, workspace_ptrs=None,
                          launch_with_pdl=False, sm=self.sm, norm_out=norm_out,
                          residual_out=residual_out, use_oneshot=use_oneshot)
        normed, res = _reference_allreduce_norm(kw["allreduce_in"], kw["residual_in"], kw["rms_gamma"],
                                                eps, self.group)
        kw["residual_out"].copy_(res)
        kw["norm_out"].copy_(normed)
        return kw["norm_out"], kw["residual_out"]

    def close(self):
        pass


def _allreduce_worker(rank: int, tp: int, port: int, cfg: dict, results) -> None:
    """One TP rank: make the workspace, run every check in the same order as its peers."""
    out = {"rank": rank, "rows": [], "dispatch": [], "error": None}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        from glm_fused import fusion
        from glm_fused import flashinfer_adapter as fa

        dry = cfg["dry_run"]
        dev = "cpu" if dry else "cuda:0"
        if not dry:
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", rank=rank, world_size=tp,
                                timeout=timedelta(seconds=cfg["timeout"]))
        group = dist.new_group(list(range(tp)), backend="gloo")  # a TP group, as the runners pass
        hidden, max_tokens = cfg["hidden"], cfg["max_tokens"]
        t0 = time.perf_counter()
        if dry:
            kernel = _StandInKernel(tp_rank=rank, tp_size=tp, max_num_tokens=max_tokens,
                                    hidden_size=hidden, group=group)
        else:
            kernel = fa.FlashInferAllReduceFusion(tp_rank=rank, tp_size=tp, max_num_tokens=max_tokens,
                                                  hidden_size=hidden, dtype=torch.bfloat16, device=dev,
                                                  group=group, shared_gpu=True)
        out["workspace_seconds"] = round(time.perf_counter() - t0, 2)
        out["workspace_mib"] = round(kernel.workspace_bytes / 2**20)
        sm = kernel.sm

        def sync():
            if not dry:
                torch.cuda.synchronize()

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
                sync()
                ref_norm, ref_res = _ref_fused(parts.float(), residual, weight, EPS)
                out["rows"].append({
                    "tokens": n, "mode": mode, "oneshot": chosen,
                    "normed_rel": _rel(got_norm, ref_norm), "residual_rel": _rel(got_res, ref_res),
                    "nan": bool(torch.isnan(got_norm).any() or torch.isnan(got_res).any()),
                    "digest": [_digest(got_norm), _digest(got_res)],
                })
                del parts

        # Calls past the workspace or the size cap must take the reference path (choose_impl).
        if dry:  # pretend Hopper so the caps bite as they would there
            env = fusion.KernelEnv(device="cuda", sm=90, tp_size=tp, hidden_size=hidden,
                                   flashinfer_error=None, workspace_max_tokens=max_tokens)
        else:
            env = fa.kernel_env(tp_size=tp, hidden_size=hidden, workspace_max_tokens=max_tokens)
        cap = fusion.size_cap_tokens(env.sm, tp, hidden, 2)
        stats, log = fusion.FusionStats(), fusion.FallbackLog()
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
            else:
                got_norm, got_res = _reference_allreduce_norm(partial, residual, weight, EPS, group)
            sync()
            ref_norm, ref_res = _ref_fused(parts.float(), residual, weight, EPS)
            out["dispatch"].append({"tokens": n, "impl": impl, "reason": reason,
                                    "normed_rel": _rel(got_norm, ref_norm),
                                    "residual_rel": _rel(got_res, ref_res),
                                    "nan": bool(torch.isnan(got_norm).any() or torch.isnan(got_res).any())})
            del parts
        out["stats"] = stats.as_dict()
        out["size_cap_tokens"] = cap
        kernel.close()
        dist.destroy_process_group()
    except Exception:
        out["error"] = traceback.format_exc(limit=8)[-3000:]
    results.put(out)


def run_allreduce_tp(tp: int, *, tokens, hidden: int = HIDDEN, max_tokens: int = 2048,
                     timeout: float = 240.0, dry_run: bool = False) -> dict:
    """Spawn ``tp`` ranks on GPU 0, collect their rows, merge them (worst over ranks)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA in forked children is undefined
    results = ctx.Queue()
    cfg = {"tokens": list(tokens), "hidden": hidden, "max_tokens": max_tokens,
           "timeout": max(60, int(timeout)), "dry_run": dry_run}
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, tp, port, cfg, results), daemon=True)
             for r in range(tp)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    ranks, deadline = {}, t0 + timeout
    while len(ranks) < tp:
        try:
            r = results.get(timeout=max(1.0, deadline - time.perf_counter()))
        except queue_mod.Empty:
            break
        ranks[r["rank"]] = r
        if r["error"]:
            deadline = min(deadline, time.perf_counter() + 20)  # peers of a failed rank hang
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    seconds = round(time.perf_counter() - t0, 1)
    errors = {r: v["error"] for r, v in ranks.items() if v["error"]}
    missing = sorted(set(range(tp)) - set(ranks))
    if missing:
        errors.update({r: f"no result within {timeout:.0f} s (hung or killed)" for r in missing})
    rows = _merge_rank_rows([ranks[r]["rows"] for r in sorted(ranks) if not ranks[r]["error"]])
    dispatch = _merge_rank_rows([ranks[r]["dispatch"] for r in sorted(ranks) if not ranks[r]["error"]],
                                key=("tokens",))
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
    """choose_impl on this device's real KernelEnv: fused inside the workspace and cap only."""
    try:
        from glm_fused import flashinfer_adapter as fa
    except ImportError as exc:
        return {"status": "skip", "summary": f"torch not importable ({exc})"}
    from glm_fused import fusion

    error = fa.probe()
    decisions, rows, mismatches = [], [], 0
    for tp in (1, 2, 4, 8, 16):
        env = fa.kernel_env(tp_size=tp, hidden_size=args.hidden, workspace_max_tokens=args.max_tokens,
                            flashinfer_error=error)
        cap = fusion.size_cap_tokens(env.sm, tp, args.hidden, 2)
        for dtype in ("bfloat16", "float32"):
            for n in sorted({0, 1, 64, 65, 256, 257, args.max_tokens, args.max_tokens + 1, 8192, 8193}):
                impl, reason = fusion.choose_impl(env, dtype=dtype, num_tokens=n)
                expected = None
                if env.sm == 90 and args.hidden == HIDDEN:  # an independent statement of the rule
                    fused = (env.device == "cuda" and error is None and dtype == "bfloat16"
                             and 0 < n <= min(args.max_tokens, _SM90_CAP_TOKENS_H4096.get(tp, 0)))
                    expected = "flashinfer" if fused else "reference"
                    mismatches += impl != expected
                decisions.append({"tp": tp, "dtype": dtype, "tokens": n, "impl": impl, "reason": reason,
                                  "expected": expected, "size_cap_tokens": cap})
                if dtype == "bfloat16" or n == 1:
                    rows.append([tp, dtype, n, impl, expected or "-", reason or ""])
    _table(["tp", "dtype", "tokens", "impl", "expected", "reason"], rows)
    env = fa.kernel_env(tp_size=4, hidden_size=args.hidden, workspace_max_tokens=args.max_tokens,
                        flashinfer_error=error)
    status = "fail" if mismatches else ("pass" if env.sm == 90 else "ok")
    return {"status": status, "decisions": decisions, "probe": error, "env_tp4": dataclasses.asdict(env),
            "summary": (f"{len(decisions)} decisions on sm{env.sm} ({env.device}), {mismatches} mismatches"
                        + ("" if env.sm == 90 else "; expectations written for sm90 only"))}


SECTIONS = {"build": run_build, "norm": run_norm, "allreduce": run_allreduce, "policy": run_policy}


# ---------------------------------------------------------------------------- output
def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2e}"


def _short_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _table(header: list, rows: list) -> None:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(flush=True)


def _write_json(out_dir: Path, meta: dict, sections: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    data = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = {}
    data.setdefault("sections", {}).update(sections)
    data["meta"] = meta
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _token_list(text: str) -> list:
    """Integers, or tp-1 / tp / tp+1 (resolved per TP size)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    return [x if x in ("tp-1", "tp", "tp+1") else int(x) for x in items]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections, run in this order (default {','.join(SECTIONS)})")
    p.add_argument("--out", type=Path, help="directory for gpu_check.json (merged with an existing one)")
    p.add_argument("--tp", type=_int_list, default=list(DEFAULT_TPS), help="TP sizes for allreduce (2,4,8)")
    p.add_argument("--tokens", type=_token_list, default=list(BOUNDARY_TOKENS),
                   help="token counts for allreduce (default: every boundary from 1 to 2048, with tp-1/tp/tp+1)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    p.add_argument("--max-tokens", type=int, default=2048, help="workspace tokens (default 2048)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per TP size before ranks are killed")
    p.add_argument("--dry-run", action="store_true",
                   help="allreduce on CPU with a reference stand-in for the kernel: checks the harness "
                        "and the adapter's argument checks, not the kernel")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
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
