"""RMSNorm, and the fused all-reduce + residual-add + RMSNorm that threads the residual.

``fused_allreduce_residual_rmsnorm(partial, residual, weight, eps, comm)`` returns
``(rmsnorm(allreduce(partial) + residual) * weight, allreduce(partial) + residual)``.
Per call, ``glm_fused.fusion.pick_for_call`` picks FlashInfer's one-kernel version (GPU, made
at start-up, held by ``comm``) or the reference below; both give the same maths.
"""

from __future__ import annotations

import torch
from torch import nn

from glm_fused.fusion import pick_for_call
from glm_fused.torch_backend import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics; cast back to the input dtype BEFORE the weight multiply (as transformers)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Classic layout: ``(norm(x + residual), x + residual)``; no residual means it starts here."""
        if kernels.enabled(x):
            return _add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x


def fused_allreduce_residual_rmsnorm(partial: torch.Tensor, residual: torch.Tensor | None,
                                     weight: torch.Tensor, eps: float, comm
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce this rank's partial sum, add the residual (None = zero), RMSNorm.

    ``partial`` is consumed (the reference all-reduces it in place).
    """
    impl = pick_for_call(comm, dtype=_dtype_name(partial.dtype), num_tokens=partial.shape[0])
    if impl == "flashinfer":
        if residual is None:
            residual = torch.zeros_like(partial)
        return comm.kernel(partial, residual, weight, eps)
    return _reference(partial, residual, weight, eps, comm)


def _reference(partial, residual, weight, eps, comm):
    # The all-reduce runs in the model dtype like the plain path; the add rounds to the model
    # dtype exactly as the classic ``x + residual`` does, so reference == classic layout.
    summed = comm.all_reduce_uncounted(partial)
    if kernels.enabled(summed):
        return _add_rmsnorm(summed, residual, weight, eps)
    if residual is not None:
        summed = summed + residual
    return rms_norm(summed, weight, eps), summed


def _add_rmsnorm(x, residual, weight, eps):
    from glm_fused.torch_backend.kernels.rmsnorm import add_rmsnorm

    return add_rmsnorm(x, residual, weight, eps)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
