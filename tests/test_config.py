"""Config parsing in both Hugging Face forms, and the tensor-parallel checks."""

import json

import pytest

from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.sharding import TPShard

from conftest import ROOT

AIR = ROOT / "configs" / "glm-4.5-air.json"
BIG = ROOT / "configs" / "glm-4.5.json"


def test_air_config_values():
    c = Glm4MoeConfig.from_json_file(AIR)
    assert (c.hidden_size, c.num_attention_heads * c.head_dim) == (4096, 12288)  # head_dim is explicit
    assert c.rotary_dim == 64 and c.rope_theta == 1_000_000
    assert c.eos_token_id == [151329, 151336, 151338] and c.dtype == "bfloat16"
    assert not c.is_moe_layer(0) and c.is_moe_layer(1) and not c.use_qk_norm


def test_glm45_sibling_config():
    c = Glm4MoeConfig.from_json_file(BIG)
    assert c.use_qk_norm and c.routed_scaling_factor == 2.5 and c.first_k_dense_replace == 3
    assert c.n_routed_experts == 160 and not c.is_moe_layer(2) and c.is_moe_layer(3)


def test_from_pretrained_takes_what_model_takes(tmp_path, monkeypatch):
    """The tiny default and Hugging Face names, as the model's ``from_pretrained`` and
    ``--model`` take them: a cached snapshot first, else the config shipped for a GLM model."""
    from glm_fused.tiny import ensure_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tiny = Glm4MoeConfig.from_pretrained("glm-4.5-air-tiny")
    assert tiny == Glm4MoeConfig.from_pretrained(ensure_tiny_checkpoint()) and tiny.hidden_size == 128
    assert Glm4MoeConfig.from_pretrained("GLM-4.5-Air") == Glm4MoeConfig.from_json_file(AIR)
    assert Glm4MoeConfig.from_pretrained("zai-org/GLM-4.5") == Glm4MoeConfig.from_json_file(BIG)
    snapshot = tmp_path / "hub" / "models--zai-org--GLM-4.5-Air" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--zai-org--GLM-4.5-Air" / "refs").mkdir()
    (tmp_path / "hub" / "models--zai-org--GLM-4.5-Air" / "refs" / "main").write_text("abc")
    (snapshot / "config.json").write_text(json.dumps({**json.loads(AIR.read_text()), "num_hidden_layers": 3}))
    assert Glm4MoeConfig.from_pretrained("zai-org/GLM-4.5-Air").num_hidden_layers == 3
    with pytest.raises(UserError, match="someorg/Model"):
        Glm4MoeConfig.from_pretrained("someorg/Model")


def test_transformers5_form_equals_transformers4_form(tmp_path):
    raw = json.loads(AIR.read_text())
    v5 = {k: v for k, v in raw.items() if k not in ("rope_theta", "partial_rotary_factor", "torch_dtype")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000, "partial_rotary_factor": 0.5}
    v5["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(v5))
    assert Glm4MoeConfig.from_pretrained(tmp_path) == Glm4MoeConfig.from_json_file(AIR)
    # and a round trip through our own writer, both forms
    c = Glm4MoeConfig.from_json_file(AIR)
    for form in (4, 5):
        assert Glm4MoeConfig.from_dict(c.to_hf_dict(form)) == c


def test_transformers_reads_our_hf_dict():
    transformers = pytest.importorskip("transformers")
    c = Glm4MoeConfig.from_json_file(AIR)
    hf = transformers.Glm4MoeConfig(**c.to_hf_dict(5))
    assert hf.head_dim == 128 and hf.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_air_splits_at_supported_tp(tp):
    c = Glm4MoeConfig.from_json_file(AIR)
    c.check_tp(tp)
    heads = sorted({TPShard(c, r, tp).kv_heads() for r in range(tp)})
    assert heads[0][0] == 0 and heads[-1][1] == c.num_key_value_heads  # every KV head held somewhere


def test_kv_heads_replicated_beyond_their_count():
    c = Glm4MoeConfig.from_json_file(AIR)  # 8 KV heads
    assert [TPShard(c, r, 16).kv_heads() for r in (0, 1, 2, 15)] == [(0, 1), (0, 1), (1, 2), (7, 8)]
    assert TPShard(c, 3, 16).num_kv_heads == 1


@pytest.mark.parametrize("tp,field", [(3, "moe_intermediate_size"), (5, "num_attention_heads"),
                                      (0, "positive"), (64, "num_attention_heads")])
def test_impossible_tp_names_the_value(tp, field):
    c = Glm4MoeConfig.from_json_file(AIR)
    with pytest.raises(UserError, match=field):
        c.check_tp(tp)


@pytest.mark.parametrize("change,field", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 7}, "num_attention_heads"),
    ({"topk_group": 3}, "topk_group"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"hidden_size": -4}, "hidden_size"),
    # values of the wrong kind: named here, not a TypeError inside the model
    ({"hidden_size": True}, "hidden_size=True must be a positive integer"),
    ({"max_position_embeddings": 2.5}, "max_position_embeddings=2.5 must be a positive integer"),
    ({"max_position_embeddings": None}, "max_position_embeddings=None must be a positive integer"),
    ({"n_shared_experts": -3}, "n_shared_experts=-3 must be a non-negative integer"),
    ({"first_k_dense_replace": "1"}, "first_k_dense_replace='1' must be a non-negative integer"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta='big' must be a positive number"),
    ({"rms_norm_eps": None}, "rms_norm_eps=None must be a positive number"),
    ({"routed_scaling_factor": [1.0]}, r"routed_scaling_factor=\[1.0\] must be a positive number"),
    ({"rope_parameters": {"partial_rotary_factor": None}}, "partial_rotary_factor=None must be a number"),
    ({"use_qk_norm": "yes"}, "use_qk_norm='yes' must be true or false"),
    ({"pad_token_id": -1}, "pad_token_id=-1 must be a token id or null"),
    ({"eos_token_id": {}}, r"eos_token_id=\{\} must be a token id or a list of them"),
    ({"eos_token_id": [1, True]}, "eos_token_id=.* must be a token id or a list of them"),
])
def test_bad_config_values_are_named(tmp_path, change, field):
    raw = json.loads(AIR.read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=field):
        Glm4MoeConfig.from_pretrained(tmp_path)


def test_unreadable_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json"):
        Glm4MoeConfig.from_pretrained(tmp_path)
    with pytest.raises(UserError, match="not found"):
        Glm4MoeConfig.from_pretrained(tmp_path / "nowhere")


def test_a_rope_table_too_large_for_memory_is_one_line():
    """max_position_embeddings sizes the RoPE table unless --max-model-len is given; a value far
    beyond any context is refused by name, not as an allocator error blamed on the weights."""
    from glm_fused.backends import get_backend

    with pytest.raises(UserError, match=r"RoPE table for 1000000000000 positions .* --max-model-len"):
        get_backend("torch").LAYERS.RotaryEmbedding(128, 64, 10**12, 10_000.0)
