"""The glm45 tool-call parser on recorded GLM-format answers: whole, and streamed in pieces of
every length 1..N, the streamed deltas accumulated by the official ``openai`` package's own
stream accumulator (an independent reader of OpenAI's delta shape)."""

from __future__ import annotations

import itertools
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from glm_fused.server.tool_parser import Glm45ToolParser, typed_value


def parse_tool_calls(text: str, tools: list[dict] | None, make_id) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole answer fed in one piece, ``tool_calls`` in OpenAI's
    message shape."""
    parser = Glm45ToolParser(tools, make_id)
    parser.feed(text)
    parser.finish()
    content, calls = parser.result()
    return content, [c.to_openai() for c in calls]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
            "hourly": {"type": "boolean"}, "options": {"type": "object"}, "hours": {"type": "array"},
            "note": {"type": ["string", "null"]}, "unit": {"enum": ["c", "f"]},
            "code": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "free": {}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}},
]

# Recorded answers in GLM-4.5's format (as its chat template renders calls): (text, content, calls)
# with calls as (name, arguments dict).
ANSWERS = [
    ("\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     None, [("get_weather", {"city": "Oslo", "days": 3})]),
    ("I'll check the weather for you.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Paris, France</arg_value>\n</tool_call>",
     "I'll check the weather for you.", [("get_weather", {"city": "Paris, France"})]),
    # Two calls in one answer.
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>\n"
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bergen</arg_value>\n</tool_call>",
     None, [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]),
    # No arguments, with and without the newline.
    ("<tool_call>get_time\n</tool_call>", None, [("get_time", {})]),
    ("<tool_call>get_time</tool_call>\n", None, [("get_time", {})]),
    # GLM-4.7's compact form (no separators).
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>days</arg_key>"
     "<arg_value>2</arg_value></tool_call>", None, [("get_weather", {"city": "Rome", "days": 2})]),
    # Values typed from the schema.
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value> 7 </arg_value>\n<arg_key>scale</arg_key>\n<arg_value>2.5</arg_value>\n"
     "<arg_key>hourly</arg_key>\n<arg_value>true</arg_value>\n"
     "<arg_key>options</arg_key>\n<arg_value>{\"unit\": \"c\", \"n\": [1, 2]}</arg_value>\n"
     "<arg_key>hours</arg_key>\n<arg_value>[6, 12]</arg_value>\n<arg_key>note</arg_key>\n<arg_value>true</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>f</arg_value>\n<arg_key>code</arg_key>\n<arg_value>null</arg_value>\n"
     "<arg_key>free</arg_key>\n<arg_value>{\"x\": false}</arg_value>\n</tool_call>",
     None, [("get_weather", {"city": "123", "days": 7, "scale": 2.5, "hourly": True,
                             "options": {"unit": "c", "n": [1, 2]}, "hours": [6, 12], "note": "true",
                             "unit": "f", "code": None, "free": {"x": False}})]),
    # Python-style literals, an integral float for an integer, text that is not a declared type.
    ("<tool_call>get_weather\n<arg_key>hourly</arg_key>\n<arg_value>False</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>4.0</arg_value>\n<arg_key>scale</arg_key>\n<arg_value>big</arg_value>\n"
     "</tool_call>", None, [("get_weather", {"hourly": False, "days": 4, "scale": "big"})]),
    # String values keep quotes, backslashes, newlines, markup and non-ASCII exactly.
    ("Writing it now.\n\n<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>C:\\tmp\\a \"b\".txt</arg_value>\n"
     "<arg_key>text</arg_key>\n<arg_value>  line 1\n\tline <2> & </b>\nnaïve 🙂\n</arg_value>\n</tool_call>",
     "Writing it now.",
     [("write_file", {"path": "C:\\tmp\\a \"b\".txt", "text": "  line 1\n\tline <2> & </b>\nnaïve 🙂\n"})]),
    # An unknown tool: values read as JSON where they are JSON.
    ("<tool_call>lookup\n<arg_key>id</arg_key>\n<arg_value>42</arg_value>\n<arg_key>q</arg_key>\n"
     "<arg_value>forty two</arg_value>\n</tool_call>", None, [("lookup", {"id": 42, "q": "forty two"})]),
    # Text between and after calls.
    ("First <tool_call>get_time</tool_call> then\n<tool_call>get_time</tool_call> done.\n",
     "First then\ndone.", [("get_time", {}), ("get_time", {})]),
    # Cut off by max_tokens: closed with what it has.
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Os", None, [("get_weather", {"city": "Os"})]),
    ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>1", None, [("get_weather", {"days": 1})]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>da", None,
     [("get_weather", {"city": "Oslo"})]),
    ("<tool_call>get_wea", None, [("get_wea", {})]),
    # No calls: the text passes through unchanged, tag-like text included.
    ("The answer is 4.\n", "The answer is 4.\n", []),
    ("  a < b and <tool_cal", "  a < b and <tool_cal", []),
    ("Use the <tool_response> tag.", "Use the <tool_response> tag.", []),
]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def expected_message(content, calls):
    return content, [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                     for i, (n, a) in enumerate(calls)]


def as_dicts(tool_calls):
    """Arguments parsed: the JSON text must be valid, and hold these values."""
    return [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in tool_calls]


@pytest.mark.parametrize("text,content,calls", ANSWERS)
def test_whole_answer(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, TOOLS, make_id=ids())
    assert (got_content, as_dicts(got_calls)) == expected_message(content, calls)


def stream_through_openai(text: str, size: int):
    """Feed pieces of ``size`` characters; hand each delta to openai's stream accumulator as a
    chat chunk; return (final message, the raw entries) after checking each entry's shape."""
    parser = Glm45ToolParser(TOOLS, make_id=ids())
    state = ChatCompletionStreamState()
    entries, seen = [], set()

    def chunk(delta: dict, finish: str | None = None) -> None:
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))

    chunk({"role": "assistant", "content": ""})
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        indexes = [e["index"] for e in out.tool_calls]
        assert len(indexes) == len(set(indexes)), "one entry per call in a delta"
        for e in out.tool_calls:
            if e["index"] in seen:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                assert e["function"]["arguments"], "no empty fragments"
            else:
                assert e["index"] == len(seen), "calls open in order"
                assert set(e) == {"index", "id", "type", "function"} and e["type"] == "function"
                assert isinstance(e["function"]["name"], str)
                seen.add(e["index"])
            entries.append(e)
        delta = {}
        if out.content:
            delta["content"] = out.content
        if out.tool_calls:
            delta["tool_calls"] = out.tool_calls
        if delta:
            chunk(delta)
    chunk({}, "tool_calls" if seen else "stop")
    return state.get_final_completion().choices[0].message, parser


@pytest.mark.parametrize("text,content,calls", ANSWERS)
def test_streamed_in_pieces_of_every_length(text, content, calls):
    want_content, want_calls = expected_message(content, calls)
    whole_content, whole_calls = parse_tool_calls(text, TOOLS, make_id=ids())
    for size in range(1, len(text) + 1):
        message, parser = stream_through_openai(text, size)
        got_calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                     for c in message.tool_calls or []]
        assert got_calls == whole_calls, size  # the same arguments text as the whole answer
        assert as_dicts(got_calls) == want_calls, size
        assert (message.content or None) == want_content, size
        assert parser.result()[0] == whole_content


def test_string_values_stream_before_the_value_ends():
    parser = Glm45ToolParser(TOOLS, make_id=ids())
    first = parser.feed("<tool_call>write_file\n<arg_key>text</arg_key>\n<arg_value>Once upon")
    assert first.tool_calls[0]["function"] == {"name": "write_file", "arguments": '{"text": "Once upon'}
    more = parser.feed(" a time</arg_val")
    assert more.tool_calls == [{"index": 0, "function": {"arguments": " a time"}}]
    end = parser.feed("ue>\n</tool_call>")
    assert end.tool_calls == [{"index": 0, "function": {"arguments": '"}'}}]
    assert json.loads(parser.calls[0].arguments) == {"text": "Once upon a time"}


def test_typed_value_rules():
    assert typed_value("5", {"type": "integer"}) == 5
    assert typed_value("5", {"type": "string"}) == "5"
    assert typed_value(" 5 ", {"type": "string"}) == " 5 "
    assert typed_value("5", {}) == 5 and typed_value("five", {}) == "five"
    assert typed_value("5.5", {"type": "integer"}) == "5.5"
    assert typed_value("3", {"type": "number"}) == 3
    assert typed_value("None", {"type": "null"}) is None
    assert typed_value('"x"', {"type": ["integer", "string"]}) == "x"
    assert typed_value("[1]", {"type": "object"}) == "[1]"
