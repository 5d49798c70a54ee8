"""glm_fused: GLM-4.5-Air for tensor-parallel inference with fused all-reduce + RMSNorm.

``from glm_fused import Glm4MoeForCausalLM, Glm4MoeConfig`` gives the Paddle model (the
default backend) and the config. Both are resolved on first use, so ``import glm_fused``
itself never imports Paddle or torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "Glm4MoeForCausalLM": ("glm_fused.paddle_backend", "Glm4MoeForCausalLM"),
    "Glm4MoeConfig": ("glm_fused.config", "Glm4MoeConfig"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # resolve once
        return value
    raise AttributeError(f"module 'glm_fused' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = ["__version__", "Glm4MoeForCausalLM", "Glm4MoeConfig"]
