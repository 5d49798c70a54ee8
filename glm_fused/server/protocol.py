"""OpenAI-compatible request models and response builders.

Requests are validated with pydantic in strict mode: a JSON string or boolean is never
taken for a number (``max_tokens: "10"``, ``stream: "yes"``, ``prompt: [true]`` are refused),
while an integer is accepted where a float is expected. Responses are plain dicts in OpenAI's
layout (the official client reads them as-is). Every declared field is honoured, or refused
with 400 naming it (``REFUSED``, and values this server cannot serve); so are vLLM's and
SGLang's structured output fields and vLLM's other fields (``VLLM_UNSERVED``: taken only at
the value that asks for nothing). Other unknown fields are accepted and ignored, as vLLM
does. Requests are validated in the preprocessing workers (``glm_fused.server.preprocess``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from glm_fused.engine.sampling import InvalidParam, SamplingParams
from glm_fused.server.errors import ApiError

# Variables the server itself gives the chat template; a request may not set them through
# chat_template_kwargs (tools belong in `tools`, messages would replace the conversation,
# add_generation_prompt would end the prompt differently).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"})
MAX_STOP_CHARS = 1024  # per stop string: each generated token is matched against every one
MAX_CHOICES = 1024     # prompts x n in one request
# OpenAI fields this server does not serve: refused by name rather than ignored.
REFUSED = {
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}


@dataclass(frozen=True)
class Constraint:
    """Structured output asked for under vLLM's or SGLang's names, for
    ``glm_fused.engine.structured.request_format``."""

    param: str             # the field it came from, named in errors
    kind: str              # one of STRUCTURED_KINDS
    value: Any
    compact: bool = False  # JSON with ", " and ": " as its only whitespace (vLLM's disable_any_whitespace)


# vLLM's structured_outputs: a JSON schema, any JSON object, a regex, one of some strings, an EBNF grammar
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The same under older and other names: vLLM's guided_* (before structured_outputs), SGLang's
STRUCTURED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                      "guided_grammar": "grammar", "json_schema": "json", "regex": "regex", "ebnf": "grammar"}
# Fields that may ask for a grammar: such a request is prepared in a worker, where compiling it
# cannot hold up the server's event loop
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *STRUCTURED_ALIASES)
GRAMMAR_BACKENDS = (None, "auto", "xgrammar")  # the one this server has, under the names a request may give

# vLLM's own request fields that this server does not serve: taken at the value that asks for
# nothing (a client sending defaults), else refused by name; any other unknown field is ignored
VLLM_UNSERVED = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "truncate_prompt_tokens": (None, "truncate_prompt_tokens is not supported; send the prompt to be used"),
    "prompt_logprobs": (None, "prompt_logprobs is not supported; use echo with logprobs on /v1/completions"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported; use logit_bias or structured_outputs"),
    "bad_words": (None, "bad_words is not supported; use logit_bias"),
    "logits_processors": (None, "logits_processors are not supported"),
    "add_generation_prompt": (True, "add_generation_prompt false is not supported: the prompt ends where the "
                                    "assistant answers"),
    "continue_final_message": (False, "continue_final_message is not supported"),
    "echo": (False, "echo is not supported on chat completions (it is on /v1/completions)"),
    "chat_template": (None, "a per-request chat_template is not supported; start the server with --chat-template"),
    "documents": (None, "documents are not supported"),
    "return_tokens_as_token_ids": (False, "return_tokens_as_token_ids is not supported; use return_token_ids"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens false is not supported"),
    "priority": (0, "request priorities are not supported: requests are served first come, first served"),
    "cache_salt": (None, "cache_salt is not supported: the prefix cache is shared by all requests"),
    "vllm_xargs": (None, "vllm_xargs is not supported"),
    "kv_transfer_params": (None, "kv_transfer_params (disaggregated serving) is not supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI's names; top_k, min_p, repetition_penalty,
    min_tokens, seed, ignore_eos, stop_token_ids, skip_special_tokens,
    include_stop_str_in_output and structured_outputs as vLLM has them; the structured output
    fields under other names are read from the extras: ``constraint``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[str, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Optional[str] = None  # an end-user id for the caller's own records: accepted, not used
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None

    def _check_common(self) -> None:
        extra = self.model_extra or {}
        for name, why in REFUSED.items():
            # A declared field's value is in __dict__; getattr of an undeclared name goes
            # through pydantic's __getattr__ and an AttributeError (0.1 ms for the five).
            value = extra.get(name, self.__dict__.get(name))
            if value is not None:
                raise ApiError(400, why, param=name)
        for name, (nothing, why) in VLLM_UNSERVED.items():
            if name in extra and extra[name] != nothing and not (nothing is None and extra[name] in ([], {})):
                raise ApiError(400, why, param=name)
        if not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be in 1..{MAX_CHOICES}, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        for i, s in enumerate([self.stop] if isinstance(self.stop, str) else self.stop or []):
            if len(s) > MAX_STOP_CHARS:
                raise ApiError(400, f"stop strings are limited to {MAX_STOP_CHARS} characters; this one has {len(s)}",
                               param="stop" if isinstance(self.stop, str) else f"stop.{i}")
        for key in self.logit_bias or {}:
            if not key.strip().lstrip("-").isdigit():
                raise ApiError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")

    def _special_tokens(self, default: bool, why: str) -> None:
        """vLLM's add_special_tokens: its default for this endpoint, or refused."""
        value = (self.model_extra or {}).get("add_special_tokens")
        if value is not None and value is not default:
            raise ApiError(400, f"add_special_tokens {str(value).lower()} is not supported here: {why}",
                           param="add_special_tokens")

    def constraint(self) -> Constraint | None:
        """What the output must follow under vLLM's ``structured_outputs`` (or its older
        ``guided_*`` fields) or SGLang's ``regex`` / ``json_schema`` / ``ebnf``; None when none
        is given. Two at once, or an option this server cannot honour, is a 400 naming it."""
        extra, found, compact = self.model_extra or {}, [], False
        for key, value in (self.structured_outputs or {}).items():
            where = f"structured_outputs.{key}"
            if key == "json_object" and value in (None, False):
                continue
            if key == "json_object" and value is not True:
                raise ApiError(400, f"{where} must be true or false", param=where)
            if key in STRUCTURED_KINDS:
                if value is not None:
                    found.append((where, key, value))
            elif key in ("disable_fallback", "disable_additional_properties", "disable_any_whitespace"):
                # one grammar backend, so no fallback; it keeps to the declared properties either way
                if not isinstance(value, bool):
                    raise ApiError(400, f"{where} must be true or false", param=where)
                compact = compact or (key == "disable_any_whitespace" and value)
            elif key in ("backend", "_backend"):
                if value not in GRAMMAR_BACKENDS:
                    raise ApiError(400, f"{where} {value!r}: this server's grammars are xgrammar's", param=where)
            elif key in ("whitespace_pattern", "structural_tag"):
                if value is not None:
                    raise ApiError(400, f"{where} is not supported", param=where)
            else:
                raise ApiError(400, f"{where} is not a structured output option (expected one of "
                                    f"{', '.join(STRUCTURED_KINDS)})", param=where)
        found += [(name, kind, extra[name]) for name, kind in STRUCTURED_ALIASES.items()
                  if extra.get(name) is not None]
        if extra.get("guided_decoding_backend") not in GRAMMAR_BACKENDS:
            raise ApiError(400, f"guided_decoding_backend {extra['guided_decoding_backend']!r}: this server's "
                                f"grammars are xgrammar's", param="guided_decoding_backend")
        if extra.get("guided_whitespace_pattern") is not None:
            raise ApiError(400, "guided_whitespace_pattern is not supported", param="guided_whitespace_pattern")
        if len(found) > 1:
            raise ApiError(400, f"{found[0][0]} and {found[1][0]} both constrain the output: give one",
                           param=found[1][0])
        return Constraint(*found[0], compact=compact) if found else None

    def sampling_params(self, default_max_tokens: int, *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    # Tried in this order, the first form that fits wins: a token-id list is matched before any
    # list of other things is tried (pydantic's default, the best fit, first tried list[str] on
    # it and made an error per id: 0.5 ms of 2,080 ids, against 0.03 ms).
    prompt: Union[str, list[int], list[list[int]], list[str]] = Field(union_mode="left_to_right")
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    return_token_ids: bool = False

    def check(self, max_logprobs: int) -> None:
        self._check_common()
        self._special_tokens(True, "a text prompt gets the tokenizer's special tokens")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of}: only 1 is supported (use n for several choices)",
                           param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ApiError(400, f"logprobs must be in 0..{max_logprobs} (--max-logprobs), got {self.logprobs}",
                           param="logprobs")

    def prompts(self) -> list[Union[str, list[int]]]:
        """Every prompt: text, or token ids."""
        p = self.prompt
        prompts = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(prompts) * self.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={self.n} exceeds {MAX_CHOICES} choices per request",
                           param="prompt")
        for i, one in enumerate(prompts):
            if (isinstance(one, list) and not one) or one == "":
                raise ApiError(400, "prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty",
                               param="prompt" if len(prompts) == 1 else f"prompt.{i}")
        return prompts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "observation"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None

    def check(self, max_logprobs: int) -> None:
        self._check_common()
        self._special_tokens(False, "the chat template writes the prompt's special tokens")
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins, as in vLLM
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise ApiError(400, f"top_logprobs must be in 0..{max_logprobs} (--max-logprobs), "
                                    f"got {self.top_logprobs}", param="top_logprobs")
        if self.modalities not in (None, ["text"]):
            raise ApiError(400, "only the text modality is supported", param="modalities")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.get("type") != "text":
                        raise ApiError(400, f"content part of type {part.get('type')!r}: only text is supported",
                                       param=f"messages.{i}.content.{j}.type")
                    if not isinstance(part.get("text"), str):
                        raise ApiError(400, "a text content part needs a string `text`",
                                       param=f"messages.{i}.content.{j}.text")
        kwargs = self.chat_template_kwargs or {}
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                what = "pass tools in the request's `tools`" if key in ("tools", "documents") else \
                    "the server sets this template variable itself"
                raise ApiError(400, f"chat_template_kwargs.{key}: {what}", param=f"chat_template_kwargs.{key}")
        if not isinstance(kwargs.get("enable_thinking", True), bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                           param="chat_template_kwargs.enable_thinking")

    @property
    def num_logprobs(self) -> int | None:
        """How many top logprobs per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def text_chars(self) -> int:
        """Characters of text in the messages (a lower bound of the rendered prompt's)."""
        total = 0
        for m in self.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(part["text"]) for part in m.content)
        return total

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    @property
    def enable_thinking(self) -> bool:
        return (self.chat_template_kwargs or {}).get("enable_thinking", True)

    def template_kwargs(self) -> dict:
        """Extra template variables (checked by ``check``), enable_thinking aside."""
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k != "enable_thinking"}


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: ``prompt`` (text), or ``messages`` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                      token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response(rid: str, obj: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole (non-streamed) answer: ``obj`` is ``text_completion`` or ``chat.completion``."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, created: int, choice: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_card(name: str, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "glm_fused",
            "max_model_len": max_model_len}
