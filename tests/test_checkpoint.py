"""The checkpoint reader and load plan: both expert layouts, slicing, and strictness."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from glm_fused.checkpoint import Checkpoint, expected_shapes, iter_rank_weights  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.safetensors_io import SafetensorsFile  # noqa: E402
from glm_fused.sharding import TPShard  # noqa: E402


def _hf_model():
    cfg = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, attention_bias=True, use_qk_norm=True)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # nothing left at its neutral init
            p.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    model = _hf_model()
    dirs = {}
    for form in ("original", "fused"):
        d = tmp_path_factory.mktemp(form)
        # transformers 5 writes per-expert names by default, fused experts on request
        model.save_pretrained(d, save_original_format=(form == "original"), max_shard_size="40KB")
        dirs[form] = d
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return dirs, state


def test_the_two_layouts_really_differ(hf):
    dirs, _ = hf
    orig, fused = Checkpoint(dirs["original"]).names, Checkpoint(dirs["fused"]).names
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in orig
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and len(Checkpoint(dirs["fused"]).files) > 1


@pytest.mark.parametrize("form", ["original", "fused"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_slices_reassemble_the_full_tensors(hf, form, tp):
    dirs, state = hf
    ckpt = Checkpoint(dirs[form])
    cfg = Glm4MoeConfig.from_pretrained(dirs[form])
    ranks = [dict(iter_rank_weights(ckpt, cfg, TPShard(cfg, r, tp))) for r in range(tp)]
    for r, w in enumerate(ranks):
        shapes = expected_shapes(cfg, TPShard(cfg, r, tp))
        assert {k: v.shape for k, v in w.items()} == {k: s for k, (s, _) in shapes.items()}
    D, nq = 16, 8 // tp
    # q rows and o_proj columns follow the same heads; k/v replicated when tp > 2 KV heads
    q = np.concatenate([w["layers.0.self_attn.qkv_proj.weight"][: nq * D] for w in ranks])
    np.testing.assert_array_equal(q, state["model.layers.0.self_attn.q_proj.weight"])
    o = np.concatenate([w["layers.0.self_attn.o_proj.weight"] for w in ranks], axis=1)
    np.testing.assert_array_equal(o, state["model.layers.0.self_attn.o_proj.weight"])
    kv_of = lambda w: w["layers.2.self_attn.qkv_proj.weight"][nq * D:]  # noqa: E731
    k_full = state["model.layers.2.self_attn.k_proj.weight"]
    head = lambda r: r * 2 // tp if tp > 2 else None  # noqa: E731
    if tp > 2:
        for r, w in enumerate(ranks):
            np.testing.assert_array_equal(kv_of(w)[:D], k_full[head(r) * D:(head(r) + 1) * D])
    # experts: gate rows then up rows of each rank's slice of the intermediate dimension
    gate_up = np.concatenate([w["layers.1.mlp.experts.gate_up_proj"] for w in ranks], axis=1)
    I_loc = 32 // tp
    gate = np.concatenate([gate_up[:, r * 2 * I_loc: r * 2 * I_loc + I_loc] for r in range(tp)], axis=1)
    np.testing.assert_array_equal(gate, state["model.layers.1.mlp.experts.gate_up_proj"][:, :32])
    down = np.concatenate([w["layers.1.mlp.experts.down_proj"] for w in ranks], axis=2)
    np.testing.assert_array_equal(down, state["model.layers.1.mlp.experts.down_proj"])
    embed = np.concatenate([w["embed_tokens.weight"] for w in ranks])
    np.testing.assert_array_equal(embed, state["model.embed_tokens.weight"])
    for w in ranks:  # router and its bias replicated, fp32
        np.testing.assert_array_equal(w["layers.2.mlp.gate.e_score_correction_bias"],
                                      state["model.layers.2.mlp.gate.e_score_correction_bias"])


def test_bf16_is_widened_exactly(tmp_path):
    from safetensors.torch import save_file
    x = torch.randn(6, 10).to(torch.bfloat16)
    save_file({"a": x, "b": x.float()}, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.dtype("a") == "BF16"
    np.testing.assert_array_equal(f.read("a"), x.float().numpy())
    np.testing.assert_array_equal(f.read("a", (slice(None), slice(3, 7))), x.float().numpy()[:, 3:7])


# ---- strictness: every broken checkpoint names the tensor or the file ------------------

def _copy(hf, tmp_path, form="original"):
    dirs, _ = hf
    dst = tmp_path / "ckpt"
    shutil.copytree(dirs[form], dst)
    return dst


def _load_all(d):
    cfg = Glm4MoeConfig.from_pretrained(d)
    ckpt = Checkpoint(d)
    for _ in iter_rank_weights(ckpt, cfg, TPShard(cfg, 0, 1)):
        pass


def _rewrite(d, fn):
    """Apply fn to the tensors of every shard (a dict), rewriting the index."""
    from safetensors.numpy import load_file, save_file
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(d / shard))
        fn(tensors)
        save_file(tensors, str(d / shard))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
        index["weight_map"].update({k: shard for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor(hf, tmp_path):
    d = _copy(hf, tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight", None))
    with pytest.raises(UserError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight.*missing"):
        _load_all(d)


def test_unexpected_tensor(hf, tmp_path):
    d = _copy(hf, tmp_path)

    def add(t):
        if "model.norm.weight" in t:
            t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
    _rewrite(d, add)
    with pytest.raises(UserError, match=r"safetensors.*unexpected tensor 'model\.layers\.0\.mlp\.extra_proj"):
        _load_all(d)


def test_wrong_shape(hf, tmp_path):
    d = _copy(hf, tmp_path)

    def shrink(t):
        if "model.layers.1.self_attn.o_proj.weight" in t:
            t["model.layers.1.self_attn.o_proj.weight"] = t["model.layers.1.self_attn.o_proj.weight"][:, :64]
    _rewrite(d, shrink)
    with pytest.raises(UserError, match=r"o_proj\.weight' has shape \[64, 64\], expected \[64, 128\]"):
        _load_all(d)


def test_truncated_shard(hf, tmp_path):
    d = _copy(hf, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(UserError, match=rf"{shard.name}: file is truncated"):
        _load_all(d)


def test_missing_shard(hf, tmp_path):
    d = _copy(hf, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(UserError, match=rf"{shard.name}: shard listed in model.safetensors.index.json is missing"):
        _load_all(d)


def test_garbage_header(hf, tmp_path):
    d = _copy(hf, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not-json-at-all!" + b"\0" * 64)
    with pytest.raises(UserError, match=rf"{shard.name}: corrupt safetensors header"):
        _load_all(d)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="pickles are never loaded"):
        Checkpoint(tmp_path)


def test_mtp_layer_is_skipped_but_other_extras_are_not(hf, tmp_path):
    d = _copy(hf, tmp_path)

    def add_mtp(t):
        if "model.norm.weight" in t:
            t["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
            t["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((32, 64), np.float32)
    _rewrite(d, add_mtp)
    _load_all(d)  # layer 3 == num_hidden_layers: the MTP block, skipped
