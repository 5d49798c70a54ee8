"""The accuracy tool: the same prompts through the fused and the unfused model, compared.

Both models run on the same ranks with the same weights, one after the other (only one
model is in memory at a time). Rank 0 writes the logits to a private file; this process
computes the metrics (``glm_fused.metrics``), prints the table and decides the exit code.

``--fp32-reference``: the same weights also run in float32 (classic layout, plain all-reduces)
on the same ranks, beside the fused model (its weights are copied: a bf16 model's exactly, an
fp8 model's dequantized), so each of fused and unfused is measured against one yardstick and
the tool can say which side is off; the fused model's mean row error to fp32 may then be at
most ``--max-error-ratio`` times the unfused model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from glm_fused.errors import UserError
from glm_fused.launcher import stdout_gone

# Defaults of the pass/fail rule, per compute dtype. fp32: the two layouts differ only by the
# order of additions (~1e-6 of the largest logit). bf16: one bf16 path alone is up to ~5e-2
# (max rel) and ~5% of top-1 from fp32 at GLM-4.5-Air's width (docs/gpu-results.md), and the
# two layouts round at different points, so they may differ by up to about twice that.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-1, "float16": 1e-1}
DEFAULT_MIN_TOP1 = {"float32": 0.99, "bfloat16": 0.85, "float16": 0.85}
DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In a distant galaxy, a small robot wondered why the stars",
]


def build_parser() -> argparse.ArgumentParser:
    from glm_fused.engine_args import EngineArgs

    p = argparse.ArgumentParser(
        prog="logit_diff.py",
        description="Compare fused (all-reduce + residual + RMSNorm in one call) against unfused logits.",
        epilog="Exit status: 0 within tolerance, 1 past it, 2 for a usage or input error.")
    EngineArgs.add_cli_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", metavar="FILE.json",
                     help="JSON list of token-id lists")
    src.add_argument("--prompts", metavar="FILE.txt",
                     help="one prompt per line, tokenized with the checkpoint's tokenizer after [gMASK]<sop>")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="greedy continuation length compared between the two models (default 16)")
    p.add_argument("--json", metavar="OUT.json", help="write the metrics and fusion counters here")
    p.add_argument("--save-logits", metavar="OUT.npz",
                   help="write fused_i and unfused_i float32 [len_i, vocab] for each prompt i")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest allowed max|fused - unfused| / max|unfused logit| "
                        f"(default {DEFAULT_TOLERANCE['float32']:g} for float32, "
                        f"{DEFAULT_TOLERANCE['bfloat16']:g} for bfloat16/float16)")
    p.add_argument("--min-top1", type=float, default=None,
                   help="smallest allowed top-1 agreement (default "
                        f"{DEFAULT_MIN_TOP1['float32']} for float32, {DEFAULT_MIN_TOP1['bfloat16']} for bfloat16)")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also run the same weights in float32 (unfused) on the same ranks and measure fused and "
                        "unfused each against it")
    p.add_argument("--max-error-ratio", type=float, default=1.1,
                   help="with --fp32-reference: largest allowed (fused mean row error to fp32) / (unfused mean row "
                        "error to fp32) (default 1.1)")
    p.add_argument("--hf-reference", action="store_true",
                   help="also compare both against transformers' Glm4MoeForCausalLM (torch, needs the "
                        "whole model in this process's memory: small checkpoints only)")
    return p


# ---- parent: validate inputs before any rank starts -----------------------------------

def _load_prompts(args, spec, config) -> list[list[int]]:
    if args.prompt_ids is not None:
        try:
            raw = json.loads(Path(args.prompt_ids).read_text())
        except FileNotFoundError:
            raise UserError(f"--prompt-ids {args.prompt_ids}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"--prompt-ids {args.prompt_ids}: not valid JSON ({exc})") from None
        except OSError as exc:  # a directory, no permission
            raise UserError(f"--prompt-ids {args.prompt_ids}: cannot read it ({exc.strerror or exc})") from None
        ok = isinstance(raw, list) and raw and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in raw)
        if not ok:
            raise UserError(f"--prompt-ids {args.prompt_ids}: expected a non-empty JSON list of "
                            f"non-empty lists of token ids")
        prompts = raw
        source = f"--prompt-ids {args.prompt_ids}"
    else:
        if args.prompts is not None:
            try:
                lines = Path(args.prompts).read_text().splitlines()
            except FileNotFoundError:
                raise UserError(f"--prompts {args.prompts}: file not found") from None
            except UnicodeDecodeError:
                raise UserError(f"--prompts {args.prompts}: not UTF-8 text") from None
            except OSError as exc:
                raise UserError(f"--prompts {args.prompts}: cannot read it ({exc.strerror or exc})") from None
            texts = [line for line in lines if line.strip()]
            if not texts:
                raise UserError(f"--prompts {args.prompts}: no prompts (one per line)")
            source = f"--prompts {args.prompts}"
        else:
            texts, source = DEFAULT_PROMPTS, "built-in prompts"
        prompts = _tokenize(texts, spec, config, source, args.seed)
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < config.vocab_size]
        if bad:
            raise UserError(f"{source}: prompt {i} has token id {bad[0]} outside 0..{config.vocab_size - 1}")
    return prompts


def _tokenize(texts, spec, config, source, seed) -> list[list[int]]:
    if spec.path is None or not (Path(spec.path) / "tokenizer.json").exists():
        if source != "built-in prompts":
            raise UserError(f"{source}: the model has no tokenizer.json; give --prompt-ids instead")
        # Random weights without a tokenizer: random token ids are as good a probe as text.
        rng = np.random.default_rng(seed)
        return [rng.integers(0, config.vocab_size, size=8 + 5 * i).tolist() for i in range(len(texts))]
    from glm_fused.tokenizer import Tokenizer

    tok = Tokenizer(spec.path)
    prefix = [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]
    prefix = [t for t in prefix if t is not None]
    return [prefix + tok.encode(text) for text in texts]


def _check_outputs(args) -> None:
    """Outputs must never overwrite an input."""
    inputs = {Path(x).resolve() for x in (args.prompt_ids, args.prompts) if x is not None}
    for flag, out in (("--json", args.json), ("--save-logits", args.save_logits)):
        if out is None:
            continue
        out = Path(out)
        if out.resolve() in inputs:
            raise UserError(f"{flag} {out}: would overwrite an input file")
        if out.is_dir():
            raise UserError(f"{flag} {out}: is a directory")
        if not out.parent.exists():
            raise UserError(f"{flag} {out}: directory {out.parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    from glm_fused.cli import common

    parser = build_parser()
    prepared = {}

    def checks(args):  # after the shared flag checks, before any rank starts
        if not args.fused:
            raise UserError("--unfused: logit_diff always runs both layouts; drop the flag")
        if args.max_new_tokens < 0:
            raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
        if not args.max_error_ratio > 0:
            raise UserError(f"--max-error-ratio {args.max_error_ratio}: must be positive")
        if args.tolerance is not None and not args.tolerance >= 0:
            raise UserError(f"--tolerance {args.tolerance}: must be 0 or more")
        if args.min_top1 is not None and not 0 <= args.min_top1 <= 1:
            raise UserError(f"--min-top1 {args.min_top1}: must be in [0, 1] (a fraction of positions)")
        _check_outputs(args)
        spec = resolve_model(args.model, load_format=args.load_format)
        config = Glm4MoeConfig.from_json_file(args.config_path)
        prompts = _load_prompts(args, spec, config)
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        if longest > config.max_position_embeddings:
            raise UserError(f"a prompt of {longest - args.max_new_tokens} tokens + --max-new-tokens "
                            f"{args.max_new_tokens} exceeds max_position_embeddings={config.max_position_embeddings}")
        # One sequence at a time in slot 0, sized to the longest prompt and continuation.
        args.prompts, args.max_num_seqs = prompts, 1
        args.max_model_len = args.max_num_batched_tokens = longest
        if args.num_gpu_blocks_override is None:
            args.num_gpu_blocks_override = -(-longest // args.block_size)
        args.tolerance = DEFAULT_TOLERANCE[args.dtype] if args.tolerance is None else args.tolerance
        args.min_top1 = DEFAULT_MIN_TOP1[args.dtype] if args.min_top1 is None else args.min_top1
        args.result_file = str(Path(tmp) / "logits.npz")
        prepared.update(args=args, spec=spec)

    from glm_fused.config import Glm4MoeConfig
    from glm_fused.model_path import resolve_model

    with tempfile.TemporaryDirectory(prefix="glm_fused_logit_diff_") as tmp:
        status = common.run_main(parser, "glm_fused.cli.logit_diff:worker", argv, extra_checks=checks)
        if status != 0:
            return status
        args = prepared["args"]
        with np.load(args.result_file, allow_pickle=False) as data:
            results = {k: data[k] for k in data.files}
        stats = json.loads(Path(args.result_file).with_name("stats.json").read_text())
    try:
        hf = _hf_reference(prepared["spec"], args.prompts) if args.hf_reference else None
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    report = _report(args.prompts, results, stats, hf, args.tolerance, args.min_top1, vars(args),
                     args.max_error_ratio if args.fp32_reference else None)
    # the files first: a reader of stdout that leaves early (`| head`) must not cost them
    if args.json:
        _atomic_write(Path(args.json), lambda f: f.write(json.dumps(report, indent=2).encode()))
    if args.save_logits:
        arrays = {k: v for k, v in results.items()
                  if k.startswith(("fused_", "unfused_", "fp32_")) and "greedy" not in k}
        if hf is not None:
            arrays.update({f"transformers_{i}": v for i, v in enumerate(hf)})
        _atomic_write(Path(args.save_logits), lambda f: np.savez(f, **arrays))
    try:
        _print_report(report)
    except BrokenPipeError:
        return stdout_gone()
    return 0 if report["passed"] else 1


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- every rank -----------------------------------------------------------------------

def worker(args: dict) -> None:
    import argparse
    import dataclasses

    from glm_fused.batch import ForwardBatch
    from glm_fused.cli import common
    from glm_fused.model.loader import copy_weights
    from glm_fused.runner import ModelRunner

    ns = argparse.Namespace(**args)
    out: dict[str, np.ndarray] = {}
    stats = {}
    rank = common.Rank(ns)

    def prefill(runner, prompt):
        return runner.forward(ForwardBatch.prefill([prompt], runner.slot_tables([0]), all_logits=True))

    for fused in (True, False):
        tag = "fused" if fused else "unfused"
        rank.args.fused = fused
        runner = rank.build_runner()
        try:
            for i, prompt in enumerate(ns.prompts):
                logits = prefill(runner, prompt)
                if i == 0:
                    stats[tag] = runner.fusion_stats()  # one prefill forward
                out[f"{tag}_{i}"] = logits
                tokens = [int(logits[-1].argmax())] if ns.max_new_tokens else []
                for k in range(ns.max_new_tokens - 1):
                    step = runner.forward(ForwardBatch.decode([tokens[-1]], [len(prompt) + k],
                                                              runner.slot_tables([0])))
                    if i == 0 and k == 0:
                        stats[f"{tag}_decode"] = runner.fusion_stats()  # one decode forward
                        stats[f"{tag}_decode_mode"] = runner.decode_mode()
                    tokens.append(int(step[0].argmax()))
                out[f"{tag}_greedy_{i}"] = np.asarray(tokens, dtype=np.int64)
            if fused and ns.fp32_reference:  # the same weights in fp32, beside this model for the copy
                settings = dataclasses.replace(rank.args, dtype="float32", fused=False, fusion_impl="reference",
                                               load_format="dummy")
                reference = ModelRunner(settings, rank.config, tp_rank=rank.rank, tp_size=rank.world)
                try:
                    copy_weights(runner.model, reference.model)
                    for i, prompt in enumerate(ns.prompts):
                        out[f"fp32_{i}"] = prefill(reference, prompt)
                finally:
                    reference.close()
        finally:
            runner.close()
            rank.runner = runner = None
    if rank.rank == 0:
        np.savez(ns.result_file, **out)
        Path(ns.result_file).with_name("stats.json").write_text(json.dumps(stats))


# ---- report ---------------------------------------------------------------------------

def _hf_reference(spec, prompts) -> list[np.ndarray]:
    try:
        import torch
        import transformers
    except ImportError:
        raise UserError("--hf-reference: needs torch and transformers (pip install 'glm_fused[test]')") from None
    if spec.path is None:
        raise UserError("--hf-reference: needs a checkpoint (not --load-format dummy)")
    transformers.logging.set_verbosity_error()  # its load report lists the MTP tensors it ignores
    model = transformers.Glm4MoeForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().numpy() for p in prompts]


def _report(prompts, results, stats, hf, tolerance, min_top1, run_args, max_error_ratio=None) -> dict:
    from glm_fused import metrics

    rows, hf_rows, fp32_rows = [], [], []
    for i, prompt in enumerate(prompts):
        fused, unfused = results[f"fused_{i}"], results[f"unfused_{i}"]
        row = metrics.compare_logits(unfused, fused)
        row["greedy_agreement"] = metrics.sequence_agreement(
            results[f"fused_greedy_{i}"].tolist(), results[f"unfused_greedy_{i}"].tolist())
        rows.append(row)
        if hf is not None:
            hf_rows.append({"fused": metrics.compare_logits(hf[i], fused),
                            "unfused": metrics.compare_logits(hf[i], unfused)})
        if f"fp32_{i}" in results:
            fp32_rows.append({tag: metrics.compare_logits(results[f"fp32_{i}"], results[f"{tag}_{i}"])
                              for tag in ("fused", "unfused")})
    overall = metrics.aggregate(rows)
    passed = overall["max_rel_diff"] <= tolerance and overall["top1_agreement"] >= min_top1
    vs_fp32 = None
    if fp32_rows:
        vs_fp32 = {tag: metrics.aggregate([r[tag] for r in fp32_rows]) for tag in ("fused", "unfused")}
        unfused_error = vs_fp32["unfused"]["mean_row_rel_diff"]
        vs_fp32["max_error_ratio"] = max_error_ratio
        # None: the unfused model computes in fp32 with plain all-reduces - it is the reference itself
        vs_fp32["error_ratio"] = vs_fp32["fused"]["mean_row_rel_diff"] / unfused_error if unfused_error else None
        if vs_fp32["error_ratio"] is not None:
            passed = passed and vs_fp32["error_ratio"] <= max_error_ratio
    fusion = dict(stats["fused"])
    fusion["per_decode_step"] = stats.get("fused_decode")
    fusion["decode_mode"] = stats.get("fused_decode_mode")  # CUDA graphs or eager
    fusion["unfused_model"] = {k: stats["unfused"][k] for k in ("fused_allreduce_norm_calls",
                                                                "plain_allreduce_calls")}
    report = {
        "model": run_args.get("model_name"), "backend": run_args["backend"], "tp": run_args["tp"],
        "dtype": run_args["dtype"], "device": run_args.get("device"),
        "tolerance": {"max_rel_diff": tolerance, "min_top1": min_top1},
        "prompts": [dict(tokens=len(p), **r) for p, r in zip(prompts, rows)],
        "overall": overall,
        "fusion": fusion,
        "passed": bool(passed),
    }
    if vs_fp32 is not None:
        report["vs_fp32"] = vs_fp32
    if hf is not None:
        report["vs_transformers"] = {
            "fused": metrics.aggregate([r["fused"] for r in hf_rows]),
            "unfused": metrics.aggregate([r["unfused"] for r in hf_rows]),
        }
    return report


def _print_report(report: dict) -> None:
    cols = ("tokens", "max_abs_diff", "mean_abs_diff", "max_rel_diff", "kl_mean", "top1_agreement",
            "top5_agreement", "greedy_agreement")
    heads = ("prompt", "tokens", "max|d|", "mean|d|", "max rel", "KL", "top1", "top5", "greedy")
    print(f"logit_diff: {report['model']}  backend={report['backend']}  tp={report['tp']}  "
          f"dtype={report['dtype']}  (fused vs unfused)")
    print("  ".join(f"{h:>9}" for h in heads))

    def fmt(name, row):
        cells = [f"{name:>9}"]
        for c in cols:
            v = row.get(c, row.get("positions") if c == "tokens" else None)
            cells.append(f"{v:>9}" if isinstance(v, int) else f"{v:>9.2e}" if c.endswith(("diff", "mean"))
                         else f"{v:>9.4f}")
        return "  ".join(cells)

    for i, row in enumerate(report["prompts"]):
        print(fmt(str(i), row))
    print(fmt("overall", report["overall"]))
    f = report["fusion"]
    print(f"fusion per forward (fused model): {f['fused_allreduce_norm_calls']} fused all-reduce+norm calls, "
          f"{f['plain_allreduce_calls']} plain all-reduces, implementation {f.get('fused_impl')}")
    if "vs_transformers" in report:
        for tag, m in report["vs_transformers"].items():
            print(f"vs transformers ({tag}): max|d| {m['max_abs_diff']:.2e}  max rel {m['max_rel_diff']:.2e}  "
                  f"top1 {m['top1_agreement']:.4f}")
    if "vs_fp32" in report:
        v = report["vs_fp32"]
        for tag in ("fused", "unfused"):
            m = v[tag]
            print(f"vs fp32, same weights ({tag}): mean row error {m['mean_row_rel_diff']:.2e}  max rel "
                  f"{m['max_rel_diff']:.2e}  KL {m['kl_mean']:.2e}  top1 {m['top1_agreement']:.4f}")
        if v["error_ratio"] is None:
            print("fused / unfused error to fp32: n/a (the unfused model runs in fp32: it is the reference)")
        else:
            print(f"fused / unfused error to fp32: {v['error_ratio']:.3f} (limit {v['max_error_ratio']:g})")
    tol = report["tolerance"]
    verdict = "PASS" if report["passed"] else "FAIL"
    print(f"{verdict}: max rel diff {report['overall']['max_rel_diff']:.2e} (limit {tol['max_rel_diff']:g}), "
          f"top-1 agreement {report['overall']['top1_agreement']:.4f} (minimum {tol['min_top1']})")


if __name__ == "__main__":
    sys.exit(main())
