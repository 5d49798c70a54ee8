"""Hang-up detection that no middleware can hide, and a count of requests in flight.

``ClientWatch`` wraps the whole ASGI app (uvicorn calls it first), so whatever middleware
the app has, it sees the server's own ``receive``. Once a request's body has been read, it
keeps one task waiting on ``receive``: with uvicorn, the next message is
``http.disconnect``, sent when the client closes the connection (or when the response is
complete). It then sets the request's ``client_gone(scope)`` event, which the handlers race
against their results. Inner layers that call ``receive`` after the body get the same
disconnect from the event, never a second reader on the socket.

(Starlette's ``Request.is_disconnected()`` cannot do this: behind ``BaseHTTPMiddleware`` it
polls the middleware's own receive channel, which never reports the disconnect.)
"""

from __future__ import annotations

import asyncio

_SCOPE_KEY = "glm_fused.client_gone"


def client_gone(scope: dict) -> asyncio.Event | None:
    """The event set when this request's client hangs up (None outside ClientWatch)."""
    return scope.get(_SCOPE_KEY)


class ClientWatch:
    def __init__(self, app):
        self.app = app
        self.open_posts = 0  # POST requests in flight (read from other threads: an int is atomic)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = asyncio.Event()
        scope[_SCOPE_KEY] = gone
        body_done = False
        watcher: asyncio.Task | None = None

        async def wait_for_hang_up():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        async def watched_receive():
            nonlocal body_done, watcher
            if body_done:
                await gone.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                body_done = True
                gone.set()
            elif not message.get("more_body", False):
                body_done = True
                watcher = asyncio.ensure_future(wait_for_hang_up())
            return message

        post = scope.get("method") == "POST"
        self.open_posts += post
        try:
            await self.app(scope, watched_receive, send)
        finally:
            self.open_posts -= post
            if watcher is not None:
                watcher.cancel()
