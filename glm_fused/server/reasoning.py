"""The ``glm45`` reasoning parser: GLM-4.5's ``<think>...</think>`` block becomes
``reasoning_content``, the text after it ``content``; for a whole answer and piece by piece
while streaming (pieces of any length; a tag may be split across pieces).

Where the answer starts is read from the prompt, as vLLM's ``glm45`` parser reads it from
the prompt's token ids: GLM's template ends the generation prompt with ``<|assistant|>``
when thinking is on (the answer opens its own ``<think>``), and with
``<|assistant|>\\n<think></think>`` when ``enable_thinking`` is false (everything is content).
A template whose prompt ends inside an open ``<think>`` starts the answer in reasoning.

Behaviour (vLLM's, with streamed and whole answers always agreeing):
* ``<think>R</think>C`` gives reasoning ``R`` and content ``C``; an empty block gives no
  reasoning (``None``); newlines before ``<think>`` and at the start of the content (the
  template's separators) are dropped;
* an answer that does not open with ``<think>`` is all content, tags later in the text
  included;
* an answer cut off inside the block (``max_tokens``) is all reasoning, content ``None``
  (vLLM's streamed result; its whole-text path returns the raw text as content instead).

Text-based, not token-based: the tags are added tokens that ``decode`` keeps (not special),
so matching decoded text is exact, and it works for any tokenizer piece boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
ASSISTANT = "<|assistant|>"

# Where an answer begins.
EXPECT = "expect"        # may open a think block (thinking on)
REASONING = "reasoning"  # inside a block the prompt opened
CONTENT = "content"      # the block is over (thinking off): all content


def start_state(prompt: str) -> str:
    """Where the answer to ``prompt`` (the rendered chat prompt) begins: look at the text
    after the last ``<|assistant|>``, as vLLM's ``is_reasoning_end`` does on token ids."""
    tail = prompt.rsplit(ASSISTANT, 1)[-1]
    if THINK_END in tail:
        return CONTENT
    if THINK_START in tail:
        return REASONING
    return EXPECT


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``tags`` (text
    to hold back: the tag may complete in the next piece)."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


@dataclass
class ReasoningDelta:
    """New text of each kind from one ``feed``/``finish`` call ('' when none)."""

    reasoning: str = ""
    content: str = ""


class Glm45ReasoningParser:
    """Splits one answer; feed its text in order, then call ``finish`` once."""

    def __init__(self, prompt: str = "", state: str | None = None):
        self.state = state or start_state(prompt)
        self._held = ""               # text that may be the beginning of a tag
        self._content_started = False  # newlines before the first content are separators
        self.reasoning = ""            # totals so far
        self.content = ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        buf, self._held = self._held + text, ""
        while buf:
            if self.state == EXPECT:
                buf = buf.lstrip("\n")
                if not buf:
                    break  # only separators so far
                if buf.startswith(THINK_START):
                    self.state, buf = REASONING, buf[len(THINK_START):]
                elif THINK_START.startswith(buf):
                    self._held, buf = buf, ""  # '<thi': wait for the rest
                else:
                    self.state = CONTENT
            elif self.state == REASONING:
                end = buf.find(THINK_END)
                if end >= 0:
                    out.reasoning += buf[:end]
                    self.state, buf = CONTENT, buf[end + len(THINK_END):]
                else:
                    keep = partial_tag(buf, (THINK_END,))
                    out.reasoning += buf[:len(buf) - keep]
                    self._held, buf = buf[len(buf) - keep:], ""
            else:
                if not self._content_started:
                    buf = buf.lstrip("\n")
                    self._content_started = bool(buf)
                out.content += buf
                buf = ""
        return self._count(out)

    def finish(self) -> ReasoningDelta:
        """The end of the answer: text held back as a possible tag is what it is."""
        out = ReasoningDelta()
        held, self._held = self._held, ""
        if held:
            if self.state == REASONING:
                out.reasoning = held
            else:  # an unfinished '<think' at the start is text
                self.state = CONTENT
                out.content = held
        return self._count(out)

    def _count(self, out: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def result(self) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` so far, ``None`` where empty (as vLLM)."""
        return self.reasoning or None, self.content or None
