"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`), checked in
constant time against every key.

A pure ASGI middleware (not starlette's BaseHTTPMiddleware, which gets in the way of
streaming responses and of the cancellation that aborts a disconnected client's request).
"""

from __future__ import annotations

import hashlib
import hmac

from jaxserve.server.errors import APIError

# Liveness and scraping stay open by default, so that probes need no secret.
DEFAULT_OPEN_PATHS = ("/health", "/metrics")
# Open always (as in vLLM, which protects only /v1): they tell nothing about the model's use.
# Every other path needs a key, so that a new route is protected unless it is listed here.
ALWAYS_OPEN_PATHS = ("/version", "/docs", "/docs/oauth2-redirect", "/openapi.json")


def _digest(key: str | bytes) -> bytes:
    # Comparing fixed-size digests hides the keys' lengths as well as their contents.
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode("utf-8")).digest()


class APIKeyMiddleware:
    def __init__(self, app, api_keys: tuple[str, ...], open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS):
        self.app = app
        self.key_digests = tuple(_digest(k) for k in api_keys)
        self.open_paths = frozenset(open_paths) | frozenset(ALWAYS_OPEN_PATHS)

    def authorized(self, authorization: bytes | None, x_api_key: bytes | None = None) -> bool:
        if authorization is not None and authorization[:7].lower() == b"bearer ":
            offered = _digest(authorization[7:].strip())
        elif x_api_key is not None:    # the anthropic SDK's header
            offered = _digest(x_api_key.strip())
        else:
            return False
        ok = False
        for key in self.key_digests:   # no early exit: every key is compared every time
            ok |= hmac.compare_digest(offered, key)
        return ok

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not self.key_digests or scope["path"] in self.open_paths
                or scope["method"] == "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self.authorized(headers.get(b"authorization"), headers.get(b"x-api-key")):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                  "or 'x-api-key: <key>' with one of the server's --api-key values",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            anthropic = scope["path"].startswith("/v1/messages")
            response = error.anthropic_response() if anthropic else error.response()
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
