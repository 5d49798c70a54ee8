"""Counters of the fused calls, and the once-per-reason log of why a call fell back."""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("glm_fused.fusion")


class FusionStats:
    """Counters of one forward; the runners reset them at the start of each.

    ``impl`` always holds both keys so a report shows explicit zeros.
    """

    IMPLS = ("flashinfer", "reference")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.fused_calls = 0
        self.plain_allreduce_calls = 0
        self.impl = Counter({k: 0 for k in self.IMPLS})
        self.fallback_reasons: Counter[str] = Counter()

    def record(self, impl: str, reason: str | None = None) -> None:
        """One fused call served by ``impl``; ``reason`` when it fell back to the reference."""
        self.fused_calls += 1
        self.impl[impl] += 1
        if reason is not None:
            self.fallback_reasons[reason] += 1

    def record_plain_allreduce(self, n: int = 1) -> None:
        self.plain_allreduce_calls += n

    def add(self, other: "FusionStats") -> None:
        """Count ``other``'s calls too (a replayed CUDA graph adds the calls it captured)."""
        self.fused_calls += other.fused_calls
        self.plain_allreduce_calls += other.plain_allreduce_calls
        self.impl.update(other.impl)  # Counter.update adds
        self.fallback_reasons.update(other.fallback_reasons)

    def as_dict(self) -> dict:
        return {
            "fused_allreduce_norm_calls": self.fused_calls,
            "plain_allreduce_calls": self.plain_allreduce_calls,
            "fused_impl": dict(self.impl),
            "fallback_reasons": dict(self.fallback_reasons),
        }


class FallbackLog:
    """Logs each distinct fallback reason once per process (all instances share the memory).

    Per call the reason would flood the log (every decode step, every layer); once is enough
    to tell why the kernel is not running.
    """

    _seen: set[str] = set()
    _lock = threading.Lock()

    def __init__(self, log: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self._log = log or logger
        self._level = level

    def log_once(self, reason: str, level: int | None = None) -> bool:
        """True when this call logged (the reason was new to this process)."""
        with FallbackLog._lock:
            if reason in FallbackLog._seen:
                return False
            FallbackLog._seen.add(reason)
        self._log.log(self._level if level is None else level,
                      "fused all-reduce + RMSNorm falls back to the reference: %s", reason)
        return True

    @classmethod
    def reset(cls) -> None:
        """Forget what was logged (a fresh process's state; for tests run in one process)."""
        with cls._lock:
            cls._seen.clear()

