"""Structured output, enforced while decoding with xgrammar (the grammar library vLLM and
SGLang use): an answer that ends with a stop token always parses and follows its schema.

What a request asks for becomes one xgrammar structural tag (``request_format``):
* ``response_format`` ``json_object`` (any JSON object) or ``json_schema`` (that schema,
  strictly: no properties beyond the declared ones, as OpenAI's strict mode);
* a ``constraint`` under vLLM's or SGLang's names (``glm_fused.server.protocol``): a JSON
  schema, any JSON object, a regular expression, one of a list of strings, or an EBNF grammar
  (xgrammar's dialect, as vLLM takes it);
* ``tool_choice`` ``required`` (one or more calls to the request's tools; exactly one with
  ``parallel_tool_calls: false``) or a named function (one call to it), in GLM-4.5's call
  format exactly as its chat template renders calls, each argument following the tool's
  parameter schema (string arguments as raw text, the others as JSON: what
  ``glm_fused.server.tool_parser`` reads back);
* with thinking on, an optional ``<think>...</think>`` block first (free text; the answer
  cannot stop inside it).

``StructuredOutputs`` (one per server: the tokenizer's vocabulary and a compiler with a
cache) compiles a tag; each constrained sequence gets a ``GrammarState``, which gives its
row of the token bitmask before sampling (``next_bitmask``) and accepts the sampled token
after. The sampler (``glm_fused.engine.sampling``) applies the row to the logits.

xgrammar is an optional dependency (``pip install -e '.[structured]'``; it needs torch):
without it ``StructuredOutputs`` raises ``UserError`` naming the extra.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

import numpy as np

from glm_fused.engine.sampling import InvalidParam, bitmask_to_bool
from glm_fused.errors import UserError

# Longest run of whitespace allowed inside JSON: room for pretty-printed nesting, but a weak
# (or random) model cannot spend its whole budget on spaces.
JSON_MAX_WHITESPACE = 16
# A raw string argument must not contain the tags that would end it early when read back.
_VALUE_EXCLUDES = ["</arg_value>", "</tool_call>"]
_KEY_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]*"


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise UserError("structured output needs xgrammar: pip install -e '.[structured]'") from None
    return xgrammar


def _st():
    return _xgr().structural_tag


# ---- what a request asks for ---------------------------------------------------------------
def _string_format(schema: dict):
    """A raw string argument (the text between ``<arg_value>`` and ``</arg_value>``)."""
    st = _st()
    if "const" in schema:
        return st.ConstStringFormat(value=str(schema["const"]))
    if isinstance(schema.get("enum"), list):
        values = [st.ConstStringFormat(value=str(v)) for v in schema["enum"]]
        return values[0] if len(values) == 1 else st.OrFormat(elements=values)
    if isinstance(schema.get("pattern"), str):
        return st.RegexFormat(pattern=schema["pattern"])
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        # No '<' in a length-bounded value, so it cannot spell a closing tag.
        return st.RegexFormat(pattern=f"[^<]{{{low or 0},{'' if high is None else high}}}")
    return st.AnyTextFormat(excludes=_VALUE_EXCLUDES)


def _json_safe(schema: Any) -> Any:
    """The schema with its length-bounded strings made safe for JSON. xgrammar 0.2.9 writes a
    string with ``minLength``/``maxLength`` (and no pattern) as up to N characters of
    ``[^"\\\r\n]``, letting through control characters that JSON forbids unescaped (strict
    parsers then reject the answer); such strings get the same bounds as a pattern without
    them."""
    from glm_fused.server.tool_parser import is_string_property

    if isinstance(schema, list):
        return [_json_safe(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples") else _json_safe(v) for k, v in schema.items()}
    bounded = isinstance(out.get("minLength"), int) or isinstance(out.get("maxLength"), int)
    if bounded and is_string_property(out) and not any(k in out for k in ("pattern", "format", "enum", "const")):
        low, high = out.get("minLength", 0), out.get("maxLength")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{"" if high is None else high}}}$'
        out.pop("minLength", None)  # the pattern holds the bounds (xgrammar warns about both at once)
        out.pop("maxLength", None)
    return out


def _json_format(schema: Any, **kwargs):
    return _st().JSONSchemaFormat(json_schema=_json_safe(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE, **kwargs)


def _value_format(schema: Any):
    from glm_fused.server.tool_parser import is_string_property

    if isinstance(schema, dict) and is_string_property(schema):
        return _string_format(schema)
    return _json_format(schema if isinstance(schema, dict) and schema else True, excludes=_VALUE_EXCLUDES)


def _call_format(name: str, parameters: dict, where: str):
    """One call in GLM-4.5's layout: ``<tool_call>NAME\\n`` then per argument
    ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n``, then ``</tool_call>``; declared
    properties in their order, the required ones always, extra keys only where
    ``additionalProperties`` allows them."""
    st = _st()
    const = lambda text: st.ConstStringFormat(value=text)  # noqa: E731
    parts = [const(f"<tool_call>{name}\n")]
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    for key, prop in props.items():
        if not isinstance(key, str) or any(c in key for c in "<>\n"):
            raise InvalidParam(where, f"{where}: argument name {key!r} cannot be written in GLM's call format")
        pair = st.SequenceFormat(elements=[const(f"<arg_key>{key}</arg_key>\n<arg_value>"), _value_format(prop),
                                           const("</arg_value>\n")])
        parts.append(pair if key in required else st.OptionalFormat(content=pair))
    extra = parameters.get("additionalProperties")
    if extra not in (None, False):
        pair = st.SequenceFormat(elements=[
            const("<arg_key>"), st.RegexFormat(pattern=_KEY_PATTERN), const("</arg_key>\n<arg_value>"),
            _value_format(extra if isinstance(extra, dict) else {}), const("</arg_value>\n")])
        parts.append(st.StarFormat(content=pair))
    parts.append(const("</tool_call>"))
    return st.SequenceFormat(elements=parts)


def _json_schema(response_format: dict) -> Any:
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise InvalidParam("response_format.json_schema",
                           "response_format.json_schema must be an object with a JSON schema in 'schema'")
    schema = spec.get("schema", True)
    return schema if schema != {} else True


# xgrammar's errors begin with its log prefix, "[12:00:00] /src/x.cc:9: ": its source, not the user's schema
_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _cannot_enforce(param: str, exc: Exception) -> InvalidParam:
    """xgrammar's refusal as a 400's message: its first line, without xgrammar's log prefix."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    what = "the schema" if param.startswith(("response_format", "tool")) else "it"
    return InvalidParam(param, f"{param}: {what} cannot be enforced: {_XGR_LOG_PREFIX.sub('', first)}")


def _constraint_format(param: str, kind: str, value: Any, compact: bool):
    """One of ``protocol.Constraint``'s kinds as a format; ``compact``: JSON whose only
    whitespace is the ``, `` and ``: `` between items."""
    st = _st()
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):  # vLLM takes the schema as JSON text too
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidParam(param, f"{param}: not a JSON schema: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidParam(param, f"{param} must be a JSON schema (an object)")
        schema = schema if schema != {} else True
        if not compact:
            return _json_format(schema)
        # the structural tag's JSON allows at least one free whitespace, so the schema's grammar
        # as xgrammar writes it without (its fixed separators, as vLLM's disable_any_whitespace)
        try:
            grammar = _xgr().Grammar.from_json_schema(json.dumps(_json_safe(schema)), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _cannot_enforce(param, exc) from None
        return st.GrammarFormat(grammar=str(grammar))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise InvalidParam(param, f"{param} must be a non-empty list of non-empty strings")
        return st.OrFormat(elements=[st.ConstStringFormat(value=v) for v in dict.fromkeys(value)])
    if not isinstance(value, str) or not value:
        raise InvalidParam(param, f"{param} must be a non-empty string")
    return st.RegexFormat(pattern=value) if kind == "regex" else st.GrammarFormat(grammar=value)


def request_format(*, response_format: dict | None = None, constraint=None, tools: list[dict] | None = None,
                   tool_mode: str = "none", tool_name: str | None = None, parallel_tool_calls: bool = True,
                   thinking: bool = False, lead_newline: bool = True):
    """The xgrammar structural tag for a request, or ``None`` when nothing is enforced.

    ``constraint``: a ``glm_fused.server.protocol.Constraint`` (vLLM's and SGLang's structured
    output fields); ``tool_mode``/``tool_name``: ``glm_fused.server.chat.resolve_tool_choice``'s
    result; ``thinking``: the answer may open with a think block (the reasoning parser's start
    state is not ``content``); ``lead_newline``: the answer may open with a newline (a chat
    answer, as GLM writes one; a completion continues its prompt as it is). Raises
    ``InvalidParam`` naming the field at fault."""
    st = _st()
    kind = (response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidParam("response_format.type", f"response_format type {kind!r}: expected text, "
                                                   "json_object or json_schema")
    forced = tool_mode in ("required", "named")
    if kind != "text" and constraint is not None:
        raise InvalidParam(constraint.param, f"{constraint.param} cannot be combined with response_format {kind}: "
                                             f"give one")
    asked = ("response_format", f"response_format {kind}") if kind != "text" else \
        (constraint.param, constraint.param) if constraint is not None else None
    if forced and asked:
        raise InvalidParam(asked[0], f"{asked[1]} cannot be combined with tool_choice "
                                     f"{tool_mode if tool_mode == 'required' else repr(tool_name)}")
    newline = st.OptionalFormat(content=st.ConstStringFormat(value="\n"))
    lead = [newline] if lead_newline else []
    if forced:
        calls = {}
        for i, tool in enumerate(tools or []):
            fn = tool["function"]
            if tool_mode == "required" or fn["name"] == tool_name:
                calls[fn["name"]] = _call_format(fn["name"], fn.get("parameters") or {},
                                                 f"tools.{i}.function.parameters")
        if not calls:
            raise InvalidParam("tool_choice", "tool_choice names no tool of this request")
        one = next(iter(calls.values())) if len(calls) == 1 else st.OrFormat(elements=list(calls.values()))
        if tool_mode == "required" and parallel_tool_calls:
            more = st.StarFormat(content=st.SequenceFormat(elements=[st.ConstStringFormat(value="\n"), one]))
            one = st.SequenceFormat(elements=[one, more])
        body = st.SequenceFormat(elements=[*lead, one])
    elif kind == "json_object":
        body = st.SequenceFormat(elements=[*lead, _json_format({"type": "object"})])
    elif kind == "json_schema":
        body = st.SequenceFormat(elements=[*lead, _json_format(_json_schema(response_format))])
    elif constraint is not None:
        body = st.SequenceFormat(elements=[*lead, _constraint_format(constraint.param, constraint.kind,
                                                                     constraint.value, constraint.compact)])
    else:
        return None
    if thinking:
        think = st.TagFormat(begin="<think>", content=st.AnyTextFormat(excludes=["<think>", "</think>"]),
                             end="</think>")
        body = st.SequenceFormat(elements=[st.OptionalFormat(content=st.SequenceFormat(elements=[newline, think])),
                                           body])
    return st.StructuralTag(format=body)


# ---- well-formed UTF-8 --------------------------------------------------------------------------
# xgrammar 0.2.9 matches a character class byte by byte and lets through byte sequences that are
# not UTF-8 (F0 81 ..., E0 80 ...: a sampled JSON string then decodes to U+FFFD and breaks its
# maxLength or pattern). So a constrained answer also follows UTF-8's own automaton: its state
# is (continuation bytes still due, range of the next one); 0 = between characters.
_UTF8_STATES = ((0, 0, 0), (1, 0x80, 0xBF), (2, 0x80, 0xBF), (2, 0xA0, 0xBF), (2, 0x80, 0x9F), (3, 0x80, 0xBF),
                (3, 0x90, 0xBF), (3, 0x80, 0x8F))
_UTF8_INDEX = {state: i for i, state in enumerate(_UTF8_STATES)}


def _utf8_step(state: int, byte: int) -> int:
    """The next state after ``byte``, or -1 when it breaks UTF-8 (RFC 3629's table)."""
    need, low, high = _UTF8_STATES[state]
    if need:
        if not low <= byte <= high:
            return -1
        return 0 if need == 1 else _UTF8_INDEX[(need - 1, 0x80, 0xBF)]
    if byte < 0x80:
        return 0
    for first, last, nxt in ((0xC2, 0xDF, (1, 0x80, 0xBF)), (0xE0, 0xE0, (2, 0xA0, 0xBF)),
                             (0xE1, 0xEC, (2, 0x80, 0xBF)), (0xED, 0xED, (2, 0x80, 0x9F)),
                             (0xEE, 0xEF, (2, 0x80, 0xBF)), (0xF0, 0xF0, (3, 0x90, 0xBF)),
                             (0xF1, 0xF3, (3, 0x80, 0xBF)), (0xF4, 0xF4, (3, 0x80, 0x8F))):
        if first <= byte <= last:
            return _UTF8_INDEX[nxt]
    return -1


class Utf8Table:
    """Per UTF-8 state: which tokens keep the text well-formed (bitmask words) and the state
    each leaves. A token without bytes (a stop token) is allowed only between characters."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int):
        n = len(_UTF8_STATES)
        self.next = np.full((n, vocab_size), -1, dtype=np.int8)
        for token, data in enumerate(decoded_vocab[:vocab_size]):
            if data.isascii():  # most tokens: fine between characters, never inside one
                self.next[0, token] = 0
            else:
                for start in range(n):
                    self.next[start, token] = _utf8_run(start, data)
        words = (vocab_size + 31) // 32
        allowed = np.zeros((n, words * 32), dtype=bool)
        allowed[:, :vocab_size] = self.next >= 0
        self.words = np.packbits(allowed, axis=-1, bitorder="little").view("<i4").reshape(n, words).astype(np.int32)


def _utf8_run(state: int, data: bytes) -> int:
    for byte in data:
        state = _utf8_step(state, byte)
        if state < 0:
            return -1
    return state


# ---- compiling, and one sequence's state ---------------------------------------------------
class StructuredOutputs:
    """The tokenizer's vocabulary as xgrammar sees it, and a caching grammar compiler.

    ``tokenizer``: ``glm_fused.tokenizer.Tokenizer``; ``vocab_size``: the model's (the logits'
    width, which may exceed the tokenizer's); ``stop_token_ids``: the ids that end an answer
    (allowed only where the grammar is complete)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 2):
        xgr = _xgr()
        from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

        backend = tokenizer.backend
        stops = sorted(int(t) for t in stop_token_ids)
        if not stops:
            raise UserError("structured output needs the tokenizer's end-of-answer token ids")
        # xgrammar reads the vocabulary's encoding (byte-level BPE...) from the tokenizer;
        # the vocabulary itself is written here: special tokens (role markers, [gMASK],
        # reserved ids) left empty, which xgrammar never allows; by default it would allow
        # them as text inside strings, where decode() then drops them.
        detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                      vocab_size=vocab_size, stop_token_ids=stops)
        vocab = [""] * vocab_size
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in tokenizer.special_ids:
                vocab[i] = token
        self.info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, detected.dump_metadata())
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.utf8 = Utf8Table([bytes(t) for t in self.info.decoded_vocab], vocab_size)

    def compile(self, tag, param: str = "response_format"):
        """A compiled grammar (cached by the compiler); ``InvalidParam`` if xgrammar refuses it."""
        try:
            return self.compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from these
            raise _cannot_enforce(param, exc) from None

    def state(self, compiled) -> "GrammarState":
        return GrammarState(compiled, self.vocab_size, self.utf8)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled, vocab_size: int, utf8: Utf8Table):
        self._matcher = _xgr().GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._utf8, self._utf8_state = utf8, 0

    def next_bitmask(self) -> np.ndarray:
        """The allowed next tokens as one bitmask row (int32 words, bit set = allowed), for the
        sampler: the grammar's, that keep the text well-formed UTF-8."""
        row = np.full((1, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self._matcher.fill_next_token_bitmask(row, 0)
        row[0] &= self._utf8.words[self._utf8_state]
        return row[0]

    def allowed(self) -> np.ndarray:
        """The allowed next tokens as a bool vector (tests)."""
        return bitmask_to_bool(self.next_bitmask(), self.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it."""
        if not self._matcher.accept_token(int(token_id)):
            return False
        if 0 <= token_id < self._utf8.next.shape[1]:
            self._utf8_state = max(int(self._utf8.next[self._utf8_state, token_id]), 0)
        return True

    @property
    def completed(self) -> bool:
        """The text so far is a complete answer (a stop token may come now)."""
        return bool(self._matcher.is_completed())

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

