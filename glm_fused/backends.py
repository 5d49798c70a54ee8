"""Backend selection. Each backend package holds tensor code only; the rest is shared."""

from __future__ import annotations

import importlib

from glm_fused.errors import UserError

BACKENDS = {"paddle": "glm_fused.paddle_backend", "torch": "glm_fused.torch_backend"}
DEFAULT_BACKEND = "paddle"


def get_backend(name: str = DEFAULT_BACKEND):
    """The backend module: LAYERS (the model bound to the framework), OPS, init_distributed,
    broadcast_int64, barrier."""
    if name not in BACKENDS:
        raise UserError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
    framework = "paddlepaddle" if name == "paddle" else "torch"
    try:
        return importlib.import_module(BACKENDS[name])
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("paddle", "torch"):
            raise UserError(f"--backend {name}: {framework} is not installed "
                            f"(pip install {framework})") from None
        raise
