"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, rank 0 only).

Nothing is imported here, so that the preprocessing workers (``python -m
glm_fused.server.preprocess_pool``) import no web framework.
"""
