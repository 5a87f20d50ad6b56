"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause is raised as an `APIError` (or converted to one by the
handlers below), so no route has to build error bodies itself.
"""

from __future__ import annotations

import logging

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("jaxserve.server")

# Seconds a client should wait before retrying a 503 (overloaded / engine restarting).
RETRY_AFTER_S = 1

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


# Anthropic's error types by status (its Messages API answers in this shape).
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": _TYPE_BY_STATUS.get(self.status, "APIError"),
                          "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE_BY_STATUS.get(self.status, "api_error"),
                                           "message": self.message}}

    def anthropic_response(self) -> JSONResponse:
        return JSONResponse(self.anthropic_body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str, code: str = "overloaded") -> APIError:
    """503 with Retry-After: the server is full (`overloaded`) or its engine has stopped
    (`engine_stopped`: shutting down or failed; another replica may answer)."""
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def loc_to_param(loc) -> str:
    """pydantic's error location ('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body",) and not out:
            continue
        # pydantic names union members by their type ('str', 'list[int]', ...); skip those.
        elif isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(err: pydantic.ValidationError | RequestValidationError) -> APIError:
    """The first few pydantic errors as one 400 message that names each field."""
    errors = err.errors()
    parts = []
    for e in errors[:3]:
        param = loc_to_param(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            return bad_request(f"request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}",
                               code="invalid_json")
        parts.append(f"{param or 'body'}: {e['msg']}" if param else e["msg"])
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    first_param = loc_to_param(errors[0].get("loc", ())) if errors else None
    return bad_request("invalid request: " + "; ".join(parts) + more, param=first_param or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
