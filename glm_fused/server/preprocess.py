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
from pydantic import BaseModel, ValidationError

from glm_fused.engine.llm_engine import check_prompt
from glm_fused.engine.sampling import InvalidParam, SamplingParams
from glm_fused.errors import UserError
from glm_fused.server import protocol as P
from glm_fused.server.errors import ApiError, from_validation_errors

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
KINDS = ("completion", "chat")
# A lone surrogate can only come from a \uD800-\uDFFF escape (raw UTF-8 cannot encode one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass
class Prepared:
    """A validated, tokenized request: what the HTTP side submits and how it answers."""

    kind: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False

    # Across the worker pipe: a small JSON header and the ids as raw int64 (a long prompt
    # costs a memcpy, not a JSON round trip on the engine's side).
    def to_wire(self) -> tuple[dict, bytes]:
        header = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "prompt_ids"}
        header["params"] = dataclasses.asdict(self.params)
        return header, np.asarray(self.prompt_ids, dtype=np.int64).tobytes()

    @classmethod
    def from_wire(cls, header: dict, ids: bytes) -> "Prepared":
        fields = dict(header)
        fields["params"] = SamplingParams(**fields["params"])
        return cls(prompt_ids=np.frombuffer(ids, dtype=np.int64).tolist(), **fields)


class RequestPreprocessor:
    """Turns request bodies into ``Prepared`` requests, or raises ``ApiError``."""

    def __init__(self, *, model_name: str, max_model_len: int, vocab_size: int | None, tokenizer=None):
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_token_chars = longest_token_chars(tokenizer) if tokenizer is not None else None

    def prepare(self, kind: str, body: bytes) -> Prepared:
        data = parse_json(body)
        if kind == "completion":
            self._check_ids_fit(data.get("prompt"))
            return self.completion(validate(data, P.CompletionRequest))
        if kind == "chat":
            return self.chat(validate(data, P.ChatCompletionRequest))
        raise ValueError(f"unknown request kind {kind!r}")

    # ---- the endpoints --------------------------------------------------------------------
    def completion(self, req: P.CompletionRequest) -> Prepared:
        self._check_model(req.model)
        req.check()
        prompt = req.single_prompt()
        req.sampling_params(1)  # parameters in range before any costly work
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this server has no tokenizer (dummy weights from a bare config): "
                                    "send prompt as a list of token ids", param="prompt")
            self._check_text_fits(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = prompt
        params = req.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
        self._check_fits(ids, params, "prompt", req.max_tokens is not None)
        if req.max_tokens is None:
            params.max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        if self.tokenizer is None and params.stop:
            raise ApiError(400, "stop strings need a tokenizer; this server has none (use stop_token_ids)",
                           param="stop")
        return Prepared("completion", list(ids), params, stream=req.stream, include_usage=req.include_usage,
                        return_token_ids=req.return_token_ids or self.tokenizer is None)

    def chat(self, req: P.ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        req.check()
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ApiError(400, "this server has no tokenizer with a chat template; use /v1/completions",
                           param="messages")
        req.sampling_params(1)
        self._check_text_fits(req.text_chars(), "messages")
        try:
            text = self.tokenizer.apply_chat_template(req.message_dicts(), add_generation_prompt=True,
                                                      enable_thinking=req.enable_thinking, **req.template_kwargs())
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        self._check_text_fits(len(text), "messages")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = req.sampling_params(max(1, self.max_model_len - len(ids)))
        self._check_fits(ids, params, "messages", req.max_tokens is not None)
        return Prepared("chat", ids, params, stream=req.stream, include_usage=req.include_usage)

    # ---- checks ---------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def _check_ids_fit(self, prompt: Any) -> None:
        """Refuse a token-id prompt longer than the context before validating every id."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and len(prompt) >= self.max_model_len and not isinstance(prompt[0], str):
            raise ApiError(400, f"prompt has {len(prompt)} tokens; this server's context limit (--max-model-len) "
                                f"is {self.max_model_len}, leaving no room to generate",
                           param="prompt", code="context_length_exceeded")

    def _check_text_fits(self, chars: int, param: str) -> None:
        """Refuse text that needs more tokens than the context holds, before tokenizing it."""
        if self.max_token_chars is None:
            return
        at_least = -(-chars // self.max_token_chars)
        if at_least >= self.max_model_len:
            raise ApiError(400, f"{param} has {chars} characters, at least {at_least} tokens; this server's "
                                f"context limit (--max-model-len) is {self.max_model_len} tokens",
                           param=param, code="context_length_exceeded")

    def _check_fits(self, ids: list[int], params: SamplingParams, param: str, max_tokens_given: bool) -> None:
        try:
            check_prompt(ids, params, max_model_len=self.max_model_len, vocab_size=self.vocab_size, param=param,
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
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
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
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(body):
        path = lone_surrogate_path(data)
        if path is not None:
            param = ".".join(map(str, path))
            raise ApiError(400, f"{param} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                "which is not text", param=param)
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
