"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, rank 0 only).

Names resolve on first use, so that the preprocessing workers (``python -m
glm_fused.server.preprocess_pool``) import no web framework.
"""

_LAZY = {
    "EngineBridge": "glm_fused.server.app",
    "HttpServer": "glm_fused.server.app",
    "create_app": "glm_fused.server.app",
    "run_engine_loop": "glm_fused.server.app",
    "ServerMetrics": "glm_fused.server.metrics",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'glm_fused.server' has no attribute {name!r}")
