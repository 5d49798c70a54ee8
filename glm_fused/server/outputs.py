"""From engine outputs to OpenAI choices: one ``Choice`` per sequence (a prompt's n-th
answer), its text (with ``echo``), its chat message (reasoning and tool calls through
``ChatOutputParser``), and logprobs in both of OpenAI's shapes.

Logprobs are those of the model's raw distribution (vLLM's default). Completions use the
legacy shape ``{tokens, token_logprobs, top_logprobs, text_offset}``, whose ``top_logprobs``
maps token text to logprob for the top N and the chosen token; with ``echo`` the prompt's
tokens come first (the first prompt token has no logprob: ``None``). Chat uses
``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
A token's text is its own decode (``U+FFFD`` for a piece of a character), as vLLM shows it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from glm_fused.server import protocol as P
from glm_fused.server.chat import ChatOutputParser

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps to the same value


class TokenTexts:
    """Token ids as logprobs show them (each id's own decode, cached). Without a tokenizer
    (token-id-only servers): ``token_id:N``, vLLM's spelling."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self._cache[token_id] = text
        return text


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def completion_logprobs(pairs: list[tuple[int, Any]], texts: TokenTexts, offset: int = 0) -> tuple[dict, int]:
    """The legacy shape for ``pairs`` of (token id, ``(logprob, top ids, top logprobs)`` or
    None); ``offset``: the text offset of the first token. Returns it and the next offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in pairs:
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, ids, values = entry
        top = {texts(i): _lp(v) for i, v in zip(ids, values)}
        top.setdefault(text, _lp(chosen))
        out["token_logprobs"].append(_lp(chosen))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(pairs: list[tuple[int, Any]], texts: TokenTexts) -> dict:
    """OpenAI's chat shape for (token id, entry) pairs."""
    def item(token: int, value: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8", errors="replace"))}

    content = []
    for token, (chosen, ids, values) in pairs:
        content.append({**item(token, chosen), "top_logprobs": [item(i, v) for i, v in zip(ids, values)]})
    return {"content": content}


class Choice:
    """One sequence of a request: choice ``index`` answers prompt ``prompt_index``."""

    def __init__(self, index: int, request_id: str, prompt_index: int, prep, texts: TokenTexts):
        self.index, self.request_id, self.prompt_index = index, request_id, prompt_index
        self.prep, self.texts = prep, texts
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.seq = None            # the engine's Sequence (its logprobs), once an output came
        self._logprobs_out = 0     # output logprob entries handed out (streaming)
        self._offset = 0           # text offset of the next completion logprob
        self.started = False       # streaming: the first chunk (role / echo) is out
        self.parser = ChatOutputParser(prep.prompt_tail, reasoning=prep.reasoning, tools=prep.tools) \
            if prep.kind == "chat" else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.prep.params.logprobs is not None

    def take(self, out) -> list[int]:
        """Record one engine output; the new token ids."""
        self.seq = out.seq
        self.pieces.append(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason
        return out.new_token_ids

    def new_logprobs(self, count: int) -> list[tuple[int, Any]]:
        """The next ``count`` output tokens with their logprob entries."""
        start = self._logprobs_out
        self._logprobs_out += count
        entries = self.seq.output_logprobs if self.seq is not None else []
        return list(zip(self.token_ids[start:start + count], entries[start:start + count]))

    # ---- completions ---------------------------------------------------------------------
    def echo_text(self) -> str:
        return self.prep.prompt_texts[self.prompt_index] if self.prep.echo else ""

    def prompt_logprob_pairs(self) -> list[tuple[int, Any]]:
        prompt = np.asarray(self.prep.prompts[self.prompt_index]).tolist()
        entries = self.seq.prompt_logprobs if self.seq is not None else []
        return list(zip(prompt, entries + [None] * (len(prompt) - len(entries))))

    def completion_logprobs(self, pairs: list[tuple[int, Any]]) -> dict:
        out, self._offset = completion_logprobs(pairs, self.texts, self._offset)
        return out

    def completion(self) -> dict:
        """The whole choice (non-streamed)."""
        logprobs = None
        if self.wants_logprobs:
            pairs = (self.prompt_logprob_pairs() if self.prep.echo else []) + self.new_logprobs(len(self.token_ids))
            logprobs = self.completion_logprobs(pairs)
        return P.completion_choice(self.index, self.echo_text() + "".join(self.pieces), self.finish_reason,
                                   logprobs, self.token_ids if self.prep.return_token_ids else None)

    # ---- chat ----------------------------------------------------------------------------
    def chat(self) -> dict:
        parser = self.parser
        parser.feed("".join(self.pieces), final=True)
        logprobs = chat_logprobs(self.new_logprobs(len(self.token_ids)), self.texts) if self.wants_logprobs else None
        return {"index": self.index, "message": parser.message(), "logprobs": logprobs,
                "finish_reason": self.chat_finish_reason(self.finish_reason)}

    def chat_finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` when the answer called tools, except for a named tool_choice, which
        OpenAI (and vLLM) end with ``stop``."""
        return reason if self.prep.tool_mode == "named" else self.parser.finish_reason(reason)
