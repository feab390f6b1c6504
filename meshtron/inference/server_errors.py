"""Every error the server answers, in OpenAI's shape {"error": {"message", "type", "param", "code"}}:
4xx for what the client sent (bad JSON, types, limits, unknown model or URL, a missing key), 503
while not ready, 500 only for a fault of the server itself (logged with its traceback). Also the
`X-Request-Id` echo: a client's id comes back in the response header and goes into the log; it is
never used as a key (engine ids are always the server's own).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from meshtron.inference.metrics import ServerMetrics
from meshtron.inference.protocol import ApiError, error_body, validation_error
from meshtron.inference.request import InvalidRequestError

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

logger = logging.getLogger("meshtron.server")


class ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: an error may quote anything the client sent."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(metrics: Optional[ServerMetrics], err: ApiError,
                   headers: Optional[dict[str, str]] = None) -> ErrorResponse:
    if metrics is not None:
        metrics.error(err.status, err.kind)
    extra = {"www-authenticate": "Bearer"} if err.status == 401 else {}
    return ErrorResponse(error_body(err.message, err.param, err.kind, err.code), err.status,
                         headers={**extra, **(headers or {})})


def unauthorized(metrics: ServerMetrics, message: str) -> ErrorResponse:
    return error_response(metrics, ApiError(401, message, kind="invalid_request_error", code="invalid_api_key"))


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> ErrorResponse:
        return error_response(metrics, exc)

    @app.exception_handler(InvalidRequestError)
    async def bad_params(request: Request, exc: InvalidRequestError) -> ErrorResponse:
        return error_response(metrics, ApiError(400, f"{exc.param}: {exc.message}", exc.param))

    @app.exception_handler(ValidationError)
    async def bad_body(request: Request, exc: ValidationError) -> ErrorResponse:
        return error_response(metrics, validation_error(exc.errors()))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> ErrorResponse:
        return error_response(metrics, validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> ErrorResponse:
        message = (f"Invalid URL ({request.method} {request.url.path})" if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405
                   else str(exc.detail))
        return error_response(metrics, ApiError(exc.status_code, message), headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception) -> ErrorResponse:
        # starlette logs the traceback after this answer: a 500 is a bug of ours
        return error_response(metrics, ApiError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                                kind="server_error"))


def client_request_id(headers: list[tuple[bytes, bytes]]) -> Optional[bytes]:
    for name, value in headers:
        if name == b"x-request-id":
            return value
    return None


class EchoRequestId:
    """ASGI middleware: a client's X-Request-Id header is returned as the response's x-request-id
    (replacing the server's own id, which the body's `id` still carries)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        client_id = client_request_id(scope["headers"]) if scope["type"] == "http" else None
        if client_id is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", client_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
