"""Sampling parameters and the numpy sampler (rank 0 only, on the full-vocabulary logits).

Each sequence owns a numpy ``Generator``: seeded when the request gives a seed, so a seeded
request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

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

    def make_generator(self) -> np.random.Generator:
        # Unseeded requests still get their own generator, from fresh OS entropy.
        return np.random.default_rng(self.seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from a row of logits ``[vocab]``.

    Greedy is ``argmax`` (lowest id on ties). Otherwise temperature, then top-k, then top-p
    (the smallest set of most likely tokens whose probability reaches ``top_p``), then one
    inverse-CDF draw from the sequence's generator.
    """
    logits = np.asarray(logits)
    if params.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    vocab = x.shape[-1]
    # Candidate ids, most likely first. top-k narrows the sort to k entries.
    if 0 < params.top_k < vocab:
        ids = np.argpartition(-x, params.top_k - 1)[:params.top_k]
    else:
        ids = np.arange(vocab)
    ids = ids[np.argsort(-x[ids], kind="stable")]
    z = x[ids]
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep tokens while the mass BEFORE them is below top_p: the first always stays.
        before = np.cumsum(probs) - probs
        keep = int(np.count_nonzero(before < params.top_p))
        ids, probs = ids[:keep], probs[:keep]
        probs = probs / probs.sum()
    cdf = np.cumsum(probs)
    pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(pick, len(ids) - 1)])
