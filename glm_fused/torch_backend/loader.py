"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors; this file only
copies each float32 array into its parameter (cast to the parameter's dtype; the router
stays fp32 because its parameters are fp32) and checks that every parameter got exactly one.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from glm_fused.checkpoint import expected_shapes, load_rank_weights
from glm_fused.config import Glm4MoeConfig
from glm_fused.sharding import TPShard


@torch.no_grad()
def load_weights(model: torch.nn.Module, model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
                 progress: bool = True) -> None:
    params = dict(model.named_parameters())
    load_rank_weights(model_dir, config, shard, {n: tuple(p.shape) for n, p in params.items()},
                      lambda name, array: params[name].copy_(torch.from_numpy(array)), progress)


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at the real sizes (``--load-format dummy``): N(0, 0.02), norms ones.

    Deterministic per (seed, parameter, rank). Router parameters are replicated, so they are
    drawn without the rank: every rank must route a token to the same experts.
    """
    kinds = {name: kind for name, (_, kind) in expected_shapes(model.config, model.shard).items()}
    for name, param in model.named_parameters():
        kind = kinds.get(name, "weight")
        if kind == "norm":
            param.fill_(1.0)
            continue
        owner = "all" if kind == "router" else model.shard.rank
        generator = torch.Generator(device=param.device)
        generator.manual_seed(zlib.crc32(f"{seed}:{name}:{owner}".encode()))
        param.normal_(0.0, 0.02, generator=generator)
