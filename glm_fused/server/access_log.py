"""One log line per request (``--disable-log-requests`` turns it off): who, what, the status,
how long it took to the last byte (streams included), and for generation requests the
request id, token counts and finish reasons (a handler leaves them in
``scope["state"][ACCESS_NOTE]``). ``GET /health`` and ``GET /metrics``, which probes and
scrapers poll, are not logged.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("glm_fused.access")

ACCESS_NOTE = "glm_fused.access_note"
QUIET = frozenset({("GET", "/health"), ("GET", "/metrics")})


class AccessLog:
    """ASGI wrapper that logs each finished HTTP request."""

    def __init__(self, app, enabled: bool = True):
        self.app, self.enabled = app, enabled

    async def __call__(self, scope, receive, send):
        if not self.enabled or scope["type"] != "http" or (scope.get("method"), scope.get("path")) in QUIET:
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [0]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client") or ("-", 0)
            note = (scope.get("state") or {}).get(ACCESS_NOTE, "")
            logger.info('%s:%s "%s %s" %s %.3fs%s', client[0], client[1], scope.get("method"), scope.get("path"),
                        status[0] or "-", time.monotonic() - start, f" {note}" if note else "")
