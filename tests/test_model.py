"""The model, once, on both frameworks: against transformers' Glm4MoeForCausalLM, fused against
classic layout, KV-cache paths against one-shot forwards, Paddle against torch.

Checkpoints are written by transformers itself from tiny random models, in both expert
layouts and both config forms, with non-trivial norm weights and correction biases so a
wrong norm, bias or routing shows. Multi-rank checks run once per (framework, TP size)
through ``glm_fused.launcher`` (tests/model_workers.py does the work and writes JSON).

Tolerances, as max |diff| / max |ref| over all logits of a scenario:
* fp32, ours vs transformers: <= 1e-4. Both compute in fp32 and differ only in summation
  order (measured ~6e-7 here, both frameworks, TP 1/2/4).
* fp32, fused vs classic layout and cached/batched vs one-shot forward: <= 1e-5. Same maths
  with the all-reduce moved or the attention split differently (measured 0 and ~5e-7).
* fp32, Paddle vs torch on the same checkpoint and scenarios: <= 1e-4 (as vs transformers).
* bf16: BF16_CPU_BOUNDS (CPU torch) and BF16_BOUNDS (CUDA, with the FlashInfer kernel).
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

import model_workers as workers  # noqa: E402  (tests/ is on sys.path under pytest)
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.launcher import launch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ["paddle", "torch"]
VOCAB = 256
PROMPT_LENS = (40, 7)  # model_workers.run_scenarios relies on these lengths
HF_TOL = 1e-4
SAME_MATHS_TOL = 1e-5
# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 0.2% per stored value), and in a
# random model a few tokens sit on a near-tie between experts that rounding flips (moving that
# token's logits by up to ~20% of scale). So bf16 is judged on all rows pooled: mean |diff|,
# the 90th percentile of a row's max |diff| (both relative to the logit scale), and top-1
# agreement. A real fault lands far outside: a wrong cast or a misused kernel (random logits
# agree on top-1 about 1/256 of the time and differ by ~100% of scale). Faults that stay inside
# bf16 noise are checked directly in tests/test_layer_numerics.py: router logits in bf16 moved
# the mean below by -0.5% / -2%, norm statistics in bf16 by +10% / +11% (and flipped 1 of 47
# top-1 rows).
#
# CPU, the small checkpoints A and B, bf16 vs our fp32 (test_bfloat16_on_cpu_tracks_fp32),
# measured with torch 2.13 on x86: mean 0.21% / 0.23%, p90 0.99% / 1.09%, top-1 1.0 / 1.0.
# Bounds: 1.5x the worse of the two for mean and p90 (summation order differs between CPUs and
# builds); top-1 lets 2 of the 47 rows of a checkpoint flip.
BF16_CPU_BOUNDS = {"mean": 0.0035, "p90": 0.0165, "top1": 0.95}
# CUDA, the hidden-512 checkpoint G at TP 1/2/4 (FlashInfer where it serves): measured mean
# 0.45%, p90 1.5%, top-1 0.91 (its logits are flat: std 0.3 of a max of 1.9, so close calls are
# common). Bounds about 2x (mean), 3x (p90) those; not re-measured since.
BF16_BOUNDS = {"mean": 0.01, "p90": 0.05, "top1": 0.8}


def _needs(framework: str) -> None:
    if importlib.util.find_spec(framework) is None:  # found, not imported: collection stays light
        pytest.skip(f"{framework} is not installed")


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
    return _write_all(tmp_path_factory.mktemp("ckpts"), CHECKPOINTS, prompts)


def _launch_checks(out: Path, tp: int, prompts, ckpts: dict[str, Path], **extra) -> Path:
    args = {"out": str(out), "prompts": prompts, "checkpoints": {k: str(v) for k, v in ckpts.items()}, **extra}
    device = extra.get("device", "cpu")
    # On a GPU without the prebuilt module the first workspace JIT-builds FlashInfer's
    # trtllm_comm (~265 s on an H200 host; FLASHINFER_WORKSPACE_BASE keeps the build).
    timeout = 800 if device == "gpu" else 240
    code = launch(workers.tp_checks, args, nprocs=tp, device=device, timeout=timeout)
    assert code == 0, f"TP {tp} ranks failed (exit {code}; {extra})"
    return out


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, ckpts, prompts):
    """``tp_run(framework, tp)``: run model_workers.tp_checks once (CPU, fp32), return its out dir."""
    done: dict[tuple[str, int], Path] = {}

    def run(framework: str, tp: int) -> Path:
        _needs(framework)
        if (framework, tp) not in done:
            done[(framework, tp)] = _launch_checks(tmp_path_factory.mktemp(f"{framework}_tp{tp}"), tp, prompts,
                                                   ckpts, backend=framework, extras=True)
        return done[(framework, tp)]

    return run


def _names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", "np") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_the_parameter_count_is_transformers_own(name):
    """``Glm4MoeConfig.num_parameters`` (what the out-of-memory message at load reports) counts
    what transformers' model holds: its parameters and the router's correction bias (a buffer
    there, a weight of the checkpoint)."""
    from glm_fused.config import Glm4MoeConfig

    model = _hf_model(CHECKPOINTS[name])
    experts, others = Glm4MoeConfig.from_dict(model.config.to_dict()).num_parameters()
    held = dict(model.named_parameters())
    held.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert experts == sum(t.numel() for n, t in held.items() if ".mlp.experts." in n) > 0
    assert experts + others == sum(t.numel() for t in held.values())


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
               pooled: bool = False) -> list[dict]:
    """Assert one tp_checks run: accuracy, fused == classic, cached == one-shot, identical
    ranks, counters.

    ``kernel``: the implementation every fused call must have used ("reference" on CPU,
    "flashinfer" where the kernel serves every call of these small batches). ``pooled``:
    judge accuracy on all scenarios' rows together (bf16) rather than each scenario (fp32).
    """
    def pick(table):
        return {"all": table["all"]} if pooled else table

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]
    result = ranks[0]
    assert [r["rank"] for r in ranks] == list(range(tp)) and result["world"] == tp
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
            assert sum(stats["fused_impl"].values()) == 0, stats
    return ranks


FP32_HF = {"max": HF_TOL}
FP32_SAME = {"max": SAME_MATHS_TOL}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_matches_transformers_fused_equals_classic(tp_run, framework, tp):
    ranks = _check_run(tp_run(framework, tp), tp, FP32_HF, FP32_SAME)
    # 3 tokens < TP 4 and single-token decode steps are among the scenarios checked.
    assert {"tokens_1", "tokens_3", "tokens_40", "cached_decode", "mixed",
            "batched_decode"} <= set(ranks[0]["checkpoints"]["A"]["vs_hf"]["fused"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_forced_kernel_standalone_model_dummy_weights(tp_run, framework, tp):
    ranks = [json.loads((tp_run(framework, tp) / f"rank{r}.json").read_text()) for r in range(tp)]
    first = ranks[0]
    # FlashInfer asked for on CPU: every call falls back, with a warning that says why.
    forced = first["forced_flashinfer"]
    assert forced["vs_hf"] <= HF_TOL
    for stats in forced["stats"]:
        assert stats["fused_impl"] == {"flashinfer": 0, "reference": 7} and stats["plain_allreduce_calls"] == 0
    assert any("FlashInfer unavailable" in m and "CUDA" in m for m in forced["log"]), forced["log"]
    for r in ranks:
        # Hundreds of fused calls fell back on each rank; each distinct reason is logged once.
        fallbacks = [m for m in r["log"] if "falls back to the reference" in m]
        assert fallbacks and len(fallbacks) == len(set(fallbacks)), fallbacks
    alone = first["standalone"]
    assert alone["shape_2d"] == [2, 7, VOCAB] and alone["shape_1d"] == [7, VOCAB]
    assert alone["vs_hf_2d"] <= HF_TOL and alone["vs_hf_1d"] <= HF_TOL
    dummy = first["dummy"]
    assert dummy["repeat_equal"] and dummy["finite"] and dummy["norm_all_ones"] and dummy["logits_std"] > 0
    assert 0.015 < dummy["qkv_std"] < 0.025  # N(0, 0.02)
    for r in ranks[1:]:
        assert r["dummy"]["router_digest"] == first["dummy"]["router_digest"]  # replicated router
        assert r["dummy"]["weight_digest"] != first["dummy"]["weight_digest"]  # each rank its own slice
    assert all(r["broadcast"] == [0, 7, 14, 21, 28, 35] for r in ranks)
    for rank, r in enumerate(ranks):
        assert f"this process is rank {rank} of {tp}: start one process per rank" in (r["wrong_tp_size"] or ""), r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 4])
def test_paddle_matches_torch(tp_run, tp):
    """Same checkpoints, same scenarios, both frameworks, fp32, fused and classic."""
    ours = np.load(tp_run("torch", tp) / "logits.npz")
    theirs = np.load(tp_run("paddle", tp) / "logits.npz")
    assert sorted(ours.files) == sorted(theirs.files) and len(ours.files) == 2 * 2 * 7
    for key in ours.files:
        err = workers.rel_err(theirs[key], ours[key])
        assert err <= HF_TOL, f"TP{tp} {key}: paddle vs torch {err:.2e}"


# ---- in-process (TP 1) ------------------------------------------------------------------------

def _model_class(framework: str):
    _needs(framework)
    from glm_fused.backends import get_backend

    return get_backend(framework).Glm4MoeForCausalLM


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_from_pretrained_and_plain_call(ckpts, prompts, framework):
    """The standalone use: from_pretrained + model(input_ids) for [seq] and [batch, seq], as the
    framework's own tensors, arrays or lists; the class is the framework's native module."""
    cls = _model_class(framework)
    model = cls.from_pretrained(ckpts["B"], fused=True, dtype="float32")
    F = model.F
    native = torch.nn.Module if framework == "torch" else __import__("paddle").nn.Layer
    assert isinstance(model, native)
    ref0, ref1 = (np.load(ckpts["B"] / f"hf_logits_{i}.npy") for i in (0, 1))
    one = model(F.tensor(np.array(prompts[1])))
    assert list(one.shape) == [len(prompts[1]), VOCAB]
    assert workers.rel_err(F.to_numpy(one), ref1) <= HF_TOL
    two = F.to_numpy(model([prompts[0][:7], prompts[1]]))
    assert two.shape == (2, 7, VOCAB)
    assert workers.rel_err(two[0], ref0[:7]) <= HF_TOL and workers.rel_err(two[1], ref1) <= HF_TOL
    params = dict(model.named_parameters())
    assert params.keys() >= {"embed_tokens.weight", "layers.1.mlp.experts.gate_up_proj",
                             "layers.2.mlp.gate.e_score_correction_bias", "lm_head.weight"}
    assert F.dtype_name(model.layers[1].mlp.gate.weight) == "float32"


def test_from_pretrained_takes_the_tiny_name():
    cls = _model_class("torch")
    model = cls.from_pretrained("glm-4.5-air-tiny")
    assert model.config.num_hidden_layers == 4 and torch.isfinite(model([1, 2, 3])).all()


def test_from_pretrained_takes_a_hugging_face_name_and_revision(tmp_path, monkeypatch):
    """A name in the local Hugging Face cache, as --model takes it; ``revision`` picks the
    snapshot (here two copies of the tiny checkpoint, the second with another rope_theta)."""
    import shutil

    from glm_fused.tiny import ensure_tiny_checkpoint

    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    entry = hub / "models--zai-org--GLM-4.5-Air"
    for rev in ("a1" * 20, "b2" * 20):
        shutil.copytree(ensure_tiny_checkpoint(), entry / "snapshots" / rev)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("a1" * 20)
    (entry / "refs" / "v2").write_text("b2" * 20)
    config = entry / "snapshots" / ("b2" * 20) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_theta": 500.0}))
    cls = _model_class("torch")
    main, v2 = cls.from_pretrained("GLM-4.5-Air"), cls.from_pretrained("zai-org/GLM-4.5-Air", revision="v2")
    assert v2.config.rope_theta == 500.0 and main.config.rope_theta != 500.0
    assert torch.equal(main([3, 4, 5]), cls.from_pretrained("glm-4.5-air-tiny")([3, 4, 5]))
    assert not torch.allclose(main([3, 4, 5]), v2([3, 4, 5]))  # positions 1 and 2 rotate otherwise
    with pytest.raises(UserError, match="--revision v3"):
        cls.from_pretrained("GLM-4.5-Air", revision="v3")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_plain_call_refuses_what_is_not_token_ids(framework):
    """model(input_ids) names what is wrong with its input; before, a negative id ran silently
    in Paddle, and an id past the vocabulary was a framework's index error (at TP > 1 it would be
    a row of zeros)."""
    model = _model_class(framework).from_pretrained("glm-4.5-air-tiny")
    for bad, error, message in [
        ([[-1, 2]], ValueError, r"token id -1 is outside the vocabulary \(0..1023\)"),
        ([[3, 1024]], ValueError, r"token id 1024 is outside the vocabulary"),
        (np.array([[1.5, 2.0]]), ValueError, "must be integer token ids, got float64"),
        ([[True, False]], ValueError, "must be integer token ids, got bool"),
        ([[1, 2], [3]], ValueError, "its rows differ in length"),
        ("hello", TypeError, "must be token ids .*, got str"),
        (None, TypeError, "got NoneType"),
        ([[]], ValueError, r"got shape \[1, 0\]"),
        ([1] * 4097, ValueError, "4097 positions, more than the 4096 this model was built for"),
    ]:
        with pytest.raises(error, match=message):
            model(bad)
    assert list(model(np.array([[3, 1023]], np.int32)).shape) == [1, 2, 1024]  # any integer kind


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_from_pretrained_arguments_are_checked_by_name(framework):
    cls = _model_class(framework)
    for kwargs, error, message in [({"max_position": 0}, ValueError, "max_position must be a positive integer"),
                                   ({"max_position": -5}, ValueError, "got -5"),
                                   ({"tp_rank": 1}, ValueError, r"tp_rank 1 outside 0..0 \(tp_size 1\)")]:
        with pytest.raises(error, match=message):
            cls.from_pretrained("glm-4.5-air-tiny", **kwargs)
    # the command line's spellings of the dtype; Paddle refuses bfloat16 on CPU by name
    assert cls.from_pretrained("glm-4.5-air-tiny", dtype="fp32").dtype == "float32"
    if framework == "torch":
        assert cls.from_pretrained("glm-4.5-air-tiny", dtype="bf16").dtype == "bfloat16"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_parallel_without_a_job_says_how_to_start_one(framework):
    cls = _model_class(framework)
    with pytest.raises(ValueError, match=r"tp_size=2, but this process is rank 0 of 1: start one process per rank "
                                         r"\(torchrun --nproc-per-node 2"):
        cls.from_pretrained("glm-4.5-air-tiny", tp_rank=1, tp_size=2)


def test_the_written_once_classes_are_not_for_direct_use():
    from glm_fused.model.glm4_moe import Glm4MoeForCausalLM

    with pytest.raises(TypeError, match="framework-neutral"):
        Glm4MoeForCausalLM(Glm4MoeConfig())
    assert issubclass(_model_class("torch"), Glm4MoeForCausalLM)


def test_bfloat16_on_cpu_tracks_fp32(ckpts, prompts):
    """torch: bf16 weights and activations vs our fp32 result on the same checkpoint (BF16_CPU_BOUNDS)."""
    cls = _model_class("torch")
    for name in ("A", "B"):
        fp32 = cls.from_pretrained(ckpts[name], dtype="float32")
        bf16 = cls.from_pretrained(ckpts[name], dtype="bfloat16")
        assert bf16.embed_tokens.weight.dtype == torch.bfloat16
        assert bf16.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
        ref = np.concatenate([fp32(p).numpy() for p in prompts])
        got = np.concatenate([bf16(p).float().numpy() for p in prompts])
        _assert_within({"all": workers.compare(got, ref)}, BF16_CPU_BOUNDS, f"{name} bf16 vs fp32")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dtype_names_are_checked(ckpts, framework):
    cls = _model_class(framework)
    config = Glm4MoeConfig.from_pretrained(ckpts["A"])
    with pytest.raises(UserError, match="dtype 'float16'"):
        cls(config, dtype="float16")
    if framework == "paddle":
        with pytest.raises(UserError, match=r"dtype bfloat16.*CPU"):
            cls(config, dtype="bfloat16")


def test_import_glm_fused_imports_no_framework():
    code = ("import sys, glm_fused; assert glm_fused.__version__; "
            "from glm_fused import Glm4MoeConfig; assert Glm4MoeConfig.__module__ == 'glm_fused.config'; "
            "import glm_fused.model, glm_fused.fused_op, glm_fused.runner, glm_fused.engine; "
            "bad = [m for m in ('paddle', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    _needs("paddle")
    import glm_fused
    from glm_fused.paddle_backend import Glm4MoeForCausalLM

    assert glm_fused.Glm4MoeForCausalLM is Glm4MoeForCausalLM  # the Paddle model is the default


# ---- loader strictness ----------------------------------------------------------------------

class _FakeComm:
    """Loading needs no collective; the model only stores the handle."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size


def _load(framework: str, d: Path, tp_size: int = 1, extra_param: bool = False):
    from glm_fused.model.loader import load_weights

    config = Glm4MoeConfig.from_pretrained(d)
    model = _model_class(framework)(config, tp_rank=0, tp_size=tp_size, comm=_FakeComm(tp_size))
    if extra_param:  # a parameter the load plan never fills
        layer = model.layers[0].self_attn
        layer.stray = layer.param([3], "float32")
    load_weights(model, d, progress=False)
    return model


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
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_loader_refuses_bad_checkpoints(ckpts, tmp_path, framework, how):
    named = _corrupt(ckpts["A"], tmp_path / how, how)
    with pytest.raises(UserError) as err:
        _load(framework, tmp_path / how)
    assert named in str(err.value)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_loader_requires_every_parameter(ckpts, framework):
    """A parameter the load plan never fills is an error, not silently uninitialised memory."""
    with pytest.raises(UserError, match="layers.0.self_attn.stray"):
        _load(framework, ckpts["A"], extra_param=True)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_loader_fills_this_ranks_slices_in_their_dtypes(ckpts, framework):
    model = _load(framework, ckpts["A"], tp_size=2)  # rank 0 of 2: slices, not whole tensors
    F = model.F
    params = dict(model.named_parameters())
    full = _tensors(ckpts["A"])
    np.testing.assert_array_equal(F.to_numpy(params["layers.1.mlp.gate.e_score_correction_bias"]),
                                  full["model.layers.1.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(F.to_numpy(params["lm_head.weight"]), full["lm_head.weight"][:VOCAB // 2])
    assert list(params["layers.2.mlp.experts.gate_up_proj"].shape) == [8, 32, 64]
    assert {F.dtype_name(p) for p in params.values()} == {"float32"}


def test_loader_requires_each_parameter_exactly_once(ckpts, monkeypatch):
    """The load plan's bookkeeping, with the plan bent to skip, repeat or misshape a tensor."""
    from types import SimpleNamespace

    from glm_fused import checkpoint

    real = checkpoint.iter_rank_plan

    def bent(change):
        monkeypatch.setattr(checkpoint, "iter_rank_plan", lambda *a, **k: change(real(*a, **k)))

    bent(lambda items: ((n, p) for n, p in items if n != "layers.0.mlp.down_proj.weight"))
    with pytest.raises(UserError, match=r"no weights loaded for parameter 'layers\.0\.mlp\.down_proj\.weight'"):
        _load("torch", ckpts["A"])
    bent(lambda items: (x for n, p in items for x in ([(n, p)] * (2 if n == "norm.weight" else 1))))
    with pytest.raises(UserError, match=r"'norm\.weight' would be loaded twice"):
        _load("torch", ckpts["A"])
    shorter = lambda p: SimpleNamespace(shape=(p.shape[0] - 1, *p.shape[1:]), parts=p.parts)  # noqa: E731
    bent(lambda items: ((n, shorter(p) if n == "lm_head.weight" else p) for n, p in items))
    with pytest.raises(UserError, match=r"'lm_head\.weight' has shape \[255, 64\]"):
        _load("torch", ckpts["A"])


# ---- the fused op's kernel path, with a stand-in kernel -------------------------------------

class _KernelComm:
    """Rank 0 of 2 identical ranks: the all-reduce doubles; the 'kernel' is a torch function."""

    def __init__(self, workspace_tokens: int):
        from glm_fused.fused_op import FallbackLog, FusionStats, KernelEnv

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


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fused_op_kernel_path_matches_the_reference(monkeypatch, framework):
    """What the GPU path does around the kernel, on CPU: choose per call, hand the framework's
    tensors to the torch kernel (Paddle: zero-copy by DLPack), take its results back, count the
    implementation."""
    _needs(framework)
    from glm_fused.backends import get_backend
    from glm_fused.fused_op import fused_allreduce_residual_rmsnorm, policy

    F = get_backend(framework).OPS
    # The kernel serves bf16 only (and Paddle cannot compute bf16 on CPU): the policy is told
    # fp32 is a kernel dtype, and the stand-in kernel computes in fp32.
    monkeypatch.setattr(policy, "KERNEL_DTYPES", (*policy.KERNEL_DTYPES, "float32"))
    rng = np.random.default_rng(0)
    comm = _KernelComm(workspace_tokens=8)
    weight = F.tensor(rng.random(64, dtype=np.float32) + 0.5)
    for tokens, impl in ((3, "flashinfer"), (8, "flashinfer"), (9, "reference")):
        p_np, r_np = rng.standard_normal((2, tokens, 64), dtype=np.float32)
        partial, residual = F.tensor(p_np), F.tensor(r_np)
        expect_sum = p_np * 2 + r_np
        expect = expect_sum / np.sqrt((expect_sum ** 2).mean(-1, keepdims=True) + 1e-5) * F.to_numpy(weight)
        calls = len(comm.kernel_inputs)
        normed, summed = fused_allreduce_residual_rmsnorm(partial, residual, weight, 1e-5, comm, F)
        assert type(normed) is type(partial) and type(summed) is type(partial)
        np.testing.assert_allclose(F.to_numpy(summed), expect_sum, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(F.to_numpy(normed), expect, rtol=1e-5, atol=1e-5)
        if impl == "flashinfer":
            p_t, r_t, w_t = comm.kernel_inputs[-1]
            # zero-copy: the torch views are the framework's buffers
            assert p_t.data_ptr() == partial.data_ptr() and r_t.data_ptr() == residual.data_ptr()
            assert w_t.data_ptr() == weight.data_ptr()
        else:
            assert len(comm.kernel_inputs) == calls  # past the workspace: never handed to the kernel
    stats = comm.stats.as_dict()
    assert stats["fused_impl"] == {"flashinfer": 2, "reference": 1}
    assert list(stats["fallback_reasons"]) == ["num_tokens > workspace (8 tokens)"]


def test_capture_sizes_cover_every_batch():
    from glm_fused.torch_backend.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for n in (1, 5, 17, 64):
        sizes = capture_sizes(n)
        assert sizes[-1] == n and all(any(s >= b for s in sizes) for b in range(1, n + 1))


def test_fusion_stats_add_counts_a_replayed_graph():
    from glm_fused.fused_op import FusionStats

    captured, step = FusionStats(), FusionStats()
    captured.record("flashinfer")
    captured.record("reference", "too many tokens")
    captured.record_plain_allreduce(2)
    step.record("reference", "too many tokens")
    step.add(captured)
    assert step.as_dict() == {"fused_allreduce_norm_calls": 3, "plain_allreduce_calls": 2,
                              "fused_impl": {"flashinfer": 1, "reference": 2},
                              "fallback_reasons": {"too many tokens": 2}}


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
    return _write_all(tmp_path_factory.mktemp("gpu_ckpts"), GPU_CHECKPOINTS, prompts)


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cuda_bfloat16_fused_kernel(gpu_ckpts, prompts, tmp_path, monkeypatch, tp):
    """bf16 on CUDA (torch), ranks sharing one GPU when there are fewer GPUs than ranks.

    At TP 2/4 every fused call of these small batches must be served by FlashInfer's kernel
    (a missing FlashInfer fails here: the GPU proof is the point of the test), and the result
    must agree with transformers (fp32) and with the classic layout within BF16_BOUNDS; at TP 1
    every call takes the reference.
    """
    from glm_fused.fused_op import flashinfer

    monkeypatch.setenv("GLM_FUSED_DEVICE", "gpu")  # TP 1 runs in this process
    if tp > 1:
        assert flashinfer.probe() is None, f"FlashInfer cannot run here: {flashinfer.probe()}"
    kernel = "flashinfer" if tp > 1 else "reference"
    out = _launch_checks(tmp_path, tp, prompts, gpu_ckpts, backend="torch", device="gpu", dtype="bfloat16")
    ranks = _check_run(out, tp, BF16_BOUNDS, BF16_BOUNDS, kernel=kernel, pooled=True)
    assert ranks[0]["device"].startswith("cuda")
