"""The glm45 reasoning parser: whole answers, and the same answers streamed in pieces of every
length (tags split anywhere) and token by token through the tiny tokenizer."""

from __future__ import annotations

import random

import pytest

from glm_fused import tiny
from glm_fused.server.reasoning import CONTENT, EXPECT, REASONING, Glm45ReasoningParser, start_state
from glm_fused.tokenizer import Tokenizer


def parse_reasoning(text: str, prompt: str = "") -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a whole answer to ``prompt``: fed in one piece."""
    parser = Glm45ReasoningParser(prompt)
    parser.feed(text)
    parser.finish()
    return parser.result()


# Generation prompts as GLM-4.5's template ends them.
THINKING_ON = "[gMASK]<sop><|user|>\nWhat is 2+2?<|assistant|>"
THINKING_OFF = "[gMASK]<sop><|user|>\nWhat is 2+2?/nothink<|assistant|>\n<think></think>"
# A template that opens the block itself (GLM-4.6/4.7 style).
OPENED = "[gMASK]<sop><|user|>\nWhat is 2+2?<|assistant|><think>"

# (prompt, answer text, reasoning_content, content)
CASES = [
    (THINKING_ON, "\n<think>Two and two.\nThat is four.</think>\nThe answer is 4.",
     "Two and two.\nThat is four.", "The answer is 4."),
    (THINKING_ON, "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    (THINKING_ON, "<think>This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat"),
    (THINKING_ON, "<think>This is a reasoning section</think>", "This is a reasoning section", None),
    (THINKING_ON, "<think></think>This is the rest", None, "This is the rest"),
    (THINKING_ON, "<think></think>", None, None),
    # Stopped inside the block (max_tokens): all reasoning.
    (THINKING_ON, "\n<think>Still working on the capital of", "Still working on the capital of", None),
    (THINKING_ON, "<think>ends on a partial tag </thi", "ends on a partial tag </thi", None),
    # No block opened: all content, later tags included.
    (THINKING_ON, "This is the rest", None, "This is the rest"),
    (THINKING_ON, "Plain </think> text <think>", None, "Plain </think> text <think>"),
    (THINKING_ON, "<thi", None, "<thi"),
    (THINKING_ON, "\n<b>bold</b>", None, "<b>bold</b>"),
    # Content keeps its inner and trailing newlines and later tags.
    (THINKING_ON, "<think>a</think>\n\nline1\n\nline2\n", "a", "line1\n\nline2\n"),
    (THINKING_ON, "<think>a</think>b</think>c", "a", "b</think>c"),
    (THINKING_ON, "<think>a <think> b</think>c", "a <think> b", "c"),
    # Thinking off: the prompt closed the block, everything is content.
    (THINKING_OFF, "\nThe answer is 4.", None, "The answer is 4."),
    (THINKING_OFF, "<think>not reasoning</think>tail", None, "<think>not reasoning</think>tail"),
    (THINKING_OFF, "\n", None, None),
    # The prompt opened the block.
    (OPENED, "adding up</think>\nfour", "adding up", "four"),
    (OPENED, "never closed", "never closed", None),
]


def stream(prompt: str, pieces) -> tuple[str, str, Glm45ReasoningParser]:
    parser = Glm45ReasoningParser(prompt)
    reasoning, content = "", ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    delta = parser.finish()
    return reasoning + delta.reasoning, content + delta.content, parser


@pytest.mark.parametrize("prompt,text,reasoning,content", CASES)
def test_whole_answer(prompt, text, reasoning, content):
    assert parse_reasoning(text, prompt) == (reasoning, content)


@pytest.mark.parametrize("prompt,text,reasoning,content", CASES)
def test_streamed_in_pieces_of_every_length(prompt, text, reasoning, content):
    for size in range(1, len(text) + 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got_r, got_c, parser = stream(prompt, pieces)
        assert (got_r or None, got_c or None) == (reasoning, content), size
        assert parser.result() == (reasoning, content)


@pytest.mark.parametrize("prompt,text,reasoning,content", CASES)
def test_streamed_in_random_pieces_with_empty_ones(prompt, text, reasoning, content):
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got_r, got_c, _ = stream(prompt, pieces)
        assert (got_r or None, got_c or None) == (reasoning, content)


def test_deltas_never_show_part_of_a_tag():
    parser = Glm45ReasoningParser(THINKING_ON)
    shown = []
    for ch in "<think>abc</think>xyz":
        delta = parser.feed(ch)
        shown.append(delta.reasoning + delta.content)
    assert "".join(shown) == "abcxyz"
    assert all("<" not in s and ">" not in s for s in shown)
    assert parser.state == CONTENT


def test_start_state_reads_the_last_assistant_turn():
    assert start_state(THINKING_ON) == EXPECT
    assert start_state(THINKING_OFF) == CONTENT
    assert start_state(OPENED) == REASONING
    history = "<|user|>\nHi<|assistant|>\n<think></think>\nHello<|user|>\nAgain<|assistant|>"
    assert start_state(history) == EXPECT
    assert start_state("no chat markup at all") == EXPECT


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(tiny.ensure_tiny_checkpoint())


@pytest.mark.parametrize("thinking", [True, False])
def test_prompts_from_the_chat_template(tok, thinking):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=thinking)
    assert start_state(prompt) == (EXPECT if thinking else CONTENT)


def test_token_by_token_through_the_tiny_tokenizer(tok):
    text = "\n<think>The lighthouse stands at the end.</think>\nA river begins as rain, naïve café 🙂."
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the tags survive decoding (they are not special tokens)
    decoder = tok.text_stream()
    pieces = [decoder.step(i) for i in ids] + [decoder.flush()]
    got_r, got_c, _ = stream(THINKING_ON, pieces)
    assert (got_r, got_c) == ("The lighthouse stands at the end.", "A river begins as rain, naïve café 🙂.")
