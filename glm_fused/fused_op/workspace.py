"""The fused kernel's workspace, made once at start-up on the TP group (never on the first
forward: that breaks CUDA-graph capture), and FlashInfer's ``comm_backend`` protocol over a
``glm_fused.comm.TPCommBase`` through which its IPC handles are exchanged.

``setup_fusion`` is what a runner calls after the model is built: it decides whether any call
could use the kernel, makes the workspace, has every rank vote that it exists (one rank
waiting in the kernel while the others all-reduce would hang), and stores on ``comm`` the
kernel (or None) and the ``KernelEnv`` that ``pick_for_call`` consults.
"""

from __future__ import annotations

import logging

from glm_fused.fused_op import policy

logger = logging.getLogger("glm_fused.runner")

# The implementation setting (one name everywhere): "auto" uses FlashInfer where it can run,
# "flashinfer" asks for it (a warning when it cannot), "reference" never makes a workspace.
FUSION_IMPLS = ("auto", "flashinfer", "reference")


class CommBackend:
    """FlashInfer's ``comm_backend`` protocol (MPI-style names) over one TP group.

    FlashInfer swaps IPC handles and pids through it (small Python objects) at start-up only,
    which is how a Paddle process group can drive a workspace FlashInfer builds with torch
    tensors. The exchange must run on the TP group, never on a wider one (a known hang with
    DP/PP); here the TP group is the world, so ``Split`` into one colour returns this group.
    """

    def __init__(self, comm):
        self._comm = comm
        self._rank, self._size = comm.rank, comm.size

    def Get_rank(self) -> int:  # noqa: N802 - FlashInfer's names
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def allgather(self, data) -> list:
        return [data] if self._size == 1 else self._comm.all_gather_object(data)

    def bcast(self, data, root: int):
        return data if self._size == 1 else self._comm.broadcast_object(data, root)

    def barrier(self) -> None:
        if self._size > 1:
            self._comm.barrier()

    def Split(self, color: int, key: int) -> "CommBackend":  # noqa: N802
        everyone = self.allgather((color, key, self._rank))
        if len({c for c, _, _ in everyone}) != 1:
            # Sub-groups are not needed while TP == world; refuse rather than build a wrong one.
            raise RuntimeError("comm backend Split: ranks asked for different colours")
        if [r for _, _, r in sorted(everyone)] != list(range(self._size)):
            raise RuntimeError("comm backend Split: a reordering split is not supported")
        return self


def setup_fusion(comm, *, fused: bool, fusion_impl: str, sm: int | None, hidden_size: int, dtype: str,
                 max_num_batched_tokens: int, kernel_args, shares_gpu: bool) -> None:
    """Make the workspace where some call could use it, and set ``comm.kernel``/``comm.kernel_env``.

    Made only where a call could use it: fused layout, a GPU (``sm``), ``fusion_impl`` not
    reference, a kernel TP size and dtype, a size cap above zero; sized to the smaller of
    max_num_batched_tokens and that cap. Elsewhere ``choose_impl`` names the reason.
    ``kernel_args()`` gives the workspace's (torch dtype, torch device).
    """
    if not fused:
        return  # the classic layout makes no fused calls
    kernel, error = None, None
    tokens = policy.workspace_tokens(sm, comm.size, hidden_size, policy.DTYPE_BYTES[dtype], max_num_batched_tokens)
    wanted = (sm is not None and fusion_impl != "reference" and comm.size in policy.KERNEL_TP_SIZES
              and dtype in policy.KERNEL_DTYPES and tokens > 0)
    if fusion_impl == "reference":
        error = "disabled by --disable-flashinfer-allreduce-fusion"
    if wanted:
        kernel, error = _make_kernel(comm, tokens, hidden_size, kernel_args, shares_gpu)
        # Every rank must take the same path: agree that the kernel exists on all ranks first.
        if comm.size > 1 and not comm.all_agree(kernel is not None) and kernel is not None:
            kernel.close()
            kernel, error = None, "FlashInfer workspace failed on another rank"
    comm.kernel = kernel
    comm.kernel_env = policy.KernelEnv(device="gpu" if sm is not None else "cpu", sm=sm, tp_size=comm.size,
                                       hidden_size=hidden_size, flashinfer_error=error,
                                       workspace_max_tokens=tokens if kernel is not None else 0)
    if kernel is not None:
        logger.info("fused all-reduce + RMSNorm: %r", kernel)
    elif fusion_impl == "flashinfer":
        # Asked for by name: say why it cannot run, as a warning rather than a fallback note.
        why = error or policy.choose_impl(comm.kernel_env, dtype=dtype, num_tokens=1)[1]
        logger.warning("fused all-reduce + RMSNorm: FlashInfer unavailable (%s); every call uses the "
                       "reference", why)


def _make_kernel(comm, max_tokens: int, hidden_size: int, kernel_args, shares_gpu: bool):
    try:
        from glm_fused.fused_op import flashinfer
        dtype, device = kernel_args()
    except ImportError as exc:
        return None, f"flashinfer adapter unavailable: {exc}"
    error = flashinfer.probe()
    if error:
        return None, error
    try:
        kernel = flashinfer.FlashInferAllReduceFusion(
            tp_rank=comm.rank, tp_size=comm.size, max_num_tokens=max_tokens, hidden_size=hidden_size,
            dtype=dtype, device=device, group=CommBackend(comm), shared_gpu=shares_gpu)
    except flashinfer.FusionUnavailable as exc:
        return None, str(exc)
    return kernel, None
