"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors and makes sure every
parameter gets exactly one; the framework's weight writer (``Ops.weight_writer``) copies each
planned slice, as stored, into its place in the parameter, converting once to the
parameter's dtype (the router stays fp32 because its parameters are fp32).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from glm_fused.checkpoint import expected_shapes, load_rank_weights


@dataclass(frozen=True)
class LoadStats:
    """What one rank read: checkpoint bytes as stored, and the seconds from opening the
    checkpoint to the last byte in place."""
    bytes: int
    seconds: float

    @property
    def gib_per_s(self) -> float:
        return self.bytes / 2**30 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        size = f"{self.bytes / 2**30:.2f} GiB" if self.bytes >= 2**30 / 10 else f"{self.bytes / 2**20:.1f} MiB"
        return f"{self.gib_per_s:.2f} GiB/s ({size} in {self.seconds:.2f} s)"


def load_weights(model, model_dir: str | Path, progress: bool = True) -> LoadStats:
    F = model.F
    params = dict(model.named_parameters())
    t0 = time.perf_counter()
    with F.no_grad(), F.weight_writer(model.device) as writer:
        nbytes = load_rank_weights(model_dir, model.config, model.shard,
                                   {n: tuple(p.shape) for n, p in params.items()},
                                   lambda name, parts: writer.write(params[name], parts), progress)
    return LoadStats(nbytes, time.perf_counter() - t0)


def dummy_weights(model, seed: int = 0) -> None:
    """Random weights at the real sizes (``--load-format dummy``): N(0, 0.02), norms ones.

    Deterministic per (seed, parameter, rank). Router parameters are replicated, so they are
    drawn without the rank: every rank must route a token to the same experts.
    """
    F = model.F
    kinds = {name: kind for name, (_, kind) in expected_shapes(model.config, model.shard).items()}
    with F.no_grad():
        for name, param in model.named_parameters():
            kind = kinds.get(name, "weight")
            if kind == "norm":
                F.fill(param, 1.0)
                continue
            owner = "all" if kind == "router" else model.shard.rank
            F.fill_normal(param, 0.02, f"{seed}:{name}:{owner}")
