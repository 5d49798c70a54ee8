"""The checkpoint reader and load plan: both expert layouts, slicing, and strictness."""

import json
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from glm_fused.checkpoint import Checkpoint, expected_shapes, iter_rank_plan, read_float32_into  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402
from glm_fused.errors import UserError  # noqa: E402
from glm_fused.safetensors_io import SafetensorsFile  # noqa: E402
from glm_fused.sharding import TPShard  # noqa: E402


def iter_rank_weights(ckpt, cfg, shard):
    """The load plan carried out in numpy: ``(parameter name, float32 array in this rank's shape)``."""
    for name, p in iter_rank_plan(ckpt, cfg, shard):
        value = np.empty(p.shape, dtype=np.float32)
        for part in p.parts:
            read_float32_into(value[part.dst], part)
        yield name, value


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


def _full_tensors(name: str, parts: list[np.ndarray], cfg: Glm4MoeConfig) -> dict[str, np.ndarray]:
    """Checkpoint tensors rebuilt from every rank's part of parameter ``name``.

    The sharding rules of docs/design.md, written out here independently of the load plan:
    vocabulary rows split in rank order; q heads split; KV heads split while tp <= KV heads,
    else each serves tp // kv_heads consecutive ranks (who must hold identical rows); gate and
    up rows (dense, shared and routed experts) split, each rank holding its gate rows then its
    up rows; o_proj and down_proj columns split; norms and the router replicated.
    """
    tp, D = len(parts), cfg.head_dim
    src = name if name == "lm_head.weight" else f"model.{name}"
    cat = np.concatenate

    def same(arrays):
        for r, a in enumerate(arrays[1:], 1):
            np.testing.assert_array_equal(a, arrays[0], err_msg=f"{name}: rank {r} differs from rank 0")
        return arrays[0]

    if name in ("embed_tokens.weight", "lm_head.weight"):
        return {src: cat(parts)}
    if name.endswith(("norm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
        return {src: same(parts)}
    if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
        prefix, kind = src.rsplit("qkv_proj.", 1)
        nq = cfg.num_attention_heads // tp * D
        nkv = max(1, cfg.num_key_value_heads // tp) * D
        full = {f"{prefix}q_proj.{kind}": cat([p[:nq] for p in parts])}
        for j, proj in enumerate(("k_proj", "v_proj")):
            pieces = [p[nq + j * nkv: nq + (j + 1) * nkv] for p in parts]
            if tp > cfg.num_key_value_heads:
                per_head = tp // cfg.num_key_value_heads
                pieces = [same(pieces[h * per_head:(h + 1) * per_head]) for h in range(cfg.num_key_value_heads)]
            full[f"{prefix}{proj}.{kind}"] = cat(pieces)
        return full
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")):
        return {src: cat(parts, axis=1)}
    if name.endswith("gate_up_proj.weight"):  # dense MLP and shared experts: [2 * I/tp, H]
        prefix = src.removesuffix("gate_up_proj.weight")
        half = parts[0].shape[0] // 2
        return {f"{prefix}gate_proj.weight": cat([p[:half] for p in parts]),
                f"{prefix}up_proj.weight": cat([p[half:] for p in parts])}
    if name.endswith("experts.gate_up_proj"):  # [E, 2 * I/tp, H]; the checkpoint: gate rows, then up
        half = parts[0].shape[1] // 2
        return {src: cat([cat([p[:, :half] for p in parts], axis=1), cat([p[:, half:] for p in parts], axis=1)],
                         axis=1)}
    if name.endswith("experts.down_proj"):  # [E, H, I/tp]
        return {src: cat(parts, axis=2)}
    raise AssertionError(f"no reassembly rule for parameter {name!r}: add one to _full_tensors")


@pytest.mark.parametrize("form", ["original", "fused"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_slices_reassemble_the_full_tensors(hf, form, tp):
    """Every planned parameter of every rank, put back together, equals the tensors transformers
    saved (both expert layouts; at TP 4 and 8 the 2 KV heads are replicated)."""
    dirs, state = hf
    ckpt = Checkpoint(dirs[form])
    cfg = Glm4MoeConfig.from_pretrained(dirs[form])
    ranks = [dict(iter_rank_weights(ckpt, cfg, TPShard(cfg, r, tp))) for r in range(tp)]
    for r, w in enumerate(ranks):
        shapes = expected_shapes(cfg, TPShard(cfg, r, tp))
        assert {k: v.shape for k, v in w.items()} == {k: s for k, (s, _) in shapes.items()}
    rebuilt: dict[str, np.ndarray] = {}
    for name in ranks[0]:
        for src, full in _full_tensors(name, [w[name] for w in ranks], cfg).items():
            assert src not in rebuilt, f"{src} rebuilt twice"
            rebuilt[src] = full
    assert set(rebuilt) == set(state)  # every tensor of the model, none invented
    for src, full in rebuilt.items():
        np.testing.assert_array_equal(full, state[src], err_msg=src)


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
    dst.parent.mkdir(parents=True, exist_ok=True)
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


def _edit_header(shard, fn):
    """Rewrite a shard's JSON header with ``fn(header)`` applied; the data stays as it was."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = fn(json.loads(data[8:8 + n]))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize("edit, message", [
    (lambda h: [h], r"corrupt safetensors header \(not a JSON object\)"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "data_offsets": [0, "x"]}},
     r"corrupt header entry for tensor '.*' \(shape and data_offsets must be non-negative integers\)"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": ["a"]}}, r"must be non-negative integers"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "shape": [-4, 8]}}, r"must be non-negative integers"),
    (lambda h: {**h, _first_tensor(h): {**h[_first_tensor(h)], "dtype": 7}}, r"has dtype 7, which is not supported"),
])
def test_malformed_header_entries_are_one_line(hf, tmp_path, edit, message):
    d = _copy(hf, tmp_path)
    shard = sorted(d.glob("*.safetensors"))[0]
    _edit_header(shard, edit)
    with pytest.raises(UserError, match=rf"{shard.name}: .*{message}"):
        _load_all(d)


@pytest.mark.parametrize("weight_map", [5, [], {"model.norm.weight": 3}])
def test_an_index_whose_weight_map_is_not_names_to_files(hf, tmp_path, weight_map):
    d = _copy(hf, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match=r"index.json: not a valid safetensors index \(weight_map must map"):
        _load_all(d)


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="pickles are never loaded"):
        Checkpoint(tmp_path)


def test_mtp_layer_is_skipped_but_other_extras_are_not(hf, tmp_path):
    """The MTP block (layer index num_hidden_layers = 3 here) loads as skipped; the same
    kind of tensor inside a decoder layer, or outside any layer, is refused by name."""
    def add(extra: dict):
        def fn(t):
            if "model.norm.weight" in t:
                t.update(extra)
        return fn

    mtp = {"model.layers.3.eh_proj.weight": np.ones((64, 128), np.float32),
           "model.layers.3.mlp.experts.0.up_proj.weight": np.ones((32, 64), np.float32)}
    d = _copy(hf, tmp_path / "mtp")
    _rewrite(d, add(mtp))
    _load_all(d)  # skipped
    for extra in ("model.layers.2.eh_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight",
                  "model.eh_proj.weight"):
        d = _copy(hf, tmp_path / extra)
        _rewrite(d, add({**mtp, extra: np.ones((2, 2), np.float32)}))
        with pytest.raises(UserError, match=rf"unexpected tensor '{re.escape(extra)}'"):
            _load_all(d)
