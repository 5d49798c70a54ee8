"""One request's state in the engine: tokens, KV-cache blocks, progress, text, timings."""

from __future__ import annotations

import enum
import functools
import time

import numpy as np

from glm_fused.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"    # queued (new, or preempted: to be recomputed), holds no KV-cache blocks
    RUNNING = "running"    # holds blocks; prefilling or decoding
    FINISHED = "finished"  # blocks returned


class Sequence:
    """A request: its prompt, generated tokens, KV-cache blocks, and how much of it is cached."""

    def __init__(self, request_id: str, prompt_token_ids, params: SamplingParams,
                 detokenizer=None, arrival_time: float | None = None, max_len: int = 1 << 62,
                 sampling_seed: int | None = None, grammar=None, stop_ids: frozenset[int] = frozenset()):
        """``sampling_seed``: the seed of the draws (default: the request's own, else fresh);
        ``grammar``: a ``glm_fused.engine.structured.GrammarState`` its tokens must follow;
        ``stop_ids``: the ids that end it (EOS, ``stop_token_ids``), which ``min_tokens`` holds back."""
        if len(prompt_token_ids) == 0:
            raise ValueError("empty prompt")
        self.request_id = request_id
        try:  # a copy: the caller's list or array may change
            self._prompt_array = np.array(prompt_token_ids, dtype=np.int64)
        except OverflowError:
            raise ValueError("a prompt token id does not fit in 64 bits") from None
        # A step reads slices of the array; the whole prompt as a list of ints only when asked
        # (``prompt_token_ids``: 0.05 ms for 2,080 ids, on the way of a request to its first token).
        self.prompt_len = len(self._prompt_array)
        self.params = params
        self.max_len = max_len  # the context limit: prompt + output
        self.output_token_ids: list[int] = []
        self.status = Status.WAITING
        self.num_computed = 0     # tokens whose keys/values are in the cache
        self.num_inflight = 0     # tokens sampled on the device whose value the host has not seen yet
        # KV-cache bookkeeping (glm_fused.engine.block_manager): the blocks held, in position
        # order; the keys of full blocks (computed once: tokens never change) and the running
        # hash they are digested from; how many leading blocks are in the prefix cache.
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.block_hasher = None
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        # This sequence's row in the runner's per-sequence device state (the token it sampled
        # last, read by the next step's placeholder): from its first admission to its end.
        self.row: int | None = None
        self.finish_reason: str | None = None
        self.sampling_seed = params.sampling_seed() if sampling_seed is None else sampling_seed
        self.grammar = grammar
        self.stop_ids = stop_ids
        # Logprobs, when asked: per output token (logprob, top ids, top logprobs); per prompt
        # token the same, None for the first (nothing predicts it).
        self.output_logprobs: list[tuple[float, list[int], list[float]]] = []
        self.prompt_logprobs: list[tuple[float, list[int], list[float]] | None] = \
            [None] if params.prompt_logprobs is not None else []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.scheduled_time: float | None = None  # first admitted to a step (queue time ends)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Text (only with a detokenizer: glm_fused.tokenizer.TextStream or alike, with
        # step(id) -> str and flush() -> str): output so far, cut at a stop string; `_sent`
        # chars were already handed out as deltas.
        self.detokenizer = detokenizer
        self.text = ""
        self._sent = 0
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self._cut = False  # text was cut at a stop string: it is final

    # ---- sizes ---------------------------------------------------------------------------
    @functools.cached_property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as plain ints (made once, when first read)."""
        return self._prompt_array.tolist()

    @property
    def reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last, except
        that prompt tokens still to be scored (echo) need their previous position's logits,
        so those positions are computed (as vLLM, which skips the cache for prompt logprobs)."""
        if self.params.prompt_logprobs is not None:
            return min(self.num_tokens - 1, len(self.prompt_logprobs) - 1)
        return self.num_tokens - 1

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sample (on the host
        or still in flight)."""
        return self.num_tokens + self.num_inflight - self.num_computed

    @property
    def waits_for_host(self) -> bool:
        """Whether its next draw needs its last token on the host: a grammar advances with each
        token (the mask of the next step comes from it), penalties count the tokens. Such a
        sequence never gets a step with a token in flight (no overlapped step)."""
        return self.grammar is not None or self.params.penalized

    @property
    def wants_more(self) -> bool:
        """Whether another token may still be generated, counting those in flight (EOS and stop
        strings are only known once a token reaches the host)."""
        if self.num_inflight and self.waits_for_host:
            return False
        made = len(self.output_token_ids) + self.num_inflight
        return made < self.params.max_tokens and self.num_tokens + self.num_inflight < self.max_len

    @property
    def next_sample_index(self) -> int:
        """The output index of the next token to be drawn (what its uniforms are keyed by)."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output (a prefill chunk, or the last sample); -1 for
        a token still in flight (the runner reads it from the device)."""
        p, n = self.prompt_len, self.num_tokens
        if end <= p:
            known = self._prompt_array[start:end].tolist()
        elif start >= p:
            known = self.output_token_ids[start - p:end - p]
        else:
            known = self._prompt_array[start:].tolist() + self.output_token_ids[:end - p]
        return known + [-1] * (min(end, n + self.num_inflight) - max(start, n))

    def token_bytes(self, start: int, end: int) -> bytes:
        """Tokens ``start:end`` as int64 bytes (the prefix cache's keys hash them); all known."""
        if end <= self.prompt_len:
            return self._prompt_array[start:end].tobytes()
        return np.asarray(self.token_ids(start, end), dtype=np.int64).tobytes()

    # ---- generation ----------------------------------------------------------------------
    def append_token(self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int,
                     now: float | None = None) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(int(token_id))
        params = self.params
        if self.grammar is not None:
            if not self.grammar.accept(token_id):  # the mask allows only what it accepts: a bug
                self.finish_reason = "abort"
                return
            if self.grammar.terminated:  # it took a stop token: the answer is complete
                self.finish_reason = "stop"
                return
        if not params.ignore_eos and token_id in eos_token_ids:
            self.finish_reason = "stop"   # the EOS token counts as generated, shows no text
            return
        if token_id in params.stop_token_ids:
            self.finish_reason = "stop"
            return
        if self.detokenizer is not None:
            old_len = len(self.text)
            self.text += self.detokenizer.step(token_id)
            # Stop strings count from min_tokens on, as vLLM's.
            if len(self.output_token_ids) > params.min_tokens and self._check_stop_strings(old_len):
                return
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = "length"

    def _check_stop_strings(self, old_len: int) -> bool:
        if not self._max_stop or len(self.text) == old_len:
            return False
        # Earlier text was already searched: a new match must end inside the new text.
        start = max(0, old_len - self._max_stop + 1)
        hits = [(i, len(s)) for i, s in ((self.text.find(s, start), s) for s in self.params.stop) if i >= 0]
        if hits:
            at, size = min(hits)
            self.text = self.text[:at + (size if self.params.include_stop_str_in_output else 0)]
            self.finish_reason = "stop"
            self._cut = True
            return True
        return False

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finish_reason = self.finish_reason or reason
        self.status = Status.FINISHED
        if self.detokenizer is not None and not self._cut:
            # An incomplete character at the very end is shown as-is when the sequence ends.
            self.text += self.detokenizer.flush()

    def take_text_delta(self) -> str:
        """New text since the last call. While running, text that could still turn out to
        be the start of a stop string is held back."""
        end = len(self.text)
        if not self.finished and self._max_stop:
            for size in range(min(self._max_stop - 1, end - self._sent), 0, -1):
                tail = self.text[end - size:]
                if any(s.startswith(tail) for s in self.params.stop):
                    end -= size
                    break
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta
