"""RMSNorm, and the fused all-reduce + residual-add + RMSNorm that threads the residual.

``RMSNorm.fused(partial, residual, comm)`` is ``glm_fused.fused_op.fused_allreduce_residual_rmsnorm``
with this norm's weight: ``(rmsnorm(allreduce(partial) + residual) * w, allreduce(partial) + residual)``.
The classic call ``norm(x, residual)`` is the same without the all-reduce.
"""

from __future__ import annotations

from glm_fused.fused_op import fused_allreduce_residual_rmsnorm
from glm_fused.model.module import Module


class RMSNorm(Module):
    def __init__(self, hidden_size: int, eps: float, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = self.param([hidden_size], dtype, fill=1.0)

    def forward(self, x, residual=None):
        """Classic layout: ``(norm(x + residual), x + residual)``; no residual means it starts here."""
        return self.F.add_rms_norm(x, residual, self.weight, self.eps)

    def fused(self, partial, residual, comm):
        """Fused layout: all-reduce this rank's partial sum into the residual, then the norm."""
        return fused_allreduce_residual_rmsnorm(partial, residual, self.weight, self.eps, comm, self.F)


def add_norm(norm: RMSNorm, x, residual, fused: bool, comm):
    """``(norm(x + residual), x + residual)``; in the fused layout ``x`` is a partial sum."""
    return norm.fused(x, residual, comm) if fused else norm(x, residual)
