"""The Triton kernels (glm_fused/torch_backend/kernels) against the eager layers they replace.

On CPU: Triton's interpreter runs every kernel, and the tiny model with the kernels on vs off,
in fp32 (tolerance 1e-5 relative; the interpreter has no bf16 arithmetic). On a GPU: the same
checks in bf16 at GLM-4.5-Air's sizes (tolerance 2e-2 relative, bf16 rounding), and CUDA-graph
decode against eager decode through the ModelRunner.

fp8 (weights e4m3 with row scales, activations quantized per token inside the kernels): each
kernel against the same fp8 maths emulated in plain torch (tests/triton_checks.py
``emulated_ops``) with the tolerances above, and against fp32 on the dequantized weights
within FP8_VS_FP32 = 5e-2 (max |diff| / max |ref|): the issue's rule, written before the first
GPU run; e4m3 rounds activations to 3 mantissa bits (up to 6% per element), measured 2-4% on
CPU at toy sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
FP32_TOL = 1e-5
BF16_TOL = 2e-2
# fp8 against fp32, the rule 1, fixed before the first GPU run. On an H200 the Air-size
# checks measured up to 0.047; the toy fused-MoE check in bf16 (test_kernels_small_bf16) 0.0508:
# a known miss, kept as measured (docs/fp8.md).
FP8_VS_FP32 = 5e-2
# fp8 checks in bf16 against their emulation (kernels off): where the two bf16 activations
# differ by one ulp before quantization, their fp8 codes can differ by one step (up to 1/8 of
# the value), so the bf16 tolerance is too tight; measured on an H200: up to 0.039 (model_fp8).
FP8_BF16_TOL = 5e-2
FLAGS = ("router_ids_differ", "router_shared_column_bad", "align_bad_m1", "align_bad_m16", "no_residual_passthrough",
         "q_in_place", "other_rows_untouched", "zero_row_nan")


def _assert_checks(results: dict, tol: float) -> None:
    """Every check judged; all that miss named in one failure, so one miss cannot hide another."""
    missed = []
    for name, values in results.items():
        fp8 = name.startswith(("moe_fp8", "linear_fp8", "model_fp8"))
        for key, value in values.items():
            if key in FLAGS:
                if value != 0.0:
                    missed.append((name, key, value, "must be 0"))
                continue
            if key.startswith("fp8_vs_fp32"):
                limit = FP8_VS_FP32
            else:
                limit = FP8_BF16_TOL if fp8 and tol == BF16_TOL else tol
            if not value <= limit:  # (a NaN misses too)
                missed.append((name, key, value, limit))
    assert not missed, missed


def _interpreter_env() -> dict:
    """A child process's environment that runs the kernels under Triton's CPU interpreter."""
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kernels_under_the_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    # the interpreter is single-threaded Python: the checks are shared by one process per core (at most 4)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = _interpreter_env()
    procs = [subprocess.Popen([sys.executable, str(HERE / "triton_checks.py"), "cpu", "float32", str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(max(1, min(4, cores)))]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=540)
            assert proc.returncode == 0, err[-3000:]
            for line in out.splitlines():
                row = json.loads(line)
                results[row.pop("check")] = row
    finally:
        for proc in procs:
            proc.kill()
    from triton_checks import CHECKS

    assert set(results) == set(CHECKS)
    _assert_checks(results, FP32_TOL)


def _sm90_compile(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """``fn`` compiled for an H100/H200 (sm90) with Triton's bundled ptxas: no GPU needed."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton

    src = ASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                           "num_stages": num_stages})


def _assert_pdl(ptx: str) -> None:
    """A kernel built for PDL waits for the kernel before, then lets the next one start."""
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < launch, "no griddepcontrol.wait before launch_dependents"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fp8_kernels_compile_for_sm90():
    """The fp8 kernels as the GPU would build them (the interpreter never lowers them): the
    weight-only tiles widen e4m3 codes for bf16 products, quantize-in-kernel tiles quantize
    activations (``cvt.rn.satfinite`` to e4m3), prefill tiles read e4m3 rows and multiply with
    e4m3 wgmma."""
    pytest.importorskip("triton")
    from glm_fused.torch_backend.kernels import fp8, fused_moe

    try:
        quant = _sm90_compile(fp8._per_token_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                                            "K": "i32", "stride_x": "i32", "stride_q": "i32"},
                              {"BLOCK": 1024, "PDL": False})
    except Exception as exc:  # no ptxas in this Triton build
        pytest.skip(f"cannot compile for sm90 here: {type(exc).__name__}: {str(exc)[:200]}")
    assert "cvt.rn.satfinite.e4m3x2.f32" in quant.asm["ptx"]
    assert "griddepcontrol" not in quant.asm["ptx"]  # launched the ordinary way: no PDL instructions
    for kind, bm, bn in ((fp8.MMA, 16, 32), (fp8.SWAP, 16, 64), (fp8.FMA, 1, 16)):
        gemv = _sm90_compile(fp8._weight_only_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
            "N": "i32", "K": "i32", "stride_x": "i32", "stride_w": "i32", "stride_o": "i32"},
            {"HAS_BIAS": False, "EVEN_K": True, "KIND": kind, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 256,
             "PDL": True})
        assert "e4m3x2" in gemv.asm["ptx"]  # e4m3 codes widened in registers
        _assert_pdl(gemv.asm["ptx"])
        ptx = gemv.asm["ptx"]  # the first weight tile is requested before the wait
        assert 0 <= ptx.find("ld.global") < ptx.find("griddepcontrol.wait")
        assert ("mma" in gemv.asm["ptx"]) == (kind != fp8.FMA)  # bf16 tensor cores, or none
    for mode, tile, kind in ((fused_moe.QUANT_IN_KERNEL, (16, 128, 128, 1, 4, 3), fused_moe.MMA),
                             (fused_moe.WEIGHT_ONLY, (16, 32, 256, 1, 4, 4), fused_moe.MMA),
                             (fused_moe.WEIGHT_ONLY, (16, 64, 128, 1, 4, 4), fused_moe.SWAP),
                             (fused_moe.WEIGHT_ONLY, (1, 8, 512, 1, 4, 3), fused_moe.FMA),
                             (fused_moe.QUANTIZED_INPUT, (128, 128, 64, 8, 8, 4), fused_moe.MMA)):
        bm, bn, bk, gm, warps, stages = tile
        a = "*fp8e4nv" if mode == fused_moe.QUANTIZED_INPUT else "*bf16"
        common = {"w_ptr": "*fp8e4nv", "sh_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "sh_s_ptr": "*fp32",
                  "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "N": "i32", "K": "i32", "num_m": "i32",
                  "shared_id": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i32"}
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "PREC": "tf32", "FP8": mode,
                  "KIND": kind, "PDL": True}
        gate_up = _sm90_compile(fused_moe._gate_up_kernel, {
            "x_ptr": a, "xs_ptr": "*fp32", "h_ptr": "*bf16", "I": "i32", "stride_x": "i32", "stride_h": "i32",
            **common}, {"TOP_K": 9, **consts}, warps, stages)
        down = _sm90_compile(fused_moe._down_kernel, {
            "h_ptr": a, "hs_ptr": "*fp32", "y_ptr": "*bf16", "pw_ptr": "*fp32", "H": "i32", "stride_h": "i32",
            "stride_y": "i32", **common}, consts, warps, stages)
        for kernel in (gate_up, down):
            ptx = kernel.asm["ptx"]
            _assert_pdl(ptx)
            if mode == fused_moe.QUANTIZED_INPUT:
                assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
            elif mode == fused_moe.WEIGHT_ONLY:
                assert "e4m3x2" in ptx and "satfinite" not in ptx  # codes widened; nothing quantized
            else:
                assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_decode_attention_reads_host_inputs_before_the_pdl_wait():
    """Decode attention as the GPU would build it: the lengths and the first tile's page ids
    (uploaded by the host, never written by the kernel before) are read before
    ``griddepcontrol.wait``, in both stages; and a tile over several pages loads one id per
    page, not one per key (a load per key kept batch 2 at 512 keys 1.13x the contiguous kernel)."""
    pytest.importorskip("triton")
    from glm_fused.torch_backend.kernels import decode_attention as da

    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "len_ptr": "*i32",
           "lead_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32", "splits": "i32",
           **{f"stride_{n}": "i32" for n in ("qs", "qh", "table", "cblock", "cpos", "ch", "os", "oh", "osp", "ls",
                                              "lh")}}
    loads = {}
    for page, rows in ((16, 1), (64, 1), (1, 1), (16, da.GROUP_ROWS), (1, da.GROUP_ROWS)):  # (1: the smallest block)
        try:
            kernel = _sm90_compile(da._stage1, sig, dict(
                GROUP=12, GROUP_B=16, HEAD_DIM=128, BLOCK=da.BLOCK_N, PREC="tf32", PAGED=True, PAGE=page, PDL=True,
                ROWS=rows, LONE=False, DIRECT=False))
        except Exception as exc:  # no ptxas in this Triton build
            pytest.skip(f"cannot compile for sm90 here: {type(exc).__name__}: {str(exc)[:200]}")
        ptx = kernel.asm["ptx"]
        _assert_pdl(ptx)
        assert 0 <= ptx.find("ld.global") < ptx.find("griddepcontrol.wait"), (page, rows)
        loads[page, rows] = ptx.count("ld.global")
    assert max(loads[16, 1], loads[1, 1]) <= loads[64, 1] + 8, loads  # 4 or 64 page ids, not one load per key
    stage2 = _sm90_compile(da._stage2, {
        "o_ptr": "*fp32", "lse_ptr": "*fp32", "len_ptr": "*i32", "lead_ptr": "*i32", "out_ptr": "*bf16",
        "splits": "i32", "splits1": "i32", "num_heads": "i32", "stride_os": "i32", "stride_oh": "i32",
        "stride_osp": "i32", "stride_ls": "i32", "stride_lh": "i32", "stride_outs": "i32", "stride_outh": "i32"},
        dict(SPLITS_B=da.MAX_SPLITS, HEADS_B=1, HEAD_DIM=128, BLOCK=da.BLOCK_N, PDL=True, GROUPED=False))
    ptx = stage2.asm["ptx"]
    _assert_pdl(ptx)
    assert 0 <= ptx.find("ld.global") < ptx.find("griddepcontrol.wait")


def test_row_groups_and_when_a_step_replays_them():
    """Runs of one sequence's rows cut in groups of four (a row alone is a group of one), and
    the rule that picks the grouped graph: a chunk after >= GROUPED_MIN_CONTEXT cached
    positions whose rows read at least twice the keys of the step's decodes."""
    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.torch_backend.cuda_graph import GROUPED_MIN_CONTEXT, DecodeGraphs
    from glm_fused.torch_backend.kernels.decode_attention import row_groups

    assert row_groups(np.array([7, 3, 3, 3, 3, 3, 3, 9, 2, 2, 2, 2, 2, 2, 2, 2, 2])).tolist() == [
        1, 4, 0, 0, 0, 2, 0, 1, 4, 0, 0, 0, 4, 0, 0, 0, 1]
    assert row_groups(np.array([], dtype=np.int64)).tolist() == []
    # a lone chunk (its own short path), and the group size as given
    assert row_groups(np.full(6, 5)).tolist() == [4, 0, 0, 0, 2, 0]
    assert row_groups(np.full(1, 5)).tolist() == [1]
    assert row_groups(np.full(7, 5), rows=2).tolist() == [2, 0, 2, 0, 2, 0, 1]
    rng = np.random.default_rng(0)
    for _ in range(200):  # against the rule written out row by row
        runs = rng.integers(1, 11, rng.integers(1, 8))
        seq = np.repeat(rng.permutation(50)[:len(runs)], runs)
        size = int(rng.integers(1, 6))
        want = []
        for n in runs:
            want += [min(size, n - i) if i % size == 0 else 0 for i in range(n)]
        assert row_groups(seq, rows=size).tolist() == want

    def step(chunk_context, chunk_len, decode_contexts):
        ctx = [chunk_context] + list(decode_contexts)
        q = [chunk_len] + [1] * len(decode_contexts)
        pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q)])
        return ForwardBatch(np.zeros(sum(q)), pos, q, ctx, [sum(q) - 1], np.zeros((len(q), 200)))

    c = GROUPED_MIN_CONTEXT
    assert DecodeGraphs.grouped(step(c, 32, []))
    assert not DecodeGraphs.grouped(step(c - 1, 32, []))  # a short context: re-read per row is cheaper
    assert DecodeGraphs.grouped(step(2048, 16, [512] * 8))
    assert not DecodeGraphs.grouped(step(1024, 32, [1024] * 32))  # the decodes' keys dominate


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("triton")
    return torch.device("cuda", 0)


@pytest.mark.gpu
def test_kernels_small_bf16(cuda):
    import triton_checks

    _assert_checks(triton_checks.run_all("cuda", torch.bfloat16), BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 300, 2048])
def test_fused_moe_at_air_sizes(cuda, T):
    import triton_checks

    res = triton_checks.check_fused_moe("cuda", torch.bfloat16, T=T, hidden=4096, inter=1408, experts=128,
                                        top_k=8, seed=T)
    _assert_checks({"fused_moe": res}, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 300, 2048])
def test_fused_moe_fp8_at_air_sizes(cuda, T):
    """The fp8 fused MoE (shared expert folded) at GLM-4.5-Air's sizes, bf16 activations."""
    import triton_checks

    res = triton_checks.check_moe_fp8("cuda", torch.bfloat16, T=T, hidden=4096, inter=1408, experts=128, top_k=8,
                                      seed=T)
    _assert_checks({"moe_fp8": res}, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 2048])
@pytest.mark.parametrize("N, K", [(14336, 4096), (4096, 12288), (21888, 4096), (4096, 10944)])
def test_linear_fp8_at_air_sizes(cuda, M, N, K):
    """The fp8 Linear (per-token quantization + _scaled_mm) at the attention and dense-MLP sizes."""
    import triton_checks

    res = triton_checks.check_linear_fp8("cuda", torch.bfloat16, M=M, K=K, N=N, seed=M)
    _assert_checks({"linear_fp8": res}, BF16_TOL)


@pytest.mark.gpu
def test_kernels_launch_with_pdl(cuda):
    """On sm90 and later the kernels are launched with PDL (the compiled kernels carry the
    launch option) and give the same bits as ordinary launches: a chain of add + RMSNorm and
    fp8 Linears, where a kernel reading its input before the previous one finished would differ."""
    from glm_fused.torch_backend.kernels import fp8, pdl, rmsnorm

    if torch.cuda.get_device_capability(cuda)[0] < 9:
        pytest.skip("PDL needs sm90 or later")
    g = torch.Generator(device=cuda).manual_seed(0)
    x = torch.randn(1, 4096, device=cuda, dtype=torch.bfloat16, generator=g)
    norm_w = 1 + 0.1 * torch.randn(4096, device=cuda, dtype=torch.bfloat16, generator=g)
    codes = torch.randn(4096, 4096, device=cuda, generator=g).to(torch.float8_e4m3fn)
    scale = 0.02 * torch.rand(4096, device=cuda, generator=g)

    def chain():
        h, res = rmsnorm.add_rmsnorm(x, None, norm_w, 1e-5)
        for _ in range(16):
            h, res = rmsnorm.add_rmsnorm(fp8.linear_fp8_weight_only(h, codes, scale), res, norm_w, 1e-5)
        return h

    previous = pdl.set_pdl(True)
    try:
        with_pdl = chain()
        pdl.set_pdl(False)
        plain = chain()
    finally:
        pdl.set_pdl(previous)
    torch.cuda.synchronize()
    assert torch.isfinite(plain).all() and torch.equal(with_pdl, plain)
    for kernel in (fp8._weight_only_kernel, rmsnorm._add_rmsnorm_kernel):
        compiled = list(kernel.device_caches[cuda.index][0].values())
        assert {k.metadata.launch_pdl for k in compiled} == {True, False}, kernel


@pytest.mark.gpu
def test_attention_kernels_at_air_sizes(cuda):
    import triton_checks

    for page in (16, 64, 128):
        res = triton_checks.check_decode_attention("cuda", torch.bfloat16, lens=(1, 257, 4096, 1000), heads=96,
                                                   kv_heads=8, head_dim=128, page=page)
        _assert_checks({f"decode_attention_page{page}": res}, BF16_TOL)
    res = triton_checks.check_decode_attention("cuda", torch.float32, lens=(3, 100), heads=24, kv_heads=2,
                                               head_dim=128)
    _assert_checks({"decode_attention_fp32": res}, FP32_TOL)
    # a batch of 40 x 8 kv heads: one split, the output written by stage 1
    res = triton_checks.check_decode_attention("cuda", torch.bfloat16, lens=tuple(range(1, 4001, 100)), heads=96,
                                               kv_heads=8, head_dim=128)
    _assert_checks({"decode_attention_one_split": res}, BF16_TOL)
    for page in (16, 64):  # prompt chunks as rows, grouped (the CUDA graphs' chunk steps)
        res = triton_checks.check_grouped_decode_attention("cuda", torch.bfloat16, runs=((2048, 32), (700, 1), (0, 5),
                                                                                         (100, 63)),
                                                           heads=96, kv_heads=8, head_dim=128, page=page)
        _assert_checks({f"grouped_decode_attention_page{page}": res}, BF16_TOL)
    for page in (16, 64):  # prompt chunks: fresh, after a cached prefix, a lone decode
        res = triton_checks.check_prefill_attention("cuda", torch.bfloat16, chunks=((0, 512), (2048, 32), (700, 1),
                                                                                    (100, 300)),
                                                    heads=96, kv_heads=8, head_dim=128, page=page)
        _assert_checks({f"prefill_attention_page{page}": res}, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_cuda_graph_decode_matches_eager(cuda, monkeypatch, quantization):
    """The runner's decode from CUDA graphs (padded batch sizes included; short prompt chunks
    as a row per token) against eager steps (bf16 weights, and dummy fp8 weights: fp8 GEMMs and
    the fp8 fused MoE inside the graphs)."""
    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")
    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    def settings(graph: bool) -> EngineArgs:
        return EngineArgs(backend="torch", device="gpu", dtype="bfloat16", max_num_seqs=6, max_model_len=64,
                          max_num_batched_tokens=64, load_format="dummy", seed=3, enforce_eager=not graph,
                          block_size=16, num_gpu_blocks_override=24, quantization=quantization).resolve()

    from glm_fused.torch_backend import cuda_graph
    from glm_fused.torch_backend.kernels.decode_attention import row_groups

    # Chunks after any cached context replay the grouped graphs (by default only after 512
    # positions, more than this model holds); fresh ones still replay the plain graphs.
    monkeypatch.setattr(cuda_graph, "GROUPED_MIN_CONTEXT", 1)
    grouped_steps = []
    monkeypatch.setattr(cuda_graph, "row_groups", lambda rows: grouped_steps.append(rows) or row_groups(rows))
    config = settings(True).config()
    runners = {graph: ModelRunner(settings(graph), config, tp_rank=0, tp_size=1) for graph in (True, False)}
    assert runners[True].graphs is not None and runners[True].graphs.sizes == [1, 2, 4, 6]
    assert bool(runners[True].model.fp8_params) == (quantization == "fp8")
    assert runners[False].graphs is None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 7, 5)]
    logits = {}
    tables = np.array([[17, 3, 9, 0], [5, 22, 1, 14], [8, 2, 23, 11]])  # scattered blocks of 16
    for graph, runner in runners.items():
        outs = [runner.forward(ForwardBatch.prefill(prompts, tables))]
        lens = [4, 7, 5]
        for step in range(3):  # batch 3 pads to 4; then batch 1
            outs.append(runner.forward(ForwardBatch.decode([10 + step] * 3, lens, tables)))
            lens = [n + 1 for n in lens]
        outs.append(runner.forward(ForwardBatch.decode([20], [lens[1]], tables[1:2])))
        # Long enough to cross into a second block, with blocks of only part of the table given.
        outs.append(runner.forward(ForwardBatch([30] * 12, np.arange(lens[1] + 1, lens[1] + 13), [12],
                                                [lens[1] + 1], [11], tables[1:2])))
        outs.append(runner.forward(ForwardBatch.decode([21, 22], [lens[0], lens[1] + 13],
                                                       [tables[0, :2], tables[1, :2]])))
        # Short prompt chunks replay the graphs, a row per token: 5 tokens after a context (every
        # row's logits), then one decode beside a 4-token chunk (the graphs hold 6 rows).
        short = [ForwardBatch([31, 32, 33, 34, 35], np.arange(lens[1] + 14, lens[1] + 19), [5], [lens[1] + 14],
                              np.arange(5), tables[1:2]),
                 ForwardBatch([23, 40, 41, 42, 43], [lens[0] + 1, lens[2], lens[2] + 1, lens[2] + 2, lens[2] + 3],
                              [1, 4], [lens[0] + 1, lens[2]], [0, 4], tables[[0, 2]])]
        for batch in short:
            assert (runner.graphs is not None and runner.graphs.can_run(batch)) == graph
            outs.append(runner.forward(batch))
        logits[graph] = outs
        if graph:  # the two short-chunk steps
            assert [r.tolist() for r in grouped_steps] == [[0] * 5, [0, 1, 1, 1, 1]], grouped_steps
        stats = runner.fusion_stats()
        assert stats["fused_allreduce_norm_calls"] == 2 * config.num_hidden_layers + 1, stats
        runner.close()
    for a, b in zip(logits[True], logits[False]):
        assert np.abs(a - b).max() / np.abs(b).max() <= BF16_TOL
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


@pytest.mark.gpu
def test_eager_step_does_not_wait_for_the_device(cuda, monkeypatch):
    """An eager step (a prompt chunk) queues its work and returns while the device is still busy
    with earlier work: its host arrays go up through page-locked memory. A plain copy of
    pageable memory waits for everything queued before it, so the engine could not schedule
    the next step meanwhile (measured: 11.6 ms of each 2,048-token prefill's host time on an
    H200, and a higher TTFT under load, docs/speed.md)."""
    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")
    import time

    import numpy as np

    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    settings = EngineArgs(backend="torch", device="gpu", dtype="bfloat16", max_num_seqs=4, max_model_len=64,
                          max_num_batched_tokens=64, load_format="dummy", enforce_eager=True, block_size=16,
                          num_gpu_blocks_override=16).resolve()
    runner = ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    batch = ForwardBatch.prefill([list(range(1, 40))], np.array([[3, 1, 4]]))
    runner.execute(batch, sample=False)  # warm: every kernel compiled and loaded
    torch.cuda.synchronize(cuda)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(int(2e8))  # the device busy for a while (about 0.1 s)
    end.record()
    end.synchronize()
    busy_s = start.elapsed_time(end) / 1e3
    torch.cuda._sleep(int(2e8) * 5)  # about 5 x busy_s
    t0 = time.perf_counter()
    runner.execute(batch, sample=False)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize(cuda)
    runner.close()
    assert host_s < 2 * busy_s, f"the step held the host {host_s:.3f} s behind {5 * busy_s:.3f} s of queued work"


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_no_kernel_compiles_after_start_up(cuda, monkeypatch, tmp_path, quantization):
    """Once the runner is built (graphs captured, kernels warmed up), no step a server can
    schedule compiles a Triton kernel: decodes of every batch size beside prompt chunks of any
    length and context, in random mixes. A compile in the middle of serving stalls every
    request for 0.5-1.4 s. Real GLM-4.5-Air widths, 2 layers (one dense, one MoE)."""
    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")
    import numpy as np
    import triton

    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    config = json.loads((Path(__file__).resolve().parents[1] / "configs" / "glm-4.5-air.json").read_text())
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    max_seqs, limit, max_len, bs = 32, 512, 1024, 16
    settings = EngineArgs(model=str(tmp_path), backend="torch", device="gpu", dtype="bfloat16",
                          max_num_seqs=max_seqs, max_model_len=max_len, max_num_batched_tokens=limit,
                          load_format="dummy", block_size=bs, num_gpu_blocks_override=max_seqs * max_len // bs,
                          quantization=quantization).resolve()
    runner = ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    assert runner.graphs is not None, "the decode graphs were not captured (see the runner's warning)"
    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: compiled.append(kw["repr"].split("[")[0]))
    rng = np.random.default_rng(0)
    tables = rng.permutation(max_seqs * max_len // bs).reshape(max_seqs, -1)
    vocab = config["vocab_size"]
    for step in range(60):
        n_chunks = int(rng.integers(0, 4))
        n_dec = int(rng.integers(0 if n_chunks else 1, max_seqs - n_chunks + 1)) if step % 4 else \
            max_seqs - n_chunks - step % 8
        budget = limit - n_dec
        chunks = [int(rng.integers(1, max(2, budget // max(1, n_chunks)))) for _ in range(n_chunks)]
        query = [1] * n_dec + chunks
        context = [int(rng.integers(1, max_len - q)) if q == 1 or rng.random() < 0.5 else 0 for q in query]
        rows = rng.permutation(max_seqs)[:len(query)]
        batch = ForwardBatch(rng.integers(0, vocab, sum(query)),
                             np.concatenate([np.arange(c, c + q) for c, q in zip(context, query)]),
                             query, context, np.cumsum(query) - 1, tables[rows])
        runner.forward(batch)
    runner.close()
    assert not compiled, f"kernels compiled after start-up: {sorted(set(compiled))}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_layers_under_the_interpreter(tmp_path):
    """scripts/bench_layers.py end to end on CPU, tiny sizes, fp32: the kernels (interpreted,
    launched op by op) and the plain ops, each with the attention metadata it reads, against
    transformers' layer, for both layer kinds, prefill and decode. The GPU test
    (test_gpu_model.py) is the only other run of this script, and CI has no GPU."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path / "layers.json"
    env = _interpreter_env()
    proc = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "bench_layers.py"), "--device", "cpu",
                           "--dtype", "float32", "--config", str(HERE.parent / "configs" / "glm-4.5-air-tiny.json"),
                           "--prefill", "16", "--decode-batches", "1,2", "--context", "16", "--iters", "1",
                           "--warmup", "0", "--matmul-n", "64", "--copy-mib", "4",
                           "--impls", "ours-eager,ours-v0,hf-eager", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["triton_kernels"], "the kernel variants ran the plain ops"
    cases = report["cases"]
    assert [(c["layer"], c["step"]) for c in cases] == [
        (kind, step) for kind in ("moe", "dense") for step in ("prefill", "decode-b1-c16", "decode-b2-c16")]
    for case in cases:
        for impl in ("ours-eager", "ours-v0"):
            result = case["impls"][impl]
            assert "error" not in result, (case["layer"], case["step"], impl, result)
            assert not result["vs_reference"]["nan"]
            assert result["vs_reference"]["max_rel"] <= FP32_TOL, (case["layer"], case["step"], impl, result)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_attention_dry_run(tmp_path):
    """scripts/bench_attention.py end to end under the interpreter (tiny sizes): both layouts
    agree, every block size gets a ratio; a fresh prompt through both prompt paths agrees, and
    prompt chunks as rows, grouped and not."""
    pytest.importorskip("triton")
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "bench_attention.py"), "--device", "cpu",
                           "--dry-run", "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "paged / contiguous worst" in proc.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows and all(r[f"page{p}_max_rel_diff"] <= FP32_TOL and r[f"page{p}_ratio"] > 0
                        for r in rows for p in (16, 64))
    # --prompt-lens: the batched prompt kernel and gather + SDPA agree on a fresh prompt
    assert [r["prompt_len"] for r in report["prompts"]] == [40]
    assert report["prompts"][0]["max_rel_diff"] <= FP32_TOL and "gather + SDPA" in proc.stdout
    # --chunks: a chunk's rows grouped and one program per row agree (alone, and beside decodes)
    assert [(r["context"], r["rows"], r["decodes"]) for r in report["chunks"]] == [(70, 9, 0), (40, 5, 2)]
    assert all(r["max_rel_diff"] <= FP32_TOL and r["grouped_us"] > 0 for r in report["chunks"])
