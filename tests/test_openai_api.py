"""The OpenAI API GLM users call, end to end against one tiny server started as they start
vLLM (``serve.py MODEL --enable-auto-tool-choice --tool-call-parser glm45 --reasoning-parser
glm45 --chat-template FILE``, TP 2 on CPU; ``conftest.api_server``), driven by the official
``openai`` client and raw HTTP.

The tiny model's weights are random: its answers are gibberish, but deterministic, and the
grammar keeps forced tool calls and JSON answers in shape. Answers are checked against
independent references: ``jsonschema`` for schemas, the tokenizer for /tokenize, and the
raw text of the same draws from /v1/completions for the parsers' splits.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from glm_fused.tiny import ensure_tiny_checkpoint
from glm_fused.tokenizer import Tokenizer
from test_chat import parse_answer

MODEL = "glm-4.5-air-tiny"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "label": {"type": "string", "maxLength": 5}},
        "required": ["time"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "color"], "additionalProperties": False}
ROOM = 300  # max_tokens: room to finish, far above what the bounded schemas need
ASK = [{"role": "user", "content": "What is the weather in Oslo for three days?"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ensure_tiny_checkpoint())


def post(srv, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=120)
    assert r.status_code == status, (path, body, r.status_code, r.text)
    return r.json()


def raw_completion(srv, messages, *, kwargs=None, tools=None, **sampling) -> str:
    """The raw text of the same draws a chat request makes: its rendered prompt (/tokenize)
    sent to /v1/completions as token ids with the same sampling (seeded draws do not depend
    on what else runs)."""
    ids = post(srv, "/tokenize", {"messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {}),
                                  **({"tools": tools} if tools else {})})
    return post(srv, "/v1/completions", {"model": MODEL, "prompt": ids["tokens"], **sampling})["choices"][0]["text"]


# ---- the server as started, and the tokenizer endpoints -------------------------------------
@pytest.mark.timeout(240)
def test_start_up_and_tokenizer_endpoints(api_server, tok):
    from glm_fused import __version__

    from conftest import API_DEVICE, API_TP

    log = api_server.output()
    assert str(ensure_tiny_checkpoint()) in log, "the start-up log names the tiny checkpoint's path"
    assert f"tp={API_TP}" in log
    assert ("backend=paddle (auto: Paddle runs on the CPU)" if API_DEVICE == "cpu" else "(auto: ") in log
    assert httpx.get(f"{api_server.url}/version").json() == {"version": __version__}
    info = httpx.get(f"{api_server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 1024
    assert info["chat_template"] == api_server.template.read_text()  # --chat-template is the one in use

    text = "Weather in Zürich? 🙂 <think>"
    got = post(api_server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert got["tokens"] == tok.encode(text, add_special_tokens=True) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == [tok.id_to_token(t) for t in got["tokens"]] and got["max_model_len"] == 1024
    assert post(api_server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == tok.encode(text)
    assert post(api_server, "/detokenize", {"tokens": got["tokens"]})["prompt"] == tok.decode(got["tokens"], False)
    # Messages render with the server's template; `developer` is `system`, `observation` is `tool`.
    chat = post(api_server, "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."}, *ASK],
                                          "chat_template_kwargs": {"prefill": "X"}})
    same = post(api_server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *ASK],
                                          "chat_template_kwargs": {"prefill": "X"}})
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK]) + "X"
    assert chat["tokens"] == same["tokens"] == tok.encode(rendered)
    for path, body, param in [("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus")]:
        assert post(api_server, path, body, 400)["error"]["param"] == param


# ---- tools ------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_follow_their_schemas(api_server, choice):
    """A forced call on the random tiny model: the grammar keeps it in GLM's format, so it
    ends with a stop token, parses, and its arguments follow the tool's schema."""
    client = api_server.client()
    tool_choice = {"type": "function", "function": {"name": "set_alarm"}} if choice == "named" else "required"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                       parallel_tool_calls=False, max_tokens=ROOM, temperature=0,
                                       extra_body=NO_THINKING)
    c = r.choices[0]
    # As OpenAI and vLLM: a named tool_choice ends with "stop", a required one with "tool_calls".
    assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), c
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert choice == "required" or call.function.name == "set_alarm"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    # Streamed: OpenAI's tool-call deltas join to the same call.
    name, arguments, reasons = None, "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                                parallel_tool_calls=False, max_tokens=ROOM, temperature=0,
                                                stream=True, extra_body=NO_THINKING):
        delta = chunk.choices[0].delta
        for entry in delta.tool_calls or []:
            assert entry.index == 0
            name = name or entry.function.name
            arguments += entry.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (name, arguments) == (call.function.name, call.function.arguments)
    assert reasons[-1] == c.finish_reason and not any(reasons[:-1])


@pytest.mark.timeout(240)
def test_auto_tool_calls_are_parsed_and_results_rendered_back(api_server, tok):
    """tool_choice auto (--enable-auto-tool-choice): the answer is the glm45 parser's reading
    of the raw text; a conversation with the call and its result renders back in GLM's format."""
    client = api_server.client()
    start = tok.token_to_id("<tool_call>")
    sampling = dict(max_tokens=24, temperature=1.0, seed=8, logit_bias={str(start): 4.0})
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, extra_body=NO_THINKING, **sampling)
    raw = raw_completion(api_server, ASK, kwargs={"enable_thinking": False}, tools=TOOLS, **sampling)
    assert "<tool_call>" in raw  # the bias made the random model call (a seed that does)
    want = parse_answer(raw, tools=TOOLS)
    got = r.choices[0].message
    assert got.content == want["content"]
    assert [(t.function.name, t.function.arguments) for t in got.tool_calls or []] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in want.get("tool_calls", [])]
    assert r.choices[0].finish_reason in ("length", "tool_calls" if want.get("tool_calls") else "stop")

    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    rendered = tok.decode(post(api_server, "/tokenize", {"messages": history, "tools": TOOLS})["tokens"], False)
    for piece in ("<tool_call>get_weather", "<arg_key>city</arg_key>", "<arg_value>Oslo</arg_value>",
                  "<arg_key>days</arg_key>", "<arg_value>3</arg_value>", "<|observation|>",
                  '<tool_response>\n{"sky": "clear"}\n</tool_response>'):
        assert piece in rendered, (piece, rendered)
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0,
                                       extra_body=NO_THINKING)
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(
        [*ASK, {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]}, history[2]],
        enable_thinking=False, tools=TOOLS)))


# ---- structured output -------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_json_schema_and_json_object_answers(api_server):
    client = api_server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person, please."}], max_tokens=ROOM, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any object."}],
                                       max_tokens=ROOM, temperature=0, response_format={"type": "json_object"},
                                       extra_body=NO_THINKING)
    if r.choices[0].finish_reason == "stop":  # an unbounded grammar: it may use all its room
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.timeout(240)
def test_vllm_and_sglang_structured_output_fields(api_server, tok):
    """vLLM's structured_outputs and guided_* fields, SGLang's regex, and response_format on
    completions, as their users send them (extra_body), on both endpoints: each answer
    checked by Python's re, the choice list or jsonschema; conflicting or unknown options
    are 400s naming the field."""
    srv, client = api_server, api_server.client()
    r = client.completions.create(model=MODEL, prompt="Sentiment:", max_tokens=ROOM, temperature=1.0, seed=3, n=3,
                                  extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}})
    assert [(c.text in ("positive", "negative", "neutral"), c.finish_reason) for c in r.choices] == [(True, "stop")] * 3
    ids = tok.encode("Code:", add_special_tokens=True)  # token ids: the request skips the inline path for its grammar
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=ROOM, temperature=1.0, seed=4,
                                  extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{2,3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,3}", r.choices[0].text) and r.choices[0].finish_reason == "stop", r
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=ROOM, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=ROOM, temperature=0,
                                       extra_body={**NO_THINKING, "guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=ROOM, temperature=1.0, seed=5,
                                       extra_body={**NO_THINKING, "regex": r"(sunny|rainy), [0-9]{1,2}C"})
    assert re.fullmatch(r"(sunny|rainy), [0-9]{1,2}C", r.choices[0].message.content), r
    refused = [
        (_complete, {"structured_outputs": {"regex": "a+"}, "guided_regex": "b+"}, "guided_regex"),
        (_complete, {"structured_outputs": {"regex": "a+", "choice": ["x"]}}, "structured_outputs.choice"),
        (_complete, {"structured_outputs": {"regexp": "a+"}}, "structured_outputs.regexp"),
        (_complete, {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        (_complete, {"structured_outputs": {"regex": "a+", "backend": "outlines"}}, "structured_outputs.backend"),
        (_complete, {"structured_outputs": "a+"}, "structured_outputs"),
        (_complete, {"guided_choice": "abc"}, "guided_choice"), (_complete, {"guided_regex": "("}, "guided_regex"),
        (_complete, {"guided_json": {"type": "bogus"}}, "guided_json"),
        (_complete, {"guided_regex": "a+", "guided_decoding_backend": "lm-format-enforcer"}, "guided_decoding_backend"),
        (_complete, {"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (_complete, {"response_format": {"type": "xml"}}, "response_format.type"),
        (_chat, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        (_chat, {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["x"]}},
         "structured_outputs.choice"),
    ]
    # vLLM's other fields this server does not serve: refused unless they ask for nothing
    refused += [(_complete, {name: value}, name) for name, value in [
        ("use_beam_search", True), ("length_penalty", 0.5), ("truncate_prompt_tokens", 4), ("prompt_logprobs", 1),
        ("allowed_token_ids", [5, 6]), ("bad_words", ["sea"]), ("add_special_tokens", False), ("priority", 1),
        ("cache_salt", "tenant-a"), ("return_tokens_as_token_ids", True), ("spaces_between_special_tokens", False)]]
    refused += [(_chat, {name: value}, name) for name, value in [
        ("add_special_tokens", True), ("add_generation_prompt", False), ("continue_final_message", True),
        ("chat_template", "{{ messages }}"), ("echo", True), ("documents", [{"text": "x"}])]]
    for body in ({"use_beam_search": False, "add_special_tokens": True, "bad_words": [], "priority": 0},):
        _complete(srv, **body)
    _chat(srv, add_generation_prompt=True, add_special_tokens=False, echo=False, continue_final_message=False)
    _assert_refused(srv, refused)


# ---- reasoning ---------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_reasoning_content_streamed_and_not(api_server, tok):
    """The prompt opens the think block (the template's `prefill`); `</think>` is pushed up
    by a logit bias, so the random answer closes it: reasoning_content is the raw text before
    it, content the rest (the separating newlines dropped)."""
    client = api_server.client()
    kwargs = {"prefill": "<think>"}
    sampling = dict(max_tokens=24, temperature=1.0, seed=11, logit_bias={str(tok.token_to_id("</think>")): 6.0})
    raw = raw_completion(api_server, ASK, kwargs=kwargs, **sampling)
    assert "</think>" in raw, raw
    reasoning, content = raw.split("</think>", 1)
    r = client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": kwargs},
                                       **sampling)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (reasoning or None, content.lstrip("\n") or None)
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                extra_body={"chat_template_kwargs": kwargs}, **sampling):
        delta = chunk.choices[0].delta
        for key in parts:
            parts[key] += getattr(delta, key, None) or ""
    assert parts == {"reasoning_content": reasoning, "content": content.lstrip("\n")}


# ---- logprobs, n, streaming ---------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_logprobs_and_n(api_server):
    client = api_server.client()
    # Once first, so that this prompt's full blocks are in the prefix cache for both requests
    # compared below: a cached prefix changes how the rest is chunked, and so the fp32 rounding
    # of the logprobs (by 1e-6 when only the second request found it cached, as when this test
    # runs alone).
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0, extra_body=NO_THINKING)
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, extra_body=NO_THINKING)
    entries = greedy.choices[0].logprobs.content
    assert len(entries) == greedy.usage.completion_tokens == 6
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the best
        assert e.bytes == list(e.token.encode("utf-8"))
    # The same tokens through /v1/completions (legacy shape) carry the same logprobs.
    ids = post(api_server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    legacy = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=6, temperature=0,
                                       logprobs=3).choices[0].logprobs
    assert legacy.tokens == [e.token for e in entries]
    assert legacy.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-6)
    assert all(len(top) in (3, 4) and top[tok] == lp for top, tok, lp in
               zip(legacy.top_logprobs, legacy.tokens, legacy.token_logprobs))
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(6)]

    kwargs = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=1.0, seed=5, n=2, logprobs=True,
                  extra_body=NO_THINKING)
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert a.choices[0].message.content != a.choices[1].message.content  # two draws, not one twice
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)
    assert all(c.logprobs.content[0].top_logprobs == [] for c in a.choices)  # top_logprobs defaults to 0
    # n with several prompts (completions): choice i * n + j answers prompt i.
    r = client.completions.create(model=MODEL, prompt=["The lighthouse", "A river"], n=2, max_tokens=3, seed=1,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 12
    alone = client.completions.create(model=MODEL, prompt="A river", max_tokens=3, seed=1, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[2].text == alone.choices[0].text


@pytest.mark.timeout(240)
def test_streamed_chat_with_usage(api_server):
    client = api_server.client()
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=10, temperature=0, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


# ---- every documented request field: honoured, or refused with 400 naming it --------------------
def _assert_refused(srv, refused: list) -> None:
    """Each ``(call, body, param)`` is a 400 whose error names ``param`` and says why."""
    wrong = []
    for call, body, param in refused:
        error = call(srv, 400, **body)["error"]
        if error["param"] != param or not error["message"]:
            wrong.append((body, error))
    assert not wrong, wrong


def _complete(srv, status=200, **body):
    body = {"model": MODEL, "prompt": "The lighthouse stands", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True, **body}
    return post(srv, "/v1/completions", body, status)


def _chat(srv, status=200, **body):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0, **NO_THINKING, **body}
    return post(srv, "/v1/chat/completions", body, status)


@pytest.mark.timeout(300)
def test_every_documented_field_is_honoured_or_refused(api_server, tok):
    srv = api_server
    base = _complete(srv, ignore_eos=True)["choices"][0]
    ids = base["token_ids"]
    # Sampling fields that must reduce to greedy, and ones that must change the draw.
    for extra in ({"temperature": 1.0, "top_k": 1, "seed": 3}, {"temperature": 1.0, "top_p": 1e-9, "seed": 3},
                  {"temperature": 1.0, "min_p": 1.0, "seed": 3}):
        assert _complete(srv, ignore_eos=True, **extra)["choices"][0]["token_ids"] == ids, extra
    assert _complete(srv, ignore_eos=True, logit_bias={"77": 100})["choices"][0]["token_ids"] == [77] * 6
    for extra in ({"repetition_penalty": 3.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        long = _complete(srv, ignore_eos=True, max_tokens=24)["choices"][0]["token_ids"]
        penalized = _complete(srv, ignore_eos=True, max_tokens=24, **extra)["choices"][0]["token_ids"]
        assert penalized != long, extra  # the random model repeats itself within 24 tokens
    # min_tokens holds stop_token_ids (and EOS) back; stop_token_ids ends the answer.
    first = ids[0]
    stopped = _complete(srv, stop_token_ids=[first])["choices"][0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = _complete(srv, stop_token_ids=[first], min_tokens=3)["choices"][0]
    assert len(held["token_ids"]) >= 3 and first not in held["token_ids"][:3]
    # Stop strings, kept or not; special tokens shown or not.
    text = base["text"]
    stop = text[2:4]
    assert _complete(srv, ignore_eos=True, stop=[stop])["choices"][0]["text"] == text[:text.index(stop)]
    kept = _complete(srv, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == text[:text.index(stop) + len(stop)]
    special = tok.token_to_id("[gMASK]")
    shown = _complete(srv, ignore_eos=True, max_tokens=2, logit_bias={str(special): 100}, skip_special_tokens=False)
    assert shown["choices"][0]["text"] == "[gMASK][gMASK]"
    assert _complete(srv, ignore_eos=True, max_tokens=2, logit_bias={str(special): 100})["choices"][0]["text"] == ""
    # Chat: max_completion_tokens, user, response_format text, modalities text.
    r = _chat(srv, max_completion_tokens=3, user="someone", response_format={"type": "text"}, modalities=["text"],
              ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 3
    # echo with logprobs: the prompt first, its first token without a logprob.
    echoed = _complete(srv, echo=True, logprobs=0, max_tokens=2)["choices"][0]
    n_prompt = len(tok.encode("The lighthouse stands", add_special_tokens=True))
    assert echoed["text"].startswith("The lighthouse stands") and echoed["logprobs"]["token_logprobs"][0] is None
    assert len(echoed["logprobs"]["tokens"]) == n_prompt + 2

    refused = [
        (_complete, {"n": 0}, "n"), (_complete, {"best_of": 2}, "best_of"), (_complete, {"suffix": "x"}, "suffix"),
        (_complete, {"logprobs": 21}, "logprobs"), (_complete, {"echo": "yes"}, "echo"),
        (_complete, {"top_k": -2}, "top_k"), (_complete, {"min_p": 1.5}, "min_p"),
        (_complete, {"repetition_penalty": 0}, "repetition_penalty"),
        (_complete, {"presence_penalty": 2.5}, "presence_penalty"),
        (_complete, {"frequency_penalty": -3}, "frequency_penalty"),
        (_complete, {"min_tokens": 7}, "min_tokens"), (_complete, {"logit_bias": {"x": 1}}, "logit_bias"),
        (_complete, {"logit_bias": {"5": 101}}, "logit_bias"), (_complete, {"logit_bias": {"5000": 1}}, "logit_bias"),
        (_complete, {"stop_token_ids": ["a"]}, "stop_token_ids.0"), (_complete, {"seed": -1}, "seed"),
        (_complete, {"stream_options": {"include_usage": True}}, "stream_options"),
        (_complete, {"skip_special_tokens": 1}, "skip_special_tokens"), (_complete, {"prompt": ["a", ""]}, "prompt.1"),
        (_chat, {"functions": [{"name": "f"}]}, "functions"), (_chat, {"function_call": "auto"}, "function_call"),
        (_chat, {"audio": {"voice": "x"}}, "audio"), (_chat, {"prediction": {"type": "content"}}, "prediction"),
        (_chat, {"web_search_options": {}}, "web_search_options"), (_chat, {"modalities": ["audio"]}, "modalities"),
        (_chat, {"top_logprobs": 2}, "top_logprobs"), (_chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (_chat, {"response_format": {"type": "xml"}}, "response_format.type"),
        (_chat, {"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
         "response_format.json_schema"),
        (_chat, {"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        (_chat, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (_chat, {"tool_choice": "required"}, "tool_choice"),
        (_chat, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        (_chat, {"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (_chat, {"messages": [{"role": "user"}]}, "messages.0.content"),
        (_chat, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ]
    _assert_refused(srv, refused)
    # Still serving.
    assert _complete(srv)["choices"][0]["finish_reason"] in ("stop", "length")
    access = [line for line in srv.output().splitlines() if "glm_fused.access" in line]
    assert any('"POST /v1/completions" 200' in line and "completion_tokens=" in line for line in access)
    assert any('"POST /v1/chat/completions" 400' in line for line in access)
