"""The frameworks' weight writers: checkpoint slices, as stored, into parameters.

A bf16 checkpoint written by transformers (both expert layouts) is loaded into each rank's
model at TP 1, 2 and 4 (ranks built in this process: loading needs no collective) with fp32
and bf16 parameters, and every parameter must equal, bit for bit, the rank's slices read by
safetensors and cast by torch (``_reference``). bf16 -> fp32 is exact, so the tolerance is 0.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from glm_fused.checkpoint import Checkpoint, Part, iter_rank_plan  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.model.loader import load_weights  # noqa: E402
from glm_fused.safetensors_io import SafetensorsFile  # noqa: E402
from glm_fused.sharding import TPShard  # noqa: E402

FRAMEWORKS = ["paddle", "torch"]


def _needs(framework: str) -> None:
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")


@pytest.fixture(scope="module")
def bf16_ckpts(tmp_path_factory):
    """The same random model saved in bf16 by transformers, per-expert and fused experts."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, attention_bias=True, use_qk_norm=True)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0, 0.1)
    model = model.to(torch.bfloat16)
    dirs = {}
    for form in ("original", "fused"):
        dirs[form] = tmp_path_factory.mktemp(f"bf16_{form}")
        model.save_pretrained(dirs[form], save_original_format=(form == "original"), max_shard_size="40KB")
    return dirs


class _Comm:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _reference(d, tp: int, rank: int) -> dict[str, np.ndarray]:
    """The rank's parameters in fp32, read by safetensors and cast by torch: independent of the
    writers' reading and converting; only the plan (checked against transformers in
    test_checkpoint.py) is shared."""
    from safetensors.torch import load_file

    tensors = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}
    config = Glm4MoeConfig.from_pretrained(d)
    out = {}
    for name, plan in iter_rank_plan(Checkpoint(d), config, TPShard(config, rank, tp)):
        value = torch.empty(plan.shape, dtype=torch.float32)
        for part in plan.parts:
            value[part.dst] = tensors[part.name][part.index].float()
        out[name] = value.numpy()
    return out


def _model(framework: str, d, tp: int, rank: int, dtype: str):
    from glm_fused.backends import get_backend

    config = Glm4MoeConfig.from_pretrained(d)
    return get_backend(framework).Glm4MoeForCausalLM(config, tp_rank=rank, tp_size=tp, comm=_Comm(rank, tp),
                                                     dtype=dtype)


def _as_fp32(F, param) -> np.ndarray:
    return F.to_numpy(F.float32(param))


def _assert_loaded_exactly(model, reference: dict[str, np.ndarray]) -> None:
    F = model.F
    params = dict(model.named_parameters())
    assert set(params) == set(reference)
    for name, param in params.items():
        np.testing.assert_array_equal(_as_fp32(F, param), reference[name], err_msg=name)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("form,tp", [("original", 1), ("fused", 1), ("original", 2), ("fused", 4)])
def test_bf16_checkpoint_into_fp32_parameters_exactly(bf16_ckpts, framework, form, tp):
    _needs(framework)
    d = bf16_ckpts[form]
    ckpt = Checkpoint(d)
    assert {ckpt.file(n).dtype(n) for n in ckpt.names} == {"BF16"}
    for rank in range(tp):
        model = _model(framework, d, tp, rank, "float32")
        stats = load_weights(model, d, progress=False)
        _assert_loaded_exactly(model, _reference(d, tp, rank))
        assert {model.F.dtype_name(p) for p in model.parameters()} == {"float32"}
        assert stats.bytes > 0 and stats.seconds > 0


@pytest.mark.parametrize("form,tp", [("original", 1), ("fused", 2)])
def test_bf16_checkpoint_into_bf16_parameters_exactly(bf16_ckpts, form, tp):
    d = bf16_ckpts[form]
    for rank in range(tp):
        model = _model("torch", d, tp, rank, "bfloat16")
        load_weights(model, d, progress=False)
        _assert_loaded_exactly(model, _reference(d, tp, rank))
        dtypes = {name: str(p.dtype) for name, p in model.named_parameters()}
        assert dtypes["layers.1.mlp.gate.weight"] == "torch.float32"  # the router stays fp32
        assert dtypes["layers.1.mlp.experts.gate_up_proj"] == "torch.bfloat16"


def test_torch_staged_copies_split_at_any_slot_size(bf16_ckpts):
    """The CUDA path's chunking, run on the CPU: slots smaller than a row, a slice, a tensor."""
    from glm_fused.torch_backend.weights import TorchWeightWriter

    d = bf16_ckpts["fused"]
    config = Glm4MoeConfig.from_pretrained(d)
    reference = _reference(d, 2, 1)
    for slot_bytes in (64, 1000, 40_000):
        model = _model("torch", d, 2, 1, "float32")
        params = dict(model.named_parameters())
        with torch.no_grad(), TorchWeightWriter("cpu", staged=True, slot_bytes=slot_bytes, slots=2) as writer:
            for name, plan in iter_rank_plan(Checkpoint(d), config, TPShard(config, 1, 2)):
                writer.write(params[name], plan.parts)
        _assert_loaded_exactly(model, reference)


def test_paddle_device_path_on_cpu(bf16_ckpts, monkeypatch):
    """The path Paddle takes on a GPU (host bits -> device -> dtype there), run on the CPU."""
    _needs("paddle")
    from glm_fused.paddle_backend import weights

    monkeypatch.setattr(weights, "_NUMPY_PARAMS", ())
    d = bf16_ckpts["original"]
    model = _model("paddle", d, 2, 0, "float32")
    load_weights(model, d, progress=False)
    _assert_loaded_exactly(model, _reference(d, 2, 0))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fp8_and_scales_flow_through_as_stored(tmp_path, framework):
    """An fp8 (e4m3) tensor lands in an fp8 parameter bit for bit, its fp32 / bf16 scales as
    stored: the writers pass the stored dtype through (what fp8 weights will need)."""
    _needs(framework)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 1, generator=g) + 0.5
    save_file({"w": w, "s32": scale, "s16": scale.to(torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert (f.dtype("w"), f.dtype("s32"), f.dtype("s16")) == ("F8_E4M3", "F32", "BF16")
    rows = (slice(2, 5),)
    w_part = Part("w", rows, (3, 8), source=f)
    if framework == "torch":
        from glm_fused.torch_backend.weights import TorchWeightWriter as Writer

        param, s32, s16 = (torch.empty(3, 8, dtype=torch.float8_e4m3fn), torch.empty(3, 1),
                           torch.empty(3, 1, dtype=torch.bfloat16))
        bits = lambda t: (t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn  # noqa: E731
                          else t.float().numpy())
    else:
        import paddle

        from glm_fused.paddle_backend.weights import PaddleWeightWriter as Writer

        param, s32, s16 = (paddle.empty([3, 8], dtype="float8_e4m3fn"), paddle.empty([3, 1], dtype="float32"),
                           paddle.empty([3, 1], dtype="bfloat16"))
        bits = lambda t: (t.view(paddle.uint8).numpy() if t.dtype == paddle.float8_e4m3fn  # noqa: E731
                          else t.astype("float32").numpy())
    with Writer("cpu") as writer:
        writer.write(param, [w_part])
        writer.write(s32, [Part("s32", (), (3, 1), source=f)])
        writer.write(s16, [Part("s16", (), (3, 1), source=f)])
    np.testing.assert_array_equal(bits(param), w[2:5].view(torch.uint8).numpy())
    np.testing.assert_array_equal(bits(s32), scale.numpy())
    np.testing.assert_array_equal(bits(s16), scale.to(torch.bfloat16).float().numpy())
    assert w_part.nbytes == 3 * 8


def test_non_float_tensor_is_one_line_error(tmp_path):
    """A checkpoint whose final norm was stored as integers: refused before anything is read."""
    import json

    from safetensors.torch import save_file

    from glm_fused.checkpoint import load_plan

    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = dict(model_type="glm4_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
               moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
               head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
    (d / "config.json").write_text(json.dumps(cfg))
    config = Glm4MoeConfig.from_pretrained(d)
    _, full = load_plan(config, TPShard(config, 0, 1), set())
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in full.items()}
    tensors["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(UserError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32, "
                                        r"expected a floating-point dtype") as err:
        load_weights(_model("torch", d, 1, 0, "float32"), d, progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 4])
def test_cuda_staged_load_equals_the_plan(bf16_ckpts, tp):
    """On a GPU: the pinned ring and copy stream land the same bits (bf16 and fp32 parameters)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    d = bf16_ckpts["fused"]
    for dtype in ("bfloat16", "float32"):
        for rank in range(tp):
            with torch.device("cuda"):
                model = _model("torch", d, tp, rank, dtype)
            load_weights(model, d, progress=False)
            _assert_loaded_exactly(model, _reference(d, tp, rank))
