"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors; this file only
copies each float32 array into its parameter (cast to the parameter's dtype; the router
stays fp32 because its parameters are fp32) and checks that every parameter got exactly one.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from glm_fused.checkpoint import Checkpoint, expected_shapes, iter_rank_weights
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.sharding import TPShard


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


@torch.no_grad()
def load_weights(model: torch.nn.Module, model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
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
        param.copy_(torch.from_numpy(array))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise UserError(f"{model_dir}: no weights loaded for parameter {missing[0]!r}{_more(missing)}")


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
