"""Sampling parameters, the per-step batch of them, and the reference sampler (numpy).

How a token is drawn (the same on the host and on the device, ``Ops.sample``), in vLLM's
order, from the model's logits ``x`` (float32, then float64 for every rule below):

1. a grammar (structured output) sets the tokens it does not allow to ``-inf``;
2. ``min_tokens``: until that many tokens are out, the stop tokens (EOS unless ignored, and
   ``stop_token_ids``) are ``-inf``;
3. ``logit_bias`` adds its value to its tokens;
4. penalties: ``repetition_penalty`` ``r`` divides a positive logit by ``r`` and multiplies a
   negative one by ``r`` for every token of the prompt or the output; then
   ``x_v -= frequency_penalty * count_v + presence_penalty * (count_v > 0)`` with ``count_v``
   the occurrences of ``v`` in the output;
5. greedy (``temperature == 0``) is ``argmax`` (lowest id on ties). Otherwise the logits are
   divided by the temperature; ``min_p`` keeps tokens whose probability is at least ``min_p``
   times the largest (``exp(x_v - max x) >= min_p``); top-k and then top-p keep the most
   likely of those; the token is the Gumbel-max over the kept ones,
   ``argmax(x_v + g_v)`` with ``g_v = -log(-log(u_v))``, which draws exactly from
   ``softmax(x)`` restricted to the kept set.

The uniforms ``u_v`` are a counter-based hash of ``(the sequence's seed, the token's index in
the output, v)`` — no generator state — so a seeded request draws the same tokens whatever
shares its batch, on whichever rank or device samples, and the device sampler reproduces this
file's draws. Logprobs (``logprobs``, ``prompt_logprobs``) are those of the model's raw
distribution, ``log_softmax`` of the logits before any rule above (vLLM's default).
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np


class InvalidParam(ValueError):
    """A request parameter out of range; ``param`` names it (the server answers 400).
    ``code``: OpenAI's error code where one exists (``context_length_exceeded``)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 (or -1) means the whole vocabulary; other negatives are refused
    min_p: float = 0.0         # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False   # benchmarks: always generate max_tokens
    min_tokens: int = 0        # stop tokens are held back until this many tokens are out
    repetition_penalty: float = 1.0   # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None         # top-N logprobs of every output token (0: the chosen one's only)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        # JSON (the trip from the preprocessing workers) turns int keys into strings.
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the tokens generated so far (so the next draw needs them)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParam("temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**63:  # the samplers hold it in int64
            raise InvalidParam("top_k", f"top_k must be a positive 64-bit integer, or 0 or -1 for the whole "
                                        f"vocabulary, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidParam("seed", f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if len(self.stop) > 16:
            raise InvalidParam("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                                             f"got {self.min_tokens!r}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be in (0, 100] (1 = off), "
                                                     f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise InvalidParam("logit_bias", f"logit_bias: token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise InvalidParam("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} "
                                                 f"for token {token}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidParam(name, f"{name} must be a non-negative integer, got {value!r}")

    def sampling_seed(self) -> int:
        """The seed of this request's draws: its own, or fresh OS entropy when unseeded (the
        engine derives unseeded requests' seeds from its global seed instead)."""
        return self.seed if self.seed is not None else secrets.randbits(63)


# ---- the counter-based uniforms ----------------------------------------------------------
# SplitMix64 (Steele, Lea, Flood 2014): a 64-bit mix with full avalanche, so neighbouring
# (seed, step, token) triples give independent-looking uniforms. Written with wrapping 64-bit
# arithmetic; the device version (TorchOps.sample) does the same on int64 tensors.
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
        return x ^ (x >> np.uint64(31))


def row_key(seed: int, step: int) -> int:
    """One sequence's key for its ``step``-th output token, as a signed int64 (tensor-friendly):
    ``splitmix64(seed + golden * (step + 1))``, here in Python ints masked to 64 bits, which
    takes 1 us where numpy scalars take 30 (a call per sampled row per step)."""
    x = (seed + GOLDEN * (step + 1)) & _U64
    x = ((x ^ (x >> 30)) * MIX1) & _U64
    x = ((x ^ (x >> 27)) * MIX2) & _U64
    x ^= x >> 31
    return x - (1 << 64) if x >> 63 else x


def derive_seed(seed: int, index: int) -> int:
    """A seed in [0, 2**63) for the ``index``-th stream under ``seed`` (the engine's global
    seed and its request counter; a request's seed and its ``n`` choices)."""
    return row_key(seed, index) & (2**63 - 1)


def uniforms(key: int, vocab: int) -> np.ndarray:
    """``u_v`` in (0, 1), float64, for v in 0..vocab-1: 53 bits of ``mix(key + (v+1)*golden)``."""
    with np.errstate(over="ignore"):
        x = np.uint64(np.int64(key).astype(np.uint64)) + np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    bits = splitmix64(x) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) / float(1 << 53)


def bitmask_to_bool(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One grammar bitmask row (int32 words) as bools: token ``t`` is bit ``t % 32`` of word ``t // 32``."""
    words = np.ascontiguousarray(np.asarray(row, dtype=np.int32).astype("<i4", copy=False))
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
    if len(bits) < vocab_size:  # a mask narrower than the logits: the rest is not allowed
        bits = np.concatenate([bits, np.zeros(vocab_size - len(bits), dtype=bool)])
    return bits


def draw(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, key: int) -> int:
    """Rule 5 for one row of processed float64 logits ``[vocab]``."""
    if temperature == 0.0:
        return int(np.argmax(x))
    x = x / temperature
    vocab = x.shape[-1]
    keep = np.ones(vocab, dtype=bool)
    if min_p > 0.0:
        keep &= np.exp(x - x.max()) >= min_p
    if 0 < top_k < vocab:
        # The k largest, lowest id first among equals.
        order = np.lexsort((np.arange(vocab), -x))
        top = np.zeros(vocab, dtype=bool)
        top[order[:top_k]] = True
        keep &= top
    if top_p < 1.0:
        ids = np.flatnonzero(keep)
        ids = ids[np.lexsort((ids, -x[ids]))]  # most likely first
        probs = np.exp(x[ids] - x[ids[0]])
        probs /= probs.sum()
        # Keep tokens while the mass BEFORE them is below top_p: the first always stays.
        before = np.cumsum(probs) - probs
        keep[:] = False
        keep[ids[before < top_p]] = True
    g = -np.log(-np.log(uniforms(key, vocab)))
    return int(np.argmax(np.where(keep, x + g, -np.inf)))


def sample(logits: np.ndarray, params: SamplingParams, key: int) -> int:
    """One token id from a row of logits ``[vocab]``; ``key`` is ``row_key(seed, step)`` (a
    fresh sequence: no history, no grammar)."""
    logits = np.asarray(logits, dtype=np.float32)
    return int(SamplingBatch.build([SampleRow(params, key)]).sample_on_host(logits[None])[0])


def logprobs_on_host(logits: np.ndarray, targets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(logprob of each row's target [R], top-n ids [R, n], their logprobs [R, n])`` of the raw
    distribution ``log_softmax(logits)``, float32, most likely first."""
    x = np.asarray(logits, dtype=np.float64)
    peak = x.max(-1, keepdims=True)
    lp = x - (peak + np.log(np.exp(x - peak).sum(-1, keepdims=True)))
    rows = np.arange(len(x))
    chosen = lp[rows, np.asarray(targets, dtype=np.int64)].astype(np.float32)
    if n <= 0:
        return chosen, np.zeros((len(x), 0), np.int64), np.zeros((len(x), 0), np.float32)
    part = np.argpartition(-lp, min(n, lp.shape[1] - 1), axis=-1)[:, :n]
    order = np.argsort(-np.take_along_axis(lp, part, -1), axis=-1, kind="stable")
    ids = np.take_along_axis(part, order, -1).astype(np.int64)
    return chosen, ids, np.take_along_axis(lp, ids, -1).astype(np.float32)


@dataclass
class SampleRow:
    """One logits row to sample: the request's parameters and key, and the state the rules
    read (how many tokens are out, the tokens seen, the grammar's bitmask row)."""

    params: SamplingParams
    key: int
    num_output: int = 0                       # for min_tokens
    stop_ids: Seq[int] = ()                   # what min_tokens holds back
    prompt_ids: Seq[int] = ()                 # for the repetition penalty
    output_ids: Seq[int] = ()                 # for every penalty
    bitmask: np.ndarray | None = None         # int32 words: the grammar's allowed tokens


# The arrays of a SamplingBatch in their broadcast order: (name, kind); kind f = float,
# i = int64, m = int32 bitmask rows.
_ARRAYS = (("temperature", "f"), ("top_p", "f"), ("min_p", "f"), ("repetition", "f"), ("presence", "f"),
           ("frequency", "f"), ("top_k", "i"), ("keys", "i"), ("bias_rows", "i"), ("bias_tokens", "i"),
           ("bias_values", "f"), ("ban_rows", "i"), ("ban_tokens", "i"), ("hist_rows", "i"), ("hist_tokens", "i"),
           ("hist_counts", "i"), ("mask_rows", "i"), ("masks", "m"), ("prompt_rows", "i"), ("prompt_targets", "i"))
_FLOAT32 = {"temperature", "top_p", "min_p", "repetition", "presence", "frequency"}


def _empty(kind: str, name: str = "") -> np.ndarray:
    if kind == "m":
        return np.zeros((0, 0), np.int32)
    return np.zeros(0, np.float32 if name in _FLOAT32 else np.float64 if kind == "f" else np.int64)


@dataclass
class SamplingBatch:
    """What one step samples and scores, as arrays (what the device sampler takes).

    Per sampled row ``[S]``: temperature (0 = greedy), top_p, min_p, the three penalties,
    top_k, and the row's key. Sparse ``(row, token, value)`` lists: ``bias_*`` (logit_bias),
    ``ban_*`` (tokens min_tokens holds back), ``hist_*`` (tokens the penalties read, with
    their count in the output; 0 for prompt-only tokens). ``masks`` holds the grammar bitmask
    rows of the rows ``mask_rows``. ``logprobs``: top-N of every sampled row (-1: none this
    step). ``prompt_rows``: flat token indices of the forward batch whose logits score the
    next prompt token ``prompt_targets`` (echo), with ``prompt_logprobs`` top-N (-1: none).
    """

    temperature: np.ndarray = field(default_factory=lambda: _empty("f", "temperature"))
    top_p: np.ndarray = field(default_factory=lambda: _empty("f", "top_p"))
    min_p: np.ndarray = field(default_factory=lambda: _empty("f", "min_p"))
    repetition: np.ndarray = field(default_factory=lambda: _empty("f", "repetition"))
    presence: np.ndarray = field(default_factory=lambda: _empty("f", "presence"))
    frequency: np.ndarray = field(default_factory=lambda: _empty("f", "frequency"))
    top_k: np.ndarray = field(default_factory=lambda: _empty("i"))
    keys: np.ndarray = field(default_factory=lambda: _empty("i"))
    bias_rows: np.ndarray = field(default_factory=lambda: _empty("i"))
    bias_tokens: np.ndarray = field(default_factory=lambda: _empty("i"))
    bias_values: np.ndarray = field(default_factory=lambda: _empty("f"))
    ban_rows: np.ndarray = field(default_factory=lambda: _empty("i"))
    ban_tokens: np.ndarray = field(default_factory=lambda: _empty("i"))
    hist_rows: np.ndarray = field(default_factory=lambda: _empty("i"))
    hist_tokens: np.ndarray = field(default_factory=lambda: _empty("i"))
    hist_counts: np.ndarray = field(default_factory=lambda: _empty("i"))
    mask_rows: np.ndarray = field(default_factory=lambda: _empty("i"))
    masks: np.ndarray = field(default_factory=lambda: _empty("m"))
    prompt_rows: np.ndarray = field(default_factory=lambda: _empty("i"))
    prompt_targets: np.ndarray = field(default_factory=lambda: _empty("i"))
    logprobs: int = -1
    prompt_logprobs: int = -1

    @property
    def num_rows(self) -> int:
        return len(self.keys)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def plain(self) -> bool:
        """No rule but temperature, top-k/top-p and min_p: the raw logits are drawn from."""
        return not (len(self.bias_rows) or len(self.ban_rows) or len(self.hist_rows) or len(self.mask_rows))

    @classmethod
    def build(cls, rows: list[SampleRow | tuple], *, prompt_rows: Seq[int] = (), prompt_targets: Seq[int] = (),
              prompt_logprobs: int = -1) -> "SamplingBatch":
        """``rows``: one ``SampleRow`` (or ``(params, key)``) per sampled row, in the order of
        the batch's logits."""
        rows = [r if isinstance(r, SampleRow) else SampleRow(*r) for r in rows]
        ps = [r.params for r in rows]
        out = cls(temperature=np.array([p.temperature for p in ps], np.float32),
                  top_p=np.array([p.top_p for p in ps], np.float32),
                  min_p=np.array([p.min_p for p in ps], np.float32),
                  repetition=np.array([p.repetition_penalty for p in ps], np.float32),
                  presence=np.array([p.presence_penalty for p in ps], np.float32),
                  frequency=np.array([p.frequency_penalty for p in ps], np.float32),
                  top_k=np.array([p.top_k for p in ps], np.int64),
                  keys=np.array([r.key for r in rows], np.int64),
                  prompt_rows=np.asarray(prompt_rows, np.int64), prompt_targets=np.asarray(prompt_targets, np.int64),
                  prompt_logprobs=int(prompt_logprobs) if len(prompt_rows) else -1,
                  logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1))
        bias, ban, hist, masks = [], [], [], []
        for i, r in enumerate(rows):
            p = r.params
            bias += [(i, t, v) for t, v in sorted(p.logit_bias.items())]
            if r.num_output < p.min_tokens:
                ban += [(i, t) for t in sorted(set(r.stop_ids))]
            if p.penalized:
                counts = Counter(map(int, r.output_ids))
                if p.repetition_penalty != 1.0:
                    for t in r.prompt_ids:
                        counts.setdefault(int(t), 0)
                hist += [(i, t, c) for t, c in sorted(counts.items())]
            if r.bitmask is not None:
                masks.append((i, np.asarray(r.bitmask, np.int32).reshape(-1)))
        if bias:
            out.bias_rows, out.bias_tokens, values = (np.array(c) for c in zip(*bias))
            out.bias_values = values.astype(np.float64)
            out.bias_rows, out.bias_tokens = out.bias_rows.astype(np.int64), out.bias_tokens.astype(np.int64)
        if ban:
            out.ban_rows, out.ban_tokens = (np.array(c, np.int64) for c in zip(*ban))
        if hist:
            out.hist_rows, out.hist_tokens, out.hist_counts = (np.array(c, np.int64) for c in zip(*hist))
        if masks:
            out.mask_rows = np.array([i for i, _ in masks], np.int64)
            out.masks = np.stack([m for _, m in masks])
        return out

    # ---- one int64 array, for the broadcast to the other ranks ---------------------------
    def to_array(self) -> np.ndarray:
        """Every array with its length (floats as their float64 bits; bitmask words in pairs),
        then the two top-N counts."""
        parts = []
        for name, kind in _ARRAYS:
            a = getattr(self, name)
            if kind == "m":
                words = a.shape[1] if a.size else 0
                flat = np.ascontiguousarray(a, np.int32).reshape(-1)
                if len(flat) % 2:
                    flat = np.concatenate([flat, np.zeros(1, np.int32)])
                parts += [np.array([len(a), words], np.int64), flat.view(np.int64)]
                continue
            data = np.asarray(a, np.float64).view(np.int64) if kind == "f" else np.asarray(a, np.int64)
            parts += [np.array([len(data)], np.int64), data]
        parts.append(np.array([self.logprobs, self.prompt_logprobs], np.int64))
        return np.concatenate(parts).astype(np.int64)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> tuple["SamplingBatch", int]:
        """The batch, and how many int64 values of ``arr`` it took."""
        arr = np.asarray(arr, np.int64)
        at, values = 0, {}
        for name, kind in _ARRAYS:
            if kind == "m":
                n, words = int(arr[at]), int(arr[at + 1])
                size = (n * words + 1) // 2
                flat = np.ascontiguousarray(arr[at + 2:at + 2 + size]).view(np.int32)[:n * words]
                values[name] = flat.reshape(n, words).copy() if n else _empty("m")
                at += 2 + size
                continue
            n = int(arr[at])
            data = np.ascontiguousarray(arr[at + 1:at + 1 + n])
            if kind == "f":
                data = data.view(np.float64).astype(np.float32 if name in _FLOAT32 else np.float64)
            values[name] = data.copy()
            at += 1 + n
        values["logprobs"], values["prompt_logprobs"] = int(arr[at]), int(arr[at + 1])
        return cls(**values), at + 2

    # ---- the reference -------------------------------------------------------------------
    def processed_logits(self, logits: np.ndarray) -> np.ndarray:
        """Rules 1-4: float64 ``[S, vocab]``."""
        x = np.array(logits, dtype=np.float64)
        vocab = x.shape[-1]
        for r, words in zip(self.mask_rows, self.masks):
            x[r, ~bitmask_to_bool(words, vocab)] = -np.inf
        if len(self.ban_rows):
            x[self.ban_rows, self.ban_tokens] = -np.inf
        if len(self.bias_rows):
            x[self.bias_rows, self.bias_tokens] += self.bias_values
        if len(self.hist_rows):
            r, t, c = self.hist_rows, self.hist_tokens, self.hist_counts
            v = x[r, t]
            rep = self.repetition[r].astype(np.float64)
            v = np.where(v > 0, v / rep, v * rep)
            v = v - self.frequency[r].astype(np.float64) * c - self.presence[r].astype(np.float64) * (c > 0)
            x[r, t] = v
        return x

    def sample_on_host(self, logits: np.ndarray) -> np.ndarray:
        """The reference: every rule, row by row."""
        x = self.processed_logits(logits)
        out = np.empty(self.num_rows, dtype=np.int64)
        for i in range(len(out)):
            out[i] = draw(x[i], float(self.temperature[i]), int(self.top_k[i]), float(self.top_p[i]),
                          float(self.min_p[i]), int(self.keys[i]))
        return out
