"""The fused op itself: ``fused_allreduce_residual_rmsnorm``, one call per norm of the stack.

``(rmsnorm(allreduce(partial) + residual) * weight, allreduce(partial) + residual)``. Per
call, ``pick_for_call`` chooses FlashInfer's one-kernel version (GPU, workspace made at
start-up by ``workspace.setup_fusion`` and held by ``comm``) or the reference (all-reduce,
then the add and RMSNorm in fp32 statistics); both compute the same maths. A call never
asserts or crashes on shape, size or device: what the kernel cannot serve, the reference does.
"""

from __future__ import annotations

from glm_fused.fused_op.policy import choose_impl


def pick_for_call(comm, *, dtype: str, num_tokens: int) -> str:
    """The implementation of one fused call, counted and (once per reason) logged.

    ``comm`` is the TP communicator (``glm_fused.comm.TPCommBase``): ``kernel_env`` (None until
    start-up set it), ``kernel`` (the workspace-holding FlashInfer object or None), ``stats``,
    ``fallback_log``.
    """
    impl, reason = "reference", None
    if comm.kernel_env is not None:
        impl, reason = choose_impl(comm.kernel_env, dtype=dtype, num_tokens=num_tokens)
        if impl == "flashinfer" and comm.kernel is None:  # a policy that says yes without a workspace
            impl, reason = "reference", "no FlashInfer workspace on this rank"
    if reason:
        comm.fallback_log.log_once(reason)
    comm.stats.record(impl, reason)
    return impl


def fused_allreduce_residual_rmsnorm(partial, residual, weight, eps: float, comm, F):
    """All-reduce this rank's partial sum, add the residual (None = zero), RMSNorm.

    ``F`` is the framework's ``Ops``. ``partial`` is consumed (the reference all-reduces it in place).
    """
    impl = pick_for_call(comm, dtype=F.dtype_name(partial), num_tokens=partial.shape[0])
    if impl == "flashinfer":
        if residual is None:
            residual = F.zeros_like(partial)
        return F.call_flashinfer(comm.kernel, partial, residual, weight, eps)
    # The all-reduce runs in the model dtype like the plain path; the add rounds to the model
    # dtype exactly as the classic ``x + residual`` does, so reference == classic layout.
    return F.add_rms_norm(comm.all_reduce_uncounted(partial), residual, weight, eps)
