"""Chat requests through GLM's template (tools, tool calls, tool results, developer role,
refusals) checked against transformers' own rendering, and answers parsed into assistant
messages (reasoning + tool calls), streamed in pieces of every length and whole."""

from __future__ import annotations

import itertools
import json

import pytest

from glm_fused import tiny
from glm_fused.engine.sampling import InvalidParam
from glm_fused.server.chat import (ChatOutputParser, check_tools, prepare_messages, render_prompt,
                                   resolve_tool_choice)
from glm_fused.server.tool_parser import new_call_id
from glm_fused.tokenizer import Tokenizer
from test_tool_parser import parse_tool_calls


def parse_answer(text: str, prompt: str = "", *, reasoning: bool = False, tools: list[dict] | None = None,
                 make_id=new_call_id) -> dict:
    """The assistant message of a whole answer fed in one piece (``ChatOutputParser``)."""
    parser = ChatOutputParser(prompt, reasoning=reasoning, tools=tools, make_id=make_id)
    parser.feed(text)
    parser.finish()
    return parser.message()

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city — any city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "options": {"type": "object"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

CONVERSATION = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo "},
                                 {"type": "text", "text": "and time?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "Two tools.",
     "tool_calls": [
         {"id": "call_a", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2, "options": {"u": "c"}}'}},
         {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": -3}'},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "12:00"}]},
]


@pytest.fixture(scope="module")
def tiny_dir():
    return tiny.ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer(tiny_dir)


def test_prompt_renders_tools_calls_and_results_in_glm_format(tok):
    prompt = render_prompt(tok, CONVERSATION, TOOLS, enable_thinking=False)
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) + "\n" in prompt
    assert "<|system|>\nAnswer briefly.<|user|>\nWeather in Oslo and time?/nothink" in prompt
    assert ("<|assistant|>\n<think>Two tools.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
            "<arg_key>options</arg_key>\n<arg_value>{\"u\": \"c\"}</arg_value>\n</tool_call>\n"
            "<tool_call>get_time\n</tool_call>") in prompt
    assert prompt.endswith("<|observation|>\n<tool_response>\n{\"temp\": -3}\n</tool_response>\n"
                           "<tool_response>\n12:00\n</tool_response><|assistant|>\n<think></think>")


@pytest.mark.parametrize("thinking", [True, False])
def test_prompt_matches_transformers_rendering(tiny_dir, tok, thinking):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_dir)
    theirs = ref.apply_chat_template(prepare_messages(CONVERSATION), tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True, enable_thinking=thinking)
    assert render_prompt(tok, CONVERSATION, TOOLS, enable_thinking=thinking) == theirs


def test_rendered_calls_parse_back_to_the_same_arguments(tok):
    history = tok.apply_chat_template(prepare_messages(CONVERSATION[:3]), add_generation_prompt=False)
    answer = history.split("</think>", 1)[1]
    counter = itertools.count()
    content, calls = parse_tool_calls(answer, TOOLS, make_id=lambda: f"c{next(counter)}")
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2, "options": {"u": "c"}}), ("get_time", {})]


def test_prepare_messages_shapes_and_refuses():
    prepared = prepare_messages(CONVERSATION)
    assert [m["role"] for m in prepared] == ["system", "user", "assistant", "tool", "tool"]
    assert prepared[2]["content"] == "" and prepared[2]["tool_calls"][0]["function"]["arguments"]["days"] == 2
    assert prepared[4]["content"] == "12:00"
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # input untouched
    assert prepare_messages([{"role": "observation", "content": "x"}])[0]["role"] == "tool"
    bad = [
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "system"}], "messages.0.content"),
        ([{"role": "user", "content": "q"}, {"role": "tool"}], "messages.1.content"),
        ([{"role": "assistant"}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages.0.content.0"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
         "messages.0.tool_calls.0.function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
         "messages.0.tool_calls.0.function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
         "messages.0.tool_calls.0.function"),
        ([{"role": "narrator", "content": "x"}], "messages.0.role"),
    ]
    for messages, param in bad:
        with pytest.raises(InvalidParam) as err:
            prepare_messages(messages)
        assert err.value.param == param, messages
        assert param in str(err.value)


def test_tools_and_tool_choice():
    assert check_tools(None) == [] and check_tools(TOOLS) is TOOLS
    assert resolve_tool_choice(None, TOOLS) == ("auto", None)
    assert resolve_tool_choice(None, []) == ("none", None)
    assert resolve_tool_choice("required", TOOLS) == ("required", None)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert resolve_tool_choice(named, TOOLS) == ("named", "get_time")
    for tools, param in [([{"type": "code_interpreter"}], "tools.0.type"),
                         ([{"type": "function"}], "tools.0.function.name"),
                         ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                          "tools.0.function.parameters"),
                         (TOOLS + TOOLS[:1], "tools.2.function.name")]:
        with pytest.raises(InvalidParam) as err:
            check_tools(tools)
        assert err.value.param == param
    for choice, tools in [("required", []), ({"type": "function", "function": {"name": "nope"}}, TOOLS),
                          ("sometimes", TOOLS), ({"type": "function"}, TOOLS)]:
        with pytest.raises(InvalidParam) as err:
            resolve_tool_choice(choice, tools)
        assert err.value.param == "tool_choice"


THINKING_ON = "[gMASK]<sop><|user|>\nWeather?<|assistant|>"
ANSWER = ("\n<think>The user wants the weather.</think>\nLet me look.\n<tool_call>get_weather\n"
          "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
          "<arg_value>2</arg_value>\n</tool_call>")
MESSAGE = {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants the weather.",
           "tool_calls": [{"id": "call_0", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_answer_with_reasoning_and_tools():
    assert parse_answer(ANSWER, THINKING_ON, reasoning=True, tools=TOOLS, make_id=ids()) == MESSAGE
    # Without the reasoning parser the think block stays in the content; without tools no calls.
    plain = parse_answer(ANSWER, THINKING_ON, make_id=ids())
    assert plain == {"role": "assistant", "content": ANSWER}
    only_reasoning = parse_answer(ANSWER, THINKING_ON, reasoning=True)
    assert only_reasoning["reasoning_content"] == "The user wants the weather."
    assert only_reasoning["content"].startswith("Let me look.\n<tool_call>get_weather")
    assert "tool_calls" not in only_reasoning


def test_streamed_answer_of_every_piece_length_adds_up_to_the_message():
    for size in range(1, len(ANSWER) + 1):
        parser = ChatOutputParser(THINKING_ON, reasoning=True, tools=TOOLS, make_id=ids())
        reasoning, content, calls = "", "", {}
        pieces = [ANSWER[i:i + size] for i in range(0, len(ANSWER), size)]
        if size % 2:  # the last piece says it is the last
            deltas = [parser.feed(p) for p in pieces[:-1]] + [parser.feed(pieces[-1], final=True)]
        else:
            deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        for delta in deltas:
            assert set(delta) <= {"reasoning_content", "content", "tool_calls"}
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": entry.get("type"),
                                                         "function": {"name": entry["function"].get("name"),
                                                                      "arguments": ""}})
                call["function"]["arguments"] += entry["function"]["arguments"]
        assert reasoning == MESSAGE["reasoning_content"] and content == MESSAGE["content"], size
        assert list(calls.values()) == MESSAGE["tool_calls"], size
        assert parser.message() == MESSAGE
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_thinking_off_answer_is_content():
    prompt = "[gMASK]<sop><|user|>\nHi/nothink<|assistant|>\n<think></think>"
    assert parse_answer("\nHello there.", prompt, reasoning=True, tools=TOOLS) == {
        "role": "assistant", "content": "Hello there.", "reasoning_content": None}
    parser = ChatOutputParser(prompt, reasoning=True, tools=TOOLS)
    parser.feed("\nHello")
    parser.finish()
    assert parser.finish_reason("stop") == "stop"
