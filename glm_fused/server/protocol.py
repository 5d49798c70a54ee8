"""OpenAI-compatible request models and response builders.

Requests are validated with pydantic in strict mode: a JSON string or boolean is never
taken for a number (``max_tokens: "10"``, ``stream: "yes"``, ``prompt: [true]`` are refused),
while an integer is accepted where a float is expected. Responses are plain dicts in OpenAI's
layout (the official client reads them as-is). Unknown extra fields are accepted and
ignored, as vLLM does; fields this server cannot honour are refused with 400 naming the field.
Requests are validated in the preprocessing workers (``glm_fused.server.preprocess``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from glm_fused.engine.sampling import InvalidParam, SamplingParams
from glm_fused.server.errors import ApiError

# Variables the server itself gives the chat template; a request may not set them through
# chat_template_kwargs (tools would slip past the refusal of tool calling, messages would
# replace the conversation, add_generation_prompt would end the prompt differently).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
    "tokenize", "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"})
MAX_STOP_CHARS = 1024  # per stop string: each generated token is matched against every one


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI names; top_k, seed, ignore_eos as vLLM has them)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: only n=1 is supported", param="n")
        if self.presence_penalty:
            raise ApiError(400, "presence_penalty is not supported (use 0)", param="presence_penalty")
        if self.frequency_penalty:
            raise ApiError(400, "frequency_penalty is not supported (use 0)", param="frequency_penalty")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        for i, s in enumerate([self.stop] if isinstance(self.stop, str) else self.stop or []):
            if len(s) > MAX_STOP_CHARS:
                raise ApiError(400, f"stop strings are limited to {MAX_STOP_CHARS} characters; this one has {len(s)}",
                               param="stop" if isinstance(self.stop, str) else f"stop.{i}")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self._refuse_unsupported()
        try:
            return SamplingParams(
                max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos)
        except InvalidParam as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    return_token_ids: bool = False

    def check(self) -> None:
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.logprobs:
            raise ApiError(400, "logprobs is not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of}: only 1 is supported", param="best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt: text or token ids (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt holds {len(p)} prompts; send one prompt per request", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p or p == "":
            raise ApiError(400, "prompt is empty", param="prompt")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "observation"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def check(self) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs is not supported", param="logprobs")
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool calling is not supported by this server", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", param="response_format")
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
                what = "tool calling is not supported by this server" if key in ("tools", "documents") else \
                    "the server sets this template variable itself"
                raise ApiError(400, f"chat_template_kwargs.{key}: {what}", param=f"chat_template_kwargs.{key}")
        if not isinstance(kwargs.get("enable_thinking", True), bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                           param="chat_template_kwargs.enable_thinking")

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


# ---- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                        completion_tokens: int, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_card(name: str, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "glm_fused",
            "max_model_len": max_model_len}
