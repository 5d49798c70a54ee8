"""Chat requests in, chat answers out, in GLM-4.5's terms.

In: OpenAI ``messages``, ``tools`` and ``tool_choice`` checked and shaped for the checkpoint's
own Jinja chat template (``prepare_messages``, ``check_tools``, ``resolve_tool_choice``,
``render_prompt``). GLM's template renders ``system``/``user``/``assistant``/``tool`` turns,
the ``tools`` block, and an assistant's ``tool_calls`` only when their ``arguments`` is a
mapping (it loops over ``arguments.items()``); OpenAI clients send ``arguments`` as JSON
text and may use the ``developer`` role, which the template would drop silently. So:
``developer`` becomes ``system``, ``observation`` becomes ``tool``, ``arguments`` text is
parsed into an object, tool results given as text parts are joined, and a message without
the content its role needs is refused (``InvalidParam`` naming the field: a 400).

Out: ``ChatOutputParser`` runs an answer through the ``glm45`` reasoning parser and then the
``glm45`` tool-call parser on its content (as vLLM does), streamed (OpenAI delta fields) or
whole (the assistant message), and says when ``finish_reason`` is ``tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any

from glm_fused.engine.sampling import InvalidParam
from glm_fused.server.reasoning import Glm45ReasoningParser
from glm_fused.server.tool_parser import Glm45ToolParser, new_call_id

_ROLE_ALIASES = {"developer": "system", "observation": "tool"}


def _text(content: Any, param: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise InvalidParam(f"{param}.{j}", f"{param}.{j}: only text parts are supported")
        return "".join(parts)
    raise InvalidParam(param, f"{param} must be a string or a list of text parts")


def _arguments(call: Any, param: str) -> dict:
    """An assistant tool call's arguments as an object (OpenAI sends JSON text)."""
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidParam(f"{param}.arguments", f"{param}.arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise InvalidParam(f"{param}.arguments", f"{param}.arguments must be a JSON object")
    return args


def prepare_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as GLM's chat template reads them (new dicts; input untouched)."""
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = _ROLE_ALIASES.get(message.get("role"), message.get("role"))
        m = {k: v for k, v in message.items() if v is not None}
        m["role"] = role
        content = message.get("content")
        if role in ("system", "user", "tool"):
            if content is None:
                raise InvalidParam(f"{where}.content", f"{where}.content is required for a {message.get('role')} "
                                                       "message")
            m["content"] = _text(content, f"{where}.content")
        elif role == "assistant":
            calls = message.get("tool_calls") or []
            if content is None and not calls:
                raise InvalidParam(f"{where}.content", f"{where}.content is required for an assistant message "
                                                       "without tool_calls")
            m["content"] = "" if content is None else _text(content, f"{where}.content")
            if not isinstance(calls, list):
                raise InvalidParam(f"{where}.tool_calls", f"{where}.tool_calls must be a list")
            shaped = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                param = f"{where}.tool_calls.{j}.function"
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise InvalidParam(param, f"{param} needs a name")
                shaped.append({**call, "function": {"name": fn["name"], "arguments": _arguments(fn, param)}})
            if shaped:
                m["tool_calls"] = shaped
            else:
                m.pop("tool_calls", None)
        else:
            raise InvalidParam(f"{where}.role", f"{where}.role {message.get('role')!r} is not a chat role "
                                                "(system, developer, user, assistant, tool)")
        out.append(m)
    return out


def check_tools(tools: list | None) -> list[dict]:
    """The request's ``tools``: function tools with a name and an object schema."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidParam("tools", "tools must be a list")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidParam(f"{where}.type", f"{where}: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise InvalidParam(f"{where}.function.name", f"{where}.function needs a name")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise InvalidParam(f"{where}.function.parameters",
                               f"{where}.function.parameters must be a JSON schema of type object")
        if fn["name"] in names:
            raise InvalidParam(f"{where}.function.name", f"{where}: two tools are named {fn['name']!r}")
        names.add(fn["name"])
    return tools


def resolve_tool_choice(tool_choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    """``(mode, name)``: mode ``none``, ``auto``, ``required`` or ``named`` (with the name)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidParam("tool_choice", "tool_choice 'required' needs tools")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type", "function") != "function" \
            or not isinstance(fn.get("name"), str):
        raise InvalidParam("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise InvalidParam("tool_choice", f"tool_choice names {fn['name']!r}, which is not in tools")
    return "named", fn["name"]


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                  enable_thinking: bool = True, **template_kwargs: Any) -> str:
    """The generation prompt for a chat request, through the checkpoint's template."""
    return tokenizer.apply_chat_template(prepare_messages(messages), add_generation_prompt=True,
                                         enable_thinking=enable_thinking, tools=tools or None,
                                         **template_kwargs)


class ChatOutputParser:
    """One answer's text to an assistant message: ``reasoning_content`` (with ``reasoning``),
    ``content`` and ``tool_calls`` (with ``tools``: the request's tools, parsed unless
    ``tool_choice`` is ``none``). ``prompt``: the rendered prompt (where thinking starts)."""

    def __init__(self, prompt: str = "", *, reasoning: bool = False, tools: list[dict] | None = None,
                 make_id=new_call_id):
        self._reasoning = Glm45ReasoningParser(prompt) if reasoning else None
        self._tools = Glm45ToolParser(tools, make_id) if tools is not None else None
        self._plain = ""  # content when there is no tool parser

    def feed(self, text: str, final: bool = False) -> dict:
        """The OpenAI chat delta fields this text adds (``{}`` when it shows nothing yet).
        ``final``: the answer ends with this text (``feed`` then ``finish`` in one delta)."""
        delta: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            parts = ([self._reasoning.feed(text)] if text else []) + ([self._reasoning.finish()] if final else [])
            if reasoning := "".join(p.reasoning for p in parts):
                delta["reasoning_content"] = reasoning
            content = "".join(p.content for p in parts)
        if self._tools is not None:
            parts = ([self._tools.feed(content)] if content else []) + ([self._tools.finish()] if final else [])
            for part in parts:
                if part.content:
                    delta["content"] = delta.get("content", "") + part.content
                for entry in part.tool_calls:
                    entries = delta.setdefault("tool_calls", [])
                    if entries and entries[-1]["index"] == entry["index"]:  # one entry per call
                        entries[-1]["function"]["arguments"] += entry["function"]["arguments"]
                    else:
                        entries.append(entry)
        elif content:
            self._plain += content
            delta["content"] = content
        return delta

    def finish(self) -> dict:
        """The end of the answer: whatever was held back (a possible tag's beginning)."""
        return self.feed("", final=True)

    @property
    def tools_called(self) -> bool:
        return bool(self._tools is not None and self._tools.calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: an answer that ends (``stop``) after calling tools says ``tool_calls``."""
        return "tool_calls" if reason == "stop" and self.tools_called else reason

    def message(self) -> dict:
        """The assistant message, after ``finish``; with a parser ``content`` is ``None`` when
        empty (as vLLM)."""
        msg: dict[str, Any] = {"role": "assistant"}
        if self._tools is not None:
            content, calls = self._tools.result()
            msg["content"] = content
            if calls:
                msg["tool_calls"] = [c.to_openai() for c in calls]
        else:  # without parsers the text is the content, as it is
            msg["content"] = (self._plain or None) if self._reasoning is not None else self._plain
        if self._reasoning is not None:
            msg["reasoning_content"] = self._reasoning.result()[0]
        return msg
