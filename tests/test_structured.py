"""Structured output with xgrammar on the tiny tokenizer (CPU): decoding random logits, and
the random tiny model's own logits (transformers), under the grammar mask always ends with
a stop token and gives text that parses and follows its schema, checked with ``jsonschema``
(JSON answers) and with the glm45 tool-call parser plus ``jsonschema`` (tool calls)."""

from __future__ import annotations

import inspect
import json
import re

import jsonschema
import numpy as np
import pytest

from glm_fused import tiny
from glm_fused.engine.sampling import InvalidParam, SamplingParams, bitmask_to_bool, row_key, sample
from glm_fused.engine.structured import StructuredOutputs, request_format
from glm_fused.server.chat import resolve_tool_choice
from glm_fused.server.protocol import Constraint
from glm_fused.tokenizer import Tokenizer
from test_chat import parse_answer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "age", "ok", "color"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"point": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": -5, "maximum": 5},
    "y": {"type": "integer", "minimum": -5, "maximum": 5}},
    "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["lat"], "additionalProperties": False}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "label": {"type": "string", "maxLength": 5}},
        "required": ["time"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
THINKING_OFF_PROMPT = "[gMASK]<sop><|user|>\nGo/nothink<|assistant|>\n<think></think>"
GREEDY, SAMPLED = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
MAX_TOKENS = 300  # room to finish: every schema here bounds its answer well below this


@pytest.fixture(scope="module")
def tiny_dir():
    return tiny.ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def so(tiny_dir, tok):
    config = json.loads((tiny_dir / "config.json").read_text())
    return StructuredOutputs(tok, config["vocab_size"], tok.eos_token_ids)


def decode_random(so, compiled, seed: int, params: SamplingParams, forced: list[int] = ()):
    """Sample from random logits under the mask with the engine's numpy sampler; returns the
    generated ids (without the stop token) and whether a stop token ended them."""
    rng = np.random.default_rng(seed)
    state = so.state(compiled)
    ids = list(forced)
    for t in forced:
        assert state.accept(t)
    for step in range(MAX_TOKENS):
        logits = rng.standard_normal(so.vocab_size).astype(np.float32)
        logits[~bitmask_to_bool(state.next_bitmask(), so.vocab_size)] = -np.inf  # as the sampler masks
        token = sample(logits, params, row_key(seed, step))
        assert state.accept(token)
        if token in so.stop_token_ids:
            assert state.terminated
            return ids, True
        ids.append(token)
    return ids, False


def compiled_for(so, **kwargs):
    return so.compile(request_format(**kwargs))


@pytest.mark.parametrize("schema", [PERSON, POINT], ids=["person", "point"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schema_from_random_logits(so, tok, schema, params):
    compiled = compiled_for(so, response_format={"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": schema}})
    for seed in range(12):
        ids, stopped = decode_random(so, compiled, seed, params)
        assert stopped, f"seed {seed}: no stop within {MAX_TOKENS} tokens"
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


def test_json_object_from_random_logits(so, tok):
    compiled = compiled_for(so, response_format={"type": "json_object"})
    done = 0
    for seed in range(12):
        ids, stopped = decode_random(so, compiled, seed, GREEDY)
        if stopped:  # an unbounded grammar: most random answers still end
            assert isinstance(json.loads(tok.decode(ids)), dict)
            done += 1
        else:  # cut off: still a prefix of JSON that the grammar accepted
            assert tok.decode(ids).lstrip().startswith("{")
    assert done >= 1


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("get_weather", True),
                                             ("set_alarm", True), ("get_time", True)])
def test_tool_calls_from_random_logits(so, tok, choice, parallel):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    mode, name = resolve_tool_choice(tool_choice, TOOLS)
    compiled = compiled_for(so, tools=TOOLS, tool_mode=mode, tool_name=name, parallel_tool_calls=parallel)
    counts = set()
    for seed in range(12):
        ids, stopped = decode_random(so, compiled, seed, SAMPLED if seed % 2 else GREEDY)
        assert stopped, f"seed {seed}: no stop within {MAX_TOKENS} tokens"
        message = parse_answer(tok.decode(ids), THINKING_OFF_PROMPT, reasoning=True, tools=TOOLS)
        calls = message.get("tool_calls", [])
        assert message["content"] is None and message["reasoning_content"] is None, message
        assert calls, message
        counts.add(len(calls))
        for call in calls:
            fn = call["function"]
            assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name)
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    if not parallel or name is not None:
        assert counts == {1}


def test_thinking_block_first_and_no_stop_inside_it(so, tok):
    compiled = compiled_for(so, response_format={"type": "json_schema", "json_schema": {"schema": POINT}},
                            thinking=True)
    state = so.state(compiled)
    for t in tok.encode("\n<think>Where"):
        assert state.accept(t)
    allowed = state.allowed()
    assert not any(allowed[t] for t in so.stop_token_ids)  # cannot stop inside the block
    forced = tok.encode("\n<think>Pick a point.</think>")
    prompt = "[gMASK]<sop><|user|>\nGo<|assistant|>"
    for seed in range(6):
        ids, stopped = decode_random(so, compiled, seed, GREEDY, forced=forced)
        assert stopped
        message = parse_answer(tok.decode(ids), prompt, reasoning=True)
        assert message["reasoning_content"] == "Pick a point."
        jsonschema.validate(json.loads(message["content"]), POINT)
    # The block is optional: an answer may start with the JSON itself.
    state = so.state(compiled)
    assert all(state.accept(t) for t in tok.encode('{"point": {"x": 1, "y": -2}}'))
    assert state.completed


def test_special_tokens_are_never_allowed_and_stop_only_at_the_end(so, tok):
    compiled = compiled_for(so, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}})
    state = so.state(compiled)
    for t in tok.encode('{"s": "'):
        assert state.accept(t)
    allowed = state.allowed()
    assert allowed.sum() > 500  # free text inside the string...
    assert not allowed[list(tok.special_ids)].any()  # ...but never a role marker or [gMASK]
    assert allowed[tok.token_to_id("<think>")]  # markup that decodes as text is text
    for t in tok.encode('x"}'):
        assert state.accept(t)
    assert state.completed and not state.terminated
    assert set(np.flatnonzero(state.allowed())) == set(so.stop_token_ids)


def test_bitmask_words_read_as_xgrammar_writes_them(so):
    rng = np.random.default_rng(3)
    bitmask = rng.integers(-2**31, 2**31, size=(3, (so.vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    for r in range(3):
        bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(so.vocab_size)]
        assert (bitmask_to_bool(bitmask[r], so.vocab_size) == np.array(bits, dtype=bool)).all()


def test_requests_that_cannot_be_enforced_name_the_field(so):
    assert request_format() is None and request_format(response_format={"type": "text"}) is None
    cases = [
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
         "response_format.json_schema"),
        (dict(response_format={"type": "json_object"}, tools=TOOLS, tool_mode="required"), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a<b": {"type": "string"}}}}}], tool_mode="required"),
         "tools.0.function.parameters"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidParam) as err:
            request_format(**kwargs)
        assert err.value.param == param, kwargs
    bad = request_format(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}})
    with pytest.raises(InvalidParam) as err:
        so.compile(bad)
    assert err.value.param == "response_format" and "cannot be enforced" in str(err.value)
    bogus = request_format(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}})
    with pytest.raises(InvalidParam) as err:
        so.compile(bogus)
    # the schema's fault, without xgrammar's log prefix (its time and C++ source file)
    assert str(err.value).startswith("response_format: the schema cannot be enforced: ") and "bogus" in str(err.value)
    assert ".cc:" not in str(err.value) and "[" not in str(err.value), str(err.value)


# vLLM's and SGLang's structured output fields (glm_fused.server.protocol.Constraint): each
# kind's answers from random logits, checked with Python's re, the choice list, a second
# reading of the grammar's language, and jsonschema
GRAMMAR_YES_NO = 'root ::= "yes" | "no" | ("maybe " [0-9] [0-9]?)'
CONSTRAINED = {
    "regex": (Constraint("structured_outputs.regex", "regex", r"[0-9]{3}-[a-z]{2,4}( ok)?"),
              lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( ok)?", text)),
    "choice": (Constraint("guided_choice", "choice", ["positive", "negative", "neutral"]),
               lambda text: text in ("positive", "negative", "neutral")),
    "grammar": (Constraint("ebnf", "grammar", GRAMMAR_YES_NO),
                lambda text: re.fullmatch(r"yes|no|maybe [0-9]{1,2}", text)),
    "json_text": (Constraint("guided_json", "json", json.dumps(POINT)),
                  lambda text: jsonschema.validate(json.loads(text), POINT) is None),
    # no free whitespace: outside strings, a space only after ':' and ',' (xgrammar's fixed
    # separators, as vLLM's disable_any_whitespace gives)
    "json_compact": (Constraint("structured_outputs.json", "json", PERSON, compact=True),
                     lambda text: jsonschema.validate(json.loads(text), PERSON) is None
                     and not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text).replace(": ", ":")
                                       .replace(", ", ","))),
}


@pytest.mark.parametrize("name", sorted(CONSTRAINED))
def test_vllm_and_sglang_constraints_from_random_logits(so, tok, name):
    constraint, holds = CONSTRAINED[name]
    compiled = so.compile(request_format(constraint=constraint, lead_newline=False), constraint.param)
    for seed in range(4):
        ids, stopped = decode_random(so, compiled, seed, SAMPLED)
        text = tok.decode(ids)
        assert stopped and holds(text), (seed, text)


def test_constraints_that_cannot_be_enforced_name_the_field(so):
    cases = [
        (Constraint("guided_regex", "regex", "("), "guided_regex"),
        (Constraint("structured_outputs.grammar", "grammar", "root ::= undefined_rule"), "structured_outputs.grammar"),
        (Constraint("guided_json", "json", "{not json"), "guided_json"),
        (Constraint("guided_json", "json", [1]), "guided_json"),
        (Constraint("json_schema", "json", {"type": "bogus"}, compact=True), "json_schema"),
        (Constraint("guided_choice", "choice", []), "guided_choice"),
        (Constraint("guided_choice", "choice", "positive"), "guided_choice"),
        (Constraint("regex", "regex", 5), "regex"),
    ]
    for constraint, param in cases:
        with pytest.raises(InvalidParam) as err:
            so.compile(request_format(constraint=constraint), constraint.param)
        assert err.value.param == param and str(err.value).startswith(param), (constraint, str(err.value))
        assert ".cc:" not in str(err.value), str(err.value)
    one = Constraint("guided_regex", "regex", "a+")
    for kwargs, param in [(dict(response_format={"type": "json_object"}), "guided_regex"),
                          (dict(tools=TOOLS, tool_mode="required"), "guided_regex")]:
        with pytest.raises(InvalidParam) as err:
            request_format(constraint=one, **kwargs)
        assert err.value.param == param, kwargs


@pytest.mark.timeout(300)
def test_the_tiny_models_own_logits(tiny_dir, tok, so):
    """Greedy decoding of the random tiny model (transformers, CPU) under the mask."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    # transformers 5.2x renamed the KV cache's keyword and output field past_key_values -> cache
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Where does a river begin?"}],
                                     enable_thinking=False, tools=TOOLS)
    mode, name = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    cases = [(request_format(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}), None),
             (request_format(tools=TOOLS, tool_mode=mode, tool_name=name), "get_weather"),
             (request_format(tools=TOOLS, tool_mode="required", parallel_tool_calls=False), "any")]
    for tag, tool in cases:
        state = so.state(so.compile(tag))
        ids, past = tok.encode(prompt), None
        step_ids, out = torch.tensor([ids]), []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                result = model(input_ids=step_ids, use_cache=True, **{cache: past})
                past = getattr(result, cache)
                logits = result.logits[:, -1, :].float()
                logits[0, ~torch.from_numpy(bitmask_to_bool(state.next_bitmask(), so.vocab_size))] = -torch.inf
                token = int(torch.argmax(logits[0]))
                assert state.accept(token)
                if token in so.stop_token_ids:
                    break
                out.append(token)
                step_ids = torch.tensor([[token]])
            else:
                pytest.fail(f"no stop within {MAX_TOKENS} tokens: {tok.decode(out)!r}")
        text = tok.decode(out)
        if tool is None:
            jsonschema.validate(json.loads(text), PERSON)
        else:
            calls = parse_answer(text, prompt, reasoning=True, tools=TOOLS)["tool_calls"]
            assert len(calls) == 1 and (tool == "any" or calls[0]["function"]["name"] == tool)
            fn = calls[0]["function"]
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def test_answers_stay_well_formed_utf8():
    """xgrammar lets some byte sequences through that are not UTF-8 (F0 81 ...); the UTF-8
    table keeps a constrained answer well-formed: after F0 only 90-BF may follow, a stop
    token (no bytes) only between characters."""
    from glm_fused.engine.structured import Utf8Table

    vocab = [b"a", b"\xf0", b"\x81", b"\x90\x80\x80", b"\xc3", b"\xa9", b"", b"\xc3\xa9", b"\xed\xa0\x80"]
    table = Utf8Table(vocab, 10)  # one id beyond the vocabulary: never allowed
    start = table.next[0]
    assert [int(x) >= 0 for x in start] == [True, True, False, False, True, False, True, True, False, False]
    after_f0 = table.next[int(start[1])]
    assert [int(x) >= 0 for x in after_f0[:9]] == [False, False, False, True, False, True, False, False, False]
    assert after_f0[3] == 0  # F0 90 80 80 is a whole character
    after_c3 = table.next[int(start[4])]
    assert np.flatnonzero(after_c3 >= 0).tolist() == [2, 5]  # 81 and A9 complete it; nothing else
    allowed = bitmask_to_bool(table.words[int(start[1])], 10)
    assert np.flatnonzero(allowed).tolist() == [3, 5]  # 81 (below 90) is not
