"""CPU tests of the fusion policy (glm_fused.fusion) and of the FlashInfer adapter's parts
that need no GPU: argument checks, keyword preparation, construction wiring, refusals."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from glm_fused.fused_op import policy as fusion
from glm_fused.fused_op import FallbackLog, FusionStats
from glm_fused.fused_op.policy import KernelEnv, choose_impl, size_cap_tokens, use_oneshot

ROOT = Path(__file__).resolve().parent.parent
H = 4096


def env(**kw) -> KernelEnv:
    base = dict(device="cuda", sm=90, tp_size=4, hidden_size=H, flashinfer_error=None, workspace_max_tokens=2048)
    base.update(kw)
    return KernelEnv(**base)


# ---------------------------------------------------------------------------- caps
@pytest.mark.parametrize("sm, tp, tokens", [
    (90, 2, 8192), (90, 4, 256), (90, 8, 64), (90, 16, 0),
    (100, 2, 8192), (100, 4, 4096), (100, 8, 128), (100, 16, 8192),
    (103, 8, 512), (120, 4, 256), (120, 8, 64),
    (80, 4, 0), (89, 2, 0), (None, 4, 0),
])
def test_size_cap_tokens_per_arch_and_tp(sm, tp, tokens):
    assert size_cap_tokens(sm, tp, H, 2) == tokens


def test_size_cap_scales_with_hidden_and_dtype():
    assert size_cap_tokens(90, 4, 2048, 2) == 512
    assert size_cap_tokens(90, 4, H, 4) == 128
    assert size_cap_tokens(90, 4, 0, 2) == 0
    assert size_cap_tokens(90, 4, H, 0) == 0


@pytest.mark.parametrize("tp, cap", [(2, 8192), (4, 256), (8, 64)])
def test_choose_impl_at_the_sm90_cap_boundary(tp, cap):
    e = env(tp_size=tp, workspace_max_tokens=16384)
    assert choose_impl(e, dtype="bfloat16", num_tokens=cap) == ("flashinfer", None)
    impl, reason = choose_impl(e, dtype="bfloat16", num_tokens=cap + 1)
    assert impl == "reference" and reason.startswith("num_tokens > size cap") and f"{cap} tokens" in reason


def test_choose_impl_at_the_workspace_boundary():
    e = env(tp_size=2, workspace_max_tokens=2048)  # TP2's cap (8192) is above the workspace
    assert choose_impl(e, dtype="bf16", num_tokens=1) == ("flashinfer", None)
    assert choose_impl(e, dtype="bf16", num_tokens=2048) == ("flashinfer", None)
    assert choose_impl(e, dtype="bf16", num_tokens=2049) == ("reference", "num_tokens > workspace (2048 tokens)")


@pytest.mark.parametrize("kw, dtype, tokens, starts", [
    (dict(device="cpu", sm=None), "bfloat16", 1, "not CUDA"),
    (dict(flashinfer_error="flashinfer.comm not importable"), "bfloat16", 1, "flashinfer unavailable: flashinfer.comm"),
    (dict(tp_size=1), "bfloat16", 1, "tp_size 1 not in"),
    (dict(tp_size=3), "bfloat16", 1, "tp_size 3 not in"),
    (dict(tp_size=32), "bfloat16", 1, "tp_size 32 not in"),
    ({}, "float32", 1, "dtype float32 is not bf16/fp16"),
    ({}, "torch.float32", 1, "dtype float32 is not bf16/fp16"),
    (dict(hidden_size=4100), "bfloat16", 1, "hidden_size 4100 not a multiple of 8"),
    (dict(workspace_max_tokens=0), "bfloat16", 1, "no workspace"),
    ({}, "bfloat16", 0, "num_tokens == 0"),
    ({}, "bfloat16", 2049, "num_tokens > workspace"),
    ({}, "bfloat16", 257, "num_tokens > size cap"),
    (dict(sm=80), "bfloat16", 1, "num_tokens > size cap (0 tokens for sm80"),
    (dict(tp_size=16), "bfloat16", 1, "num_tokens > size cap (0 tokens for sm90 tp16"),
])
def test_every_fallback_reason(kw, dtype, tokens, starts):
    impl, reason = choose_impl(env(**kw), dtype=dtype, num_tokens=tokens)
    assert impl == "reference"
    assert reason.startswith(starts), reason


def test_reasons_are_checked_in_order_and_bounded():
    # several problems at once: the environment's reason wins over the call's
    impl, reason = choose_impl(env(device="cpu", tp_size=3), dtype="float32", num_tokens=0)
    assert reason.startswith("not CUDA")
    # the reason names the workspace and the cap, never the call's size: one log line per cause
    e = env()
    assert choose_impl(e, dtype="bf16", num_tokens=3000)[1] == choose_impl(e, dtype="bf16", num_tokens=5000)[1]
    assert choose_impl(e, dtype="bf16", num_tokens=300)[1] == choose_impl(e, dtype="bf16", num_tokens=1000)[1]


@pytest.mark.parametrize("name", ["bfloat16", "bf16", "torch.bfloat16", "paddle.bfloat16", "float16", "fp16",
                                  "half", "torch.float16"])
def test_kernel_dtype_names(name):
    assert choose_impl(env(), dtype=name, num_tokens=8) == ("flashinfer", None)


def test_gpu_is_taken_as_cuda_and_negative_tokens_refused():
    assert choose_impl(env(device="gpu"), dtype="bf16", num_tokens=8) == ("flashinfer", None)
    assert choose_impl(env(device="cuda:1"), dtype="bf16", num_tokens=8) == ("flashinfer", None)
    with pytest.raises(ValueError):
        choose_impl(env(), dtype="bf16", num_tokens=-1)


def test_workspace_sizing_helpers():
    assert fusion.workspace_tokens(90, 8, H, 2, 2048) == 64
    assert fusion.workspace_tokens(90, 4, H, 2, 2048) == 256
    assert fusion.workspace_tokens(90, 2, H, 2, 2048) == 2048
    assert fusion.workspace_tokens(80, 2, H, 2, 2048) == 0
    # FlashInfer's sizing: tp * tokens * hidden * 2 bytes, plus three Lamport buffers of that
    assert fusion.workspace_bytes(4, 2048, H) == 256 * 2**20


# ---------------------------------------------------------------------------- one-shot / two-shot
def test_use_oneshot_when_two_shot_is_impossible():
    for tp in (2, 4, 8, 16):
        for n in range(1, tp + 1):
            assert use_oneshot(tp, n, H, 2, sm=90) is True
            assert use_oneshot(tp, n, H, 2, sm=100) is True


@pytest.mark.parametrize("sm, tp, last_oneshot", [
    (90, 2, 4096), (90, 4, 256), (90, 8, 64), (None, 4, 256),
    (100, 2, 4096), (100, 4, 512), (100, 8, 128),
    (120, 4, 128), (90, 16, 128),  # no table entry: FlashInfer's default, one-shot up to 128 tokens
])
def test_use_oneshot_switch_point(sm, tp, last_oneshot):
    assert use_oneshot(tp, last_oneshot, H, 2, sm=sm) is True
    assert use_oneshot(tp, last_oneshot + 1, H, 2, sm=sm) is False


def test_use_oneshot_respects_the_lamport_window():
    # 100 tokens would be one-shot by the default rule, but tp * bytes is past MAX_COMM_SIZE
    assert use_oneshot(2, 100, 2**24, 2, sm=120) is False


# ---------------------------------------------------------------------------- stats and log
def test_stats_dict_shape_and_reset():
    s = FusionStats()
    assert s.as_dict() == {"fused_allreduce_norm_calls": 0, "plain_allreduce_calls": 0,
                           "fused_impl": {"flashinfer": 0, "reference": 0}, "fallback_reasons": {}}
    s.record("flashinfer")
    s.record("reference", "num_tokens > workspace (2048 tokens)")
    s.record("reference", "num_tokens > workspace (2048 tokens)")
    s.record_plain_allreduce()
    # the attribute style the backends use
    s.fused_calls += 1
    s.impl["reference"] += 1
    s.plain_allreduce_calls += 2
    assert s.as_dict() == {"fused_allreduce_norm_calls": 4, "plain_allreduce_calls": 3,
                           "fused_impl": {"flashinfer": 1, "reference": 3},
                           "fallback_reasons": {"num_tokens > workspace (2048 tokens)": 2}}
    d = s.as_dict()
    d["fused_impl"]["flashinfer"] = 99  # a copy: reports can't change the counters
    assert s.impl["flashinfer"] == 1
    s.reset()
    assert s.as_dict()["fused_impl"] == {"flashinfer": 0, "reference": 0}
    assert s.as_dict()["fused_allreduce_norm_calls"] == 0


@pytest.fixture
def fresh_log():
    FallbackLog.reset()
    yield
    FallbackLog.reset()


def test_fallback_log_once_per_reason_per_process(fresh_log, caplog):
    caplog.set_level(logging.INFO, logger="glm_fused.fusion")
    a, b = FallbackLog(), FallbackLog()
    assert a.log_once("no workspace") is True
    assert a.log_once("no workspace") is False
    assert b.log_once("no workspace") is False  # another instance, same process: still once
    assert b.log_once("num_tokens == 0") is True
    msgs = [r.getMessage() for r in caplog.records if r.name == "glm_fused.fusion"]
    assert len(msgs) == 2 and "no workspace" in msgs[0] and "num_tokens == 0" in msgs[1]


def test_fallback_log_level(fresh_log, caplog):
    caplog.set_level(logging.DEBUG, logger="glm_fused.fusion")
    FallbackLog(level=logging.WARNING).log_once("x")
    FallbackLog().log_once("y", level=logging.DEBUG)
    levels = {r.getMessage().rsplit(": ", 1)[1]: r.levelno for r in caplog.records}
    assert levels == {"x": logging.WARNING, "y": logging.DEBUG}


# ---------------------------------------------------------------------------- import hygiene
def _imports_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    return set(out.split())


def test_policy_imports_no_framework():
    mods = _imports_after("import glm_fused, glm_fused.fused_op.policy, glm_fused.fused_op.op, glm_fused.fused_op.stats")
    assert not {"torch", "paddle", "flashinfer"} & mods


# ---------------------------------------------------------------------------- adapter, no GPU
def _torch():
    return pytest.importorskip("torch")


def test_adapter_import_does_not_import_flashinfer():
    _torch()
    if "flashinfer" in sys.modules:
        pytest.skip("flashinfer already imported by another test in this process")
    import glm_fused.fused_op.flashinfer  # noqa: F401

    assert "flashinfer" not in sys.modules  # only probe() and the constructor import it


def _fa():
    _torch()
    from glm_fused.fused_op import flashinfer as flashinfer_adapter
    return flashinfer_adapter


def test_probe_gives_a_reason_without_cuda():
    fa, torch = _fa(), _torch()
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert fa.probe() == "CUDA not available"
    e = fa.kernel_env(tp_size=4, hidden_size=H, workspace_max_tokens=2048)
    assert e.device == "cpu" and e.sm is None
    assert choose_impl(e, dtype="bf16", num_tokens=1)[0] == "reference"


@pytest.mark.parametrize("kw, words", [
    (dict(device="cpu"), "not CUDA"),
    (dict(device="cuda:0"), "CUDA not available"),
    (dict(tp_size=3), "tp_size 3"),
    (dict(tp_rank=4), "tp_rank 4"),
    (dict(hidden_size=4100), "hidden_size 4100"),
    (dict(max_num_tokens=0), "max_num_tokens"),
    (dict(dtype="float32"), "is not bf16/fp16"),
    (dict(dtype="bogus"), "unknown dtype"),
])
def test_constructing_without_a_gpu_raises_fusion_unavailable(kw, words):
    fa, torch = _fa(), _torch()
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    args = dict(tp_rank=0, tp_size=4, max_num_tokens=2048, hidden_size=H, dtype=torch.bfloat16,
                device="cuda:0", group=None)
    args.update(kw)
    with pytest.raises(fa.FusionUnavailable, match=words):
        fa.FlashInferAllReduceFusion(**args)


def _call_args(torch, n=5, tp=4, dtype=None, **kw):
    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(0)
    partial = torch.randn(n, 64, generator=g).to(dtype)
    residual = torch.randn(n, 64, generator=g).to(dtype)
    weight = torch.ones(64, dtype=dtype)
    cfg = dict(tp_rank=1, tp_size=tp, max_num_tokens=16, hidden_size=64, dtype=torch.bfloat16,
               device=torch.device("cpu"), workspace_ptrs="ws", launch_with_pdl=True, sm=90)
    cfg.update(kw)
    return partial, residual, weight, cfg


def test_prepare_call_builds_every_keyword_with_safe_flags():
    fa, torch = _fa(), _torch()
    partial, residual, weight, cfg = _call_args(torch)
    kw = fa.prepare_call(partial, residual, weight, 1e-5, **cfg)
    assert set(kw) == set(fa.CALL_KEYWORDS)
    assert kw["trigger_completion_at_end"] is True and kw["fp32_acc"] is True
    assert kw["pattern_code"] == fa.PATTERN_AR_RESIDUAL_RMSNORM == 1
    assert (kw["world_size"], kw["world_rank"], kw["token_num"], kw["hidden_dim"]) == (4, 1, 5, 64)
    assert kw["workspace_ptrs"] == "ws" and kw["launch_with_pdl"] is True
    assert kw["allreduce_in"] is partial and kw["residual_in"] is residual and kw["rms_gamma"] is weight
    for name in ("allreduce_out", "quant_out", "scale_out", "scale_factor", "layout_code"):
        assert kw[name] is None
    assert isinstance(kw["rms_eps"], float) and kw["rms_eps"] == 1e-5
    for name in ("norm_out", "residual_out"):  # fresh buffers, never the inputs
        out = kw[name]
        assert out.shape == partial.shape and out.dtype == partial.dtype
        assert out.data_ptr() not in (partial.data_ptr(), residual.data_ptr())
    assert kw["norm_out"].data_ptr() != kw["residual_out"].data_ptr()
    assert kw["use_oneshot"] is use_oneshot(4, 5, 64, 2, sm=90)


def test_prepare_call_takes_caller_buffers_and_in_place_residual():
    fa, torch = _fa(), _torch()
    partial, residual, weight, cfg = _call_args(torch)
    norm_out = torch.empty_like(partial)
    kw = fa.prepare_call(partial, residual, weight, 1e-5, norm_out=norm_out, residual_out=residual, **cfg)
    assert kw["norm_out"] is norm_out and kw["residual_out"] is residual


def test_prepare_call_forced_algorithms():
    fa, torch = _fa(), _torch()
    partial, residual, weight, cfg = _call_args(torch, n=5, tp=4)
    assert fa.prepare_call(partial, residual, weight, 1e-5, use_oneshot=False, **cfg)["use_oneshot"] is False
    assert fa.prepare_call(partial, residual, weight, 1e-5, use_oneshot=True, **cfg)["use_oneshot"] is True
    partial, residual, weight, cfg = _call_args(torch, n=4, tp=4)
    with pytest.raises(fa.FusionArgumentError, match="two-shot needs tokens > tp_size"):
        fa.prepare_call(partial, residual, weight, 1e-5, use_oneshot=False, **cfg)


def test_prepare_call_makes_inputs_contiguous():
    fa, torch = _fa(), _torch()
    partial, residual, weight, cfg = _call_args(torch)
    wide = torch.randn(64, 5).to(torch.bfloat16).t()  # [5, 64], not contiguous
    kw = fa.prepare_call(wide, residual, weight, 1e-5, **cfg)
    assert kw["allreduce_in"].is_contiguous() and torch.equal(kw["allreduce_in"], wide)


def test_prepare_call_refuses_what_would_corrupt():
    fa, torch = _fa(), _torch()
    partial, residual, weight, cfg = _call_args(torch)
    bad = [
        (dict(weight=weight.float()), "weight dtype torch.float32"),  # fp32 gamma with bf16 input
        (dict(residual=residual.float()), "residual dtype"),
        (dict(partial=torch.randn(17, 64).to(torch.bfloat16), residual=torch.randn(17, 64).to(torch.bfloat16)),
         "17 tokens > workspace 16"),
        (dict(partial=partial[:0], residual=residual[:0]), "no tokens"),
        (dict(partial=partial.reshape(5, 2, 32)), r"\[tokens, hidden\]"),
        (dict(partial=torch.randn(5, 32).to(torch.bfloat16), residual=torch.randn(5, 32).to(torch.bfloat16),
              weight=torch.ones(32, dtype=torch.bfloat16)), "hidden 32 != workspace hidden 64"),
        (dict(residual=residual[:4]), "residual shape"),
        (dict(weight=torch.ones(32, dtype=torch.bfloat16)), "weight shape"),
        (dict(norm_out=torch.empty(5, 64)), "norm_out must be"),
        (dict(residual_out=torch.empty(64, 5, dtype=torch.bfloat16).t()), "residual_out must be"),
    ]
    for change, words in bad:
        args = dict(partial=partial, residual=residual, weight=weight)
        extra = {k: change.pop(k) for k in list(change) if k in ("norm_out", "residual_out")}
        args.update(change)
        with pytest.raises(fa.FusionArgumentError, match=words):
            fa.prepare_call(args["partial"], args["residual"], args["weight"], 1e-5, **extra, **cfg)
    # a workspace on another device
    cfg2 = dict(cfg, device=torch.device("cuda", 0))
    with pytest.raises(fa.FusionArgumentError, match="workspace on cuda:0"):
        fa.prepare_call(partial, residual, weight, 1e-5, **cfg2)
    assert issubclass(fa.FusionArgumentError, fa.FusionUnavailable)


def test_as_torch_is_zero_copy():
    fa, torch = _fa(), _torch()
    t = torch.zeros(3)
    assert fa.as_torch(t) is t
    np = pytest.importorskip("numpy")
    a = np.zeros(4, dtype=np.float32)
    v = fa.as_torch(a)
    a[1] = 7.0
    assert float(v[1]) == 7.0
    with pytest.raises(TypeError):
        fa.as_torch([1, 2, 3])


def test_as_torch_takes_a_paddle_tensor():
    fa = _fa()
    paddle = pytest.importorskip("paddle")
    p = paddle.to_tensor([1.0, 2.0, 3.0], dtype="float32")
    t = fa.as_torch(p)
    assert t.tolist() == [1.0, 2.0, 3.0]
    assert t.data_ptr() == p.data_ptr()  # same memory, no copy


@pytest.fixture
def fake_gpu(monkeypatch):
    """The adapter on a pretended sm90 GPU whose FlashInfer only records what it is given."""
    fa, torch = _fa(), _torch()
    import fake_flashinfer

    calls = {}
    fake_flashinfer.pretend_gpu(monkeypatch, fake_flashinfer.fake_namespace(calls))
    return fa, torch, calls


def test_construction_wiring_with_a_comm_backend(fake_gpu):
    fa, torch, calls = fake_gpu
    from fake_flashinfer import FakeComm

    comm = FakeComm(1, 4)
    k = fa.FlashInferAllReduceFusion(tp_rank=1, tp_size=4, max_num_tokens=256, hidden_size=H, dtype="bf16",
                                     device="cuda:0", group=comm, shared_gpu=True)
    assert calls["create"] == dict(tp_rank=1, tp_size=4, max_token_num=256, hidden_dim=H, use_fp32_lamport=False,
                                   group=None, create_metadata=True, comm_backend=comm, use_symm_dev_mem=True)
    assert set(calls["create"]) == set(fa.WORKSPACE_KEYWORDS)
    assert k.launch_with_pdl is True and k.dtype == torch.bfloat16 and k.shared_gpu is True
    assert "256 tokens" in repr(k)
    with k:
        pass  # the context manager closes
    assert calls["destroyed"] == [[1], [2], [3]] and calls["freed"] == 1234
    k.close()  # idempotent
    with pytest.raises(fa.FusionUnavailable, match="closed"):
        k(torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(1, H, dtype=torch.bfloat16),
          torch.ones(H, dtype=torch.bfloat16), 1e-5)


def test_construction_refuses_a_group_that_is_not_the_tp_group(fake_gpu):
    fa, torch, calls = fake_gpu
    from fake_flashinfer import FakeComm

    with pytest.raises(fa.FusionUnavailable, match="pass the TP group"):
        fa.FlashInferAllReduceFusion(tp_rank=1, tp_size=4, max_num_tokens=256, hidden_size=H,
                                     dtype=torch.bfloat16, device="cuda:0", group=FakeComm(1, 8))
    assert "create" not in calls


def test_construction_failure_becomes_fusion_unavailable(fake_gpu, monkeypatch):
    fa, torch, calls = fake_gpu
    from fake_flashinfer import FakeComm, fake_namespace

    broken = fake_namespace(calls)

    def explode(**kw):
        raise RuntimeError("cuMemCreate: out of memory")

    broken.create_workspace = explode
    monkeypatch.setattr(fa, "_flashinfer", lambda: broken)
    with pytest.raises(fa.FusionUnavailable, match="workspace creation failed .*out of memory"):
        fa.FlashInferAllReduceFusion(tp_rank=0, tp_size=2, max_num_tokens=8, hidden_size=H,
                                     dtype=torch.bfloat16, device="cuda:0", group=FakeComm(0, 2))


def test_adapter_call_returns_normed_then_residual(monkeypatch):
    """The adapter's real ``__call__`` on the CPU, its kernel a stand-in writing a different
    marker into each output: what the kernel wrote to ``norm_out`` comes back first and
    ``residual_out`` second, with fresh buffers and with the caller's (residual in place)."""
    fa, torch = _fa(), _torch()
    from fake_flashinfer import cpu_adapter

    seen = []

    def kernel(**kw):
        seen.append(kw)
        kw["norm_out"].fill_(1.0)
        kw["residual_out"].fill_(-2.0)

    adapter = cpu_adapter(monkeypatch, kernel, tp_rank=1, tp_size=4, max_num_tokens=16, hidden_size=64)
    partial, residual, weight, _ = _call_args(torch)
    partial_before = partial.clone()
    normed, res = adapter(partial, residual, weight, 1e-5)
    kw = seen[-1]
    assert torch.all(normed == 1.0) and torch.all(res == -2.0)
    assert normed is kw["norm_out"] and res is kw["residual_out"]
    assert kw["allreduce_in"] is partial and kw["residual_in"] is residual and kw["rms_gamma"] is weight
    assert (kw["world_rank"], kw["world_size"], kw["token_num"], kw["hidden_dim"]) == (1, 4, 5, 64)
    assert kw["workspace_ptrs"] == "workspace-tensor" and kw["rms_eps"] == 1e-5

    norm_buf = torch.empty_like(partial)
    normed, res = adapter(partial, residual, weight, 1e-5, norm_out=norm_buf, residual_out=residual)
    assert normed is norm_buf and res is residual
    assert torch.all(norm_buf == 1.0) and torch.all(residual == -2.0)
    assert torch.equal(partial, partial_before)  # the kernel's input is never written


def test_gpu_check_token_counts_cover_every_boundary():
    from bench.common import token_counts
    from bench.gpu_check import BOUNDARY_TOKENS

    assert token_counts(4, 2048, BOUNDARY_TOKENS) == [1, 3, 4, 5, 16, 64, 127, 128, 129, 255, 256, 257, 512, 1024,
                                                      2047, 2048]
    assert token_counts(2, 2048, BOUNDARY_TOKENS)[:3] == [1, 2, 3]
    assert token_counts(8, 300, BOUNDARY_TOKENS)[-1] == 257
