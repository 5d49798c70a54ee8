"""This rank's place in the tensor-parallel group, and the part of its handle both frameworks share.

The TP group IS the world group: one model replica spread over every rank the launcher
started. Rank, size, device and collective backend come from the launcher's environment
(docs/design.md, "Launcher environment"). On CPU the backend is gloo; ranks that share one
GPU also use gloo (it carries device tensors through host memory); one GPU per rank uses NCCL.
Each framework's ``dist.py`` joins the group and implements the collectives of ``TPCommBase``.
"""

from __future__ import annotations

import os

from glm_fused.fused_op.stats import FallbackLog, FusionStats
from glm_fused.launcher import current_rank, world_size


def rank_and_world() -> tuple[int, int]:
    return current_rank(), world_size()


def device_kind() -> str:
    """``cpu`` or ``gpu``: GLM_FUSED_DEVICE, set by the launcher (cpu when unset)."""
    return "gpu" if os.environ.get("GLM_FUSED_DEVICE", "cpu").lower() in ("gpu", "cuda") else "cpu"


def device_index() -> int:
    value = os.environ.get("GLM_FUSED_DEVICE_ID")
    return int(value) if value else 0


def dist_backend() -> str:
    return os.environ.get("GLM_FUSED_DIST_BACKEND") or ("nccl" if device_kind() == "gpu" else "gloo")


def shares_gpu() -> bool:
    """Several ranks on one GPU: the launcher says so by choosing gloo on a GPU run."""
    return device_kind() == "gpu" and dist_backend() == "gloo"


def leave_group(dist) -> None:
    """Leave the process group of ``dist`` (``torch.distributed`` or ``paddle.distributed``, which
    name these calls alike) in a known order: all ranks meet in a barrier (none is still inside
    a collective with a peer), then the group is destroyed, which joins gloo's and NCCL's
    threads while the interpreter is whole.

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


def barrier_all(dist) -> None:
    """A barrier of the global group of ``dist``; nothing outside a multi-rank group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class TPCommBase:
    """This rank's handle on the TP group, shared by every layer of one model.

    Besides the collectives it carries the fused op's state: the counters of the current
    forward, the FlashInfer kernel (made at start-up by ``fused_op.setup_fusion``, or None),
    the ``KernelEnv`` that decides per call, and the once-only fallback log. A framework
    implements the collectives below and sets ``dist`` (its distributed module) and ``join``.
    """

    dist = None  # torch.distributed | paddle.distributed
    join = None  # the framework's init_distributed

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        if size > 1 and self.dist is not None and not self.dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}(size={size}) needs {self.dist.__name__} initialised first")
        self.rank, self.size, self.group = rank, size, group
        self.stats = FusionStats()
        self.fallback_log = FallbackLog()
        self.kernel = None      # glm_fused.fused_op.flashinfer.FlashInferAllReduceFusion or None
        self.kernel_env = None  # glm_fused.fused_op.KernelEnv or None (then always the reference)

    @classmethod
    def from_env(cls, tp_rank: int, tp_size: int) -> "TPCommBase":
        """Join the global group if needed (``tp_size > 1``), then this rank's handle: tensor
        parallelism over every rank of the job (``comm=`` a handle of your own for a subgroup)."""
        if tp_size > 1:
            cls.join()
            world = cls.dist.get_world_size() if cls.dist.is_initialized() else 1
            rank = cls.dist.get_rank() if world > 1 else 0
            if (rank, world) != (tp_rank, tp_size):
                # checked here: a group of another size would sum other ranks' partials (wrong
                # logits), or fail later inside a collective with a message about tensor lists
                raise ValueError(
                    f"tp_rank={tp_rank}, tp_size={tp_size}, but this process is rank {rank} of {world}: start "
                    f"one process per rank (torchrun --nproc-per-node {tp_size}, or python -m "
                    f"paddle.distributed.launch --nproc_per_node {tp_size}) and pass each its rank "
                    "(glm_fused.launcher.current_rank()), or pass comm= for a group of your own")
        return cls(tp_rank, tp_size)

    def all_reduce(self, x):
        """Sum over the TP group (in place where the framework allows; use the result); counted
        as one plain all-reduce."""
        self.stats.record_plain_allreduce()
        return self.all_reduce_uncounted(x)

    # ---- the framework's collectives ------------------------------------------------------
    def all_reduce_uncounted(self, x):
        """The reference path of the fused op uses this (it counts its call as a fused one)."""
        raise NotImplementedError

    def all_gather(self, x, dim: int = -1):
        """Concatenate every rank's ``x`` along ``dim`` in rank order (vocab-parallel logits)."""
        raise NotImplementedError

    def gather(self, x, dim: int = -1, dst: int = 0):
        """``all_gather``'s result on rank ``dst`` only; None on the others."""
        raise NotImplementedError

    def broadcast(self, x, src: int = 0):
        raise NotImplementedError

    def all_gather_object(self, obj) -> list:
        raise NotImplementedError

    def broadcast_object(self, obj, src: int):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def all_agree(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is true on every rank (a vote)."""
        raise NotImplementedError
