#!/usr/bin/env python
"""Plant known bugs one at a time and check that the tests named for each one catch it.

    python scripts/mutate.py                 # every mutation in MUTATIONS (about 13 minutes on 2 cores)
    python scripts/mutate.py --list          # what each one plants, where, and its tests
    python scripts/mutate.py sampler-ignores-temperature router-logits-bf16

Each mutation is one find/replace in one file, applied to a fresh copy of this repository (the
files git tracks plus untracked ones it does not ignore) in a temporary directory; its tests
then run there with pytest. A test "catches" the bug when it fails with it. Results:

* caught: at least one of the mutation's tests failed (the table says how many of how many);
* survived: they all passed, so nothing guards that behaviour;
* not applicable: the text to replace no longer occurs exactly once in the file (the code
  moved or changed): update that row of MUTATIONS rather than let it pass silently;
* error: the tests could not run (none collected, a collection error, all skipped, timeout).

First the tests of every selected mutation run once together on an unchanged copy (the
baseline): a test that fails without the bug proves nothing, so a failing baseline stops here.
Exit status: 0 when every mutation was caught; 1 when one survived, the baseline failed or
a run errored; 3 when the only problem is a patch that no longer applies.

Mutations are described by behaviour, so they outlive a move of the code: when a file is
rewritten, re-point the row's ``file``/``old``/``new`` at the code that now has that behaviour.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str          # short id for the command line
    what: str          # the planted bug, as behaviour
    file: str          # relative to the repository root
    old: str           # must occur exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest arguments (node ids) that must fail with the bug


LN = "tests/test_layer_numerics.py"
MODEL_TP1 = "tests/test_model.py::test_matches_transformers_fused_equals_classic"
MUTATIONS: list[Mutation] = [
    # ---- model arithmetic, caught by the checks against transformers -------------------------
    Mutation("residual-add-dropped", "the norm's residual add is left out (classic norm and the fused reference)",
             "glm_fused/model/ops.py",
             "        if residual is not None:\n            x = x + residual\n",
             "        if residual is not None:\n            x = x\n",
             (f"{MODEL_TP1}[paddle-1]",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[paddle-reference-float32]")),
    Mutation("rmsnorm-gamma-ignored", "RMSNorm leaves out its weight",
             "glm_fused/model/ops.py",
             "        return weight * self.cast(xf, self.dtype_name(x))\n",
             "        return self.cast(xf, self.dtype_name(x))\n",
             (f"{MODEL_TP1}[torch-1]", f"{LN}::test_rmsnorm_fp32_matches_fp64[torch]")),
    Mutation("rmsnorm-eps-dropped", "RMSNorm leaves eps out of the square root",
             "glm_fused/model/ops.py",
             "self.rsqrt(self.mean(xf * xf, -1, keepdim=True) + eps)",
             "self.rsqrt(self.mean(xf * xf, -1, keepdim=True))",
             (f"{MODEL_TP1}[paddle-1]", f"{LN}::test_rmsnorm_fp32_matches_fp64[paddle]")),
    Mutation("rope-frequencies-over-head-dim", "RoPE frequencies spread over head_dim, not rotary_dim",
             "glm_fused/model/rotary.py",
             "np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)",
             "np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(head_dim)",
             (f"{MODEL_TP1}[torch-1]",)),
    Mutation("grouped-routing-top1", "an expert group scores by its best expert, not its best two",
             "glm_fused/model/ops.py",
             "self.topk(choice.reshape([T, routing.n_group, -1]), 2)",
             "self.topk(choice.reshape([T, routing.n_group, -1]), 1)",
             (f"{MODEL_TP1}[paddle-1]", f"{LN}::test_router_matches_fp64_and_keeps_fp32_logits_under_bf16[torch]")),
    Mutation("triton-moe-gate-up-swapped", "the Triton MoE kernel applies SiLU to up instead of gate",
             "glm_fused/torch_backend/kernels/fused_moe.py",
             "    h = acc_g * tl.sigmoid(acc_g) * acc_u\n", "    h = acc_u * tl.sigmoid(acc_u) * acc_g\n",
             ("tests/test_triton_kernels.py::test_kernels_under_the_triton_interpreter",)),
    Mutation("grouped-attention-group-length", "grouped decode attention lets every row of a group see the "
             "group's keys, not only those up to its own position",
             "glm_fused/torch_backend/kernels/decode_attention.py",
             "sc = tl.where(n[None, :] < tl.minimum(row_len, end)[:, None], sc, float(\"-inf\"))",
             "sc = tl.where(nm[None, :], sc, float(\"-inf\"))",
             ("tests/test_triton_kernels.py::test_kernels_under_the_triton_interpreter",)),
    Mutation("scheduler-first-row-logits", "the scheduler samples from a chunk's first row, not its last",
             "glm_fused/engine/scheduler.py",
             "logits_indices.append(offset + n - 1)", "logits_indices.append(offset)",
             ("tests/test_engine.py",)),
    Mutation("prefix-cache-hashes-in-flight-token", "a block joins the prefix cache while its last token is "
             "still in flight (hashed with what the host does not have yet)",
             "glm_fused/engine/block_manager.py",
             "full = min(seq.num_computed, seq.num_tokens) // self.block_size",
             "full = seq.num_computed // self.block_size",
             ("tests/test_engine.py::test_random_schedules_give_every_request_its_output_alone",)),
    # ---- what only precision, sharding or plumbing tests see --------------------------------
    Mutation("sampler-ignores-temperature", "the host sampler draws from softmax(logits), whatever the temperature",
             "glm_fused/engine/sampling.py",
             "    x = x / temperature\n", "    x = x\n",
             ("tests/test_engine.py::test_sampling_frequencies_follow_softmax_at_the_temperature",)),
    Mutation("device-sampler-ignores-temperature", "the device sampler (torch) draws from softmax(logits), "
             "whatever the temperature",
             "glm_fused/torch_backend/ops.py",
             "        xs = x / torch.where(temp > 0, temp, 1.0).double()[:, None]\n",
             "        xs = x\n",
             ("tests/test_engine.py::test_sampling_frequencies_follow_softmax_at_the_temperature",)),
    Mutation("adapter-outputs-swapped", "the FlashInfer adapter returns (residual, normed) instead of (normed, residual)",
             "glm_fused/fused_op/flashinfer.py",
             '        return kwargs["norm_out"], kwargs["residual_out"]\n',
             '        return kwargs["residual_out"], kwargs["norm_out"]\n',
             ("tests/test_fusion_policy.py::test_adapter_call_returns_normed_then_residual",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[torch-kernel-bfloat16]",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[paddle-kernel-bfloat16]")),
    Mutation("router-logits-bf16", "router logits computed in the model dtype (bf16), not fp32",
             "glm_fused/model/ops.py",
             "        return self.linear(self.float32(x), weight)\n",
             "        return self.float32(self.linear(x, self.cast(weight, self.dtype_name(x))))\n",
             (f"{LN}::test_router_matches_fp64_and_keeps_fp32_logits_under_bf16[torch]",)),
    Mutation("rmsnorm-statistics-bf16", "RMSNorm statistics computed in the model dtype (bf16), not fp32",
             "glm_fused/model/ops.py",
             "        xf = self.float32(x)\n        xf = xf * self.rsqrt",
             "        xf = x\n        xf = xf * self.rsqrt",
             (f"{LN}::test_rmsnorm_statistics_are_fp32_under_bf16",)),
    Mutation("up-proj-rank0-rows", "every rank reads rank 0's rows of up_proj (dense MLP, shared experts)",
             "glm_fused/checkpoint.py",
             'read(f"{src}up_proj.weight", (inter, H), _rows(a, b))',
             'read(f"{src}up_proj.weight", (inter, H), _rows(0, b - a))',
             ("tests/test_checkpoint.py::test_rank_slices_reassemble_the_full_tensors",)),
    Mutation("expert-up-proj-rank0-rows", "every rank reads rank 0's rows of each routed expert's up_proj",
             "glm_fused/checkpoint.py",
             'read(f"{ex}up_proj.weight", (I, H), _rows(a, b))',
             'read(f"{ex}up_proj.weight", (I, H), _rows(0, b - a))',
             ("tests/test_checkpoint.py::test_rank_slices_reassemble_the_full_tensors",)),
    Mutation("dummy-router-per-rank", "dummy weights draw the router per rank",
             "glm_fused/model/loader.py",
             'owner = "all" if kind == "router" else model.shard.rank',
             "owner = model.shard.rank",
             ("tests/test_model.py::test_forced_kernel_standalone_model_dummy_weights[torch-2]",
              "tests/test_model.py::test_forced_kernel_standalone_model_dummy_weights[paddle-2]")),
    Mutation("router-no-routed-scaling", "the router leaves out routed_scaling_factor",
             "glm_fused/model/ops.py",
             "        return weights * routing.scale, ids\n", "        return weights, ids\n",
             ("tests/test_cli.py::test_logit_diff_glm45_settings_match_transformers[paddle]",
              f"{LN}::test_router_matches_fp64_and_keeps_fp32_logits_under_bf16[paddle]")),
    # ---- the fused op's implementations, checked against fp64 on the CPU ----------------------
    Mutation("fused-residual-before-allreduce", "the fused op's reference adds the residual on every rank "
             "before the all-reduce",
             "glm_fused/fused_op/op.py",
             "    return F.add_rms_norm(comm.all_reduce_uncounted(partial), residual, weight, eps)\n",
             "    return F.add_rms_norm(comm.all_reduce_uncounted(partial if residual is None else partial + residual),\n"
             "                          None, weight, eps)\n",
             (f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[torch-reference-float32]",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[torch-reference-bfloat16]",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[paddle-reference-float32]")),
    Mutation("kernel-path-first-residual", "the fused op's kernel path passes the partial sum as the first "
             "layer's (absent) residual instead of zeros",
             "glm_fused/fused_op/op.py",
             "            residual = F.zeros_like(partial)\n", "            residual = partial\n",
             (f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[torch-kernel-bfloat16]",
              f"{LN}::test_fused_allreduce_residual_rmsnorm_matches_fp64[paddle-kernel-bfloat16]")),
    # ---- strictness and reporting -----------------------------------------------------------
    Mutation("extras-skipped-like-mtp", "the loader skips extra tensors in any layer, not only the MTP block",
             "glm_fused/checkpoint.py",
             "return bool(m) and int(m.group(1)) >= config.num_hidden_layers", "return bool(m)",
             ("tests/test_checkpoint.py::test_mtp_layer_is_skipped_but_other_extras_are_not",)),
    Mutation("metrics-zero-series-dropped", "/metrics leaves out an engine counter (plain all-reduces among "
             "them) while it is 0",
             "glm_fused/server/metrics.py",
             "            family.add_metric([self.model_name], value)\n            yield family\n",
             "            if value:\n"
             "                family.add_metric([self.model_name], value)\n            yield family\n",
             ("tests/test_server.py::test_metrics_move[tp2]",)),
    # ---- benchmarks --------------------------------------------------------------------------
    Mutation("bench-layers-one-metadata", "bench_layers hands the kernels' attention metadata to the plain ops too",
             "bench/bench_layers.py",
             "    metas = {on: metadata(on) for on in (False, True)}\n",
             "    metas = dict.fromkeys((False, True), metadata(True))\n",
             ("tests/test_triton_kernels.py::test_bench_layers_under_the_interpreter",)),
]


def repo_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore (what a checkout would test)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})


def copy_tree(files: list[str], dst: Path) -> None:
    for f in files:
        target = dst / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def apply(m: Mutation, tree: Path, write: bool = True) -> str | None:
    """Plant ``m`` in ``tree``; None when applied (or, ``write=False``, when it would apply),
    else why it cannot be."""
    path = tree / m.file
    if not path.is_file():
        return f"patch no longer applies: {m.file} does not exist"
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        return f"patch no longer applies: the text occurs {count} times in {m.file}"
    if write:
        path.write_text(text.replace(m.old, m.new))
    return None


def run_tests(tree: Path, tests: tuple[str, ...] | list[str], timeout: float, log: Path) -> tuple[int, dict, float]:
    """pytest in ``tree``; returns (exit status, outcome counts, seconds). 124 on timeout."""
    env = dict(os.environ)
    # Share the tiny checkpoint the real tree's tests build (no mutation touches its generator).
    env.setdefault("GLM_FUSED_CACHE", str(ROOT / ".pytest_cache" / "glm_fused"))
    t0 = time.monotonic()
    with log.open("wb") as f:
        try:
            code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                   cwd=tree, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
    lines = log.read_text(errors="replace").strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (failed|passed|skipped|errors?|deselected)",
                                                lines[-1] if lines else "")}
    if "errors" in counts:
        counts["error"] = counts.pop("errors")
    return code, counts, time.monotonic() - t0


def verdict(code: int, counts: dict) -> tuple[str, str]:
    ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
    bad = counts.get("failed", 0) + counts.get("error", 0)
    if code == 1 and bad:
        return "caught", f"{bad} of {ran} failed"
    if code == 0 and counts.get("passed", 0):
        return "survived", f"all {ran} passed"
    if code == 0:
        return "error", "every test skipped"
    if code == 124:
        return "error", "timed out"
    return "error", f"pytest exit {code} ({' '.join(f'{n} {k}' for k, n in counts.items()) or 'no summary'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true",
                        help="list the mutations, each with whether its patch applies to this tree, and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without any mutation")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary trees and logs")
    opts = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in opts.names if n not in known]
    if unknown:
        parser.error(f"unknown mutation {', '.join(unknown)} (see --list)")
    chosen = [known[n] for n in opts.names] if opts.names else MUTATIONS
    if opts.list:
        stale = 0
        for m in chosen:
            problem = apply(m, ROOT, write=False)
            stale += problem is not None
            print(f"{m.name}: {m.what}\n    {m.file}: {problem or 'patch applies'}\n    "
                  + "\n    ".join(m.tests))
        return 3 if stale else 0

    files = repo_files()
    work = Path(tempfile.mkdtemp(prefix="glm_fused-mutate-"))
    print(f"{len(chosen)} mutations; trees and logs under {work}", flush=True)
    if not opts.no_baseline:
        tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
        tree = work / "baseline"
        copy_tree(files, tree)
        code, counts, seconds = run_tests(tree, tests, opts.timeout, work / "baseline.log")
        print(f"baseline (no mutation): exit {code}, {counts} in {seconds:.0f} s", flush=True)
        if code != 0:
            print(f"the tests fail without any mutation; see {work / 'baseline.log'}")
            return 1
        shutil.rmtree(tree, ignore_errors=True)

    rows = []
    for m in chosen:
        tree = work / m.name
        copy_tree(files, tree)
        problem = apply(m, tree)
        if problem:
            result, detail, seconds = "not applicable", problem, 0.0
        else:
            code, counts, seconds = run_tests(tree, m.tests, opts.timeout, work / f"{m.name}.log")
            result, detail = verdict(code, counts)
        print(f"{m.name:34s} {result:15s} {detail} ({seconds:.0f} s)", flush=True)
        rows.append((m, result, detail))
        if not opts.keep:
            shutil.rmtree(tree, ignore_errors=True)
            if result == "caught":
                (work / f"{m.name}.log").unlink(missing_ok=True)

    print("\n| mutation | planted bug | file | result | tests |\n| --- | --- | --- | --- | --- |")
    for m, result, detail in rows:
        tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
        print(f"| {m.name} | {m.what} | `{m.file}` | {result}: {detail} | {tests} |")
    tally = {r: sum(1 for _, res, _ in rows if res == r) for r in ("caught", "survived", "not applicable", "error")}
    print("\n" + ", ".join(f"{n} {r}" for r, n in tally.items()))
    if tally["survived"] or tally["error"]:
        print(f"logs of the mutations not caught: {work}")
        return 1
    if tally["not applicable"]:
        return 3
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
