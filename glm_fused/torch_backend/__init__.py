"""PyTorch backend: the model's layers as ``torch.nn.Module``s, and torch's process group.

``from glm_fused.torch_backend import Glm4MoeForCausalLM`` gives the model for PyTorch users
(``Glm4MoeForCausalLM.from_pretrained(path, tp_rank=..., tp_size=..., fused=True, dtype=...)``).
Runs on CPU (fp32 or bf16) and CUDA (bf16; Triton kernels, CUDA-graph decode, FlashInfer's
fused all-reduce where it can serve). What is torch-specific lives here: ``ops.py`` (tensor
ops and the Triton dispatch), ``dist.py`` (the process group), ``kernels/``, ``cuda_graph.py``.
"""

from __future__ import annotations

from glm_fused.torch_backend.dist import barrier, broadcast_int64, init_distributed
from glm_fused.torch_backend.ops import LAYERS, OPS

Glm4MoeForCausalLM, Glm4MoeModel = LAYERS.Glm4MoeForCausalLM, LAYERS.Glm4MoeModel

__all__ = ["OPS", "LAYERS", "Glm4MoeForCausalLM", "Glm4MoeModel", "init_distributed", "broadcast_int64",
           "barrier"]
