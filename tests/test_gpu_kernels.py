"""GPU checks of the FlashInfer kernels (the same ones scripts/gpu_check.py runs).

Skipped cleanly without CUDA + flashinfer.comm. With them: the norm kernels vs fp32, the
fused all-reduce + residual + RMSNorm at TP 2/4/8 as processes sharing GPU 0 at every
token-count boundary (one-shot and two-shot), the fallback past workspace and cap, and
choose_impl's decisions on the real device (expected values for sm90, sm100, sm103
and sm120; another arch skips saying so).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench import gpu_check

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    gpu_check._setdefault_env()  # before flashinfer.norm is imported
    pytest.importorskip("torch")
    from glm_fused.fused_op import flashinfer as flashinfer_adapter

    reason = flashinfer_adapter.probe()
    if reason:
        pytest.skip(f"FlashInfer kernels unavailable: {reason}")
    return SimpleNamespace(hidden=gpu_check.HIDDEN, max_tokens=2048)


def test_norm_kernels_match_fp32(kernels):
    res = gpu_check.run_norm(kernels)
    bad = [c for c in res["cases"] if not c["pass"]]
    assert res["status"] == "pass", bad


@pytest.mark.slow
@pytest.mark.parametrize("tp", gpu_check.DEFAULT_TPS)
def test_fused_allreduce_matches_fp32_on_a_shared_gpu(kernels, tp):
    res = gpu_check.run_allreduce_tp(tp, tokens=gpu_check.token_counts(tp, kernels.max_tokens,
                                                                       gpu_check.BOUNDARY_TOKENS),
                                     hidden=kernels.hidden, max_tokens=kernels.max_tokens, timeout=300)
    assert not res["errors"], res["errors"]
    bad = [r for r in res["rows"] + res["dispatch"] if not r["pass"]]
    assert res["status"] == "pass", bad
    modes = {r["mode"] for r in res["rows"]}
    assert {"oneshot", "twoshot", "auto-inplace"} <= modes
    impls = {r["tokens"]: r["impl"] for r in res["dispatch"]}
    assert impls[kernels.max_tokens + 1] == "reference"
    assert impls[res["size_cap_tokens"] + 1] == "reference"
    assert impls[1] == "flashinfer"


def test_choose_impl_on_this_device(kernels):
    res = gpu_check.run_policy(kernels)
    wrong = [d for d in res["decisions"] if d["expected"] not in (None, d["impl"])]
    if res["status"] == "ok":  # the kernels run here, but no caps are written down for this arch
        pytest.skip(f"no expected fusion decisions for this GPU: {res['summary']}")
    assert res["status"] == "pass", wrong
