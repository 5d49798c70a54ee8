"""The tensor-parallel process group (paddle.distributed) and the collectives the layers use.

The TP group IS the world group: one model replica spread over every rank the launcher
started. Rank, size, device and backend come from the launcher's environment
(docs/design.md, "Launcher environment"). Only global-group collectives are used: on CPU
(gloo) Paddle's all_reduce, all_gather, broadcast and barrier are reliable there, while extra
groups from ``new_group`` fail intermittently.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.distributed as dist

from glm_fused.fusion import CommBackendBase, FallbackLog, FusionStats


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rank_and_world() -> tuple[int, int]:
    return (_env_int("GLM_FUSED_RANK", _env_int("PADDLE_TRAINER_ID", 0)),
            _env_int("GLM_FUSED_WORLD_SIZE", _env_int("PADDLE_TRAINERS_NUM", 1)))


def device() -> str:
    """This rank's Paddle device string: GLM_FUSED_DEVICE (cpu | gpu) and GLM_FUSED_DEVICE_ID."""
    kind = os.environ.get("GLM_FUSED_DEVICE", "cpu").lower()
    if kind in ("gpu", "cuda"):
        return f"gpu:{_env_int('GLM_FUSED_DEVICE_ID', 0)}"
    return "cpu"


def is_cpu() -> bool:
    return device() == "cpu"


def dist_backend() -> str:
    backend = os.environ.get("GLM_FUSED_DIST_BACKEND")
    if backend:
        return backend
    return "gloo" if is_cpu() else "nccl"


def shares_gpu() -> bool:
    """Several ranks on one GPU: the launcher says so by choosing gloo on a GPU run."""
    return not is_cpu() and dist_backend() == "gloo"


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
        dist.init_parallel_env()
        from glm_fused.launcher import at_rank_end

        at_rank_end(shutdown_distributed)
    return rank, world


def shutdown_distributed() -> None:
    """Leave the process group in a known order: all ranks meet in a barrier (none is still
    inside a collective with a peer), then the group is destroyed (as the torch backend does)."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def collective_place():
    """Where tensors for a collective live: NCCL moves device memory, gloo host memory
    (also when ranks share one GPU)."""
    if dist_backend() == "gloo":
        return paddle.CPUPlace()
    return paddle.CUDAPlace(_env_int("GLM_FUSED_DEVICE_ID", 0))


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
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class TPComm:
    """This rank's handle on the TP group, shared by every layer of one model.

    Besides the collectives it carries the fusion state the fused norm op needs: the counters
    of the current forward, the FlashInfer kernel (made at start-up by the runner, or None),
    the ``glm_fused.fusion.KernelEnv`` that decides per call, and the once-only fallback log.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group
        if size > 1 and not dist.is_initialized():
            raise RuntimeError(f"TPComm(size={size}) needs paddle.distributed initialised first")
        self.stats = FusionStats()
        self.fallback_log = FallbackLog()
        self.kernel = None      # FlashInferAllReduceFusion or None
        self.kernel_env = None  # glm_fused.fusion.KernelEnv or None (then always the reference)
        # Ranks sharing one GPU talk over gloo, which moves host tensors: activations take a
        # round trip through host memory (slow, but only the test set-up of a single GPU does it).
        self._via_host = size > 1 and shares_gpu()

    @classmethod
    def from_env(cls) -> "TPComm":
        rank, world = init_distributed()
        return cls(rank, world)

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum over the TP group (in place where the backend allows; use the result); counted
        as one plain all-reduce."""
        self.stats.record_plain_allreduce()
        return self.all_reduce_uncounted(x)

    def all_reduce_uncounted(self, x: paddle.Tensor) -> paddle.Tensor:
        """The reference path of the fused op uses this (it counts its call as a fused one)."""
        if self.size == 1:
            return x
        if self._via_host:
            host = x.cpu()
            dist.all_reduce(host, group=self.group)
            return host.to(x.place)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: paddle.Tensor, axis: int = -1) -> paddle.Tensor:
        """Concatenate every rank's ``x`` along ``axis`` in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x.cpu() if self._via_host else x.contiguous(), group=self.group)
        out = paddle.concat(parts, axis=axis)
        return out.to(x.place) if self._via_host else out

    def broadcast(self, x: paddle.Tensor, src: int = 0) -> paddle.Tensor:
        if self.size == 1:
            return x
        if self._via_host:
            host = x.cpu()
            dist.broadcast(host, src=src, group=self.group)
            return host.to(x.place)
        dist.broadcast(x, src=src, group=self.group)
        return x

    def flashinfer_comm_backend(self) -> "FlashInferCommBackend":
        return FlashInferCommBackend(self)


class FlashInferCommBackend(CommBackendBase):
    """FlashInfer's ``comm_backend`` protocol over this TP group (see ``fusion.CommBackendBase``)."""

    def __init__(self, comm: TPComm):
        super().__init__(comm.rank, comm.size)
        self._comm = comm

    def _allgather(self, data) -> list:
        out: list = []
        dist.all_gather_object(out, data, group=self._comm.group)
        return out

    def _bcast(self, data, root: int):
        box = [data]
        dist.broadcast_object_list(box, src=root, group=self._comm.group)
        return box[0]

    def _barrier(self) -> None:
        dist.barrier(group=self._comm.group)


__all__ = ["TPComm", "FlashInferCommBackend", "init_distributed", "shutdown_distributed", "broadcast_int64", "barrier",
           "device", "dist_backend", "shares_gpu", "rank_and_world"]
