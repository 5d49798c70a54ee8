"""The ``glm45`` tool-call parser: GLM-4.5's own call format to OpenAI ``tool_calls``, for a
whole answer and piece by piece while streaming (pieces of any length; tags split anywhere).

The format, as GLM-4.5's chat template renders a call (and the model writes one)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name ends at the first newline or ``<arg_key>``; whitespace between the parts is free
(GLM-4.7 writes none). Each value becomes JSON typed from the tool's parameter schema, as
vLLM's ``glm45`` parser does: a property declared ``string`` keeps its text exactly; any
other value is read as JSON (``3`` -> 3, ``true``, ``{"a": 1}``, ``[1, 2]``; Python's
``True``/``False``/``None`` too) when it is a JSON value of a declared type, else kept as text.

Streaming follows OpenAI's tool-call deltas: a call's first entry carries ``index``, ``id``,
``type`` and ``function.name`` (``arguments`` '' or its first fragment), later entries
``index`` and an ``arguments`` fragment; the fragments of a call join to exactly the
``arguments`` string the whole answer gives (always valid JSON). String values stream as they
arrive; other values when complete. Text outside calls is content; whitespace around calls
is dropped (the template's separators), so text without calls passes through unchanged.
A call cut off by ``max_tokens`` is closed with what it has (its ``arguments`` stay valid
JSON; ``finish_reason`` says ``length``).

Hand-written: the format is GLM's own; no library parses it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from glm_fused.server.reasoning import partial_tag

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
_WS = " \t\r\n"

# Parser states.
_TEXT, _NAME, _ARGS, _KEY, _BEFORE_VALUE, _VALUE = "text", "name", "args", "key", "before_value", "value"
_PY_LITERALS = {"True": True, "False": False, "None": None}
_MISSING = object()


def new_call_id() -> str:
    """An id in OpenAI's shape (``call_`` + 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


# ---- values typed from the tool's JSON schema ------------------------------------------------
def declared_types(schema: Any) -> set[str]:
    """JSON types a property schema allows; empty when it does not say (any type)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_json_type(v) for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            parts = [declared_types(s) for s in schema[key]]
            return set() if not all(parts) else set().union(*parts)
    return set()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def is_string_property(schema: Any) -> bool:
    types = declared_types(schema)
    return bool(types) and types <= {"string"}


def typed_value(text: str, schema: Any) -> Any:
    """The JSON value of one ``<arg_value>`` text for a property with this schema."""
    types = declared_types(schema)
    if types and types <= {"string"}:
        return text
    stripped = text.strip()
    try:
        value = json.loads(stripped)
    except ValueError:
        value = _PY_LITERALS.get(stripped, _MISSING)
    if value is _MISSING:
        return text
    kind = _json_type(value)
    if not types or kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and float(value).is_integer():
        return int(value)
    return text  # not a value of a declared type: what the model wrote, as text


# ---- results ---------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """What one ``feed``/``finish`` call adds: content text and OpenAI tool-call delta entries
    (at most one entry per call index)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of ``tags`` occurs in ``text`` (-1, None if none does)."""
    hits = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(hits) if hits else (-1, None)


class Glm45ToolParser:
    """Parses one answer's calls; feed its text in order, then call ``finish`` once.

    ``tools``: the request's OpenAI ``tools`` list (for the parameter schemas)."""

    def __init__(self, tools: list[dict] | None = None, make_id: Callable[[], str] = new_call_id):
        self._schemas: dict[str, dict] = {}
        for tool in tools or []:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self._schemas[fn["name"]] = params if isinstance(params, dict) else {}
        self._make_id = make_id
        self.calls: list[ToolCall] = []
        self.content = ""
        self._state = _TEXT
        self._held = ""         # text that may be the beginning of a tag
        self._ws = ""           # whitespace after the last content: shown only if text follows
        self._after_call = False
        self._acc = ""          # the name, key or value being read
        self._key = ""
        self._string_value = False
        self._value_schema: Any = None
        self._nargs = 0
        self._out: ToolDelta | None = None

    # ---- public --------------------------------------------------------------------------
    def feed(self, text: str) -> ToolDelta:
        self._out = ToolDelta()
        buf, self._held = self._held + text, ""
        while buf:
            buf = getattr(self, "_in_" + self._state)(buf)
        return self._take()

    def finish(self) -> ToolDelta:
        """The end of the answer: held text is what it is; a call cut off is closed."""
        self._out = ToolDelta()
        held, self._held = self._held, ""
        if self._state == _TEXT:
            if held:
                self._content(held)
            if not self.calls:
                self._show(self._ws)  # no calls: the text passes through unchanged
            self._ws = ""
        else:
            self._acc += held
            if self._state == _NAME:
                if self._acc.strip():
                    self._open_call()
                    self._close_call()
            elif self._state == _VALUE:
                self._close_value()
                self._close_call()
            else:  # between pairs, or a key without its value: drop the key
                self._close_call()
            self._state = _TEXT
        return self._take()

    def result(self) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``; content ``None`` when empty (or only whitespace beside calls)."""
        content = self.content if self.content and (self.content.strip() or not self.calls) else None
        return content, self.calls

    # ---- states: each reads from the front of buf and returns what is left ----------------
    def _in_text(self, buf: str) -> str:
        i = buf.find(TOOL_START)
        if i < 0:
            keep = partial_tag(buf, (TOOL_START,))
            self._content(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ""
        self._content(buf[:i])
        self._state, self._acc = _NAME, ""
        return buf[i + len(TOOL_START):]

    def _in_name(self, buf: str) -> str:
        i, tag = _first(buf, ("\n", KEY_START, TOOL_END))
        if i < 0:
            return self._hold(buf, (KEY_START, TOOL_END))
        self._acc += buf[:i]
        self._open_call()
        if tag == TOOL_END:
            self._close_call()
            return buf[i + len(tag):]
        self._state = _ARGS
        return buf[i + (1 if tag == "\n" else 0):]

    def _in_args(self, buf: str) -> str:
        i, tag = _first(buf, (KEY_START, TOOL_END))
        if i < 0:  # whitespace (or stray text) between pairs
            keep = partial_tag(buf, (KEY_START, TOOL_END))
            self._held = buf[len(buf) - keep:]
            return ""
        if tag == TOOL_END:
            self._close_call()
        else:
            self._state, self._acc = _KEY, ""
        return buf[i + len(tag):]

    def _in_key(self, buf: str) -> str:
        i, tag = _first(buf, (KEY_END, TOOL_END))
        if i < 0:
            return self._hold(buf, (KEY_END, TOOL_END))
        self._acc += buf[:i]
        if tag == TOOL_END:  # a key without a value
            self._close_call()
        else:
            self._key, self._state = self._acc.strip(), _BEFORE_VALUE
        return buf[i + len(tag):]

    def _in_before_value(self, buf: str) -> str:
        i, tag = _first(buf, (VALUE_START, KEY_START, TOOL_END))
        if i < 0:
            keep = partial_tag(buf, (VALUE_START, KEY_START, TOOL_END))
            self._held = buf[len(buf) - keep:]
            return ""
        if tag == VALUE_START:
            self._open_value()
        elif tag == KEY_START:  # a key without a value: the next pair starts
            self._state, self._acc = _KEY, ""
        else:
            self._close_call()
        return buf[i + len(tag):]

    def _in_value(self, buf: str) -> str:
        i, tag = _first(buf, (VALUE_END, TOOL_END))
        if i < 0:
            keep = partial_tag(buf, (VALUE_END, TOOL_END))
            self._value_text(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ""
        self._value_text(buf[:i])
        self._close_value()
        if tag == TOOL_END:
            self._close_call()
        else:
            self._state = _ARGS
        return buf[i + len(tag):]

    # ---- helpers ---------------------------------------------------------------------------
    def _hold(self, buf: str, tags: tuple[str, ...]) -> str:
        keep = partial_tag(buf, tags)
        self._acc += buf[:len(buf) - keep]
        self._held = buf[len(buf) - keep:]
        return ""

    def _content(self, text: str) -> None:
        """Content outside calls. Whitespace that ends it waits to see what follows: more
        text shows it; a call drops it, unless text follows the call too (then it joins the
        two sides, and the whitespace right after the call goes)."""
        body = text.rstrip(_WS)
        if self._after_call:
            body = body.lstrip(_WS)
            if not body:
                return
            shown = (self._ws if self.content else "") + body
            self._after_call = False
        elif not body:
            self._ws += text
            return
        else:
            shown = self._ws + body
        self._show(shown)
        self._ws = text[len(text.rstrip(_WS)):]

    def _show(self, text: str) -> None:
        if text:
            self._out.content += text
            self.content += text

    def _open_call(self) -> None:
        call = ToolCall(self._make_id(), self._acc.strip())
        self.calls.append(call)
        self._nargs = 0
        self._out.tool_calls.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": ""}})

    def _args(self, text: str) -> None:
        """Append to the current call's arguments (and to this delta's entry for it)."""
        index = len(self.calls) - 1
        self.calls[index].arguments += text
        entries = self._out.tool_calls
        if entries and entries[-1]["index"] == index:
            entries[-1]["function"]["arguments"] += text
        else:
            entries.append({"index": index, "function": {"arguments": text}})

    def _key_json(self) -> str:
        return ("{" if self._nargs == 0 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": "

    def _open_value(self) -> None:
        schema = self._schemas.get(self.calls[-1].name, {}).get("properties", {})
        schema = schema.get(self._key) if isinstance(schema, dict) else None
        self._string_value = is_string_property(schema)
        self._value_schema = schema
        self._state, self._acc = _VALUE, ""
        if self._string_value:  # streams as it arrives
            self._args(self._key_json() + '"')
            self._nargs += 1

    def _value_text(self, text: str) -> None:
        if not text:
            return
        if self._string_value:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])  # escaping is per character
        else:
            self._acc += text

    def _close_value(self) -> None:
        if self._string_value:
            self._args('"')
        else:
            value = typed_value(self._acc, self._value_schema)
            self._args(self._key_json() + json.dumps(value, ensure_ascii=False))
            self._nargs += 1
        self._acc = ""

    def _close_call(self) -> None:
        self._args("{}" if self._nargs == 0 else "}")
        self._state, self._after_call = _TEXT, True

    def _take(self) -> ToolDelta:
        out, self._out = self._out, None
        return out
