"""OpenAI-compatible request models, response builders and the OpenAI error shape.

Requests are validated with pydantic; responses are plain dicts in OpenAI's layout (the
official client reads them as-is). Unknown extra fields are accepted and ignored, as
OpenAI does; fields this server cannot honour are refused with 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from glm_fused.engine.sampling import InvalidParam, SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error",
                             404: "invalid_request_error", 413: "invalid_request_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share (OpenAI names; top_k, seed, ignore_eos as vLLM has them)."""

    model_config = ConfigDict(extra="allow")

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
    model_config = ConfigDict(extra="allow")

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
                for part in m.content:
                    if part.get("type") != "text":
                        raise ApiError(400, f"content part of type {part.get('type')!r}: only text is supported",
                                       param=f"messages.{i}.content")

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    @property
    def enable_thinking(self) -> bool:
        kwargs = self.chat_template_kwargs or {}
        return bool(kwargs.get("enable_thinking", True))


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
