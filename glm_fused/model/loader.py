"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors and makes sure every
parameter gets exactly one; this file only hands each array to the framework
(``Ops.copy_into``: to the parameter's device and dtype; the router stays fp32 because its
parameters are fp32).
"""

from __future__ import annotations

from pathlib import Path

from glm_fused.checkpoint import expected_shapes, load_rank_weights


def load_weights(model, model_dir: str | Path, progress: bool = True) -> None:
    F = model.F
    params = dict(model.named_parameters())
    with F.no_grad():
        load_rank_weights(model_dir, model.config, model.shard, {n: tuple(p.shape) for n, p in params.items()},
                          lambda name, array: F.copy_into(params[name], array), progress)


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
