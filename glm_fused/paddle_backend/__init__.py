"""Paddle backend (the default): the model's layers as ``paddle.nn.Layer``s, and Paddle's process group.

``from glm_fused import Glm4MoeForCausalLM`` gives this backend's model. Paddle on CPU
computes in float32 only (it has no bfloat16 CPU kernels). On GPU the fused op reaches
FlashInfer through the shared torch adapter by DLPack - wired, but unproven: paddlepaddle-gpu
3.x has not been available to run it. What is Paddle-specific lives here: ``ops.py`` (tensor
ops) and ``dist.py`` (the process group).
"""

from __future__ import annotations

import warnings

# Paddle warns on import about a compiler cache it only needs for custom C++ ops.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

from glm_fused.paddle_backend.dist import barrier, broadcast_int64, init_distributed  # noqa: E402
from glm_fused.paddle_backend.ops import LAYERS, OPS  # noqa: E402

Glm4MoeForCausalLM, Glm4MoeModel = LAYERS.Glm4MoeForCausalLM, LAYERS.Glm4MoeModel

__all__ = ["OPS", "LAYERS", "Glm4MoeForCausalLM", "Glm4MoeModel", "init_distributed", "broadcast_int64",
           "barrier"]
