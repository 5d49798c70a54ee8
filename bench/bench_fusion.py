"""Several-GPU proof and timing of the fused all-reduce + residual-add + RMSNorm (torch backend).

One process per GPU (NCCL, started by ``glm_fused.launcher``); for each TP size in ``--tp``
that the visible GPUs allow, one job runs three sections (``--only``):

  check   FlashInfer's fused op vs the reference (NCCL all-reduce in fp32, add, RMSNorm, all
          fp32) at every token count, bf16: max relative error of the normed output and of the
          residual, one-shot, two-shot and the adapter's own choice; fresh random inputs per
          check, outputs poisoned with NaN; the model's unfused bf16 path measured beside it
  timing  the fused op vs the unfused pair (NCCL all-reduce, then add + RMSNorm by torch - the
          model's fallback - or by flashinfer.norm.fused_add_rmsnorm) at every token count,
          under CUDA graphs, medians over many replays: the ratio, the crossover, and the
          per-(sm, TP) size cap in the form glm_fused/fused_op/policy.py keeps it (paste-ready)
  model   GLM-4.5-Air at its real sizes (random weights, ``--num-layers`` of them) in the
          unfused and the fused layout: logit parity, decode time per output token at batch
          1/8/32/64 and prefill time at 2048 tokens, side by side

Rank 0 writes its section results after each section, so a later hang loses nothing. This
process prints the tables (Markdown), the paste-ready cap rows, and writes ``--out``:
``bench_fusion.json`` and ``bench_fusion.md``. Exit status 1 when a check or the logit parity
fails or a TP job did not finish.

``--dry-run`` runs the same pipeline on CPU ranks (gloo) with the reference maths standing in
for the kernel, at tiny sizes: it exercises the harness, not the kernel, and its timings mean
nothing.

NVLink multicast stays off in every rank (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1): on a shared host it can take the GPUs down for others. FlashInfer's
``trtllm`` all-reduce only, never ``mnnvl``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import (CUDA_NORM_ENV, NO_MULTICAST_ENV, BenchRank, environment, int_list, launch_ranks,
                          load_config, md_table, name_list, token_counts, token_list, write_json, write_text)
from bench.reference import StandInKernel, add_rms_norm_ref, allreduce_add_rms_norm_ref, digest, rel_error
from glm_fused.errors import UserError
from glm_fused.fused_op import KERNEL_TP_SIZES

# NO_MULTICAST_ENV is forced, not defaulted: a user's NCCL_NVLS_ENABLE=1 must not reach a
# shared host's GPUs. CUDA_NORM_ENV is a default.

SECTIONS = ("check", "timing", "model")
MIB = 1 << 20
REL_TOL = 1e-2        # the kernel check's pass mark, as bench/gpu_check.py
NCCL_REF_TOL = 1e-5   # fp32 NCCL sum vs the same sum done locally: order of additions only
EPS = 1e-5            # GLM-4.5's rms_norm_eps
DTYPE_BYTES = 2       # bf16: the caps are byte sizes of a bf16 [tokens, hidden] input

# Sizes of the real run, and of --dry-run (tiny, on CPU ranks), for the flags not given.
GPU_DEFAULTS = dict(
    tokens="1,tp-1,tp+1,16,64,128,129,256,512,1024,2048", hidden=4096, workspace_tokens=2048,
    replays=200, calls_per_replay=10, warmup=3,
    model="zai-org/GLM-4.5-Air", batches="1,8,32,64", prefill_tokens=2048, decode_context=32,
    decode_steps=10, prefill_reps=3, model_warmup=2, parity_tokens=64, timeout=420.0,
)
DRY_DEFAULTS = dict(
    tokens="1,tp-1,tp+1,16", hidden=128, workspace_tokens=32,
    replays=3, calls_per_replay=2, warmup=1,
    model="glm-4.5-air-tiny.json", batches="1,4", prefill_tokens=32, decode_context=4,
    decode_steps=2, prefill_reps=1, model_warmup=1, parity_tokens=12, timeout=120.0,
)

# Timed variants of one all-reduce + add + RMSNorm.
FUSED_VARIANTS = ("fused_oneshot", "fused_twoshot")
UNFUSED_VARIANTS = ("unfused_torch", "unfused_fi_norm")
VARIANT_TITLES = {
    "fused_oneshot": "fused one-shot",
    "fused_twoshot": "fused two-shot",
    "unfused_torch": "NCCL + torch add/norm",
    "unfused_fi_norm": "NCCL + FI fused_add_rmsnorm",
}


# ======================================================================================
# Framework-free: crossover, caps, formatting (unit-tested on synthetic timings)
# ======================================================================================

def best_time(row: dict, keys) -> tuple[float | None, str | None]:
    """The fastest of ``row[k]`` (microseconds) over ``keys`` that were measured."""
    have = [(row[k], k) for k in keys if row.get(k) is not None]
    return min(have) if have else (None, None)


def fused_by_rule(row: dict, tp: int, hidden: int, sm: int | None) -> float | None:
    """The fused time of the algorithm ``glm_fused.fused_op.policy.use_oneshot`` picks today."""
    from glm_fused.fused_op import policy as fusion

    oneshot = fusion.use_oneshot(tp, row["tokens"], hidden, DTYPE_BYTES, sm=sm)
    return row.get("fused_oneshot" if oneshot else "fused_twoshot")


def crossover(rows: list[dict], fused_keys=FUSED_VARIANTS, unfused_keys=UNFUSED_VARIANTS,
              win_ratio: float = 1.0) -> dict:
    """Where the fused op stops beating the unfused pair.

    ``rows``: one per token count, ``{"tokens": n, <variant>: microseconds or None}``. Per
    row the fastest fused variant is set against the fastest unfused one; the fused op
    "wins" when ``fused / unfused <= win_ratio``. The cap is the largest token count at which
    it wins AND it won at every smaller count: a cap is a single threshold, so a win past the
    first loss cannot be used (it is reported as ``wins_after_loss``). ``cap_tokens`` is 0
    when the first count already loses; ``open_ended`` when no count lost (the cap is then
    only what was measured). ``crossover_estimate`` interpolates ``log(ratio)`` linearly in
    ``log(tokens)`` between the last win and the first loss.
    """
    table = []
    for row in sorted(rows, key=lambda r: r["tokens"]):
        fused, fused_key = best_time(row, fused_keys)
        unfused, unfused_key = best_time(row, unfused_keys)
        if fused is None or unfused is None or unfused <= 0:
            continue
        ratio = fused / unfused
        table.append({"tokens": row["tokens"], "fused_us": fused, "fused_variant": fused_key,
                      "unfused_us": unfused, "unfused_variant": unfused_key, "ratio": ratio,
                      "win": ratio <= win_ratio})
    cap, first_loss = 0, None
    for r in table:
        if not r["win"]:
            first_loss = r
            break
        cap = r["tokens"]
    estimate = None
    if first_loss is not None and cap:
        last_win = next(r for r in table if r["tokens"] == cap)
        x0, x1 = math.log(last_win["tokens"]), math.log(first_loss["tokens"])
        y0, y1 = math.log(last_win["ratio"] / win_ratio), math.log(first_loss["ratio"] / win_ratio)
        x = x0 if y1 == y0 else x0 + (x1 - x0) * (0 - y0) / (y1 - y0)
        estimate = round(math.exp(min(max(x, x0), x1)))
    after = [r["tokens"] for r in table if first_loss is not None and r["tokens"] > first_loss["tokens"]
             and r["win"]]
    return {"rows": table, "cap_tokens": cap,
            "first_loss_tokens": None if first_loss is None else first_loss["tokens"],
            "crossover_estimate": estimate, "open_ended": first_loss is None and bool(table),
            "measured_max_tokens": table[-1]["tokens"] if table else 0, "wins_after_loss": after,
            "win_ratio": win_ratio}


def oneshot_limit(rows: list[dict], tp: int, win_ratio: float = 1.0) -> dict:
    """Largest input (tokens) up to which one-shot is no slower than two-shot, counted only
    where two-shot exists (``tokens > tp``); same single-threshold rule as ``crossover``.
    At ``tokens <= tp`` one-shot is the only algorithm, so a limit of 0 still means one-shot there."""
    both = [r for r in rows if r["tokens"] > tp and r.get("fused_oneshot") is not None
            and r.get("fused_twoshot") is not None]
    out = crossover([{"tokens": r["tokens"], "one": r["fused_oneshot"], "two": r["fused_twoshot"]}
                     for r in both], fused_keys=("one",), unfused_keys=("two",), win_ratio=win_ratio)
    return {"limit_tokens": out["cap_tokens"], "first_loss_tokens": out["first_loss_tokens"],
            "open_ended": out["open_ended"], "rows": out["rows"]}


def bytes_expr(nbytes: int) -> str:
    """A byte count the way fusion.py's tables write it: ``2 * MiB``, ``MiB // 2``, or plain."""
    if nbytes <= 0:
        return "0"
    if nbytes % MIB == 0:
        return f"{nbytes // MIB} * MiB"
    if MIB % nbytes == 0:
        return f"MiB // {MIB // nbytes}"
    return str(nbytes)


def cap_row(sm: int | None, caps_tokens: dict[int, int], hidden: int, *, kept: dict[int, int] | None = None,
            note: str = "") -> str:
    """One paste-ready entry of ``_SIZE_CAP_BYTES`` (or ``_ONESHOT_MAX_BYTES``) in fusion.py.

    ``caps_tokens``: measured {tp: tokens}; a 0 is written out (size cap 0: never fused;
    one-shot limit 0: one-shot only where two-shot cannot run) rather than left out, since a
    missing one-shot entry means FlashInfer's default. ``kept``: {tp: tokens} of TP sizes not
    measured, carried over from the code as they are.
    """
    merged = {**(kept or {}), **caps_tokens}
    entries = [f"{tp}: {bytes_expr(tokens * hidden * DTYPE_BYTES)}" for tp, tokens in sorted(merged.items())]
    label = "cpu" if sm is None else str(sm)
    body = f"{label}: {{{', '.join(entries)}}},"
    return f"    {body}" + (f"  # {note}" if note else "")


def caps_from_timing(per_tp: dict[int, dict], sm: int | None, hidden: int, *, code_caps: dict[int, int],
                     when: str, where: str, win_ratio: float = 1.0) -> dict:
    """Caps and one-shot limits from each TP's timing rows, plus the paste-ready rows.

    ``code_caps``: {tp: tokens} of fusion.py today at this sm, for comparison and for TP
    sizes this run did not time.
    """
    caps, oneshot, notes, summary = {}, {}, [], {}
    for tp, timing in sorted(per_tp.items()):
        rows = timing.get("rows") or []
        if not rows:
            continue
        cross = crossover(rows, win_ratio=win_ratio)
        one = oneshot_limit(rows, tp, win_ratio=win_ratio)
        caps[tp], oneshot[tp] = cross["cap_tokens"], one["limit_tokens"]
        summary[tp] = {"crossover": cross, "oneshot": one, "code_cap_tokens": code_caps.get(tp, 0),
                       "cap_bytes": cross["cap_tokens"] * hidden * DTYPE_BYTES,
                       "oneshot_max_bytes": one["limit_tokens"] * hidden * DTYPE_BYTES}
        if cross["open_ended"]:
            notes.append(f"tp{tp} fused faster at every size measured (<= {cross['measured_max_tokens']} tokens)")
        elif cross["cap_tokens"] == 0:
            notes.append(f"tp{tp} never fused (slower already at {cross['first_loss_tokens']} tokens)")
    kept = {tp: t for tp, t in code_caps.items() if tp not in caps}
    tokens_note = ", ".join(f"tp{tp} {t}" for tp, t in sorted(caps.items()))
    note = f"{where}, {when}: tokens at H {hidden} bf16: {tokens_note}"
    if kept:
        note += "; " + ", ".join(f"tp{tp}" for tp in sorted(kept)) + " not measured, kept from the code"
    return {
        "sm": sm, "hidden": hidden, "caps_tokens": caps, "oneshot_tokens": oneshot, "per_tp": summary,
        "notes": notes, "code_caps_tokens": code_caps,
        "size_cap_row": cap_row(sm, caps, hidden, kept=kept, note=note),
        "oneshot_row": cap_row(sm, oneshot, hidden, note=f"{where}, {when}: one-shot up to, tokens: "
                               + ", ".join(f"tp{tp} {t}" for tp, t in sorted(oneshot.items()))),
    }


def _e(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def _us(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


# ======================================================================================
# Parent process: flags, one launch per TP size, tables, JSON
# ======================================================================================

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_fusion.py", description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 all passed, 1 a check/parity failed or a TP job did not finish, 2 usage error.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--tp", type=int_list, default=[2, 4, 8],
                   help="TP sizes; each one the visible GPUs allow runs as its own job (default 2,4,8)")
    g.add_argument("--only", default=",".join(SECTIONS),
                   help=f"sections, comma-separated (default {','.join(SECTIONS)})")
    g.add_argument("--device", choices=["gpu", "cpu"], default=None,
                   help="gpu (default) or cpu (the same as --dry-run)")
    g.add_argument("--dry-run", action="store_true",
                   help="CPU ranks (gloo), reference stand-in for the kernel, tiny sizes: checks the harness only")
    g.add_argument("--shared-gpu", action="store_true",
                   help="allow more ranks than GPUs (ranks share GPUs over gloo): check and model only, no timing")
    g.add_argument("--out", type=Path, help="directory for bench_fusion.json and bench_fusion.md")
    g.add_argument("--timeout", type=float, default=None, help="seconds per TP job before its ranks are stopped")
    g.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run; later TP jobs get what is left")
    g = p.add_argument_group("kernel check and timing")
    g.add_argument("--tokens", type=token_list, default=None,
                   help=f"token counts (default {GPU_DEFAULTS['tokens']})")
    g.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096)")
    g.add_argument("--workspace-tokens", type=int, default=None, help="fused workspace tokens (default 2048)")
    g.add_argument("--replays", type=int, default=None, help="timed graph replays per variant (default 200)")
    g.add_argument("--calls-per-replay", type=int, default=None, help="op calls captured in one graph (default 10)")
    g.add_argument("--warmup", type=int, default=None, help="untimed calls before capture (default 3)")
    g.add_argument("--no-graphs", action="store_true", help="time eagerly (CUDA events) instead of under CUDA graphs")
    g.add_argument("--win-ratio", type=float, default=1.0,
                   help="fused wins at a size when fused/unfused <= this (default 1.0)")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="model whose config is used with random weights: HF name, checkpoint directory or "
                        "config .json (default zai-org/GLM-4.5-Air = configs/glm-4.5-air.json)")
    g.add_argument("--num-layers", default="auto",
                   help="decoder layers (overrides num_hidden_layers); auto: as many of the config's as "
                        "fit in --memory-fraction of the GPU (default auto)")
    g.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of the free GPU memory auto layers may fill (default 0.9)")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="model dtype (default bfloat16)")
    g.add_argument("--batches", type=int_list, default=None, help="decode batch sizes (default 1,8,32,64)")
    g.add_argument("--prefill-tokens", type=int, default=None, help="prefill length timed (default 2048)")
    g.add_argument("--decode-context", type=int, default=None, help="prompt tokens per decoding sequence (default 32)")
    g.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per batch size (default 10)")
    g.add_argument("--prefill-reps", type=int, default=None, help="timed prefills (default 3)")
    g.add_argument("--model-warmup", type=int, default=None, help="untimed steps before each timing (default 2)")
    g.add_argument("--parity-tokens", type=int, default=None, help="prompt whose every logit is compared (default 64)")
    g.add_argument("--model-variants", default="unfused,fused",
                   help="comma-separated: unfused, fused (kernel where the caps allow), fused-reference "
                        "(fused layout, kernel off) (default unfused,fused)")
    g.add_argument("--seed", type=int, default=0, help="seed of inputs and weights (default 0)")
    return p


MODEL_VARIANTS = {"unfused": (False, "auto"), "fused": (True, "auto"), "fused-reference": (True, "reference")}


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """Validate and settle every flag in this process; the result travels to the ranks."""
    if args.dry_run and args.device == "gpu":
        raise UserError("--dry-run runs on CPU ranks: drop --device gpu")
    if args.device == "cpu":
        args.dry_run = True  # no kernel on CPU: the stand-in, at tiny sizes unless told otherwise
    args.device = "cpu" if args.dry_run else "gpu"
    args.stand_in = args.dry_run
    defaults = DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if isinstance(args.tokens, str):
        args.tokens = token_list(args.tokens)
    if isinstance(args.batches, str):
        args.batches = int_list(args.batches)
    args.only = name_list(args.only, SECTIONS, "--only")
    args.model_variants = name_list(args.model_variants, MODEL_VARIANTS, "--model-variants")
    for flag in ("hidden", "workspace_tokens", "replays", "calls_per_replay", "prefill_tokens", "decode_context",
                 "decode_steps", "prefill_reps", "parity_tokens"):
        if int(getattr(args, flag)) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    too_big = [t for t in args.tokens if isinstance(t, int) and t > args.workspace_tokens]
    if too_big:
        raise UserError(f"--tokens {too_big[0]}: more than --workspace-tokens {args.workspace_tokens}")
    if args.hidden % 8:
        raise UserError(f"--hidden {args.hidden}: the kernel needs a multiple of 8")
    if not args.batches or min(args.batches) < 1:
        raise UserError(f"--batches {args.batches}: need positive batch sizes")
    if args.warmup < 0 or args.model_warmup < 0:
        raise UserError("--warmup / --model-warmup: must be >= 0")
    if not 0 < args.memory_fraction <= 1:
        raise UserError(f"--memory-fraction {args.memory_fraction}: must be in (0, 1]")
    if args.num_layers != "auto":
        try:
            args.num_layers = int(args.num_layers)
        except ValueError:
            raise UserError(f"--num-layers {args.num_layers!r}: a positive integer or auto") from None
        if args.num_layers < 1:
            raise UserError(f"--num-layers {args.num_layers}: must be at least 1")
    # Tokens of the largest model step: the timed prefill, the parity prompt, or the decode
    # prompts of the largest batch (prefilled in one step).
    args.max_step_tokens = max(args.prefill_tokens, args.parity_tokens, max(args.batches) * args.decode_context)
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise UserError(f"--out {args.out}: exists and is not a directory")
        args.out = str(args.out)

    # The model config, resolved here so a bad --model fails before any rank starts.
    args.config_path = _config_path(args.model) if "model" in args.only else None
    if args.config_path:
        from glm_fused.config import Glm4MoeConfig

        config = Glm4MoeConfig.from_json_file(args.config_path)
        args.model_name = args.model
        args.config_layers = config.num_hidden_layers
    # TP sizes this machine can run.
    args.gpus = _visible_gpus() if args.device == "gpu" else 0
    if args.device == "gpu" and args.gpus < 1:
        raise UserError("--device gpu: no GPU visible (use --dry-run for the CPU pipeline)")
    runnable, skipped = [], {}
    for tp in args.tp:
        problem = _tp_problem(args.config_path, tp) if args.config_path and tp > 1 else None
        if tp < 2:
            skipped[tp] = "the fused all-reduce needs TP >= 2"
        elif tp not in KERNEL_TP_SIZES:
            skipped[tp] = f"not a TP size the TRT-LLM kernel is built for {KERNEL_TP_SIZES}"
        elif args.device == "gpu" and tp > args.gpus and not args.shared_gpu:
            skipped[tp] = f"needs {tp} GPUs, {args.gpus} visible (--shared-gpu runs it for correctness only)"
        elif problem:
            skipped[tp] = problem
        else:
            runnable.append(tp)
    if not runnable:
        why = "; ".join(f"tp {tp}: {w}" for tp, w in skipped.items())
        raise UserError(f"--tp {','.join(map(str, args.tp))}: nothing to run here ({why})")
    args.run_tps, args.skipped_tps = runnable, {str(k): v for k, v in skipped.items()}
    return args


def _config_path(spec: str) -> str:
    """A config file for random weights: a .json path, a configs/ file name, or a --model spec."""
    from glm_fused.model_path import resolve_model
    from glm_fused.tiny import configs_dir

    if spec.endswith(".json"):
        for candidate in (Path(spec).expanduser(), configs_dir() / spec):
            if candidate.is_file():
                return str(candidate)
        raise UserError(f"--model {spec}: config file not found")
    return str(resolve_model(spec, load_format="dummy").config_path)


def _tp_problem(config_path: str, tp: int) -> str | None:
    from glm_fused.config import Glm4MoeConfig

    try:
        Glm4MoeConfig.from_json_file(config_path).check_tp(tp)
    except UserError as exc:
        return str(exc)
    return None


def _visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        raise UserError("--device gpu: torch is not installed") from None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in NO_MULTICAST_ENV.items():
        os.environ[key] = value  # ranks inherit this environment
    for key, value in CUDA_NORM_ENV.items():
        os.environ.setdefault(key, value)
    try:
        prepare(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    if args.device == "gpu":
        meta = environment()  # imports torch, asks nvidia-smi and nvcc
    else:
        import platform

        meta = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "python": platform.python_version()}
    meta.update(argv=list(sys.argv[1:] if argv is None else argv), dry_run=args.dry_run, device=args.device,
                stand_in_kernel=args.stand_in, gpus=args.gpus, hidden=args.hidden,
                workspace_tokens=args.workspace_tokens, skipped_tps=args.skipped_tps,
                env={k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, *CUDA_NORM_ENV, "FLASHINFER_DISABLE_JIT")})
    banner = "DRY RUN: CPU ranks, reference standing in for the kernel, timings meaningless. " if args.stand_in else ""
    print(f"bench_fusion: {banner}TP {', '.join(map(str, args.run_tps))} on {args.device}"
          + (f" ({args.gpus} GPUs)" if args.device == "gpu" else "")
          + "".join(f"; tp {tp} skipped: {why}" for tp, why in args.skipped_tps.items()), flush=True)

    results, started = {}, time.monotonic()
    for tp in args.run_tps:
        timeout = args.timeout
        if args.time_budget is not None:
            left = args.time_budget - (time.monotonic() - started)
            if left < 30:
                results[tp] = {"status": "skipped", "error": "--time-budget spent"}
                continue
            timeout = min(timeout, left)
        print(f"== tp {tp}", flush=True)
        t0 = time.monotonic()
        code, reports = launch_ranks("bench.bench_fusion:worker", dict(vars(args), tp_size=tp), nprocs=tp,
                                     device=args.device, timeout=timeout)
        res = reports.get(0, {})  # rank 0 reports the job
        res["exit_code"], res["seconds"] = code, round(time.monotonic() - t0, 1)
        res["status"] = "done" if code == 0 else ("timeout" if code == 124 else "failed")
        results[tp] = res
        if args.out:  # after every job: a run cut short by its host keeps what it measured
            _write_report(Path(args.out), build_report(args, meta, results))
    report = build_report(args, meta, results)
    text = render_report(report)
    print(text, flush=True)
    if args.out:
        _write_report(Path(args.out), report, text)
        print(f"wrote {Path(args.out) / 'bench_fusion.json'} and {Path(args.out) / 'bench_fusion.md'}", flush=True)
    return 0 if report["passed"] else 1


def _write_report(out: Path, report: dict, text: str | None = None) -> None:
    write_json(out / "bench_fusion.json", report)
    write_text(out / "bench_fusion.md", (text or render_report(report)) + "\n")


def build_report(args, meta: dict, results: dict[int, dict]) -> dict:
    """Everything the tables show, and the verdict."""
    from glm_fused.fused_op import policy as fusion

    hidden = args.hidden
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    sm = next((r.get("sm") for r in results.values() if r.get("sm") is not None), None)
    gpu = meta.get("gpu") or "CPU"
    where = f"{args.gpus}x {gpu}" if args.device == "gpu" else "CPU dry run"
    timing = {tp: r["timing"] for tp, r in results.items() if r.get("timing")}
    code_caps = {tp: fusion.size_cap_tokens(sm, tp, hidden, DTYPE_BYTES) for tp in KERNEL_TP_SIZES}
    code_caps = {tp: t for tp, t in code_caps.items() if t > 0}
    caps = None
    if timing and not args.stand_in:
        caps = caps_from_timing(timing, sm, hidden, code_caps=code_caps, when=when, where=where,
                                win_ratio=args.win_ratio)
    elif timing:  # the dry run still exercises the computation, labelled as such
        caps = caps_from_timing(timing, None, hidden, code_caps={}, when=when, where="DRY RUN, not a measurement",
                                win_ratio=args.win_ratio)
    failures = []
    for tp, r in results.items():
        if r.get("status") != "done":
            failures.append(f"tp {tp}: job {r.get('status')}")
        if r.get("check") and not r["check"].get("passed"):
            failures.append(f"tp {tp}: kernel check failed")
        if r.get("model") and r["model"].get("parity") and not r["model"]["parity"].get("passed", True):
            failures.append(f"tp {tp}: logit parity failed")
    return {"meta": meta, "date": when, "sm": sm, "where": where, "tp": {str(k): v for k, v in results.items()},
            "caps": caps, "failures": failures, "passed": not failures}


def render_report(report: dict) -> str:
    """The tables, Markdown; section (a) check, (b) timing + caps, (c) model."""
    meta, out = report["meta"], []
    tps = {int(k): v for k, v in report["tp"].items()}
    head = "DRY RUN (CPU ranks; reference standing in for the kernel; timings meaningless)" \
        if meta.get("stand_in_kernel") else report["where"]
    out.append(f"## bench_fusion: {head}, {report['date']}")
    info = ", ".join(f"{k} {meta[k]}" for k in ("torch", "torch_cuda", "flashinfer", "driver", "sm")
                     if meta.get(k) is not None)
    if info:
        out.append(info)
    jobs = [[tp, r.get("status"), r.get("seconds"), (r.get("error") or "")[:120]] for tp, r in sorted(tps.items())]
    out.append(md_table(["TP", "job", "seconds", "error"], jobs))

    # (a)
    rows = []
    for tp, r in sorted(tps.items()):
        for x in (r.get("check") or {}).get("rows", []):
            rows.append([tp, x["tokens"], "/".join(x["modes"]), _e(x["normed_rel"]), _e(x["residual_rel"]),
                         _e(x.get("unfused_normed_rel")), _e(x.get("unfused_residual_rel")),
                         "yes" if x["nan"] else "no", "yes" if x["ranks_agree"] else "NO",
                         "PASS" if x["pass"] else "FAIL"])
    if rows:
        link = "gloo" if meta.get("stand_in_kernel") else "NCCL"
        out.append(f"### (a) fused op vs fp32 reference ({link} all-reduce in fp32, add, RMSNorm): max |d| / max |ref|, "
                   f"worst over modes and ranks; pass <= {REL_TOL:g}")
        out.append(md_table(["TP", "tokens", "modes", "fused normed", "fused residual", "unfused bf16 normed",
                             "unfused bf16 residual", "NaN", "ranks agree", "result"], rows))

    # (b)
    caps = report.get("caps") or {}
    for tp, r in sorted(tps.items()):
        t = r.get("timing")
        if not t:
            continue
        per = (caps.get("per_tp") or {}).get(tp) or (caps.get("per_tp") or {}).get(str(tp)) or {}
        cross = per.get("crossover") or {}
        ratios = {x["tokens"]: x for x in cross.get("rows", [])}
        trows = []
        for x in t["rows"]:
            c = ratios.get(x["tokens"], {})
            trows.append([x["tokens"], *(_us(x.get(k)) for k in (*FUSED_VARIANTS, *UNFUSED_VARIANTS)),
                          _us(x.get("fused_rule")), "-" if not c else f"{c['ratio']:.2f}",
                          "-" if not c else ("fused" if c["win"] else "unfused")])
        method = "CUDA graphs" if t.get("graphs") else ("wall clock, CPU" if t.get("device") == "cpu" else "eager")
        out.append(f"### (b) TP {tp}: microseconds per call, median over {t.get('replays')} replays of "
                   f"{t.get('calls_per_replay')} calls ({method}), slowest rank")
        out.append(md_table(["tokens", *(VARIANT_TITLES[k] for k in (*FUSED_VARIANTS, *UNFUSED_VARIANTS)),
                             "fused (code's one-shot rule)", "best fused / best unfused", "faster"], trows))
        if cross:
            out.append(_crossover_line(tp, cross, per))
    if caps.get("size_cap_row"):
        out.append("Paste into glm_fused/fused_op/policy.py, `_SIZE_CAP_BYTES` (replacing this sm's entry), together "
                   "with the one-shot row into `_ONESHOT_MAX_BYTES` (the caps assume the better algorithm):")
        out.append("```\n" + caps["size_cap_row"] + "\n" + caps["oneshot_row"] + "\n```")
        for n in caps.get("notes", []):
            out.append(f"- {n}")

    # (c)
    out += _model_tables(tps)
    verdict = "PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"])
    out.append(f"**{verdict}**")
    return "\n\n".join(out)


def _model_tables(tps: dict[int, dict]) -> list[str]:
    """Step times side by side per layout, then the logit parity, for every TP size."""
    out, mrows, prows, variants, tol, names = [], [], [], [], {}, set()
    for tp, r in sorted(tps.items()):
        m = r.get("model")
        if not m:
            continue
        variants, names = m.get("variants", []), names | {str(m.get("name"))}
        steps = [(f"decode_b{b}", f"decode batch {b}, ms per output token") for b in m.get("batches", [])]
        steps.append(("prefill", f"prefill {m.get('prefill_tokens')} tokens, ms"))
        for key, title in steps:
            vals = {v: m["timing"].get(v, {}).get(key) or {} for v in variants}
            ms = {v: vals[v].get("median_ms") for v in variants}
            ratio = "-"
            if ms.get("fused") and ms.get("unfused"):
                ratio = f"{ms['fused'] / ms['unfused']:.3f}"
            kernel = "-"
            if vals.get("fused"):
                impl = vals["fused"].get("fused_impl") or {}
                kernel = f"{impl.get('flashinfer', 0)}/{impl.get('flashinfer', 0) + impl.get('reference', 0)}"
            mrows.append([tp, m.get("num_layers"), title, *(_ms(ms[v]) for v in variants), ratio, kernel])
        parity = m.get("parity") or {}
        tol = parity.get("tolerance") or tol
        for row in parity.get("rows", []):
            prows.append([tp, row["scenario"], row["positions"], _e(row["max_rel_diff"]), _e(row["mean_abs_diff"]),
                          _e(row["kl_mean"]), f"{row['top1_agreement']:.3f}",
                          "" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")])
    if mrows:
        out.append(f"### (c) model, random weights ({', '.join(sorted(names))}), eager runner: median per step, "
                   "slowest rank")
        out.append(md_table(["TP", "layers", "step", *variants, "fused / unfused", "fused calls on the kernel"], mrows))
    if prows:
        out.append(f"### (c) logit parity, fused vs unfused (same weights and inputs): pass when all rows pooled "
                   f"have max rel <= {tol.get('max_rel_diff')} and top-1 >= {tol.get('min_top1')}")
        out.append(md_table(["TP", "logits", "rows", "max rel", "mean abs", "KL mean", "top-1", "result"], prows))
    return out


def _tok(n) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _crossover_line(tp: int, cross: dict, per: dict) -> str:
    code = per.get("code_cap_tokens")
    code_txt = f"; the code's cap today: {_tok(code)}" if code is not None else ""
    one = per.get("oneshot") or {}
    one_txt = f"; one-shot no slower than two-shot up to {_tok(one.get('limit_tokens'))}"
    if one.get("first_loss_tokens") is not None:
        one_txt += f" (two-shot faster from {one['first_loss_tokens']})"
    if cross.get("open_ended"):
        return (f"TP {tp}: fused faster at every size measured, up to {_tok(cross['measured_max_tokens'])}: "
                f"cap {_tok(cross['cap_tokens'])} (raise only after measuring beyond){code_txt}{one_txt}.")
    if cross.get("cap_tokens") == 0:
        return (f"TP {tp}: fused slower already at {_tok(cross['first_loss_tokens'])}: never fused, cap 0"
                f"{code_txt}{one_txt}.")
    extra = (f"; it wins again at {', '.join(map(str, cross['wins_after_loss']))} (not usable under one cap)"
             if cross.get("wins_after_loss") else "")
    return (f"TP {tp}: fused faster up to {_tok(cross['cap_tokens'])}, slower from {cross['first_loss_tokens']} "
            f"(crossover ~{_tok(cross['crossover_estimate'])}): cap {_tok(cross['cap_tokens'])}{extra}"
            f"{code_txt}{one_txt}.")


# ======================================================================================
# Every rank
# ======================================================================================

def _join(ns) -> BenchRank:
    """This rank in its process group, with what the report says about it."""
    bad = {k: os.environ.get(k) for k, v in NO_MULTICAST_ENV.items() if os.environ.get(k) != v}
    if bad:  # the parent sets these; a rank without them must not touch the GPUs
        raise RuntimeError(f"NVLink multicast not switched off in this rank: {bad}")
    ctx = BenchRank(ns)
    if ctx.world != ns.tp_size:
        raise RuntimeError(f"launched {ctx.world} ranks for tp {ns.tp_size}")
    ctx.report.update(tp=ctx.world, device=str(ctx.device), shared_gpu=ctx.shares_gpu, dist_backend=ctx.dist_backend,
                      env={k: os.environ.get(k) for k in NO_MULTICAST_ENV})
    if ctx.on_gpu:
        major, minor = ctx.torch.cuda.get_device_capability(ctx.device)
        ctx.report.update(sm=major * 10 + minor, gpu=ctx.torch.cuda.get_device_name(ctx.device))
    return ctx


def worker(args: dict) -> None:
    ns = argparse.Namespace(**args)
    ctx = _join(ns)
    kernel = None
    try:
        if "check" in ns.only or "timing" in ns.only:
            kernel = _make_kernel(ctx)
        if "check" in ns.only:
            t0 = time.perf_counter()
            res = run_check(ctx, kernel)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            ctx.save(check=res)
            ctx.log(f"check: {'pass' if res['passed'] else 'FAIL'} ({len(res['rows'])} token counts, "
                    f"{res['seconds']} s)")
        if "timing" in ns.only:
            if ctx.shares_gpu:
                ctx.save(timing_skipped="ranks share a GPU: timing needs one GPU per rank")
                ctx.log("timing: skipped (ranks share a GPU)")
            else:
                t0 = time.perf_counter()
                res = run_timing(ctx, kernel)
                res["seconds"] = round(time.perf_counter() - t0, 1)
                ctx.save(timing=res)
                ctx.log(f"timing: {len(res['rows'])} token counts ({res['seconds']} s)")
    finally:
        if kernel is not None:
            kernel.close()
        ctx.sync()
        if ctx.on_gpu:
            ctx.torch.cuda.empty_cache()
    if "model" in ns.only:
        t0 = time.perf_counter()
        res = run_model(ctx)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.save(model=res)
        ctx.log(f"model: {res['num_layers']} layers ({res['seconds']} s)")
    ctx.barrier()


def _make_kernel(ctx: BenchRank):
    """The fused op of this rank: FlashInfer's kernel on GPU, the reference stand-in on CPU."""
    ns, torch = ctx.args, ctx.torch
    if ns.stand_in:
        return StandInKernel(tp_rank=ctx.rank, tp_size=ctx.world, max_num_tokens=ns.workspace_tokens,
                             hidden_size=ns.hidden)
    from glm_fused.fused_op import CommBackend
    from glm_fused.fused_op import flashinfer as fa

    try:  # the exchange through the TP group's comm backend, as the runner makes it
        return fa.FlashInferAllReduceFusion(
            tp_rank=ctx.rank, tp_size=ctx.world, max_num_tokens=ns.workspace_tokens, hidden_size=ns.hidden,
            dtype=torch.bfloat16, device=ctx.device, group=CommBackend(ctx.comm), shared_gpu=ctx.shares_gpu)
    except fa.FusionUnavailable as exc:
        raise UserError(f"FlashInfer's fused all-reduce is unavailable on this machine: {exc}") from None


# ---- (a) correctness ------------------------------------------------------------------

def run_check(ctx: BenchRank, kernel) -> dict:
    """Each token count: fused (one-shot, two-shot, adapter's choice in place) and the model's
    unfused bf16 path, against fp32 NCCL all-reduce + add + RMSNorm."""
    from glm_fused.fused_op import policy as fusion
    from glm_fused.fused_op import fused_allreduce_residual_rmsnorm
    from glm_fused.torch_backend import OPS

    ns, torch, tp, rank = ctx.args, ctx.torch, ctx.world, ctx.rank
    dev, hidden = ctx.device, ns.hidden
    reference_comm = ctx.comm  # kernel_env None: always the reference path
    rows, check = [], 0
    for n in token_counts(tp, ns.workspace_tokens, ns.tokens):
        modes = ["oneshot"] + (["twoshot"] if n > tp else []) + ["auto-inplace"]
        worst = {"tokens": n, "modes": modes, "normed_rel": 0.0, "residual_rel": 0.0, "nan": False,
                 "digests": [], "nccl_vs_local": 0.0}
        for mode in modes + ["unfused"]:
            check += 1
            # Every rank draws every rank's partial from one seed: the local fp32 sum checks
            # the NCCL reference itself.
            g = torch.Generator(device=dev).manual_seed(ns.seed * 7919 + tp * 1_000_003 + check)
            parts = torch.randn(tp, n, hidden, generator=g, device=dev).to(torch.bfloat16)
            residual = torch.randn(n, hidden, generator=g, device=dev).to(torch.bfloat16)
            weight = (1 + 0.25 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
            partial = parts[rank].contiguous()
            ref_norm, ref_res = allreduce_add_rms_norm_ref(partial, residual, weight, EPS)
            local_norm, local_res = add_rms_norm_ref(parts.float().sum(0), residual, weight, EPS)
            worst["nccl_vs_local"] = max(worst["nccl_vs_local"], rel_error(ref_res, local_res))
            if mode == "unfused":
                got_norm, got_res = fused_allreduce_residual_rmsnorm(partial.clone(), residual, weight, EPS,
                                                                     reference_comm, OPS)
                ctx.sync()
                worst["unfused_normed_rel"] = rel_error(got_norm, ref_norm)
                worst["unfused_residual_rel"] = rel_error(got_res, ref_res)
                continue
            norm_out = torch.full_like(partial, float("nan"))
            if mode == "auto-inplace":
                res_buf = residual.clone()
                got_norm, got_res = kernel(partial, res_buf, weight, EPS, norm_out=norm_out, residual_out=res_buf)
                oneshot = fusion.use_oneshot(tp, n, hidden, DTYPE_BYTES, sm=kernel.sm)
            else:
                oneshot = mode == "oneshot"
                res_out = torch.full_like(partial, float("nan"))
                got_norm, got_res = kernel(partial, residual, weight, EPS, norm_out=norm_out, residual_out=res_out,
                                           use_oneshot=oneshot)
            ctx.sync()
            if mode == "auto-inplace":
                worst["auto_oneshot"] = oneshot
            worst["normed_rel"] = max(worst["normed_rel"], rel_error(got_norm, ref_norm))
            worst["residual_rel"] = max(worst["residual_rel"], rel_error(got_res, ref_res))
            worst["nan"] |= bool(torch.isnan(got_norm).any() or torch.isnan(got_res).any())
            worst["digests"].append([digest(got_norm), digest(got_res)])
            del parts
        rows.append(worst)
    per_rank = ctx.gather(rows)
    merged = []
    for i, row in enumerate(rows):
        others = [r[i] for r in per_rank]
        m = {k: v for k, v in row.items() if k != "digests"}
        for key in ("normed_rel", "residual_rel", "unfused_normed_rel", "unfused_residual_rel", "nccl_vs_local"):
            m[key] = max(o[key] for o in others)
        m["nan"] = any(o["nan"] for o in others)
        m["ranks_agree"] = all(o["digests"] == others[0]["digests"] for o in others)
        m["pass"] = (not m["nan"] and m["ranks_agree"] and max(m["normed_rel"], m["residual_rel"]) <= REL_TOL
                     and m["nccl_vs_local"] <= NCCL_REF_TOL)
        merged.append(m)
    return {"rows": merged, "passed": bool(merged) and all(m["pass"] for m in merged), "tolerance": REL_TOL,
            "hidden": hidden, "workspace_tokens": ns.workspace_tokens, "sm": kernel.sm,
            "stand_in": bool(ns.stand_in)}


# ---- (b) timing -----------------------------------------------------------------------

def run_timing(ctx: BenchRank, kernel) -> dict:
    """Fused vs unfused at each token count; per-variant medians, slowest rank."""
    ns, torch, tp = ctx.args, ctx.torch, ctx.world
    dev, hidden = ctx.device, ns.hidden
    import torch.distributed as dist

    from glm_fused.fused_op import fused_allreduce_residual_rmsnorm
    from glm_fused.torch_backend import OPS

    fi_norm, fi_norm_error = None, "CPU run" if not ctx.on_gpu else None
    if ctx.on_gpu:
        try:
            import flashinfer.norm as fi_norm
        except Exception as exc:  # reported in the JSON; the torch variant still runs
            fi_norm_error = f"{type(exc).__name__}: {exc}"[:200]
        if not ctx.agree_min(fi_norm is not None):  # every rank must time the same collectives
            fi_norm, fi_norm_error = None, fi_norm_error or "flashinfer.norm missing on another rank"
    reference_comm = ctx.comm  # kernel_env None: always the reference path
    graphs = ctx.on_gpu and not ns.no_graphs
    rows, notes = [], []
    for n in token_counts(tp, ns.workspace_tokens, ns.tokens):
        g = torch.Generator(device=dev).manual_seed(ns.seed * 31 + n)
        partial = torch.randn(n, hidden, generator=g, device=dev).to(torch.bfloat16)
        residual = torch.randn(n, hidden, generator=g, device=dev).to(torch.bfloat16)
        weight = (1 + 0.25 * torch.randn(hidden, generator=g, device=dev)).to(torch.bfloat16)
        # Separate outputs keep the fused op's inputs constant over replays. The unfused
        # pair works in place like the model (the all-reduce sums into its input), so its
        # values drift over replays; GPU arithmetic takes the same time on any value.
        norm_out, res_out = torch.empty_like(partial), torch.empty_like(partial)
        work, work_res = partial.clone(), residual.clone()
        ops = {
            "fused_oneshot": lambda: kernel(partial, residual, weight, EPS, norm_out=norm_out, residual_out=res_out,
                                            use_oneshot=True),
            "unfused_torch": lambda: fused_allreduce_residual_rmsnorm(work, work_res, weight, EPS, reference_comm, OPS),
        }
        if n > tp:
            ops["fused_twoshot"] = lambda: kernel(partial, residual, weight, EPS, norm_out=norm_out,
                                                  residual_out=res_out, use_oneshot=False)
        if fi_norm is not None:
            def fi_pair():
                dist.all_reduce(work)
                fi_norm.fused_add_rmsnorm(input=work, residual=work_res, weight=weight, eps=EPS)
            ops["unfused_fi_norm"] = fi_pair
        row = {"tokens": n}
        for name in (*FUSED_VARIANTS, *UNFUSED_VARIANTS):
            if name not in ops:
                row[name] = None
                continue
            stats = _time_op(ctx, ops[name], graphs=graphs)
            if stats.get("note"):
                notes.append(f"{n} tokens {name}: {stats['note']}")
            per_rank = ctx.gather(stats["median_us"])
            row[name] = max(per_rank)  # the slowest rank sets the pace of the step
            row[f"{name}_ranks"] = per_rank
            row[f"{name}_graph"] = stats["graph"]
        row["fused_rule"] = fused_by_rule(row, tp, hidden, kernel.sm)
        rows.append(row)
        del partial, residual, work, work_res, norm_out, res_out
    return {"rows": rows, "graphs": graphs and all(r.get(f"{k}_graph", True) for r in rows for k in FUSED_VARIANTS
                                                   if r.get(k) is not None),
            "replays": ns.replays, "calls_per_replay": ns.calls_per_replay, "warmup": ns.warmup,
            "hidden": hidden, "sm": kernel.sm, "fi_norm_error": fi_norm_error, "notes": notes,
            "device": ctx.device.type, "stand_in": bool(ns.stand_in)}


def _time_op(ctx: BenchRank, fn, *, graphs: bool) -> dict:
    """Median microseconds per call of ``fn`` on this rank.

    GPU: ``calls_per_replay`` calls captured in one CUDA graph (no launch gaps), replayed
    ``replays`` times between CUDA events. If any rank fails to capture, all time eagerly
    (every rank must run the same collectives). CPU: wall clock around the same loop.
    """
    ns, torch = ctx.args, ctx.torch
    calls, replays = ns.calls_per_replay, ns.replays
    if not ctx.on_gpu:
        for _ in range(ns.warmup):
            fn()
        ctx.barrier()
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
        return {"median_us": statistics.median(times), "graph": False}

    note, graph = None, None
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(max(1, ns.warmup)):
            fn()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    ctx.sync()
    ok = 0
    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: NCCL's watchdog thread may query events of earlier work meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(calls):
                    fn()
            ok = 1
        except Exception as exc:
            graph, note = None, f"graph capture failed ({type(exc).__name__}: {str(exc)[:120]}); timed eagerly"
        ctx.sync()
    use_graph = bool(graphs and ctx.agree_min(ok))
    if graphs and not use_graph and note is None:
        note = "another rank failed to capture; timed eagerly"

    def once():
        if use_graph:
            graph.replay()
        else:
            for _ in range(calls):
                fn()

    once()  # first replay uploads the graph
    ctx.sync()
    ctx.barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        s.record()
        once()
        e.record()
    ctx.sync()
    times = [s.elapsed_time(e) * 1000.0 / calls for s, e in zip(starts, ends)]
    del graph
    return {"median_us": statistics.median(times), "graph": use_graph, "note": note}


# ---- (c) the model --------------------------------------------------------------------

def layer_budget(config, tp: int, rank: int, *, free_bytes: int, dtype_bytes: int, kv_slots: int, max_len: int,
                 reserve_bytes: int) -> int:
    """How many decoder layers of ``config`` this rank can hold in ``free_bytes`` (weights +
    KV cache; ``reserve_bytes`` kept for activations and the fused workspace), at most
    ``config.num_hidden_layers``. Framework-free: sizes from the load plan's shapes."""
    from glm_fused.checkpoint import expected_shapes
    from glm_fused.sharding import TPShard

    shard = TPShard(config, rank, tp)
    fixed, per_layer = 0, {}
    for name, (shape, kind) in expected_shapes(config, shard).items():
        nbytes = math.prod(shape) * (4 if kind == "router" else dtype_bytes)
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            per_layer[i] = per_layer.get(i, 0) + nbytes
        else:
            fixed += nbytes
    kv = 2 * kv_slots * max_len * shard.num_kv_heads * config.head_dim * dtype_bytes
    budget = free_bytes - reserve_bytes - fixed
    used, count = 0, 0
    for i in range(config.num_hidden_layers):
        cost = per_layer.get(i, 0) + kv
        if used + cost > budget:
            break
        used, count = used + cost, count + 1
    return count


def run_model(ctx: BenchRank) -> dict:
    """Unfused and fused layout at the same random weights: parity and step times."""
    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.cli.logit_diff import DEFAULT_MIN_TOP1, DEFAULT_TOLERANCE
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    ns, torch, tp, rank = ctx.args, ctx.torch, ctx.world, ctx.rank
    warm, steps = ns.model_warmup, ns.decode_steps
    max_seqs = max(ns.batches)
    max_len = max(ns.prefill_tokens, ns.parity_tokens, ns.decode_context + warm + steps)
    step_tokens = ns.max_step_tokens
    dtype_bytes = 2 if ns.dtype == "bfloat16" else 4

    if ns.num_layers == "auto":
        full = load_config(ns.config_path, ns.config_layers)
        if ctx.on_gpu:
            free, _ = torch.cuda.mem_get_info(ctx.device)
            sharing = max(1, tp // max(1, ns.gpus)) if ctx.shares_gpu else 1
            # Activations of the largest step (a few dozen [tokens, hidden] buffers, the attention
            # scores), the fused workspace, allocator slack; --memory-fraction keeps more spare.
            reserve = 2 * 2**30 + step_tokens * full.hidden_size * 64
            layers = layer_budget(full, tp, rank, free_bytes=int(free * ns.memory_fraction) // sharing,
                                  dtype_bytes=dtype_bytes, kv_slots=max_seqs, max_len=max_len,
                                  reserve_bytes=reserve)
        else:
            layers = full.num_hidden_layers
        layers = ctx.agree_min(layers)  # every rank builds the same model
        if layers < 1:
            raise UserError(f"not one decoder layer of {ns.model} fits in --memory-fraction {ns.memory_fraction} "
                            f"of this GPU at TP {tp}")
    else:
        layers = ns.num_layers
    config = load_config(ns.config_path, layers)
    ctx.log(f"model: {ns.model}, {layers} of {ns.config_layers} layers, {ns.dtype}, "
            f"variants {', '.join(ns.model_variants)}")

    # Inputs identical for every variant: random ids (decode feeds ids, not each model's
    # argmax, so both layouts see the same tokens and their logits stay comparable).
    rng = np.random.default_rng(ns.seed + 12345)
    V = config.vocab_size
    parity_prompt = rng.integers(0, V, ns.parity_tokens).tolist()
    prefill_ids = rng.integers(0, V, ns.prefill_tokens).tolist()
    decode_prompts = {b: rng.integers(0, V, (b, ns.decode_context)).tolist() for b in ns.batches}
    decode_ids = {b: rng.integers(0, V, (warm + steps, b)).tolist() for b in ns.batches}

    timing: dict[str, dict] = {}
    logits: dict[str, dict[str, np.ndarray]] = {}
    build_seconds = {}
    for variant in ns.model_variants:
        fused, fusion_choice = MODEL_VARIANTS[variant]
        t0 = time.perf_counter()
        # Settings built here, not from a command line: the config is this benchmark's own.
        settings = EngineArgs(tp=tp, backend="torch", device="gpu" if ctx.on_gpu else "cpu", dtype=ns.dtype,
                              fused=fused, fusion_impl=fusion_choice, max_num_seqs=max_seqs, max_model_len=max_len,
                              max_num_batched_tokens=step_tokens, load_format="dummy", seed=ns.seed, resolved=True)
        settings.num_gpu_blocks_override = settings.slot_blocks()  # this benchmark sized its memory itself
        runner = ModelRunner(settings, config, tp_rank=rank, tp_size=tp)
        ctx.sync()
        build_seconds[variant] = round(time.perf_counter() - t0, 1)
        kernel = getattr(runner.comm, "kernel", None)
        out: dict[str, np.ndarray] = {}
        res: dict[str, dict] = {"impl": "off" if not fused else ("flashinfer" if kernel is not None else "reference")}
        try:
            out["prompt"] = runner.forward(ForwardBatch.prefill([parity_prompt], runner.slot_tables([0]),
                                                                all_logits=True))
            times = []
            for i in range(warm + ns.prefill_reps):
                ctx.barrier()
                t0 = time.perf_counter()
                last = runner.forward(ForwardBatch.prefill([prefill_ids], runner.slot_tables([0])))
                dt = time.perf_counter() - t0
                if i == 0:
                    out["prefill"], stats = last, runner.fusion_stats()
                if i >= warm:
                    times.append(dt * 1000)
            res["prefill"] = _step_times(ctx, times, stats)
            for b in ns.batches:
                slots = runner.slot_tables(range(b))
                runner.forward(ForwardBatch.prefill(decode_prompts[b], slots))
                times = []
                for step in range(warm + steps):
                    batch = ForwardBatch.decode(decode_ids[b][step], [ns.decode_context + step] * b, slots)
                    ctx.barrier()
                    t0 = time.perf_counter()
                    step_logits = runner.forward(batch)
                    dt = time.perf_counter() - t0
                    if step == 0:
                        out[f"decode_b{b}"], stats = step_logits, runner.fusion_stats()
                    if step >= warm:
                        times.append(dt * 1000)
                res[f"decode_b{b}"] = _step_times(ctx, times, stats)
        finally:
            runner.close()
            del runner
            gc.collect()
            if ctx.on_gpu:
                torch.cuda.empty_cache()
        timing[variant] = res
        logits[variant] = out if rank == 0 else {}
        ctx.log(f"model: {variant} done (built in {build_seconds[variant]} s)")

    parity = None
    if rank == 0 and "fused" in logits and "unfused" in logits:
        parity = compare_layouts(logits["unfused"], logits["fused"], {
            "prompt": f"prompt {ns.parity_tokens} (every position)",
            "prefill": f"prefill {ns.prefill_tokens} (last position)",
            **{f"decode_b{b}": f"decode batch {b} (first step)" for b in ns.batches}},
            tolerance=DEFAULT_TOLERANCE[ns.dtype], min_top1=DEFAULT_MIN_TOP1[ns.dtype])
    return {"name": ns.model, "num_layers": layers, "config_layers": ns.config_layers, "dtype": ns.dtype,
            "variants": ns.model_variants, "batches": ns.batches, "prefill_tokens": ns.prefill_tokens,
            "decode_context": ns.decode_context, "decode_steps": steps, "prefill_reps": ns.prefill_reps,
            "warmup": warm, "max_model_len": max_len, "max_num_batched_tokens": step_tokens,
            "build_seconds": build_seconds, "timing": timing, "parity": parity}


def compare_layouts(unfused: dict, fused: dict, titles: dict[str, str], *, tolerance: float,
                    min_top1: float) -> dict:
    """Fused logits against unfused ones, per scenario and over all rows pooled.

    The verdict is on the pooled rows (logit_diff's rule: max rel diff and top-1
    agreement): in bf16 a single-row scenario (decode at batch 1) whose top two logits sit
    within rounding of each other would otherwise fail on one coin flip.
    """
    import numpy as np

    from glm_fused import metrics

    rows = []
    for key, title in titles.items():
        m = metrics.compare_logits(unfused[key], fused[key])
        m.update(scenario=title, key=key, pass_=None)
        rows.append(m)
    a = np.concatenate([unfused[k].reshape(-1, unfused[k].shape[-1]) for k in titles])
    b = np.concatenate([fused[k].reshape(-1, fused[k].shape[-1]) for k in titles])
    finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
    pooled = metrics.compare_logits(a, b) if finite else {
        "positions": int(a.shape[0]), "max_abs_diff": float("nan"), "mean_abs_diff": float("nan"),
        "max_rel_diff": float("nan"), "kl_mean": float("nan"), "kl_max": float("nan"),
        "top1_agreement": 0.0, "top5_agreement": 0.0}
    passed = finite and pooled["max_rel_diff"] <= tolerance and pooled["top1_agreement"] >= min_top1
    pooled.update(scenario="all rows pooled", key="all", finite=finite, pass_=passed)
    rows.append(pooled)
    for r in rows:
        r["pass"] = r.pop("pass_")
    return {"rows": rows, "tolerance": {"max_rel_diff": tolerance, "min_top1": min_top1}, "passed": passed}


def _step_times(ctx: BenchRank, times_ms: list[float], stats: dict) -> dict:
    """This rank's median, and the slowest rank's (ranks wait for each other every step)."""
    median = statistics.median(times_ms) if times_ms else None
    per_rank = ctx.gather(median)
    known = [m for m in per_rank if m is not None]
    return {"median_ms": max(known) if known else None, "rank_medians_ms": per_rank, "samples_rank0": times_ms,
            "fused_impl": stats.get("fused_impl"), "fused_calls": stats.get("fused_allreduce_norm_calls"),
            "plain_allreduce_calls": stats.get("plain_allreduce_calls"),
            "fallback_reasons": stats.get("fallback_reasons")}


if __name__ == "__main__":
    sys.exit(main())
