"""The fused all-reduce + residual-add + RMSNorm, in one home.

* ``policy.py``    - when FlashInfer's TRT-LLM kernel may serve a call: TP sizes, dtypes, size
                     caps per GPU, one-shot vs two-shot, workspace sizing (framework-free);
* ``op.py``        - the call: ``fused_allreduce_residual_rmsnorm`` and ``pick_for_call``;
* ``workspace.py`` - start-up: the workspace on the TP group, the all-ranks vote, the
                     ``comm_backend`` protocol FlashInfer exchanges handles through;
* ``flashinfer.py``- the one adapter to FlashInfer's kernel (torch tensors; Paddle by DLPack);
* ``stats.py``     - counters of each forward's calls and the once-per-reason fallback log.

The setting has one name, ``fusion_impl`` (``auto`` | ``flashinfer`` | ``reference``), set by
``--enable-flashinfer-allreduce-fusion`` / ``--disable-flashinfer-allreduce-fusion``.
"""

from glm_fused.fused_op.op import fused_allreduce_residual_rmsnorm, pick_for_call
from glm_fused.fused_op.policy import KERNEL_DTYPES, KERNEL_TP_SIZES, KernelEnv, choose_impl
from glm_fused.fused_op.stats import FallbackLog, FusionStats
from glm_fused.fused_op.workspace import FUSION_IMPLS, CommBackend, setup_fusion

__all__ = ["fused_allreduce_residual_rmsnorm", "pick_for_call", "KERNEL_TP_SIZES", "KERNEL_DTYPES", "KernelEnv",
           "choose_impl", "FallbackLog", "FusionStats", "FUSION_IMPLS", "CommBackend", "setup_fusion"]
