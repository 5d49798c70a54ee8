"""The PyTorch backend against transformers' Glm4MoeForCausalLM, and fused against classic layout.

Checkpoints are written by transformers itself from tiny random models, in both expert
layouts and both config forms, with non-trivial norm weights and correction biases so a
wrong norm, bias or routing shows. Multi-rank checks run once per TP size through
``glm_fused.launcher`` (tests/torch_workers.py does the work and writes JSON).

Tolerances, as max |diff| / max |ref| over all logits of a scenario:
* fp32, ours vs transformers: <= 1e-4. Both compute in fp32 and differ only in summation
  order (measured ~6e-7 here).
* fp32, fused vs classic layout and cached/batched vs one-shot forward: <= 1e-5. Same maths
  with the all-reduce moved or the attention split differently (measured 0 and ~5e-7).
* bf16 (CPU, and CUDA with the FlashInfer kernel): see BF16_BOUNDS.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch_workers  # noqa: E402  (tests/ is on sys.path under pytest)
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.launcher import launch  # noqa: E402

VOCAB = 256
PROMPT_LENS = (40, 7)  # run_scenarios relies on these lengths
HF_TOL = 1e-4
SAME_MATHS_TOL = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2% per stored value), and in a
# random model a few tokens sit on a near-tie between experts that rounding flips (moving that
# token's logits by up to ~20% of scale). So bf16 is judged on all rows of all scenarios
# pooled: mean |diff| <= 1% of the logit scale, 90% of rows within 5%, top-1 agreement >= 0.8.
# Measured, bf16 vs fp32: small models mean 0.2%, p90 ~1.5%, top-1 1.0; the hidden-512 model
# mean 0.45%, p90 1.5%, top-1 0.91 (its logits are flat: std 0.3 of a max of 1.9, so close
# calls are common). A real fault lands far outside: the router or norm statistics in bf16
# without the fp32 upcast, a wrong cast, or a misused kernel (random logits agree on top-1
# about 1/256 of the time and differ by ~100% of scale).
BF16_BOUNDS = {"mean": 0.01, "p90": 0.05, "top1": 0.8}


# name -> how transformers writes it. A: qk-norm, 4 KV heads (split at TP 4), per-expert
# tensors, transformers-5 config. B: no qk-norm, 2 KV heads (replicated at TP 4), fused
# expert tensors, transformers-4 config, another RoPE base and a quarter-rotary head.
CHECKPOINTS = {
    "A": dict(use_qk_norm=True, num_key_value_heads=4, rope_theta=10000.0, partial_rotary_factor=0.5,
              original_format=True, config_form=5, seed=0),
    "B": dict(use_qk_norm=False, num_key_value_heads=2, rope_theta=50000.0, partial_rotary_factor=0.25,
              original_format=False, config_form=4, seed=1),
}


def _hf_model(spec: dict):
    sizes = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=16)
    sizes.update(spec.get("sizes", {}))
    cfg = transformers.Glm4MoeConfig(
        vocab_size=VOCAB, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
        num_key_value_heads=spec["num_key_value_heads"], n_routed_experts=8, **sizes,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=True,
        use_qk_norm=spec["use_qk_norm"], routed_scaling_factor=2.5, attention_bias=True,
        # Init scaled with width so activations and router logits keep the same spread at
        # any hidden size (0.06 and 0.3 at hidden 64); wider router logits saturate the
        # sigmoid into near-ties that any rounding flips.
        max_position_embeddings=128, initializer_range=0.48 / sizes["hidden_size"] ** 0.5, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"],
                         "partial_rotary_factor": spec["partial_rotary_factor"]})
    torch.manual_seed(spec["seed"])
    model = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones would hide a missing or misplaced norm weight
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            gate = layer.mlp.gate
            gate.weight.normal_(0.0, 2.4 / cfg.hidden_size ** 0.5)  # scores spread: routing depends on the input
            gate.e_score_correction_bias.copy_(0.2 * torch.rand_like(gate.e_score_correction_bias))
    return model


def _write_checkpoint(path: Path, spec: dict, prompts: list[list[int]]) -> None:
    model = _hf_model(spec)
    model.save_pretrained(path, save_original_format=spec["original_format"])
    if spec["config_form"] == 4:  # the transformers-4 form real GLM-4.5 checkpoints ship with
        raw = json.loads((path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                   torch_dtype=raw.pop("dtype"), rope_scaling=None, transformers_version="4.54.0")
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            logits = model(torch.tensor([prompt])).logits[0]
            np.save(path / f"hf_logits_{i}.npy", logits.numpy())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: extra intra-op threads only add synchronisation, and on a busy
    2-core machine spinning OpenMP threads made the in-process runs 5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]


def _write_all(root: Path, specs: dict, prompts) -> dict[str, Path]:
    out = {}
    for name, spec in specs.items():
        out[name] = root / name
        _write_checkpoint(out[name], spec, prompts)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, prompts) -> dict[str, Path]:
    return _write_all(tmp_path_factory.mktemp("torch_ckpts"), CHECKPOINTS, prompts)


def _launch_checks(out: Path, tp: int, prompts, ckpts: dict[str, Path], **extra) -> Path:
    args = {"out": str(out), "prompts": prompts, "checkpoints": {k: str(v) for k, v in ckpts.items()}, **extra}
    device = "gpu" if extra.get("device") == "gpu" else "cpu"
    # On a GPU the first workspace JIT-builds FlashInfer's trtllm_comm module (~265 s on an
    # H200 host; FLASHINFER_WORKSPACE_BASE keeps the build for later runs).
    timeout = 800 if device == "gpu" else 240
    code = launch(torch_workers.tp_checks, args, nprocs=tp, device=device, timeout=timeout)
    assert code == 0, f"TP {tp} ranks failed (exit {code}; {extra})"
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, ckpts, prompts):
    """``tp_run(tp, backend)``: run tests/torch_workers.py:tp_checks once, return its out dir."""
    done: dict[tuple[int, str], Path] = {}

    def run(tp: int, backend: str = "torch") -> Path:
        if (tp, backend) not in done:
            done[(tp, backend)] = _launch_checks(tmp_path_factory.mktemp(f"{backend}_tp{tp}"), tp, prompts,
                                                 ckpts, backend=backend)
        return done[(tp, backend)]

    return run


def _names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", "np") as f:
        return set(f.keys())


def test_checkpoints_are_the_forms_we_claim(ckpts):
    a, b = _names(ckpts["A"]), _names(ckpts["B"])
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in a and "model.layers.1.mlp.experts.gate_up_proj" not in a
    assert "model.layers.1.mlp.experts.gate_up_proj" in b and "model.layers.1.mlp.experts.0.gate_proj.weight" not in b
    assert "model.layers.0.self_attn.q_norm.weight" in a and "model.layers.0.self_attn.q_norm.weight" not in b
    raw_a = json.loads((ckpts["A"] / "config.json").read_text())
    raw_b = json.loads((ckpts["B"] / "config.json").read_text())
    assert "rope_parameters" in raw_a and "rope_theta" not in raw_a
    assert "rope_parameters" not in raw_b and raw_b["rope_theta"] == 50000.0
    cfg_b = Glm4MoeConfig.from_pretrained(ckpts["B"])
    assert (cfg_b.rope_theta, cfg_b.rotary_dim, cfg_b.use_qk_norm) == (50000.0, 4, False)
    with safe_open(ckpts["A"] / "model.safetensors", "np") as f:
        assert np.abs(f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")).min() > 0
        assert np.abs(f.get_tensor("model.norm.weight") - 1).max() > 0.1


def _worst(table: dict[str, dict[str, float]], key: str) -> tuple[str, float]:
    """The scenario with the largest (``max``/``mean``) or smallest (``top1``) value."""
    pick = min if key == "top1" else max
    return pick(((k, v[key]) for k, v in table.items()), key=lambda kv: kv[1])


def _assert_within(table, bounds: dict[str, float], what: str) -> None:
    for key, bound in bounds.items():
        scenario, value = _worst(table, key)
        ok = value >= bound if key == "top1" else value <= bound
        assert ok, f"{what}: {scenario} {key} {value:.2e} (bound {bound})"


def _check_run(out: Path, tp: int, hf_bounds: dict, same_bounds: dict, kernel: str = "reference",
               pooled: bool = False) -> dict:
    """Assert one tp_checks run: accuracy, fused == classic, identical ranks, counters.

    ``kernel``: the implementation every fused call must have used ("reference" on CPU,
    "flashinfer" where the kernel serves every call of these small batches). ``pooled``:
    judge accuracy on all scenarios' rows together (bf16) rather than each scenario (fp32).
    """
    def pick(table):
        return {"all": table["all"]} if pooled else table

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]
    result = ranks[0]
    assert result["world"] == tp
    for name, entry in result["checkpoints"].items():
        calls = 2 * entry["num_layers"] + 1
        for mode in ("fused", "unfused"):
            _assert_within(pick(entry["vs_hf"][mode]), hf_bounds, f"{name} TP{tp} {mode} vs transformers")
            _assert_within(pick(entry["self"][mode]), same_bounds, f"{name} TP{tp} {mode} cached vs one-shot")
            for r in ranks[1:]:  # full-vocab logits, identical on every rank
                assert r["checkpoints"][name]["digest"][mode] == entry["digest"][mode], f"rank {r['rank']} differs"
        _assert_within(pick(entry["fused_vs_unfused"]), same_bounds, f"{name} TP{tp} fused vs classic")
        other = "flashinfer" if kernel == "reference" else "reference"
        for stats in entry["stats"]["fused"]:
            assert stats["fused_allreduce_norm_calls"] == calls and stats["plain_allreduce_calls"] == 0, stats
            assert stats["fused_impl"] == {kernel: calls, other: 0}, stats
            # Every fallback says why (on CPU: every call).
            assert sum(stats["fallback_reasons"].values()) == stats["fused_impl"]["reference"], stats
        for stats in entry["stats"]["unfused"]:
            assert stats["fused_allreduce_norm_calls"] == 0 and stats["plain_allreduce_calls"] == calls, stats
    return result


FP32_HF = {"max": HF_TOL}
FP32_SAME = {"max": SAME_MATHS_TOL}


@pytest.mark.timeout(120)
def test_tp1_matches_transformers_fused_and_classic(tp_run):
    _check_run(tp_run(1), 1, FP32_HF, FP32_SAME)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp2_fused_equals_classic(tp_run):
    _check_run(tp_run(2), 2, FP32_HF, FP32_SAME)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp4_matches_transformers_fused_and_classic(tp_run):
    result = _check_run(tp_run(4), 4, FP32_HF, FP32_SAME)
    # 3 tokens < TP 4 and single-token decode steps are among the scenarios checked above.
    assert {"tokens_1", "tokens_3", "tokens_40", "cached_decode"} <= set(result["checkpoints"]["A"]["vs_hf"]["fused"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_matches_paddle_backend(tp_run):
    """Same checkpoints, same scenarios, both backends, fp32, TP 1 and 4, fused and classic."""
    if importlib.util.find_spec("glm_fused.paddle_backend") is None:
        pytest.skip("glm_fused.paddle_backend is not in this tree")
    pytest.importorskip("paddle")
    for tp in (1, 4):
        ours = np.load(tp_run(tp, "torch") / "logits.npz")
        theirs = np.load(tp_run(tp, "paddle") / "logits.npz")
        assert sorted(ours.files) == sorted(theirs.files)
        for key in ours.files:
            err = torch_workers.rel_err(theirs[key], ours[key])
            assert err <= HF_TOL, f"TP{tp} {key}: paddle vs torch {err:.2e}"


def test_from_pretrained_and_plain_call(ckpts, prompts):
    """The standalone use: from_pretrained + model(input_ids) for [seq] and [batch, seq]."""
    from glm_fused.torch_backend import Glm4MoeForCausalLM

    model = Glm4MoeForCausalLM.from_pretrained(ckpts["B"], fused=True, dtype="float32")
    ref1 = np.load(ckpts["B"] / "hf_logits_1.npy")
    one = model(torch.tensor(prompts[1]))
    assert one.shape == (len(prompts[1]), VOCAB)
    assert torch_workers.rel_err(one.numpy(), ref1) <= HF_TOL
    ref0 = np.load(ckpts["B"] / "hf_logits_0.npy")
    two = model(torch.tensor([prompts[0][:7], prompts[1]]))
    assert two.shape == (2, 7, VOCAB)
    assert torch_workers.rel_err(two[0].numpy(), ref0[:7]) <= HF_TOL
    assert torch_workers.rel_err(two[1].numpy(), ref1) <= HF_TOL
    assert dict(model.named_parameters()).keys() >= {"embed_tokens.weight", "layers.1.mlp.experts.gate_up_proj",
                                                     "layers.2.mlp.gate.e_score_correction_bias", "lm_head.weight"}
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_bfloat16_on_cpu_tracks_fp32(ckpts, prompts):
    """bf16 weights and activations vs our fp32 result on the same checkpoint (BF16_BOUNDS)."""
    from glm_fused.torch_backend import Glm4MoeForCausalLM

    for name in ("A", "B"):
        fp32 = Glm4MoeForCausalLM.from_pretrained(ckpts[name], dtype="float32")
        bf16 = Glm4MoeForCausalLM.from_pretrained(ckpts[name], dtype="bfloat16")
        assert bf16.embed_tokens.weight.dtype == torch.bfloat16
        assert bf16.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
        ref = np.concatenate([fp32(torch.tensor(p)).numpy() for p in prompts])
        got = np.concatenate([bf16(torch.tensor(p)).float().numpy() for p in prompts])
        _assert_within({"all": torch_workers.compare(got, ref)}, BF16_BOUNDS, f"{name} bf16 vs fp32")


def test_dtype_names_are_checked():
    from glm_fused.torch_backend.model import torch_dtype

    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype(torch.float32) is torch.float32
    with pytest.raises(UserError, match="--dtype 'float16'"):
        torch_dtype("float16")


# ---- CUDA (skipped without a GPU) ------------------------------------------------------------

# Bigger than the CPU models so the kernel sees realistic vector widths (hidden 512 = 64
# 16-byte vectors per token); same structure otherwise.
GPU_CHECKPOINTS = {
    "G": dict(CHECKPOINTS["A"], seed=2,
              sizes=dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, head_dim=64)),
}


@pytest.fixture(scope="module")
def gpu_ckpts(tmp_path_factory, prompts) -> dict[str, Path]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return _write_all(tmp_path_factory.mktemp("torch_gpu_ckpts"), GPU_CHECKPOINTS, prompts)


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cuda_bfloat16_fused_kernel(gpu_ckpts, prompts, tmp_path, monkeypatch, tp):
    """bf16 on CUDA, ranks sharing one GPU when there are fewer GPUs than ranks.

    Where FlashInfer can run (TP 2/4, ``probe()`` is None) every fused call of these small
    batches must be served by the kernel, and the result must agree with transformers (fp32)
    and with the classic layout within BF16_BOUNDS; elsewhere every call takes the reference.
    """
    from glm_fused import flashinfer_adapter

    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")  # TP 1 runs in this process
    kernel = "flashinfer" if tp > 1 and flashinfer_adapter.probe() is None else "reference"
    out = _launch_checks(tmp_path, tp, prompts, gpu_ckpts, device="gpu", dtype="bfloat16", fusion="auto")
    result = _check_run(out, tp, BF16_BOUNDS, BF16_BOUNDS, kernel=kernel, pooled=True)
    assert result["device"]["device"].startswith("cuda")


# ---- loader strictness -------------------------------------------------------------------

def _tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(path / "model.safetensors", "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _corrupt(src: Path, dst: Path, how: str) -> str:
    """Copy checkpoint ``src`` to ``dst`` with one defect; return what the error must name."""
    shutil.copytree(src, dst)
    tensors = _tensors(src)
    file = dst / "model.safetensors"
    if how == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) - 1000])
        return str(file)
    if how == "missing":
        name = "model.layers.2.mlp.experts.5.up_proj.weight"
        del tensors[name]
    elif how == "extra":
        name = "model.layers.1.mlp.experts.0.extra_proj.weight"
        tensors[name] = np.zeros((4, 4), np.float32)
    elif how == "wrong_shape":
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = tensors[name][:-1]
    save_file(tensors, str(file), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("how", ["missing", "extra", "wrong_shape", "truncated"])
def test_loader_refuses_bad_checkpoints(ckpts, tmp_path, how):
    from glm_fused.sharding import TPShard
    from glm_fused.torch_backend.loader import load_weights
    from glm_fused.torch_backend.model import Glm4MoeForCausalLM

    named = _corrupt(ckpts["A"], tmp_path / how, how)
    config = Glm4MoeConfig.from_pretrained(tmp_path / how)
    model = Glm4MoeForCausalLM(config)
    with pytest.raises(UserError) as err:
        load_weights(model, tmp_path / how, config, TPShard(config, 0, 1), progress=False)
    assert named in str(err.value)


def test_loader_requires_every_parameter(ckpts):
    """A parameter the load plan never fills is an error, not silently uninitialised memory."""
    from glm_fused.sharding import TPShard
    from glm_fused.torch_backend.loader import load_weights
    from glm_fused.torch_backend.model import Glm4MoeForCausalLM

    config = Glm4MoeConfig.from_pretrained(ckpts["A"])
    model = Glm4MoeForCausalLM(config)
    model.layers[0].self_attn.register_parameter("stray", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(UserError, match="layers.0.self_attn.stray"):
        load_weights(model, ckpts["A"], config, TPShard(config, 0, 1), progress=False)


def test_dummy_weights_deterministic_and_router_replicated(ckpts):
    from glm_fused.torch_backend.loader import dummy_weights
    from glm_fused.torch_backend.model import Glm4MoeForCausalLM

    config = Glm4MoeConfig.from_pretrained(ckpts["A"])
    a, b = Glm4MoeForCausalLM(config), Glm4MoeForCausalLM(config)
    dummy_weights(a, seed=3)
    dummy_weights(b, seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    w = a.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < float(w.std()) < 0.025
    logits = a(torch.tensor([1, 2, 3]))
    assert torch.isfinite(logits).all()


def test_capture_sizes_cover_every_batch():
    from glm_fused.torch_backend.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for n in (1, 5, 17, 64):
        sizes = capture_sizes(n)
        assert sizes[-1] == n and all(any(s >= b for s in sizes) for b in range(1, n + 1))


def test_fusion_stats_add_counts_a_replayed_graph():
    from glm_fused.fusion import FusionStats

    captured, step = FusionStats(), FusionStats()
    captured.record("flashinfer")
    captured.record("reference", "too many tokens")
    captured.record_plain_allreduce(2)
    step.record("reference", "too many tokens")
    step.add(captured)
    assert step.as_dict() == {"fused_allreduce_norm_calls": 3, "plain_allreduce_calls": 2,
                              "fused_impl": {"flashinfer": 1, "reference": 2},
                              "fallback_reasons": {"too many tokens": 2}}
