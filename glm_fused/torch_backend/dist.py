"""The tensor-parallel process group (torch.distributed) and the collectives the layers use.

The TP group IS the world group: one model replica spread over every rank the launcher
started. Rank, size, device and backend come from the launcher's environment
(docs/design.md, "Launcher environment"). On CPU the backend is gloo; ranks that share one
GPU also use gloo (it carries CUDA tensors through host memory); one GPU per rank uses NCCL.
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from glm_fused.fusion import CommBackendBase, FallbackLog, FusionStats


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def rank_and_world() -> tuple[int, int]:
    return (_env_int("GLM_FUSED_RANK", _env_int("RANK", 0)),
            _env_int("GLM_FUSED_WORLD_SIZE", _env_int("WORLD_SIZE", 1)))


def device() -> torch.device:
    """This rank's device: GLM_FUSED_DEVICE (cpu | gpu) and GLM_FUSED_DEVICE_ID."""
    kind = os.environ.get("GLM_FUSED_DEVICE", "cpu").lower()
    if kind in ("gpu", "cuda"):
        index = _env_int("GLM_FUSED_DEVICE_ID", 0)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def dist_backend() -> str:
    backend = os.environ.get("GLM_FUSED_DIST_BACKEND")
    if backend:
        return backend
    return "nccl" if device().type == "cuda" else "gloo"


def shares_gpu() -> bool:
    """Several ranks on one GPU: the launcher says so by choosing gloo on a GPU run."""
    return device().type == "cuda" and dist_backend() == "gloo"


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
    """Leave the process group in a known order: all ranks meet in a barrier (none is still
    inside a collective with a peer), then the group is destroyed, which joins gloo's and
    NCCL's threads while the interpreter is whole.

    Left to interpreter exit, a gloo worker thread can drop its last finished work item
    during finalization; freeing the item's tensors takes the GIL, which a finalizing
    interpreter answers with pthread_exit inside a noexcept destructor: std::terminate,
    SIGABRT ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


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
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class TPComm:
    """This rank's handle on the TP group, shared by every layer of one model.

    Besides the collectives it carries the fusion state the fused norm op needs: the counters
    of the current forward, the FlashInfer kernel (made at start-up by the runner, or None),
    the ``glm_fused.fusion.KernelEnv`` that decides per call, and the once-only fallback log.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None, stats: FusionStats | None = None):
        self.rank, self.size, self.group = rank, size, group
        if size > 1 and not dist.is_initialized():
            raise RuntimeError(f"TPComm(size={size}) needs torch.distributed initialised first")
        self.stats = stats if stats is not None else FusionStats()
        self.fallback_log = FallbackLog()
        self.kernel = None      # FlashInferAllReduceFusion or None
        self.kernel_env = None  # glm_fused.fusion.KernelEnv or None (then always the reference)

    @classmethod
    def from_env(cls) -> "TPComm":
        rank, world = init_distributed()
        return cls(rank, world)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place; counted as one plain all-reduce."""
        self.stats.record_plain_allreduce()
        return self.all_reduce_uncounted(x)

    def all_reduce_uncounted(self, x: torch.Tensor) -> torch.Tensor:
        """The reference path of the fused op uses this (it counts its call as a fused one)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
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
        out = [None] * self._comm.size
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
