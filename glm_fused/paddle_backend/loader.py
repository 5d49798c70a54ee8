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

from glm_fused.checkpoint import expected_shapes, load_rank_weights
from glm_fused.config import Glm4MoeConfig
from glm_fused.sharding import TPShard


@paddle.no_grad()
def load_weights(model: nn.Layer, model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
                 progress: bool = True) -> None:
    params = dict(model.named_parameters())

    def assign(name, array):
        # float32 host array -> device, then the cast (numpy has no bfloat16).
        params[name].set_value(paddle.to_tensor(array, dtype="float32").astype(params[name].dtype))

    load_rank_weights(model_dir, config, shard, {n: tuple(p.shape) for n, p in params.items()}, assign,
                      progress)


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
