"""The tiny checkpoint, the tokenizer and --model resolution, checked against transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from glm_fused import tiny
from glm_fused.errors import UserError
from glm_fused.model_path import resolve_model
from glm_fused.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MULTIBYTE = "naïve café — 日本語の文章 🙂👍🏽 done."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("a") / tiny.TINY_NAME)


@pytest.fixture(scope="module")
def config(tiny_dir) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer(tiny_dir)


CHATS = [
    [{"role": "user", "content": "Where does a river begin?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bake bread?"}]},
    ],
    [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo", "days": 2}}}],
        },
        {"role": "tool", "content": '{"temp": -3}'},
        {"role": "tool", "content": '{"temp": -5}'},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


# ------------------------------------------------------------------ checkpoint


def test_checkpoint_is_byte_identical_across_builds(tiny_dir, tmp_path):
    tiny._tokenizer_json.cache_clear()  # retrain the tokenizer too, not just reuse it
    again = tiny.write_tiny_checkpoint(tmp_path / "b")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert sum(n.endswith(".safetensors") for n in names) == 3
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_tokenizer_training_is_deterministic_across_processes():
    # One worker thread there, the default pool here: thread scheduling must not matter.
    code = "from glm_fused import tiny; print(tiny._tokenizer_json(1024))"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.rstrip("\n") == tiny._tokenizer_json(1024)


def test_index_covers_exactly_the_shards(tiny_dir):
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    total = 0
    for name in files:
        with safe_open(tiny_dir / name, framework="numpy") as f:
            keys = set(f.keys())
            total += sum(f.get_tensor(k).nbytes for k in keys)
        assert keys == {k for k, v in weight_map.items() if v == name}
    assert index["metadata"]["total_size"] == total


def _tensors(tiny_dir) -> dict[str, np.ndarray]:
    out = {}
    for shard in sorted(tiny_dir.glob("*.safetensors")):
        with safe_open(shard, framework="numpy") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_shapes_follow_config_and_mtp_layer_is_present(tiny_dir, config):
    t = _tensors(tiny_dir)
    h, v, d = config["hidden_size"], config["vocab_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    e, im, inter = config["n_routed_experts"], config["moe_intermediate_size"], config["intermediate_size"]
    assert nq * d != h  # as in the real model
    n_layers = config["num_hidden_layers"]
    assert {a.dtype for a in t.values()} == {np.dtype(np.float32)}
    assert t["model.embed_tokens.weight"].shape == (v, h)
    assert t["lm_head.weight"].shape == (v, h)
    assert t["model.norm.weight"].shape == (h,)
    for i in range(n_layers + 1):  # the MTP layer has a full decoder block too
        p = f"model.layers.{i}"
        assert t[f"{p}.self_attn.q_proj.weight"].shape == (nq * d, h)
        assert t[f"{p}.self_attn.k_proj.weight"].shape == (nkv * d, h)
        assert t[f"{p}.self_attn.v_proj.bias"].shape == (nkv * d,)
        assert t[f"{p}.self_attn.o_proj.weight"].shape == (h, nq * d)
        assert f"{p}.self_attn.o_proj.bias" not in t
        if i < config["first_k_dense_replace"]:
            assert t[f"{p}.mlp.gate_proj.weight"].shape == (inter, h)
            assert t[f"{p}.mlp.down_proj.weight"].shape == (h, inter)
            assert f"{p}.mlp.gate.weight" not in t
            continue
        assert t[f"{p}.mlp.gate.weight"].shape == (e, h)
        assert t[f"{p}.mlp.gate.e_score_correction_bias"].shape == (e,)
        assert t[f"{p}.mlp.experts.{e - 1}.up_proj.weight"].shape == (im, h)
        assert t[f"{p}.mlp.experts.{e - 1}.down_proj.weight"].shape == (h, im)
        assert f"{p}.mlp.experts.{e}.up_proj.weight" not in t
        assert t[f"{p}.mlp.shared_experts.down_proj.weight"].shape == (h, im * config["n_shared_experts"])
    mtp = f"model.layers.{n_layers}"
    assert t[f"{mtp}.eh_proj.weight"].shape == (h, 2 * h)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert t[f"{mtp}.{name}.weight"].shape == (h,)
    assert t[f"{mtp}.shared_head.head.weight"].shape == (v, h)
    assert t[f"{mtp}.embed_tokens.weight"].shape == (v, h)
    assert not any(k.startswith(f"model.layers.{n_layers + 1}.") for k in t)


def test_correction_bias_changes_expert_choice_only_sometimes(tiny_dir, config):
    t = _tensors(tiny_dir)
    p, k = "model.layers.1.mlp.gate", config["num_experts_per_tok"]
    x = np.random.default_rng(0).standard_normal((2000, config["hidden_size"])).astype(np.float32)
    scores = 1 / (1 + np.exp(-(x @ t[f"{p}.weight"].T)))
    plain = np.sort(np.argsort(-scores, axis=1)[:, :k], axis=1)
    biased = np.sort(np.argsort(-(scores + t[f"{p}.e_score_correction_bias"]), axis=1)[:, :k], axis=1)
    changed = np.mean(np.any(plain != biased, axis=1))
    assert 0.02 < changed < 0.6


def test_config_ids_match_tokenizer_and_repo_config(tiny_dir, config, tok):
    ids = [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert config["eos_token_id"] == ids and config["pad_token_id"] == ids[0]
    assert tok.eos_token_ids == set(ids)
    assert tok.vocab_size == config["vocab_size"] == 1024
    assert config["vocab_size"] % 8 == 0
    repo_config = json.loads((REPO / "configs" / "glm-4.5-air-tiny.json").read_text())
    assert repo_config == config


def test_transformers_accepts_config(tiny_dir, config):
    from transformers import AutoConfig, Glm4MoeConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert isinstance(cfg, Glm4MoeConfig)
    assert (cfg.head_dim, cfg.n_routed_experts, cfg.num_hidden_layers) == (32, 16, 4)
    assert Glm4MoeConfig(**config).hidden_size == 128


def test_transformers_loads_weights_and_gives_separated_logits(tiny_dir, tok):
    import torch
    from transformers import Glm4MoeForCausalLM

    model, info = Glm4MoeForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
    assert not info["mismatched_keys"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "How do you bake a loaf of bread?"}])
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
    assert logits.shape == (ids.shape[1], 1024) and np.isfinite(logits).all()
    assert 1.0 < logits.std(axis=-1).mean() < 6.0
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.mean(top2[:, 1] - top2[:, 0] > 0.05) > 0.7


# ------------------------------------------------------------------ tokenizer


def test_transformers_tokenizer_encodes_and_decodes_the_same(tiny_dir, tok):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tiny_dir / "tokenizer.json"))
    texts = [
        "The keeper climbs 112 steps; it's cold!",
        MULTIBYTE,
        "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>\nok<|endoftext|>",
        "  spaces\n\n\tand tabs  ",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|user|>") == [tok.token_to_id("<|user|>")]


def test_chat_template_matches_transformers_rendering(tiny_dir, tok):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_dir)
    for messages in CHATS:
        for thinking in (True, False):
            for tools in (None, TOOLS):
                ours = tok.apply_chat_template(messages, enable_thinking=thinking, tools=tools)
                theirs = ref.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking,
                    tools=tools,
                )
                assert ours == theirs


def test_chat_template_glm_format(tok):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(messages, enable_thinking=True)
    off = tok.apply_chat_template(messages, enable_thinking=False)
    assert on == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>"
    assert off == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi/nothink<|assistant|>\n<think></think>"
    assert tok.encode(on)[:2] == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]
    history = tok.apply_chat_template(CHATS[2], add_generation_prompt=False)
    call = "<|assistant|>\n<think>Need the tool.</think>\n<tool_call>weather\n<arg_key>city</arg_key>"
    assert call in history
    assert history.count("<|observation|>") == 1 and history.endswith("</tool_response>")
    with pytest.raises(UserError, match="unknown message role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


GLM_TEXT = ("[gMASK]<sop><|system|>\nYou are helpful.<|user|>\nWeather in Zürich? 🙂<|assistant|>\n"
            "<think>The user asks about Zürich — call the tool.</think>\n<tool_call>get_weather\n"
            "<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n</tool_call><|observation|>\n"
            "<tool_response>{\"temp\": 21, \"sky\": \"☀\"}</tool_response><|assistant|>\n"
            "It is 21 °C — 晴れ, naïve café  \t spaces.\n")


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_text_stream_gives_the_full_decode_piece_by_piece(tok, skip):
    """TextStream (tokenizers' DecodeStream) against a full decode of every prefix: what it has
    emitted is always the prefix's text, except an unfinished character held back, which it
    never emits as U+FFFD; with the flush it is the whole text (the same pieces the
    hand-written windowed decoder it replaced gave)."""
    import random

    cases = [tok.encode(GLM_TEXT), tok.encode("Hello " + MULTIBYTE + " bye")]
    rng = random.Random(0)
    cases += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]  # arbitrary ids
    for ids in cases:
        stream, out = tok.text_stream(skip_special_tokens=skip), ""
        for k, t in enumerate(ids, 1):
            piece = stream.step(t)
            out += piece
            full = tok.decode(ids[:k], skip_special_tokens=skip)
            if not full.endswith("\ufffd"):
                assert out == full, (ids[:k], out, full)
            else:
                assert full.startswith(out) and not piece.endswith("\ufffd")
        assert out + stream.flush() == tok.decode(ids, skip_special_tokens=skip)
    # Multi-byte characters span several byte tokens: pieces are often empty, never partial.
    stream = tok.text_stream()
    chunks = [stream.step(i) for i in tok.encode("Hello " + MULTIBYTE)]
    assert chunks.count("") >= 3 and all("\ufffd" not in c for c in chunks)
    # Special tokens vanish when skipped, and surrounding text is unchanged.
    stream = tok.text_stream()
    ids = [tok.token_to_id("<|assistant|>"), *tok.encode("ok 🙂"), tok.token_to_id("<|user|>")]
    assert "".join(stream.step(i) for i in ids) + stream.flush() == "ok 🙂"


def test_tokenizer_errors_name_the_file(tiny_dir, tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    tok = Tokenizer(tmp_path)  # no tokenizer_config.json: eos ids still come from the configs
    assert tok.eos_token_ids and not tok.has_chat_template
    with pytest.raises(UserError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(UserError, match="tokenizer_config.json"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    # chat_template.jinja wins over tokenizer_config.json, as in newer checkpoints.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content | tojson }}|{{ eos_token }}")
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "é"}]) == '"é"|'
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer.json"):
        Tokenizer(tmp_path)


# ------------------------------------------------------------------ cache and --model


def test_tiny_name_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM_FUSED_CACHE", str(tmp_path))
    first = resolve_model("glm-4.5-air-tiny")
    assert first.path == tmp_path / tiny.TINY_NAME and first.name == tiny.TINY_NAME
    assert first.config_path.is_file()
    shard = first.path / "model-00001-of-00003.safetensors"
    stamp = shard.stat().st_mtime_ns
    assert resolve_model("GLM-4.5-Air-Tiny").path == first.path
    assert shard.stat().st_mtime_ns == stamp  # reused, not rebuilt
    (first.path / tiny.MARKER_FILE).write_text("older-generator\n")
    assert tiny.ensure_tiny_checkpoint() == first.path
    assert (first.path / tiny.MARKER_FILE).read_text().strip() == tiny.tiny_version()
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny.TINY_NAME]  # no leftovers


def test_an_unusable_cache_is_one_line(tmp_path, monkeypatch):
    """$GLM_FUSED_CACHE naming a file, or a place no directory can be made, is named; it was a
    traceback from mkdir (through every entry point of the tiny default)."""
    a_file = tmp_path / "cache"
    a_file.write_text("not a directory")
    monkeypatch.setenv("GLM_FUSED_CACHE", str(a_file))
    with pytest.raises(UserError, match=r"cache \(\$GLM_FUSED_CACHE.*: it is a file, not a directory"):
        resolve_model("glm-4.5-air-tiny")
    with pytest.raises(UserError, match="cannot make the tiny checkpoint in .*/cache/below: Not a directory"):
        tiny.ensure_tiny_checkpoint(a_file / "below")
    assert a_file.read_text() == "not a directory"  # the user's file is left as it was
    env = {**os.environ, "GLM_FUSED_CACHE": str(a_file)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), "--prompt", "hi"], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot make the tiny checkpoint in "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_concurrent_builders_agree(tmp_path):
    code = "import sys; from glm_fused.tiny import ensure_tiny_checkpoint as e; print(e(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, tmp_path], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert set(outs) == {str(tmp_path / tiny.TINY_NAME)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny.TINY_NAME]
    assert (tmp_path / tiny.TINY_NAME / tiny.MARKER_FILE).read_text().strip() == tiny.tiny_version()


def test_resolve_directory(tiny_dir, tmp_path):
    got = resolve_model(str(tiny_dir))
    assert got.path == tiny_dir and got.config_path == tiny_dir / "config.json"
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(UserError, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))


def _fake_snapshot(hub: Path, repo: str, rev: str) -> Path:
    snap = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    return snap


def test_resolve_from_hf_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    a, b = "a1" * 20, "b2" * 20  # commit hashes, as the hub names snapshots
    pinned = _fake_snapshot(hub, "zai-org/GLM-4.5-Air", a)
    newer = _fake_snapshot(hub, "zai-org/GLM-4.5-Air", b)
    os.utime(pinned, (1, 1))
    refs = hub / "models--zai-org--GLM-4.5-Air" / "refs"
    refs.mkdir()
    (refs / "main").write_text(a + "\n")
    (refs / "v2").write_text(b)
    for spec in ("zai-org/GLM-4.5-Air", "GLM-4.5-Air", "glm-4.5-air"):
        got = resolve_model(spec)
        assert (got.path, got.name) == (pinned, "zai-org/GLM-4.5-Air")
    # --revision: a branch or tag (refs/), or a commit.
    assert resolve_model("GLM-4.5-Air", revision="v2").path == newer
    assert resolve_model("GLM-4.5-Air", revision=b).path == newer
    assert resolve_model("GLM-4.5-Air", revision="main").path == pinned
    with pytest.raises(UserError, match="--revision v3") as err:
        resolve_model("GLM-4.5-Air", revision="v3")
    assert "\n" not in str(err.value) and str(hub) in str(err.value)
    with pytest.raises(UserError, match="--revision"):
        resolve_model("glm-4.5-air-tiny", revision="main")  # not a cache entry
    (refs / "main").unlink()
    assert resolve_model("GLM-4.5-Air").path == newer  # no ref: the newest snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # wins over HF_HOME
    with pytest.raises(UserError, match="elsewhere"):
        resolve_model("GLM-4.5-Air")


def test_dummy_weights_use_the_repo_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    got = resolve_model("zai-org/GLM-4.5", load_format="dummy")
    assert got.path is None and got.config_path == REPO / "configs" / "glm-4.5.json"
    air = resolve_model("glm-4.5-air", load_format="dummy")
    assert (air.path, air.name) == (None, "zai-org/GLM-4.5-Air")
    assert air.config_path == REPO / "configs" / "glm-4.5-air.json"
    with pytest.raises(UserError, match="load-format dummy"):
        resolve_model("GLM-4.5-Air")


def test_unknown_name_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError) as err:
        resolve_model("foo", load_format="dummy")
    message = str(err.value)
    assert "'foo'" in message and "models--zai-org--foo" in message and str(tmp_path) in message
    assert "\n" not in message
    with pytest.raises(UserError, match="not a Hugging Face model name"):
        resolve_model("what is this?")
