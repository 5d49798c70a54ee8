"""The embedded tiny default model, ``glm-4.5-air-tiny``.

A deterministic checkpoint with GLM-4.5-Air's architecture at toy size, in the Hugging
Face layout a real checkpoint uses (sharded safetensors with the original per-expert
names, the MTP layer, tokenizer.json, Jinja chat template). It is made on first use into
a cache directory, so every code path that serves the real model can be exercised on a
laptop in seconds, and ``transformers`` can load the same files as an independent reference.

Framework-free: numpy, safetensors and tokenizers only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from glm_fused.errors import UserError

TINY_NAME = "glm-4.5-air-tiny"


def configs_dir() -> Path:
    """The project's configs/: at the repository root, or where setup.py installs it."""
    in_repo = Path(__file__).resolve().parent.parent / "configs"
    installed = Path(sys.prefix) / "share" / "glm_fused" / "configs"
    return in_repo if in_repo.is_dir() or not installed.is_dir() else installed


CONFIG_FILE = configs_dir() / f"{TINY_NAME}.json"
# Present in a finished cache directory only; holds the generator version it was made by.
MARKER_FILE = ".glm_fused_tiny_version"
DEFAULT_SHARDS = 3
# Above this many bytes of weights, more shards are written so memory stays bounded.
MAX_SHARD_BYTES = 512 * 2**20

# Added tokens in GLM-4.5's order (they follow the regular vocabulary there too).
# `special=False` for text markup the reasoning and tool parsers read back from decoded
# text: decode(skip_special_tokens=True) must keep it.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<|begin_of_image|>", True),
    ("<|end_of_image|>", True),
    ("<|begin_of_video|>", True),
    ("<|end_of_video|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", False),
)
# Regular (BPE) tokens; the rest of vocab_size is the added tokens above plus reserved ones.
REGULAR_VOCAB = 960
RESERVED_FORMAT = "<|reserved_{}|>"
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PAD_TOKEN = "<|endoftext|>"

# GLM-4's pre-tokenizer split: contractions, letter runs with one leading non-letter,
# digits in groups of up to three, punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text for the BPE merges. Plain English so that common words become single
# tokens and encoded prompts look like a real model's (a few tokens per word).
_CORPUS = """\
The lighthouse stands at the end of a long stone pier, and every night its lamp turns
slowly over the water. Sailors who come home late watch for the light, count the seconds
between its flashes, and know from the count which harbour they have reached. In winter
the keeper climbs the one hundred and twelve steps twice an evening to wind the clockwork
that turns the lens. He writes the weather in a small book: wind from the north, rain,
a heavy sea, three ships passed before midnight.

A river begins as rain on high ground. The water gathers in small streams that join one
another, and the streams become a river that finds the lowest path to the sea. Along the
way it carries sand and stones, cuts deep valleys through soft rock, and spreads wide and
slow across flat land. People have always built their towns beside rivers, because a
river gives them water to drink, fish to eat, fields to farm and a road to travel.

To bake a simple loaf of bread, mix 500 grams of flour with 10 grams of salt, 7 grams of
dry yeast and about 350 millilitres of warm water. Knead the dough for ten minutes until
it is smooth, then leave it covered in a warm place for an hour, until it has doubled in
size. Shape the loaf, let it rise again for forty minutes, and bake it at 220 degrees for
thirty to thirty-five minutes. The bread is done when it sounds hollow as you tap it.

Numbers have patterns that are easy to state and hard to prove. Every even number greater
than two seems to be the sum of two prime numbers: 4 = 2 + 2, 10 = 3 + 7, 28 = 5 + 23.
Nobody has found an exception, and nobody has yet shown that there is none. A proof would
need an argument that works for all numbers at once, not just the ones we can check.

When you ask a question, a good answer first says what it knows and then what it does not.
It gives the reasons, shows the steps, and points to where each fact came from. If the
question has more than one reading, the answer names them and explains which one it
chose, and why. It is short when it can be and long only when it must be.

The city library opens at nine in the morning and closes at six in the evening, except on
Sundays. Its reading room has tall windows, long wooden tables and green lamps. Children
come after school to do their homework; older readers come for the newspapers and stay
for the quiet. The librarian knows where every book is, and which ones are overdue.

In the mountains the weather changes quickly. A clear blue morning can turn to cloud and
snow by the afternoon, and walkers who set out in light clothes may find themselves cold
and lost. Experienced climbers carry a map, a compass, water, food and a warm coat, and
they tell someone where they are going and when they expect to return.
"""

# Generation-prompt format of GLM-4.5 (see its published chat template): the prompt opens
# with [gMASK]<sop>; each turn is a role token, a newline and the text; a user turn gets
# "/nothink" when thinking is off; an assistant turn carries a (possibly empty) think
# block; tool results follow one <|observation|>; the generation prompt is <|assistant|>,
# plus an empty think block when thinking is off so the answer starts right away.
CHAT_TEMPLATE = """\
[gMASK]<sop>
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}
{%- set thinking_off = enable_thinking is defined and not enable_thinking -%}
{%- if tools -%}
    {{- '<|system|>\\n# Tools\\n\\n' -}}
    {{- 'You may call one or more functions to assist with the user query.\\n\\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n' -}}
    {%- for tool in tools -%}
        {{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}
    {%- endfor -%}
    {{- '</tools>\\n\\nFor each function call, output the function name and arguments ' -}}
    {{- 'within the following XML format:\\n<tool_call>{function-name}\\n' -}}
    {{- '<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{arg-value-1}</arg_value>\\n' -}}
    {{- '<arg_key>{arg-key-2}</arg_key>\\n<arg_value>{arg-value-2}</arg_value>\\n...\\n</tool_call>' -}}
{%- endif -%}
{%- set state = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set state.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'system' or m.role == 'developer' -%}
        {{- '<|system|>\\n' + text_of(m.content) -}}
    {%- elif m.role == 'user' -%}
        {%- set text = text_of(m.content) -%}
        {{- '<|user|>\\n' + text -}}
        {%- if thinking_off and not text.endswith('/nothink') -%}
            {{- '/nothink' -}}
        {%- endif -%}
    {%- elif m.role == 'assistant' -%}
        {%- set text = text_of(m.content) -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in text -%}
            {%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
            {%- set text = text.split('</think>')[-1] -%}
        {%- endif -%}
        {{- '<|assistant|>' -}}
        {#- Reasoning is kept only for turns after the last user message. -#}
        {%- if loop.index0 > state.last_user and reasoning.strip() -%}
            {{- '\\n<think>' + reasoning.strip() + '</think>' -}}
        {%- else -%}
            {{- '\\n<think></think>' -}}
        {%- endif -%}
        {%- if text.strip() -%}
            {{- '\\n' + text.strip() -}}
        {%- endif -%}
        {%- for call in m.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\\n<tool_call>' + fn.name -}}
            {%- if fn.arguments is mapping -%}
                {%- for key, value in fn.arguments.items() -%}
                    {{- '\\n<arg_key>' + key + '</arg_key>\\n<arg_value>' -}}
                    {{- value if value is string else value | tojson(ensure_ascii=False) -}}
                    {{- '</arg_value>' -}}
                {%- endfor -%}
            {%- elif fn.arguments -%}
                {{- '\\n' + fn.arguments -}}
            {%- endif -%}
            {{- '\\n</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' or m.role == 'observation' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != m.role -%}
            {{- '<|observation|>' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' + text_of(m.content) + '\\n</tool_response>' -}}
    {%- else -%}
        {{- raise_exception('unknown message role: ' + m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}
    {%- if thinking_off -%}
        {{- '\\n<think></think>' -}}
    {%- endif -%}
{%- endif -%}
"""


# ----------------------------------------------------------------------------- config


def base_config() -> dict:
    """The tiny model's config.json as stored in configs/ (the single source of truth)."""
    try:
        return json.loads(CONFIG_FILE.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"tiny model config missing: {CONFIG_FILE}") from exc


def tiny_config(config_overrides: dict | None = None) -> dict:
    """Config with overrides applied and the special-token ids taken from the tokenizer."""
    config = base_config()
    config.update(config_overrides or {})
    tokenizer = build_tokenizer()
    if config["vocab_size"] < tokenizer.get_vocab_size():
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the tiny tokenizer's "
            f"{tokenizer.get_vocab_size()} tokens"
        )
    config["pad_token_id"] = tokenizer.token_to_id(PAD_TOKEN)
    config["eos_token_id"] = [tokenizer.token_to_id(t) for t in EOS_TOKENS]
    return config


# ---------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=1)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=REGULAR_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != REGULAR_VOCAB:
        raise RuntimeError(
            f"tiny corpus gave {tok.get_vocab_size()} BPE tokens, expected {REGULAR_VOCAB}"
        )
    # Added one at a time so each gets the next id, in the listed order.
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    n = 0
    while tok.get_vocab_size() < vocab_size:
        tok.add_special_tokens([AddedToken(RESERVED_FORMAT.format(n), special=True)])
        n += 1
    return tok.to_str(pretty=True)


def build_tokenizer():
    """The tiny tokenizer (a ``tokenizers.Tokenizer``), trained deterministically."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(base_config()["vocab_size"]))


def _tokenizer_config(tokenizer) -> dict:
    added = {
        str(i): {
            "content": tok.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok.special,
        }
        for i, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKENS[0],
        "pad_token": PAD_TOKEN,
        "model_max_length": base_config()["max_position_embeddings"],
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ------------------------------------------------------------------------------ weights


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, shape and how to draw it."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "norm" (1 + noise) or "zero_mean_small"
    std: float = 0.0
    fp32: bool = False  # stays fp32 whatever the checkpoint dtype (router bias)


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order: model, final norm, lm_head, MTP.

    Projections are drawn with std ``1/sqrt(fan_in)`` so that every attention and MLP block
    changes the residual stream by about as much as the embedding: a wrong RoPE, head
    split or router then moves the logits visibly, which small fixed stds would hide.
    """
    h = config["hidden_size"]
    v = config["vocab_size"]
    nq, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n_layers = config["num_hidden_layers"]
    n_mtp = config.get("num_nextn_predict_layers", 0)
    specs: list[TensorSpec] = []

    def linear(name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> None:
        specs.append(TensorSpec(name, (out_dim, in_dim), "normal", gain / math.sqrt(in_dim)))

    def norm(name: str, dim: int) -> None:
        specs.append(TensorSpec(name, (dim,), "norm", 0.05))

    def swiglu(prefix: str, width: int) -> None:
        linear(f"{prefix}.gate_proj.weight", width, h)
        linear(f"{prefix}.up_proj.weight", width, h)
        linear(f"{prefix}.down_proj.weight", h, width)

    def layer(i: int) -> None:
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", h)
        for proj, heads in (("q", nq), ("k", nkv), ("v", nkv)):
            linear(f"{p}.self_attn.{proj}_proj.weight", heads * d, h)
            if config.get("attention_bias", False):
                specs.append(TensorSpec(f"{p}.self_attn.{proj}_proj.bias", (heads * d,), "normal", 0.1))
        if config.get("use_qk_norm", False):
            norm(f"{p}.self_attn.q_norm.weight", d)
            norm(f"{p}.self_attn.k_norm.weight", d)
        linear(f"{p}.self_attn.o_proj.weight", h, nq * d)
        norm(f"{p}.post_attention_layernorm.weight", h)
        if i < config["first_k_dense_replace"]:
            swiglu(f"{p}.mlp", config["intermediate_size"])
            return
        n_exp, im = config["n_routed_experts"], config["moe_intermediate_size"]
        linear(f"{p}.mlp.gate.weight", n_exp, h)
        # Small, so that it only sometimes changes which experts are picked.
        specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (n_exp,), "normal", 0.01, fp32=True))
        for e in range(n_exp):
            swiglu(f"{p}.mlp.experts.{e}", im)
        swiglu(f"{p}.mlp.shared_experts", im * config["n_shared_experts"])

    specs.append(TensorSpec("model.embed_tokens.weight", (v, h), "normal", 1.0))
    for i in range(n_layers):
        layer(i)
    norm("model.norm.weight", h)
    # Gain 3: logits of std ~3, so the top token usually stands clear of the second.
    linear("lm_head.weight", v, h, gain=3.0)
    # Multi-token-prediction layers follow the decoder layers; serving loaders skip them.
    for i in range(n_layers, n_layers + n_mtp):
        p = f"model.layers.{i}"
        specs.append(TensorSpec(f"{p}.embed_tokens.weight", (v, h), "normal", 1.0))
        norm(f"{p}.enorm.weight", h)
        norm(f"{p}.hnorm.weight", h)
        linear(f"{p}.eh_proj.weight", h, 2 * h)
        layer(i)
        norm(f"{p}.shared_head.norm.weight", h)
        linear(f"{p}.shared_head.head.weight", v, h, gain=3.0)
    return specs


def _draw(spec: TensorSpec, seed: int) -> np.ndarray:
    """fp32 values of one tensor; seeded by (seed, name) so shard layout never matters."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.name.encode())])))
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    x *= np.float32(spec.std)
    if spec.init == "norm":
        x += np.float32(1.0)
    return x


_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even; numpy has no bf16.

    Works in place on x (a fresh draw) to keep memory near one copy of the shard.
    """
    bits = x.reshape(-1).view(np.uint32)
    bits += np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    high = bits.view(np.uint16)[1::2] if np.little_endian else bits.view(np.uint16)[0::2]
    return np.ascontiguousarray(high).reshape(x.shape)


def _nbytes(spec: TensorSpec, dtype: str) -> int:
    return math.prod(spec.shape) * (4 if spec.fp32 else _DTYPES[dtype])


def _shard_plan(specs: list[TensorSpec], dtype: str, num_shards: int) -> list[list[TensorSpec]]:
    """Split the tensors, in order, into num_shards contiguous runs of about equal bytes."""
    total = sum(_nbytes(s, dtype) for s in specs)
    shards: list[list[TensorSpec]] = [[] for _ in range(num_shards)]
    done = 0
    for i, spec in enumerate(specs):
        k = min(num_shards - 1, done * num_shards // max(total, 1))
        # Leave at least one tensor for each remaining shard.
        k = max(k, num_shards - (len(specs) - i))
        shards[k].append(spec)
        done += _nbytes(spec, dtype)
    return shards


def _write_shard(specs: list[TensorSpec], seed: int, dtype: str, filename: Path) -> None:
    from safetensors import TensorSpec as SafeSpec
    from safetensors import serialize_file

    arrays: dict[str, np.ndarray] = {}
    for spec in specs:
        x = _draw(spec, seed)
        if spec.fp32 or dtype == "float32":
            arrays[spec.name] = x
        elif dtype == "float16":
            arrays[spec.name] = x.astype(np.float16)
        else:
            arrays[spec.name] = _to_bf16_bits(x)
    if dtype != "bfloat16":
        from safetensors.numpy import save_file

        save_file(arrays, filename, metadata={"format": "pt"})
        return
    # bf16 has no numpy dtype: describe the uint16 buffers as bfloat16 to the writer.
    described = {
        name: SafeSpec(
            dtype="bfloat16" if a.dtype == np.uint16 else a.dtype.name,
            shape=list(a.shape),
            data_ptr=a.ctypes.data,
            data_len=a.nbytes,
        )
        for name, a in arrays.items()
    }
    serialize_file(described, filename, metadata={"format": "pt"})


def write_tiny_checkpoint(
    path: str | os.PathLike,
    config_overrides: dict | None = None,
    seed: int = 0,
    num_shards: int | None = None,
) -> Path:
    """Write a complete tiny-style checkpoint (config, tokenizer, sharded weights) to path.

    config_overrides change any config.json field (hidden_size, num_hidden_layers,
    n_routed_experts, torch_dtype "float32" | "float16" | "bfloat16", ...), e.g. to make a
    multi-GB checkpoint for load-time measurements. Shards are drawn and written one at a
    time, so memory stays near one shard (at most MAX_SHARD_BYTES unless num_shards is
    forced). Output is a pure function of (generator, overrides, seed, num_shards).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(config_overrides)
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported torch_dtype {dtype!r}; use one of {sorted(_DTYPES)}")

    tokenizer = build_tokenizer()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n")
    generation = {
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "transformers_version": config.get("transformers_version", "4.54.0"),
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    specs = tensor_specs(config)
    total = sum(_nbytes(s, dtype) for s in specs)
    if num_shards is None:
        num_shards = max(DEFAULT_SHARDS, math.ceil(total / MAX_SHARD_BYTES))
    num_shards = max(1, min(num_shards, len(specs)))
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(_shard_plan(specs, dtype, num_shards)):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        _write_shard(shard, seed, dtype, out / filename)
        os.chmod(out / filename, 0o644)  # the writer creates owner-only files
        weight_map.update((s.name, filename) for s in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


# -------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """``$GLM_FUSED_CACHE``, else ``~/.cache/glm_fused``."""
    env = os.environ.get("GLM_FUSED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "glm_fused"


def tiny_version() -> str:
    """Content version of the default checkpoint: changes whenever its generator does."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(CONFIG_FILE.read_bytes())
    return digest.hexdigest()[:16]


def _is_complete(path: Path, version: str) -> bool:
    try:
        return (path / MARKER_FILE).read_text().strip() == version
    except OSError:
        return False


def _discard(path: Path) -> None:
    """Move a stale directory out of the way atomically, then delete it."""
    aside = path.parent / f".{path.name}.old-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # someone else moved it already
    shutil.rmtree(aside, ignore_errors=True)


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the tiny checkpoint in the cache, made first if missing or out of date.

    Safe for concurrent callers in several processes: each builds in its own temporary
    directory next to the target and renames it into place, so the target path only ever
    shows a complete checkpoint (marker file last); a loser of the race uses the winner's.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / TINY_NAME
    version = tiny_version()
    if _is_complete(target, version):
        return target
    where = "" if cache_dir is not None else " ($GLM_FUSED_CACHE, default ~/.cache/glm_fused)"
    if root.exists() and not root.is_dir():
        raise UserError(f"cannot make the tiny checkpoint in {root}{where}: it is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}.tmp-", dir=root))
    except OSError as exc:
        raise UserError(f"cannot make the tiny checkpoint in {root}{where}: {exc.strerror or exc}") from None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            write_tiny_checkpoint(tmp)
            (tmp / MARKER_FILE).write_text(version + "\n")
        except OSError as exc:  # a full disk, say
            raise UserError(f"cannot write the tiny checkpoint in {root}{where}: {exc.strerror or exc}") from None
        for _ in range(10):
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                # The target exists: another process finished first, or it is stale.
                if _is_complete(target, version):
                    return target
                _discard(target)
        raise RuntimeError(f"could not place the tiny checkpoint at {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
