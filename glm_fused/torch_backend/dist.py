"""The tensor-parallel process group in torch.distributed, and its collectives (``glm_fused.comm``)."""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from glm_fused.comm import (TPCommBase, barrier_all, device_index, device_kind, dist_backend, leave_group,
                            rank_and_world, shares_gpu)


def device() -> torch.device:
    """This rank's device: GLM_FUSED_DEVICE (cpu | gpu) and GLM_FUSED_DEVICE_ID."""
    if device_kind() == "gpu":
        torch.cuda.set_device(device_index())
        return torch.device("cuda", device_index())
    return torch.device("cpu")


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Join the global process group from the launcher's environment; a no-op at world size 1.
    ``timeout_s``: how long any collective may wait for a peer (None: torch's default)."""
    rank, world = rank_and_world()
    if world > 1 and not dist.is_initialized():
        dev = device()
        backend = dist_backend()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world, **kwargs)
        from glm_fused.launcher import at_rank_end

        at_rank_end(shutdown_distributed)
    return rank, world


def shutdown_distributed() -> None:
    """Leave the process group (``glm_fused.comm.leave_group``)."""
    leave_group(dist)


def _collective_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo takes CPU tensors (and CUDA ones through the host).
    return device() if dist_backend() == "nccl" else torch.device("cpu")


def broadcast_int64(array: np.ndarray | None, src: int = 0) -> np.ndarray:
    """Send an int64 array from ``src`` to every rank (length first, then the values)."""
    _, world = rank_and_world()
    if world == 1 or not dist.is_initialized():
        return np.asarray(array, dtype=np.int64)
    dev = _collective_device()
    is_src = dist.get_rank() == src
    length = torch.tensor([len(array) if is_src else 0], dtype=torch.int64, device=dev)
    dist.broadcast(length, src=src)
    if is_src:
        values = torch.as_tensor(np.ascontiguousarray(array, dtype=np.int64)).to(dev)
    else:
        values = torch.empty(int(length.item()), dtype=torch.int64, device=dev)
    dist.broadcast(values, src=src)
    return values.cpu().numpy()


def barrier() -> None:
    barrier_all(dist)


class TPComm(TPCommBase):
    """``TPCommBase`` over torch.distributed (the TP group is the world)."""

    dist = dist
    join = staticmethod(init_distributed)

    def all_reduce_uncounted(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == dst else None
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if self.rank == dst else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(flag.item()))


__all__ = ["TPComm", "init_distributed", "shutdown_distributed", "broadcast_int64", "barrier", "device",
           "dist_backend", "shares_gpu", "rank_and_world"]
