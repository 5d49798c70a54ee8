"""Sampling parameters, the per-step batch of them, and the reference sampler (numpy).

How a token is drawn (the same on the host and on the device): greedy is ``argmax`` (lowest
id on ties). Otherwise the logits are divided by the temperature, top-k and then top-p keep
the most likely candidates, and the token is the Gumbel-max over the kept ones,
``argmax(x_v + g_v)`` with ``g_v = -log(-log(u_v))``. That draws exactly from
``softmax(x)`` restricted to the kept set. The uniforms ``u_v`` are a counter-based hash of
``(the sequence's seed, the token's index in the output, v)`` — no generator state — so a
seeded request draws the same tokens whatever shares its batch, on whichever rank or device
samples, and the device sampler (``Ops.sample``) reproduces this file's draws.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

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
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False   # benchmarks: always generate max_tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParam("temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be a positive integer, or 0 or -1 for the whole vocabulary, "
                                        f"got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidParam("seed", f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if len(self.stop) > 16:
            raise InvalidParam("stop", f"at most 16 stop strings, got {len(self.stop)}")

    def sampling_seed(self) -> int:
        """The seed of this request's draws: its own, or fresh OS entropy when unseeded."""
        return self.seed if self.seed is not None else secrets.randbits(63)


# ---- the counter-based uniforms ----------------------------------------------------------
# SplitMix64 (Steele, Lea, Flood 2014): a 64-bit mix with full avalanche, so neighbouring
# (seed, step, token) triples give independent-looking uniforms. Written with wrapping 64-bit
# arithmetic; the device version (TorchOps.sample) does the same on int64 tensors.
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
        return x ^ (x >> np.uint64(31))


def row_key(seed: int, step: int) -> int:
    """One sequence's key for its ``step``-th output token, as a signed int64 (tensor-friendly)."""
    with np.errstate(over="ignore"):
        key = splitmix64(np.uint64(seed) + np.uint64(GOLDEN) * np.uint64(step + 1))
    return int(key.astype(np.int64))


def uniforms(key: int, vocab: int) -> np.ndarray:
    """``u_v`` in (0, 1), float64, for v in 0..vocab-1: 53 bits of ``mix(key + (v+1)*golden)``."""
    with np.errstate(over="ignore"):
        x = np.uint64(np.int64(key).astype(np.uint64)) + np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(GOLDEN)
    bits = splitmix64(x) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) / float(1 << 53)


def sample(logits: np.ndarray, params: SamplingParams, key: int) -> int:
    """One token id from a row of logits ``[vocab]``; ``key`` is ``row_key(seed, step)``."""
    logits = np.asarray(logits)
    if params.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    vocab = x.shape[-1]
    keep = np.ones(vocab, dtype=bool)
    if 0 < params.top_k < vocab:
        # The k largest, lowest id first among equals.
        order = np.lexsort((np.arange(vocab), -x))
        keep[:] = False
        keep[order[:params.top_k]] = True
    if params.top_p < 1.0:
        ids = np.flatnonzero(keep)
        ids = ids[np.lexsort((ids, -x[ids]))]  # most likely first
        probs = np.exp(x[ids] - x[ids[0]])
        probs /= probs.sum()
        # Keep tokens while the mass BEFORE them is below top_p: the first always stays.
        before = np.cumsum(probs) - probs
        keep[:] = False
        keep[ids[before < params.top_p]] = True
    g = -np.log(-np.log(uniforms(key, vocab)))
    return int(np.argmax(np.where(keep, x + g, -np.inf)))


@dataclass
class SamplingBatch:
    """The sampling settings of one step's rows, as arrays (what the device sampler takes)."""

    temperature: np.ndarray   # float32 [S]; 0 = greedy
    top_k: np.ndarray         # int64 [S]; 0 = off
    top_p: np.ndarray         # float32 [S]; 1 = off
    keys: np.ndarray          # int64 [S]: row_key(seed, step) of each row

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int]]) -> "SamplingBatch":
        """``rows``: (params, key) per sampled row, in the order of the batch's logits."""
        return cls(temperature=np.array([p.temperature for p, _ in rows], dtype=np.float32),
                   top_k=np.array([p.top_k for p, _ in rows], dtype=np.int64),
                   top_p=np.array([p.top_p for p, _ in rows], dtype=np.float32),
                   keys=np.array([k for _, k in rows], dtype=np.int64))

    def to_array(self) -> np.ndarray:
        """One int64 array (floats as their float64 bits), for the broadcast to the other ranks."""
        floats = np.stack([self.temperature, self.top_p]).astype(np.float64).view(np.int64)
        return np.concatenate([[len(self.keys)], floats.reshape(-1), self.top_k, self.keys]).astype(np.int64)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> tuple["SamplingBatch", int]:
        """The batch, and how many int64 values of ``arr`` it took."""
        n = int(arr[0])
        floats = np.ascontiguousarray(arr[1:1 + 2 * n]).view(np.float64).reshape(2, n).astype(np.float32)
        rest = arr[1 + 2 * n:]
        return cls(temperature=floats[0], top_p=floats[1], top_k=rest[:n].copy(), keys=rest[n:2 * n].copy()), 1 + 4 * n

    def sample_on_host(self, logits: np.ndarray) -> np.ndarray:
        """The reference: ``sample`` row by row."""
        out = np.empty(len(self.keys), dtype=np.int64)
        for i in range(len(out)):
            params = SamplingParams(temperature=float(self.temperature[i]), top_k=int(self.top_k[i]),
                                    top_p=float(self.top_p[i]))
            out[i] = sample(logits[i], params, int(self.keys[i]))
        return out
