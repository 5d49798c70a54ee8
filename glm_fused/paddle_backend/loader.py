"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors; this file only
copies each float32 array into its parameter (cast to the parameter's dtype; the router
stays fp32 because its parameters are fp32) and checks that every parameter got exactly one.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import paddle
from paddle import nn

from glm_fused.checkpoint import Checkpoint, expected_shapes, iter_rank_weights
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.sharding import TPShard


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


@paddle.no_grad()
def load_weights(model: nn.Layer, model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
                 progress: bool = True) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, array in iter_rank_weights(Checkpoint(model_dir), config, shard, progress=progress):
        param = params.get(name)
        if param is None:
            raise UserError(f"{model_dir}: the load plan names {name!r}, which the model has no parameter for")
        if name in loaded:
            raise UserError(f"{model_dir}: parameter {name!r} would be loaded twice")
        if tuple(array.shape) != tuple(param.shape):
            raise UserError(f"{model_dir}: tensor for {name!r} has shape {list(array.shape)}, "
                            f"the parameter on rank {shard.rank} is {list(param.shape)}")
        # float32 host array -> device, then the cast (numpy has no bfloat16).
        param.set_value(paddle.to_tensor(array, dtype="float32").astype(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise UserError(f"{model_dir}: no weights loaded for parameter {missing[0]!r}{_more(missing)}")


@paddle.no_grad()
def dummy_weights(model: nn.Layer, seed: int = 0) -> None:
    """Random weights at the real sizes (``--load-format dummy``): N(0, 0.02), norms ones.

    Deterministic per (seed, parameter, rank). Router parameters are replicated, so they are
    drawn without the rank: every rank must route a token to the same experts. Paddle has no
    per-call generator, so the global one is re-seeded per parameter and restored afterwards.
    """
    kinds = {name: kind for name, (_, kind) in expected_shapes(model.config, model.shard).items()}
    saved = paddle.get_rng_state()
    try:
        for name, param in model.named_parameters():
            kind = kinds.get(name, "weight")
            if kind == "norm":
                param.set_value(paddle.ones(param.shape, dtype=param.dtype))
                continue
            owner = "all" if kind == "router" else model.shard.rank
            paddle.seed(zlib.crc32(f"{seed}:{name}:{owner}".encode()))
            value = paddle.normal(0.0, 0.02, shape=param.shape)
            param.set_value(value.astype(param.dtype))
    finally:
        paddle.set_rng_state(saved)
