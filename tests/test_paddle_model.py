"""The Paddle backend against transformers' Glm4MoeForCausalLM, and against itself.

Checkpoints are written by transformers itself (tiny random GLM-4.5 models) in both
expert layouts and both config.json forms; every weight is moved off its neutral init
(norms, biases, e_score_correction_bias) so a wrong mapping or a skipped term shows.
All in float32. Tolerances, relative to the largest reference logit:

* vs transformers: <= 1e-4 (different kernels and summation orders in fp32; measured
  <= 1.2e-6 at TP 1, 2 and 4);
* fused vs classic layout, and KV-cache paths vs the same runner's one-shot forward:
  <= 1e-5 (same maths: on CPU the fused op is always the reference, so the two layouts
  measured bitwise equal; the cache paths only group the attention differently, ~1e-6).
The FlashInfer path cannot run here; the test at the end drives the fused op's kernel
branch with a stand-in kernel to check the policy, the counters and the DLPack round trip.

Multi-rank: one launch per TP size runs every check (tests/paddle_workers.py) and the
tests below assert on what each rank wrote.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("paddle") is None:  # found, not imported: collection stays light
    pytest.skip("paddlepaddle is not installed", allow_module_level=True)

from safetensors.numpy import load_file, save_file  # noqa: E402

from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.launcher import launch  # noqa: E402
from glm_fused.sharding import TPShard  # noqa: E402

if __package__:
    from . import paddle_workers as workers
else:
    import paddle_workers as workers

W = workers.__name__
ROOT = Path(__file__).resolve().parent.parent
HF_TOL = 1e-4
SELF_TOL = 1e-5
# name -> how transformers writes it. The first: qk-norm, 4 KV heads (split over TP 2 and 4),
# per-expert tensors, transformers-5 config. The second: no qk-norm, 2 KV heads (each
# replicated on two ranks at TP 4), fused expert tensors, transformers-4 config, another
# RoPE base and a quarter of each head rotating.
CHECKPOINTS = {
    "qknorm_experts_v5": dict(use_qk_norm=True, kv_heads=4, rope_theta=10000.0, rotary=0.5,
                              layout="original", form=5),
    "plain_fused_v4": dict(use_qk_norm=False, kv_heads=2, rope_theta=50000.0, rotary=0.25,
                           layout="fused", form=4),
}


def _hf_model(spec: dict, seed: int):
    cfg = transformers.Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
        num_key_value_heads=spec["kv_heads"], head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=spec["use_qk_norm"], max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"],
                                            "partial_rotary_factor": spec["rotary"]})
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # not all ones: a skipped norm shows
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                # Large enough to change which experts win: a bias used for the weights, or
                # not used for the choice, moves the logits.
                buf.copy_(0.5 * torch.rand_like(buf))
    return model


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 10).tolist()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> checkpoint dir; transformers' logits of both prompts beside each."""
    root = tmp_path_factory.mktemp("paddle_ckpts")
    prompts = _prompts()
    dirs = {}
    for i, (name, spec) in enumerate(CHECKPOINTS.items()):
        model = _hf_model(spec, seed=i)
        d = root / name
        model.save_pretrained(d, save_original_format=(spec["layout"] == "original"))
        if spec["form"] == 4:  # the transformers-4 config.json: top-level RoPE keys and torch_dtype
            raw = json.loads((d / "config.json").read_text())
            rope = raw.pop("rope_parameters")
            raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                       torch_dtype=raw.pop("dtype", "float32"), rope_scaling=None)
            (d / "config.json").write_text(json.dumps(raw, indent=2))
        with torch.no_grad():
            for j, p in enumerate(prompts):
                logits = model(torch.tensor([p])).logits[0].float().numpy()
                np.save(root / f"{name}_hf_{j}.npy", logits)
        dirs[name] = d
    return {"dirs": dirs, "prompts": prompts}


def test_checkpoints_really_have_both_forms(checkpoints):
    a, b = (checkpoints["dirs"][n] for n in CHECKPOINTS)
    names_a, names_b = set(load_file(a / "model.safetensors")), set(load_file(b / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names_a
    assert "model.layers.1.mlp.experts.gate_up_proj" in names_b and not any(".experts.3." in n for n in names_b)
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert "rope_parameters" in cfg_a and "rope_theta" not in cfg_a
    assert "rope_parameters" not in cfg_b and cfg_b["partial_rotary_factor"] == 0.25 and "torch_dtype" in cfg_b
    assert (Glm4MoeConfig.from_pretrained(a).rotary_dim, Glm4MoeConfig.from_pretrained(b).rotary_dim) == (8, 4)
    assert Glm4MoeConfig.from_pretrained(b).rope_theta == 50000.0
    tensors = load_file(a / "model.safetensors")
    bias = tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == np.float32 and np.abs(bias).min() > 0
    assert not np.allclose(tensors["model.layers.1.input_layernorm.weight"], 1.0)


# ---- one launch per TP size ---------------------------------------------------------------

_RESULTS: dict[int, list[dict]] = {}


def _run_tp(checkpoints, tp: int, tmp_path_factory) -> list[dict]:
    if tp not in _RESULTS:
        out = tmp_path_factory.mktemp(f"paddle_tp{tp}")
        args = {"out": str(out), "prompts": checkpoints["prompts"],
                "checkpoints": {n: str(d) for n, d in checkpoints["dirs"].items()}}
        code = launch(f"{W}:tp_checks", args, nprocs=tp, device="cpu", timeout=150)
        assert code == 0, f"TP {tp} launch failed with status {code}"
        _RESULTS[tp] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]
    return _RESULTS[tp]


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def ranks(request, checkpoints, tmp_path_factory) -> list[dict]:
    return _run_tp(checkpoints, request.param, tmp_path_factory)


@pytest.mark.timeout(240)
def test_matches_transformers(ranks):
    for name, entry in ranks[0]["checkpoints"].items():
        for mode, errors in entry["vs_hf"].items():
            worst = max(errors, key=errors.get)
            assert errors[worst] <= HF_TOL, f"{name} {mode} {worst}: rel err {errors[worst]:.2e} > {HF_TOL}"


@pytest.mark.timeout(240)
def test_fused_equals_classic_layout(ranks):
    # Prefill of 1, 3 (< TP 4) and 50 tokens, chunked prefill, decode steps, mixed batches.
    for name, entry in ranks[0]["checkpoints"].items():
        errors = entry["fused_vs_unfused"]
        assert {"two_prompts", "tokens_1", "tokens_3", "cached", "mixed", "batched_decode"} <= set(errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= SELF_TOL, f"{name} {worst}: fused vs classic {errors[worst]:.2e}"


@pytest.mark.timeout(240)
def test_kv_cache_paths_equal_one_full_forward(ranks):
    # cached: prefill 24 + chunk of 8 after context + 4 single-token decodes;
    # mixed: one sequence prefilling while another decodes; batched_decode: two decodes at
    # different context lengths. Against the same runner's one-shot forward of both prompts
    # (which is what running each sequence separately from scratch gives).
    for name, entry in ranks[0]["checkpoints"].items():
        for mode, errors in entry["vs_own_full"].items():
            worst = max(errors, key=errors.get)
            assert errors[worst] <= SELF_TOL, f"{name} {mode} {worst}: {errors[worst]:.2e}"


@pytest.mark.timeout(240)
def test_fusion_counters(ranks):
    for name, entry in ranks[0]["checkpoints"].items():
        calls = 2 * entry["layers"] + 1
        for stats in entry["stats"]["fused"]:
            assert stats["fused_allreduce_norm_calls"] == calls and stats["plain_allreduce_calls"] == 0, stats
            # CPU: no FlashInfer kernel, every call takes the reference, for a stated reason.
            assert stats["fused_impl"] == {"flashinfer": 0, "reference": calls}, stats
            assert sum(stats["fallback_reasons"].values()) == calls, stats
        for stats in entry["stats"]["unfused"]:
            assert stats["fused_allreduce_norm_calls"] == 0 and stats["plain_allreduce_calls"] == calls, stats
            assert sum(stats["fused_impl"].values()) == 0, stats


@pytest.mark.timeout(240)
def test_every_rank_returns_the_same_logits(ranks):
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    for r in ranks[1:]:
        for name, entry in r["checkpoints"].items():
            assert entry["digest"] == ranks[0]["checkpoints"][name]["digest"], (r["rank"], name)
        assert r["dummy"]["router_digest"] == ranks[0]["dummy"]["router_digest"]  # replicated router
    assert all(r["broadcast"] == [0, 7, 14, 21, 28, 35] for r in ranks)


@pytest.mark.timeout(240)
def test_forced_flashinfer_on_cpu_falls_back_and_says_so_once(ranks):
    forced = ranks[0]["forced_flashinfer"]
    assert forced["vs_hf"] <= HF_TOL
    for stats in forced["stats"]:
        assert stats["fused_impl"] == {"flashinfer": 0, "reference": 7} and stats["plain_allreduce_calls"] == 0
    assert any("FlashInfer unavailable" in m and "CUDA" in m for m in forced["log"]), forced["log"]
    for r in ranks:
        # Hundreds of fused calls fell back on each rank; each distinct reason is logged once.
        fallbacks = [m for m in r["log"] if "falls back to the reference" in m]
        assert fallbacks and len(fallbacks) == len(set(fallbacks)), fallbacks


@pytest.mark.timeout(240)
def test_standalone_model_and_dummy_weights(ranks):
    alone = ranks[0]["standalone"]
    assert alone["shape_2d"] == [2, 10, 256] and alone["shape_1d"] == [10, 256]
    assert alone["vs_hf_2d"] <= HF_TOL and alone["vs_hf_1d"] <= HF_TOL
    dummy = ranks[0]["dummy"]
    assert dummy["repeat_equal"] and dummy["finite"] and dummy["norm_all_ones"]
    assert dummy["logits_std"] > 0


# ---- in-process checks (TP 1) ----------------------------------------------------------------


def test_import_glm_fused_imports_no_framework():
    code = ("import sys, glm_fused; assert glm_fused.__version__; "
            "from glm_fused import Glm4MoeConfig; assert Glm4MoeConfig.__module__ == 'glm_fused.config'; "
            "bad = [m for m in ('paddle', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    import glm_fused
    from glm_fused.paddle_backend.model import Glm4MoeForCausalLM

    assert glm_fused.Glm4MoeForCausalLM is Glm4MoeForCausalLM  # the Paddle model is the default


def test_bfloat16_is_refused_on_cpu_naming_the_flag(checkpoints):
    from glm_fused.paddle_backend import ModelRunner

    d = checkpoints["dirs"]["qknorm_experts_v5"]
    with pytest.raises(UserError, match=r"--dtype bfloat16.*CPU"):
        ModelRunner(Glm4MoeConfig.from_pretrained(d), d, tp_rank=0, tp_size=1, dtype="bfloat16", fused=True,
                    fusion="auto", max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8)
    with pytest.raises(UserError, match=r"--dtype 'float16'"):
        ModelRunner(Glm4MoeConfig.from_pretrained(d), d, tp_rank=0, tp_size=1, dtype="float16", fused=True,
                    fusion="auto", max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8)


# ---- loader strictness, through this backend's loader -------------------------------------


def _broken_copy(checkpoints, tmp_path, edit) -> Path:
    src = checkpoints["dirs"]["qknorm_experts_v5"]
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    if edit is not None:
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _load(d: Path, tp_size: int = 1):
    from glm_fused.paddle_backend.loader import load_weights
    from glm_fused.paddle_backend.model import Glm4MoeForCausalLM

    config = Glm4MoeConfig.from_pretrained(d)
    shard = TPShard(config, 0, tp_size)
    comm = _FakeComm(tp_size)  # loading needs no collective; the model only stores the handle
    model = Glm4MoeForCausalLM(config, tp_rank=0, tp_size=tp_size, comm=comm)
    load_weights(model, d, config, shard, progress=False)
    return model


class _FakeComm:
    def __init__(self, size: int):
        self.rank, self.size = 0, size


def test_loader_fills_every_parameter_in_its_dtype(checkpoints, tmp_path):
    d = _broken_copy(checkpoints, tmp_path, None)
    model = _load(d, tp_size=2)  # rank 0 of 2: slices, not whole tensors
    params = dict(model.named_parameters())
    full = load_file(d / "model.safetensors")
    np.testing.assert_array_equal(params["layers.1.mlp.gate.e_score_correction_bias"].numpy(),
                                  full["model.layers.1.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(params["lm_head.weight"].numpy(), full["lm_head.weight"][:128])
    assert params["layers.2.mlp.experts.gate_up_proj"].shape == [8, 32, 64]
    assert all(str(p.dtype) == "paddle.float32" for p in params.values())


def test_loader_missing_tensor(checkpoints, tmp_path):
    d = _broken_copy(checkpoints, tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(UserError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        _load(d)


def test_loader_unexpected_tensor(checkpoints, tmp_path):
    d = _broken_copy(checkpoints, tmp_path,
                     lambda t: t.update({"model.layers.2.mlp.surprise.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(UserError, match=r"model\.safetensors.*model\.layers\.2\.mlp\.surprise\.weight"):
        _load(d)


def test_loader_wrong_shape(checkpoints, tmp_path):
    def shrink(t):
        t["model.layers.2.mlp.gate.weight"] = t["model.layers.2.mlp.gate.weight"][:, :32].copy()
    d = _broken_copy(checkpoints, tmp_path, shrink)
    with pytest.raises(UserError, match=r"model\.layers\.2\.mlp\.gate\.weight.*shape"):
        _load(d)


def test_loader_truncated_file(checkpoints, tmp_path):
    d = _broken_copy(checkpoints, tmp_path, None)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 256])
    with pytest.raises(UserError, match=r"model\.safetensors"):
        _load(d)


def test_loader_requires_each_parameter_exactly_once(checkpoints, tmp_path, monkeypatch):
    """The loader's own bookkeeping, with the load plan bent to skip or repeat a tensor."""
    from glm_fused import checkpoint as loader  # the bookkeeping both backends' loaders share

    d = _broken_copy(checkpoints, tmp_path, None)
    real = loader.iter_rank_weights

    def skipping(*args, **kwargs):
        return ((n, a) for n, a in real(*args, **kwargs) if n != "layers.0.mlp.down_proj.weight")

    monkeypatch.setattr(loader, "iter_rank_weights", skipping)
    with pytest.raises(UserError, match=r"no weights loaded for parameter 'layers\.0\.mlp\.down_proj\.weight'"):
        _load(d)

    def repeating(*args, **kwargs):
        for n, a in real(*args, **kwargs):
            yield n, a
            if n == "norm.weight":
                yield n, a

    monkeypatch.setattr(loader, "iter_rank_weights", repeating)
    with pytest.raises(UserError, match=r"'norm\.weight' would be loaded twice"):
        _load(d)

    def misshaped(*args, **kwargs):
        for n, a in real(*args, **kwargs):
            yield n, (a[:-1] if n == "lm_head.weight" else a)

    monkeypatch.setattr(loader, "iter_rank_weights", misshaped)
    with pytest.raises(UserError, match=r"'lm_head\.weight' has shape \[255, 64\]"):
        _load(d)


# ---- the fused op's kernel path, with a stand-in kernel -------------------------------------


class _KernelComm:
    """Rank 0 of 2 identical ranks: the all-reduce doubles; the 'kernel' is a torch function."""

    def __init__(self, workspace_tokens: int):
        from glm_fused.fusion import FallbackLog, FusionStats, KernelEnv

        self.rank, self.size = 0, 2
        self.stats, self.fallback_log = FusionStats(), FallbackLog()
        self.kernel_env = KernelEnv(device="cuda", sm=90, tp_size=2, hidden_size=64, flashinfer_error=None,
                                    workspace_max_tokens=workspace_tokens)
        self.kernel_inputs = []

    def all_reduce_uncounted(self, x):
        return x * 2

    def kernel(self, partial, residual, weight, eps):
        self.kernel_inputs.append((partial, residual, weight))
        summed = partial * 2 + residual
        normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight
        return normed, summed


def test_fused_op_kernel_path_crosses_dlpack_and_matches_the_reference(monkeypatch):
    """What the GPU path does around the kernel, on CPU: choose per call, hand Paddle tensors
    to the torch kernel zero-copy, take its torch results back, count the implementation."""
    import paddle

    from glm_fused.paddle_backend.layers import layernorm

    # The kernel serves bf16 only and Paddle cannot compute bf16 on CPU: the policy is told
    # the activations are bf16 while the stand-in kernel computes in fp32.
    monkeypatch.setattr(layernorm, "_dtype_name", lambda dtype: "bfloat16")
    paddle.seed(0)
    comm = _KernelComm(workspace_tokens=8)
    weight = paddle.rand([64]) + 0.5
    for tokens, impl in ((3, "flashinfer"), (8, "flashinfer"), (9, "reference")):
        partial, residual = paddle.randn([tokens, 64]), paddle.randn([tokens, 64])
        expect_sum = partial.numpy() * 2 + residual.numpy()
        expect = expect_sum / np.sqrt((expect_sum ** 2).mean(-1, keepdims=True) + 1e-5) * weight.numpy()
        calls = len(comm.kernel_inputs)
        normed, summed = layernorm.fused_allreduce_residual_rmsnorm(partial, residual, weight, 1e-5, comm)
        assert isinstance(normed, paddle.Tensor) and isinstance(summed, paddle.Tensor)
        np.testing.assert_allclose(summed.numpy(), expect_sum, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(normed.numpy(), expect, rtol=1e-5, atol=1e-5)
        if impl == "flashinfer":
            p_t, r_t, w_t = comm.kernel_inputs[-1]
            # zero-copy: the torch views are the Paddle buffers
            assert p_t.data_ptr() == partial.data_ptr() and r_t.data_ptr() == residual.data_ptr()
            assert w_t.data_ptr() == weight.data_ptr()
        else:
            assert len(comm.kernel_inputs) == calls  # past the workspace: never handed to the kernel
    stats = comm.stats.as_dict()
    assert stats["fused_impl"] == {"flashinfer": 2, "reference": 1}
    assert list(stats["fallback_reasons"]) == ["num_tokens > workspace (8 tokens)"]
