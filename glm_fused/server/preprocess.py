"""From a request body to what the engine needs: token ids and sampling parameters.

This runs in the preprocessing workers (``glm_fused.server.preprocess_pool``), not in the
engine's process: JSON parsing, validation, the chat template and tokenization are CPU work
that holds the interpreter lock (seconds per MB of text), and in rank 0's process they would
stall the engine loop, the collectives it drives, and ``/health``.

Checks run cheapest first, so a hostile request costs little:
1. the body is UTF-8 JSON (no NaN/Infinity) holding an object;
2. no string holds a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not text);
3. a token-id prompt longer than the context is refused before its ids are validated;
4. the fields validate strictly (``protocol``), the model name matches, unsupported
   features are refused, sampling parameters are in range;
5. a text prompt too long to fit in ``max_model_len`` tokens whatever its tokenization is
   refused before it is tokenized (see ``RequestPreprocessor.max_token_chars``);
6. chat template, tokenization, then the token count against the context limit.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic_core
from pydantic import BaseModel, ValidationError

from glm_fused.engine.llm_engine import check_prompt
from glm_fused.engine.sampling import InvalidParam, SamplingParams
from glm_fused.errors import UserError
from glm_fused.server import protocol as P
from glm_fused.server.errors import ApiError, from_validation_errors

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A lone surrogate can only come from a \uD800-\uDFFF escape (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A key "prompt" whose value is a string: a text prompt, which a worker tokenizes, so the
# handler does not parse it first (an unescaped match can only be a key: quotes inside strings
# are escaped). Anything else, unusual spellings included, is parsed and decided exactly.
_TEXT_PROMPT = re.compile(rb'"prompt"\s*:\s*"')


@dataclass
class Prepared:
    """A validated, tokenized request: what the HTTP side submits and how it answers.

    ``prompts``: token ids of each prompt (completions may send several), as the int64
    arrays the engine takes; each runs ``n`` times. ``prompt_texts``: the prompts as text,
    for ``echo``. Chat: ``tools`` are the request's tools when tool calls are parsed from
    the answer (None: not parsed),
    ``tool_mode`` the resolved tool_choice (none, auto, required, named),
    ``reasoning`` whether the glm45 reasoning parser splits it, ``prompt_tail`` the end of
    the rendered prompt (where the answer starts), ``grammar`` the xgrammar structural tag
    (JSON) the answer must follow. ``result``: the whole answer of a tokenizer endpoint.
    """

    kind: str
    prompts: list[np.ndarray]  # int64
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False
    prompt_texts: list[str] | None = None
    tools: list[dict] | None = None
    tool_mode: str = "none"
    reasoning: bool = False
    prompt_tail: str = ""
    grammar: str | None = None
    result: dict | None = None

    @property
    def prompt_ids(self) -> np.ndarray:
        """The one prompt's ids (chat, and single-prompt completions)."""
        return self.prompts[0]

    # Across the worker pipe: a small JSON header and the ids as raw int64 (a long prompt
    # costs a memcpy, not a JSON round trip on the engine's side).
    def to_wire(self) -> tuple[dict, bytes]:
        header = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "prompts"}
        header["params"] = dataclasses.asdict(self.params)
        header["prompt_lens"] = [len(p) for p in self.prompts]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in self.prompts]) if self.prompts else \
            np.zeros(0, np.int64)
        return header, ids.tobytes()

    @classmethod
    def from_wire(cls, header: dict, ids: bytes) -> "Prepared":
        fields = dict(header)
        fields["params"] = SamplingParams(**fields["params"])
        flat = np.frombuffer(ids, dtype=np.int64)
        prompts, at = [], 0
        for n in fields.pop("prompt_lens"):
            prompts.append(flat[at:at + n])
            at += n
        return cls(prompts=prompts, **fields)


class RequestPreprocessor:
    """Turns request bodies into ``Prepared`` requests, or raises ``ApiError``.

    ``options``: the server's flags that shape requests: ``max_logprobs``,
    ``enable_auto_tool_choice``, ``tool_call_parser`` and ``reasoning_parser`` (``glm45`` or None)."""

    def __init__(self, *, model_name: str, max_model_len: int, vocab_size: int | None, tokenizer=None,
                 options: dict | None = None):
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.options = {"max_logprobs": 20, "enable_auto_tool_choice": False, "tool_call_parser": None,
                        "reasoning_parser": None, **(options or {})}
        self.max_token_chars = longest_token_chars(tokenizer) if tokenizer is not None else None
        self._structured = None  # made on the first request that needs a grammar

    def prepare(self, kind: str, body: bytes) -> Prepared:
        data = parse_json(body)
        if kind == "completion":
            return self._completion(data)
        if kind == "chat":
            return self.chat(validate(data, P.ChatCompletionRequest))
        if kind == "tokenize":
            return self.tokenize(validate(data, P.TokenizeRequest))
        if kind == "detokenize":
            return self.detokenize(validate(data, P.DetokenizeRequest))
        raise ValueError(f"unknown request kind {kind!r}")

    def prepare_token_ids(self, body: bytes) -> Prepared | None:
        """``prepare("completion", body)`` when its prompt is token ids (one list, or a list of
        lists) and no structured output is asked for, else None: no tokenizer, template or
        grammar runs for it, only parsing and checks, which take about as long as the body is
        bytes (0.4 ms for 2,080 ids)."""
        if _TEXT_PROMPT.search(body):
            return None
        data = parse_json(body)
        prompt = data.get("prompt")
        if not (isinstance(prompt, list) and prompt and (type(prompt[0]) is int or isinstance(prompt[0], list))):
            return None
        if any(data.get(name) is not None for name in P.GRAMMAR_FIELDS):  # a grammar compiles in a worker
            return None
        return self._completion(data)

    def _completion(self, data: dict) -> Prepared:
        self._check_ids_fit(data.get("prompt"))
        return self.completion(validate(data, P.CompletionRequest))

    # ---- the endpoints --------------------------------------------------------------------
    def completion(self, req: P.CompletionRequest) -> Prepared:
        self._check_model(req.model)
        req.check(self.options["max_logprobs"])
        prompts = req.prompts()
        logprobs = req.logprobs
        if any(isinstance(prompt, str) for prompt in prompts):
            req.sampling_params(1)  # parameters in range before tokenizing
        single = len(prompts) == 1
        ids_list, texts = [], []
        for i, prompt in enumerate(prompts):
            param = "prompt" if single else f"prompt.{i}"
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ApiError(400, "this server has no tokenizer (dummy weights from a bare config): "
                                        "send prompt as a list of token ids", param="prompt")
                self._check_text_fits(len(prompt), param)
                ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            else:
                ids = prompt
            ids_list.append(ids)
            texts.append(prompt if isinstance(prompt, str) else None)
        params = req.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS, logprobs=logprobs,
                                     prompt_logprobs=logprobs if req.echo else None)
        for i, ids in enumerate(ids_list):  # each prompt's ids become one int64 array here
            ids_list[i] = self._check_fits(ids, params, "prompt" if single else f"prompt.{i}",
                                           req.max_tokens is not None)
        # echoed token-id prompts as text: only once their ids are known to be in the vocabulary
        texts = [t if t is not None else self.tokenizer.decode(ids_list[i].tolist(), skip_special_tokens=False)
                 if req.echo and self.tokenizer else "" for i, t in enumerate(texts)]
        if req.max_tokens is None:
            params.max_tokens = max(1, min(params.max_tokens, self.max_model_len - max(map(len, ids_list))))
            params.min_tokens = min(params.min_tokens, params.max_tokens)
        if self.tokenizer is None and params.stop:
            raise ApiError(400, "stop strings need a tokenizer; this server has none (use stop_token_ids)",
                           param="stop")
        self._check_bias(params)
        grammar = self._grammar(req, lead_newline=False)
        return Prepared("completion", ids_list, params, n=req.n, stream=req.stream, include_usage=req.include_usage,
                        return_token_ids=req.return_token_ids or self.tokenizer is None, echo=req.echo,
                        prompt_texts=texts if req.echo else None, grammar=grammar)

    def chat(self, req: P.ChatCompletionRequest) -> Prepared:
        from glm_fused.server import chat as C
        from glm_fused.server.reasoning import ASSISTANT, CONTENT, start_state

        self._check_model(req.model)
        req.check(self.options["max_logprobs"])
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ApiError(400, "this server has no tokenizer with a chat template; use /v1/completions",
                           param="messages")
        req.sampling_params(1)
        self._check_text_fits(req.text_chars(), "messages")
        try:
            tools = C.check_tools(req.tools)
            mode, name = C.resolve_tool_choice(req.tool_choice, tools)
            if mode == "auto" and tools and not (self.options["enable_auto_tool_choice"]
                                                 and self.options["tool_call_parser"]):
                raise InvalidParam("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                                  '--tool-call-parser to be set')
            messages = C.prepare_messages(req.message_dicts())
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      enable_thinking=req.enable_thinking, tools=tools or None,
                                                      **req.template_kwargs())
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_text_fits(len(text), "messages")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = req.sampling_params(max(1, self.max_model_len - len(ids)), logprobs=req.num_logprobs)
        ids = self._check_fits(ids, params, "messages", req.max_tokens is not None)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        self._check_bias(params)
        tail = text.rsplit(ASSISTANT, 1)[-1] if ASSISTANT in text else text[-64:]
        grammar = self._grammar(req, tools, mode, name, thinking=start_state(text) != CONTENT)
        parse_tools = mode in ("required", "named") or (mode == "auto" and bool(tools))
        return Prepared("chat", [ids], params, n=req.n, stream=req.stream, include_usage=req.include_usage,
                        tools=tools if parse_tools else None, tool_mode=mode, reasoning=self.options["reasoning_parser"] == "glm45",
                        prompt_tail=tail, grammar=grammar)

    def tokenize(self, req: P.TokenizeRequest) -> Prepared:
        """vLLM's ``/tokenize`` answer: ``{count, max_model_len, tokens, token_strs}``."""
        from glm_fused.server import chat as C

        self._check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer (dummy weights from a bare config)")
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if req.prompt is not None:
            self._check_text_fits(len(req.prompt), "prompt")
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens in (None, True))
        else:
            if not self.tokenizer.has_chat_template:
                raise ApiError(400, "this server's tokenizer has no chat template", param="messages")
            try:
                tools = C.check_tools(req.tools)
                messages = C.prepare_messages([m.model_dump(exclude_none=True) for m in req.messages])
                kwargs = dict(req.chat_template_kwargs or {})
                bad = sorted(set(kwargs) & P.RESERVED_TEMPLATE_KWARGS)
                if bad:
                    raise InvalidParam(f"chat_template_kwargs.{bad[0]}", f"chat_template_kwargs.{bad[0]}: the "
                                                                         "server sets this template variable itself")
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                          tools=tools or None, **kwargs)
            except InvalidParam as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            except UserError as exc:
                raise ApiError(400, str(exc), param="messages") from None
            self._check_text_fits(len(text), "messages")
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        strs = [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return Prepared("tokenize", [], SamplingParams(), result={
            "count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs})

    def detokenize(self, req: P.DetokenizeRequest) -> Prepared:
        self._check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer (dummy weights from a bare config)")
        if self.vocab_size is not None:
            bad = [t for t in req.tokens if not 0 <= t < self.vocab_size][:1]
            if bad:
                raise ApiError(400, f"tokens has token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})",
                               param="tokens")
        return Prepared("detokenize", [], SamplingParams(),
                        result={"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    # ---- structured output ----------------------------------------------------------------
    def _grammar(self, req, tools: list[dict] | None = None, mode: str = "none", name: str | None = None,
                 thinking: bool = False, lead_newline: bool = True) -> str | None:
        """The structural tag (JSON) the answer must follow, checked by compiling it here (a
        schema xgrammar cannot enforce is a 400 from this worker), or None."""
        fmt = req.response_format
        forced = mode in ("required", "named")
        constraint = req.constraint()
        if not forced and constraint is None and (fmt or {}).get("type", "text") == "text":
            return None
        param = "tool_choice" if forced else "response_format" if constraint is None else constraint.param
        if self.tokenizer is None:
            raise ApiError(400, "structured output needs the model's tokenizer; this server has none", param=param)
        try:
            from glm_fused.engine.structured import request_format

            so = self.structured()
            tag = request_format(response_format=fmt, constraint=constraint, tools=tools, tool_mode=mode,
                                 tool_name=name, parallel_tool_calls=getattr(req, "parallel_tool_calls", True),
                                 thinking=thinking, lead_newline=lead_newline)
            if tag is None:
                return None
            so.compile(tag, param)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except UserError as exc:
            raise ApiError(400, f"{param}: {exc}", param=param) from None
        return tag.model_dump_json()

    def structured(self):
        """The tokenizer's ``StructuredOutputs`` (made once; ``UserError`` without xgrammar)."""
        if self._structured is None:
            from glm_fused.engine.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size or self.tokenizer.vocab_size,
                                                 self.tokenizer.eos_token_ids)
        return self._structured

    # ---- checks ---------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def _check_ids_fit(self, prompt: Any) -> None:
        """Refuse a token-id prompt longer than the context before validating every id."""
        many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list)
        for i, ids in enumerate(prompt if many else [prompt]):
            if isinstance(ids, list) and len(ids) >= self.max_model_len and not isinstance(ids[0], str):
                param = f"prompt.{i}" if many and len(prompt) > 1 else "prompt"
                raise ApiError(400, f"{param} has {len(ids)} tokens; this server's context limit (--max-model-len) "
                                    f"is {self.max_model_len}, leaving no room to generate",
                               param=param, code="context_length_exceeded")

    def _check_text_fits(self, chars: int, param: str) -> None:
        """Refuse text that needs more tokens than the context holds, before tokenizing it."""
        if self.max_token_chars is None:
            return
        at_least = -(-chars // self.max_token_chars)
        if at_least >= self.max_model_len:
            raise ApiError(400, f"{param} has {chars} characters, at least {at_least} tokens; this server's "
                                f"context limit (--max-model-len) is {self.max_model_len} tokens",
                           param=param, code="context_length_exceeded")

    def _check_bias(self, params: SamplingParams) -> None:
        bad = [t for t in params.logit_bias if self.vocab_size is not None and t >= self.vocab_size][:1]
        if bad:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                           param="logit_bias")

    def _check_fits(self, ids: list[int], params: SamplingParams, param: str, max_tokens_given: bool) -> np.ndarray:
        """The ids as the int64 array the engine takes, or a 400."""
        try:
            return check_prompt(ids, params, max_model_len=self.max_model_len, vocab_size=self.vocab_size, param=param,
                         max_tokens_given=max_tokens_given)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest token: no tokenization of n characters has fewer than
    n / this many tokens.

    A vocabulary entry is never shorter than the text it stands for: byte-level BPE spells
    each byte as one character (and a character is at least one byte), SentencePiece spells
    text as itself (``▁`` for a space) or a byte as ``<0x41>``; an added token is its text.
    This holds as long as the normalizer does not delete characters (GLM's has none).
    """
    return max(1, max(len(token) for token in tokenizer.vocab_strings()))


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it.

    pydantic's Rust parser first: a third of ``json.loads``' time (0.16 against 0.35 ms for
    2,080 token ids on two CPU cores), with the same result wherever it succeeds (big
    integers, duplicate keys and float rounding included). It refuses what ``json.loads``
    also refuses and lone surrogates, which the checks below refuse: any body it refuses is
    parsed again by ``json.loads``, whose error says where the body is wrong."""
    try:
        data = pydantic_core.from_json(body, allow_inf_nan=False)
    except (ValueError, RecursionError):
        data = _parse_slowly(body)
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(body):
        path = lone_surrogate_path(data)
        if path is not None:
            param = ".".join(map(str, path))
            raise ApiError(400, f"{param} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                "which is not text", param=param)
    return data


def _parse_slowly(body: bytes) -> Any:
    """``json.loads``, its errors as a 400 naming the fault."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") \
            from None
    except ValueError as exc:  # NaN / Infinity
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    return data


def validate(data: dict, model: type[BaseModel]) -> Any:
    """``data`` as ``model`` (strict), or a 400 naming the first field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_input=False, include_url=False)) from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def lone_surrogate_path(data: Any) -> tuple | None:
    """Where in parsed JSON a string (or key) holds an unpaired surrogate, or None."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _encodes(key):
                    return path + (key,)
                if isinstance(item, (str, dict, list)):
                    stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
