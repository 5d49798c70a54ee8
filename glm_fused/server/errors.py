"""Errors in OpenAI's shape, and the one place where every exception becomes one.

Every error the server answers, from any layer (a refused request, an unknown route, a bug),
leaves through ``install_error_handlers``: a JSON body
``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the request field at
fault (or null), counted in ``/metrics`` as ``request_errors_total{status}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the preprocessing workers import this module and need no web framework
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

# OpenAI's error types by status; anything else is a server error.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          499: "invalid_request_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    # Errors cross the process boundary of the preprocessing workers as plain JSON.
    def to_dict(self) -> dict:
        return {"status": self.status, "message": self.message, "param": self.param, "code": self.code,
                "type": self.type}

    @classmethod
    def from_dict(cls, d: dict) -> "ApiError":
        return cls(d["status"], d["message"], d.get("param"), d.get("code"), d.get("type"))


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation_errors(errors: list[dict]) -> ApiError:
    """A 400 for pydantic's errors, naming the first field at fault as ``param``.

    Pydantic puts the union member it tried (``str``, ``list[int]``, ``function-after[...]``)
    into an error's location; ``param`` keeps the field path only, and a value that fits none
    of a union's forms is reported once, with the forms it may take.
    """
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    path: list[str] = []
    members: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and _is_type_tag(part):
            # Everything from the first member tag on belongs to that member.
            prefix = loc[:i]
            members = [str(e["loc"][i]) for e in errors
                       if len(e.get("loc", ())) > i and list(e["loc"][:i]) == prefix]
            break
        path.append(str(part))
    param = ".".join(path) or None
    if members:
        forms = ", ".join(dict.fromkeys(m for m in members if _is_type_tag(m)))
        return ApiError(400, f"{param or 'request'}: expected one of {forms}", param=param)
    message = first.get("msg", "invalid value")
    return ApiError(400, f"{param}: {message}" if param else f"request body: {message}", param=param)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part


def install_error_handlers(app: "FastAPI", on_error: Callable[[int], None]) -> Callable[[ApiError], "JSONResponse"]:
    """Route every exception through one function; returns it for code that answers directly."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def respond(err: ApiError) -> JSONResponse:
        on_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, err: ApiError):
        return respond(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError):
        return respond(from_validation_errors(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return respond(ApiError(err.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception):
        # A bug: the client gets a 500 in the usual shape (Starlette logs the traceback).
        return respond(ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    return respond
