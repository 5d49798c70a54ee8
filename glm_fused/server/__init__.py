"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, rank 0 only)."""

from glm_fused.server.app import EngineBridge, HttpServer, create_app, run_engine_loop
from glm_fused.server.metrics import ServerMetrics

__all__ = ["EngineBridge", "HttpServer", "create_app", "run_engine_loop", "ServerMetrics"]
