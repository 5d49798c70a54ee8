"""FP8 checkpoints on CPU: both layouts (compressed-tensors row scales, block fp8 with
``weight_scale_inv``), both expert-name forms, TP 1 and 4, against the same checkpoint
dequantized to fp32 (tests/fp8_checkpoints.py writes both with torch's own e4m3); broken fp8
checkpoints and configs end in one line; ``--quantization fp8`` rounds a bf16 checkpoint's
weights as an fp8 checkpoint stores them.

Tolerance: relative error (max |diff| / max |ref|) at most 1e-5 in fp32. On CPU an fp8
weight is decoded at load (codes * scale, exact in fp32) and the model computes in fp32, so
the two runs see the same weights and differ at most in summation order (measured: 0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fp8_checkpoints as fc  # noqa: E402  (tests/ is on sys.path under pytest)
from safetensors.torch import load_file, save_file  # noqa: E402

from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.engine_args import EngineArgs  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.launcher import launch  # noqa: E402
from glm_fused.tiny import ensure_tiny_checkpoint  # noqa: E402

TOL = 1e-5
PROMPTS = [[5, 17, 300, 2, 41, 9, 77, 120, 8, 3, 600, 45], [900, 4, 4, 31, 7]]
# name -> (layout, stacked experts, scale dtype). Blocks of 48 x 40: partial last blocks at every
# width of the tiny model, and at TP 4 the experts' 16 rows per rank and o_proj's 64 columns
# cut through blocks (read by two ranks each).
VARIANTS = {
    "channel": ("channel", False, torch.bfloat16),   # as zai-org/GLM-4.5-Air-FP8: per-expert, [out, 1] scales
    "channel_fused": ("channel", True, torch.float32),
    "block": ("block", False, torch.float32),
    "block_fused": ("block", True, torch.float32),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (fp8 checkpoint, its fp32 dequantized twin)."""
    root, src = tmp_path_factory.mktemp("fp8"), ensure_tiny_checkpoint()
    out = {}
    for name, (layout, fused, scale_dtype) in VARIANTS.items():
        out[name] = (root / name, root / f"{name}_ref")
        fc.convert(src, *out[name], layout, fused=fused, scale_dtype=scale_dtype)
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def _logits(tmp_path: Path, checkpoints: dict[str, Path], tp: int, **extra) -> dict[str, np.ndarray]:
    out = tmp_path / f"tp{tp}"
    out.mkdir(exist_ok=True)
    args = {"out": str(out), "prompts": PROMPTS, "checkpoints": {k: str(v) for k, v in checkpoints.items()}, **extra}
    assert launch(fc.rank_logits, args, nprocs=tp, timeout=300) == 0
    return {k: np.load(out / f"{k}.npy") for k in checkpoints}


def test_the_checkpoints_are_what_they_claim(ckpts):
    from safetensors import safe_open

    def dtypes(d: Path) -> dict[str, str]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                out.update({k: str(st.get_slice(k).get_dtype()) for k in st.keys()})
        return out

    channel, block_fused = dtypes(ckpts["channel"][0]), dtypes(ckpts["block_fused"][0])
    assert channel["model.layers.1.mlp.experts.3.up_proj.weight"] == "F8_E4M3"
    assert channel["model.layers.1.mlp.experts.3.up_proj.weight_scale"] == "BF16"
    assert channel["model.layers.1.mlp.gate.weight"] == "F32" and channel["lm_head.weight"] == "F32"
    assert block_fused["model.layers.2.mlp.experts.gate_up_proj"] == "F8_E4M3"
    assert "model.layers.2.mlp.experts.gate_up_proj_scale_inv" in block_fused
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in block_fused


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 4])
def test_fp8_checkpoints_load_as_their_dequantized_twin(ckpts, tmp_path, tp):
    runs = {}
    for name, (fp8, ref) in ckpts.items():
        runs[name], runs[f"{name}_ref"] = fp8, ref
    logits = _logits(tmp_path, runs, tp)
    for name in ckpts:
        assert _rel(logits[name], logits[f"{name}_ref"]) <= TOL, name
    # and the weights are not the bf16 checkpoint's: quantization did change them
    assert _rel(logits["channel"], logits["block"]) > 1e-3


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_model_class_loads_fp8_dequantized(ckpts, framework):
    """``from_pretrained`` of either framework on CPU: fp8 checkpoints load decoded to fp32."""
    pytest.importorskip(framework)
    from glm_fused.backends import get_backend

    cls = get_backend(framework).Glm4MoeForCausalLM
    fp8, ref = ckpts["channel"]
    a, b = (cls.from_pretrained(d, max_position=64) for d in (fp8, ref))
    assert not a.fp8_params and a.quantized  # fp8 by the config, held as fp32 here
    ids = np.array([PROMPTS[0]])
    la, lb = (np.asarray(m.F.to_numpy(m(ids)), np.float64) for m in (a, b))
    assert _rel(la, lb) <= TOL


def test_quantization_fp8_rounds_a_bf16_checkpoint_as_an_fp8_one_stores_it(ckpts, tmp_path):
    """``--quantization fp8`` of the tiny checkpoint computes with the weights the fp8 checkpoint
    (written by torch from the same weights, fp32 row scales) holds."""
    logits = _logits(tmp_path, {"online": ensure_tiny_checkpoint(), "stored": ckpts["channel_fused"][1]}, 1,
                     quantization="fp8")
    assert _rel(logits["online"], logits["stored"]) <= TOL


# ---- the loader into fp8 parameters (what a CUDA GPU with fp8 kernels holds), run on the CPU ----

class _Comm:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _rank_model(framework: str, d: Path, tp: int, rank: int, dtype: str = "float32", device: str = "cpu", **kw):
    """Rank ``rank``'s model of a TP ``tp`` group built in this process (loading needs no collective)."""
    import contextlib

    from glm_fused.backends import get_backend
    from glm_fused.model.loader import load_weights

    with torch.device(device) if device != "cpu" else contextlib.nullcontext():
        model = get_backend(framework).Glm4MoeForCausalLM(Glm4MoeConfig.from_pretrained(d), tp_rank=rank, tp_size=tp,
                                                           comm=_Comm(rank, tp), dtype=dtype, **kw)
    load_weights(model, d, progress=False)
    return model


def _assert_holds(model, twin, row_scaled: bool) -> None:
    """``model``'s fp8 weights against its fp32 ``twin``: row-scaled codes * scale equal to the
    twin; requantized ones equal to ``quantize_fp8`` of the twin (codes and scales); every other
    parameter the twin's, in the model's dtype."""
    from glm_fused.torch_backend import OPS

    params = dict(model.named_parameters())
    for n, want in twin.named_parameters():
        got = params[n]
        if n not in model.fp8_params:
            assert torch.equal(got, want.to(got.dtype)), n
            continue
        assert got.dtype == torch.float8_e4m3fn, n
        scale = params[n + "_scale"]
        if row_scaled:
            assert torch.equal(got.float() * scale[..., None], want), n
        else:
            q = OPS.quantize_fp8(want)
            assert torch.equal(got.view(torch.uint8), q.codes.view(torch.uint8)), n
            assert torch.equal(scale, q.scale), n


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("name,tp", [("channel", 1), ("channel_fused", 4), ("block", 4), ("block_fused", 1)])
def test_fp8_parameters_hold_the_checkpoint(ckpts, monkeypatch, name, tp, staged):
    """A model that keeps fp8 weights (as on a GPU with fp8 kernels; forced here on the CPU): a
    row-scaled checkpoint's codes and scales land as stored, so codes * scale equals the fp32
    twin exactly; a block-scaled one is its exact decoding requantized per row, so it equals
    ``quantize_fp8`` of the twin (codes and scales, exactly). ``staged``: the CUDA path's
    pinned-ring chunking, run on the CPU."""
    from glm_fused.torch_backend.ops import TorchOps
    from glm_fused.torch_backend.weights import TorchWeightWriter

    monkeypatch.setattr(TorchOps, "keeps_fp8", lambda self, dtype: True)
    if staged:
        monkeypatch.setattr(TorchOps, "weight_writer",
                            lambda self, device: TorchWeightWriter(device, staged=True, slot_bytes=1000, slots=2))
    fp8, ref = ckpts[name]
    for rank in range(tp):
        model, twin = _rank_model("torch", fp8, tp, rank), _rank_model("torch", ref, tp, rank)
        assert model.fp8_params
        _assert_holds(model, twin, row_scaled=VARIANTS[name][0] == "channel")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fp8_parameters_hold_the_checkpoint_on_cuda(ckpts, name):
    """The same on a GPU with fp8 kernels (a bf16 model, TP 2): codes and scales through the
    pinned ring and copy stream, block-scaled weights requantized on the device beside it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    fp8, ref = ckpts[name]
    for rank in range(2):
        model = _rank_model("torch", fp8, 2, rank, dtype="bfloat16", device="cuda")
        if not model.fp8_params:
            pytest.skip("this GPU has no fp8 kernels (sm89 or later)")
        _assert_holds(model, _rank_model("torch", ref, 2, rank, device="cuda"),
                      row_scaled=VARIANTS[name][0] == "channel")


def test_quantization_fp8_into_fp8_parameters(monkeypatch):
    """``--quantization fp8`` where the model keeps fp8: each weight is ``quantize_fp8`` of the
    checkpoint's, exactly (codes and scales; quantized one expert at a time, row by row)."""
    from glm_fused.torch_backend.ops import TorchOps

    monkeypatch.setattr(TorchOps, "keeps_fp8", lambda self, dtype: True)
    d = ensure_tiny_checkpoint()
    model = _rank_model("torch", d, 2, 1, quantization="fp8")
    assert model.fp8_params
    _assert_holds(model, _rank_model("torch", d, 2, 1), row_scaled=False)


@pytest.mark.parametrize("name", ["channel", "block_fused"])
def test_paddle_device_path_decodes_fp8(ckpts, monkeypatch, name):
    """The path Paddle takes on a GPU (each part sent to the parameter's place), on the CPU: an
    fp8 weight arrives decoded, equal to the fp32 twin exactly."""
    pytest.importorskip("paddle")
    from glm_fused.paddle_backend import weights

    monkeypatch.setattr(weights, "_NUMPY_PARAMS", ())
    fp8, ref = ckpts[name]
    model, twin = _rank_model("paddle", fp8, 2, 1), _rank_model("paddle", ref, 2, 1)
    assert model.quantized and not model.fp8_params
    expected = {n: p.numpy() for n, p in twin.named_parameters()}
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), expected[n], err_msg=n)


# ---- configs and broken checkpoints: one line each -----------------------------------------

def _resolve(d: Path, **kw) -> EngineArgs:
    return EngineArgs(model=str(d), backend="torch", device="cpu", **kw).resolve()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, fn) -> None:
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(d / shard))
        fn(tensors)
        save_file(tensors, str(d / shard))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
        index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index))


def _edit_config(d: Path, fn) -> None:
    raw = json.loads((d / "config.json").read_text())
    fn(raw)
    (d / "config.json").write_text(json.dumps(raw))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


Q = "model.layers.1.self_attn.q_proj"
O = "model.layers.2.mlp.shared_experts.down_proj"  # a matmul of its own


def _drop(name):
    return lambda t: t.pop(name, None)


def _reshape(name, shape):
    def fn(t):
        if name in t:
            t[name] = t[name].flatten()[: int(np.prod(shape))].reshape(shape).contiguous()
    return fn


def _dequantize(name, layout="channel"):
    def fn(t):
        if name + ".weight" in t:
            scale = t.pop(name + ".weight_scale")
            t[name + ".weight"] = (t[name + ".weight"].float() * scale.float()).contiguous()
    return fn


def _ignore(module):
    return lambda raw: raw["quantization_config"]["ignore"].append(module)


BROKEN = {
    "missing_scale": ("channel", _drop(f"{Q}.weight_scale"), None,
                      rf"tensor '{Q}.weight_scale' is missing from the checkpoint \(the fp8 scale of '{Q}.weight'\)"),
    "scale_shape": ("channel", _reshape(f"{Q}.weight_scale", (128, 2)), None,
                    rf"'{Q}.weight_scale' has shape \[128, 2\], expected \[256\] \(one scale per output row"),
    "block_scale_shape": ("block", _reshape(f"{Q}.weight_scale_inv", (5, 3)), None,
                          rf"'{Q}.weight_scale_inv' has shape \[5, 3\], expected \[6, 4\] \(one scale per 48x40 block"),
    "fp8_but_ignored": ("channel", None, _ignore(O),
                        rf"tensor '{O}.weight' is stored in fp8 \(F8_E4M3\), but quantization_config's ignore list "
                        rf"names '{O}'"),
    "bf16_but_quantized": ("channel", _dequantize(Q), None,
                           rf"tensor '{Q}.weight' is F32, but quantization_config quantizes '{Q}' \(expected F8_E4M3"),
    "one_matmul_split": ("channel", _dequantize(Q), _ignore(Q),
                         r"'model.layers.1.self_attn.q_proj' is quantized but|q_proj' .*must be quantized alike"),
    "fp8_without_config": ("channel", None, lambda raw: raw.pop("quantization_config"),
                           r"is stored in fp8 \(F8_E4M3\), but config.json has no quantization_config"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_fp8_checkpoints_end_in_one_line(ckpts, tmp_path, case):
    variant, tensors, config, message = BROKEN[case]
    d = _copy(ckpts[variant][0], tmp_path / "ckpt")
    if tensors is not None:
        _edit_tensors(d, tensors)
    if config is not None:
        _edit_config(d, config)
    with pytest.raises(UserError) as exc:
        _resolve(d)
    assert __import__("re").search(message, _one_line(exc)), _one_line(exc)


CONFIGS = {
    "method": ({"quant_method": "awq"}, r"quant_method 'awq' is not supported"),
    "format": ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, r"format 'pack-quantized'"),
    "int8": (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), r"type 'int' with 8 bits"),
    "tensor": (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
               r"weights.strategy 'tensor' is not supported"),
    "static": (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
               r"input_activations must be dynamic symmetric per-token"),
    "block_size": ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]: expected two"),
    "per_tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"without weight_block_size"),
    "regex": (lambda q: q["ignore"].append("re:("), r"'re:\(' is not a valid regex"),
    "targets_not_a_list": (lambda q: q["config_groups"]["group_0"].update(targets=True),
                           r"targets True: only groups targeting 'Linear'"),
    "int8_activations": (lambda q: q["config_groups"]["group_0"]["input_activations"].update(type="int"),
                         r"input_activations must be dynamic symmetric per-token"),
    "4_bit_activations": (lambda q: q["config_groups"]["group_0"]["input_activations"].update(num_bits=4),
                          r"input_activations must be dynamic symmetric per-token"),
    "asymmetric_weights": (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=-1),
                           r"only static symmetric weight scales"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_unsupported_quantization_configs_are_named(ckpts, tmp_path, case):
    change, message = CONFIGS[case]
    d = _copy(ckpts["channel"][0], tmp_path / "ckpt")

    def edit(raw):
        if callable(change):
            change(raw["quantization_config"])
        else:
            raw["quantization_config"] = change

    _edit_config(d, edit)
    with pytest.raises(UserError) as exc:
        Glm4MoeConfig.from_pretrained(d)
    assert __import__("re").search(message, _one_line(exc)), _one_line(exc)


def test_the_official_release_config_parses():
    """configs/glm-4.5-air-fp8.json (``--model GLM-4.5-Air-FP8 --load-format dummy``): the FP8
    release's form - compressed-tensors, channel weights, dynamic per-token activations, the
    routers and lm_head ignored."""
    from glm_fused.quantization import Fp8Scheme, parse

    config = Path(__file__).resolve().parent.parent / "configs" / "glm-4.5-air-fp8.json"
    raw = json.loads(config.read_text())["quantization_config"]
    scheme = parse(raw)
    assert scheme == Fp8Scheme("compressed-tensors", None, scheme.ignore)
    assert scheme.quantized("model.layers.5.mlp.experts.17.down_proj")
    assert scheme.quantized("model.layers.0.self_attn.o_proj") and scheme.quantized("model.layers.3.mlp.shared_experts.up_proj")
    assert not scheme.quantized("lm_head") and not scheme.quantized("model.layers.5.mlp.gate")


def test_quantization_flag(ckpts):
    with pytest.raises(UserError, match=r"--quantization 'int4': choose one of fp8"):
        EngineArgs(model=str(ckpts["channel"][1]), backend="torch", device="cpu", quantization="int4").resolve()
    assert _resolve(ckpts["channel"][1]).quantization is None
    assert _resolve(ckpts["channel"][1], quantization="fp8").quantization == "fp8"
    assert _resolve(ckpts["channel"][0]).quantization == "fp8"  # an fp8 checkpoint is fp8 without the flag


def test_a_quantized_lm_head_loads_decoded(ckpts, tmp_path):
    """compressed-tensors quantizes ``lm_head`` unless ignored: the model (whose LM head is never
    fp8) takes it decoded, exactly as the fp32 twin holds it."""
    fp8 = _copy(ckpts["channel_fused"][0], tmp_path / "fp8")
    ref = _copy(ckpts["channel_fused"][1], tmp_path / "ref")

    def quantize_head(t):
        if "lm_head.weight" in t:
            codes, scale = fc.quantize_rows(t["lm_head.weight"])
            t["lm_head.weight"], t["lm_head.weight_scale"] = codes, scale[:, None].contiguous()

    def dequantize_head(t):
        if "lm_head.weight" in t:
            codes, scale = fc.quantize_rows(t["lm_head.weight"])
            t["lm_head.weight"] = (codes.float() * scale[:, None]).contiguous()

    _edit_tensors(fp8, quantize_head)
    _edit_tensors(ref, dequantize_head)
    _edit_config(fp8, lambda raw: raw["quantization_config"]["ignore"].remove("lm_head"))
    logits = _logits(tmp_path, {"fp8": fp8, "ref": ref}, 1)
    assert _rel(logits["fp8"], logits["ref"]) <= TOL


def test_dummy_fp8_weights_on_cpu():
    from glm_fused.batch import ForwardBatch
    from glm_fused.runner import ModelRunner

    settings = EngineArgs(model="glm-4.5-air-tiny", load_format="dummy", backend="torch", device="cpu",
                          quantization="fp8", max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16).resolve()
    runner = ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    assert runner.weights().startswith("fp8 e4m3") and "held dequantized in float32" in runner.weights()
    from glm_fused.torch_backend import OPS

    w = runner.model.layers[1].mlp.experts.gate_up_proj[3].detach()
    assert torch.allclose(OPS.dequantize_fp8(OPS.quantize_fp8(w)), w, rtol=1e-6, atol=0)  # on its rows' fp8 grid
    draw = torch.randn_like(w)
    assert not torch.allclose(OPS.dequantize_fp8(OPS.quantize_fp8(draw)), draw, rtol=1e-3, atol=0)
    assert np.isfinite(runner.forward(ForwardBatch.prefill([[1, 2, 3]], runner.slot_tables([0])))).all()
    runner.close()


def _set_first_scale(name, value):
    def fn(t):
        if name in t:
            t[name] = t[name].clone()
            t[name].view(-1)[0] = value
    return fn


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
@pytest.mark.parametrize("variant,scale", [("channel", f"{Q}.weight_scale"), ("block", f"{Q}.weight_scale_inv"),
                                           ("block_fused", "model.layers.2.mlp.experts.down_proj_scale_inv")])
def test_a_bad_scale_is_named_at_load(ckpts, tmp_path, variant, scale, value):
    """A NaN, infinite or negative fp8 scale served NaN or garbage without a word; now the load
    names it, in either framework. The check comes before the weight writer, so it holds
    whether the model keeps fp8 or decodes to floats."""
    d = _copy(ckpts[variant][0], tmp_path / "ckpt")
    _edit_tensors(d, _set_first_scale(scale, value))
    _resolve(d)  # the headers are fine: the check reads the scales
    for framework in ("torch", "paddle"):
        with pytest.raises(UserError) as exc:
            _rank_model(framework, d, 1, 0)
        assert __import__("re").search(rf"fp8 scale '{scale}' holds {value}; scales must be finite and not negative",
                                       _one_line(exc)), _one_line(exc)
    d2 = _copy(ckpts[variant][0], tmp_path / "zero")  # an all-zero row's scale may be 0: it loads
    _edit_tensors(d2, _set_first_scale(scale, 0.0))
    _rank_model("torch", d2, 2, 1)


@pytest.mark.timeout(120)
def test_a_broken_fp8_checkpoint_is_one_cli_line(ckpts, tmp_path):
    import subprocess
    import sys

    d = _copy(ckpts["channel"][0], tmp_path / "ckpt")
    _edit_tensors(d, _drop(f"{Q}.weight_scale"))
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "generate.py"), "--model", str(d), "--backend",
                           "torch", "--prompt", "hi", "--max-new-tokens", "1"], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"'{Q}.weight_scale' is missing" in last, proc.stderr[-2000:]
