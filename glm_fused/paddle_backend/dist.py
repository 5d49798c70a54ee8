"""The tensor-parallel process group in paddle.distributed, and its collectives (``glm_fused.comm``).

Only global-group collectives are used: on CPU (gloo) Paddle's all_reduce, all_gather,
broadcast and barrier are reliable there, while extra groups from ``new_group`` fail
intermittently.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

import numpy as np
import paddle
import paddle.distributed as dist

from glm_fused.comm import (TPCommBase, barrier_all, device_index, device_kind, dist_backend, leave_group,
                            rank_and_world, shares_gpu)

_FLAGS_BANNER = re.compile(r"=+ Modified FLAGS detected =+\n(?:FLAGS\(.*\)\n)*=+\n")


def device() -> str:
    """This rank's Paddle device string: GLM_FUSED_DEVICE (cpu | gpu) and GLM_FUSED_DEVICE_ID."""
    return f"gpu:{device_index()}" if device_kind() == "gpu" else "cpu"


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Select this rank's device and join the global group; no group at world size 1.
    ``timeout_s``: how long an NCCL collective may wait for a peer (None: Paddle's default,
    30 min). Paddle's gloo group (CPU) has no such setting: gloo's own 30 s applies."""
    rank, world = rank_and_world()
    paddle.set_device(device())
    if world > 1 and not dist.is_initialized():
        # Paddle reads its own PADDLE_* variables (set by the launcher); only the backend
        # may need filling in when a rank was started by hand.
        os.environ.setdefault("PADDLE_DISTRI_BACKEND", dist_backend())
        if timeout_s is not None:
            os.environ["PADDLE_PG_TIMEOUT"] = str(int(timeout_s * 1000))  # read by init_parallel_env, in ms
        # init_parallel_env writes every Paddle flag that differs from its default to stderr,
        # and Paddle 3 itself changes one (FLAGS_enable_pir_in_executor): a banner on every
        # start with nothing for the user in it. Whatever else it writes still goes out.
        written = io.StringIO()
        try:
            with contextlib.redirect_stderr(written):
                dist.init_parallel_env()
        finally:
            sys.stderr.write(_FLAGS_BANNER.sub("", written.getvalue()))
        from glm_fused.launcher import at_rank_end

        at_rank_end(shutdown_distributed)
    return rank, world


def shutdown_distributed() -> None:
    """Leave the process group (``glm_fused.comm.leave_group``)."""
    leave_group(dist)


def collective_place():
    """Where tensors for a collective live: NCCL moves device memory, gloo host memory
    (also when ranks share one GPU)."""
    if dist_backend() == "gloo":
        return paddle.CPUPlace()
    return paddle.CUDAPlace(device_index())


def broadcast_int64(array: np.ndarray | None, src: int = 0) -> np.ndarray:
    """Send an int64 array from ``src`` to every rank (length first, then the values)."""
    _, world = rank_and_world()
    if world == 1 or not dist.is_initialized():
        return np.asarray(array, dtype=np.int64)
    is_src = dist.get_rank() == src
    place = collective_place()
    length = paddle.to_tensor([len(array) if is_src else 0], dtype="int64", place=place)
    dist.broadcast(length, src=src)
    n = int(length.item())
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if is_src:
        values = paddle.to_tensor(np.ascontiguousarray(array, dtype=np.int64), place=place)
    else:
        values = paddle.zeros([n], dtype="int64").to(place)
    dist.broadcast(values, src=src)
    return values.numpy()


def barrier() -> None:
    barrier_all(dist)


class TPComm(TPCommBase):
    """``TPCommBase`` over paddle.distributed (the TP group is the world)."""

    dist = dist
    join = staticmethod(init_distributed)

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        super().__init__(rank, size, group)
        # Ranks sharing one GPU talk over gloo, which moves host tensors: activations take a
        # round trip through host memory (slow, but only the test set-up of a single GPU does it).
        self._via_host = size > 1 and shares_gpu()

    def all_reduce_uncounted(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.size == 1:
            return x
        if self._via_host:
            host = x.cpu()
            dist.all_reduce(host, group=self.group)
            return host.to(x.place)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: paddle.Tensor, dim: int = -1) -> paddle.Tensor:
        if self.size == 1:
            return x
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x.cpu() if self._via_host else x.contiguous(), group=self.group)
        out = paddle.concat(parts, axis=dim)
        return out.to(x.place) if self._via_host else out

    def gather(self, x: paddle.Tensor, dim: int = -1, dst: int = 0) -> paddle.Tensor | None:
        # Paddle's gloo has no reliable gather (NOTES: only the global-group basics are): an
        # all-gather, kept on dst only. Paddle runs on CPU here, where the cost is small.
        out = self.all_gather(x, dim)
        return out if self.rank == dst else None

    def broadcast(self, x: paddle.Tensor, src: int = 0) -> paddle.Tensor:
        if self.size == 1:
            return x
        if self._via_host:
            host = x.cpu()
            dist.broadcast(host, src=src, group=self.group)
            return host.to(x.place)
        dist.broadcast(x, src=src, group=self.group)
        return x

    def all_gather_object(self, obj) -> list:
        out: list = []
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_agree(self, ok: bool) -> bool:
        flag = paddle.to_tensor([int(ok)], dtype="int32", place=collective_place())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(int(flag.item()))


__all__ = ["TPComm", "init_distributed", "shutdown_distributed", "broadcast_int64", "barrier", "device",
           "dist_backend", "shares_gpu", "rank_and_world", "collective_place"]
