"""Requests per endpoint on /metrics: `http_requests_total{handler, method, status}`, the
counter vLLM's /metrics shows (prometheus-fastapi-instrumentator's names: the route's path
template, the method, the status class "2xx" ...).

A pure ASGI middleware, as auth.py's: it must not get in the way of streams or of the
cancellation that aborts a disconnected client's request. Only paths that match a route are
counted, so that clients inventing paths cannot grow the label set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.routing import Match, Router


class RequestCounter:
    def __init__(self, app, router: Router, registry: CollectorRegistry):
        self.app = app
        self.router = router
        self.counter = Counter("http_requests", "HTTP requests by route, method and status class",
                               labelnames=("handler", "method", "status"), registry=registry)

    def _handler(self, scope) -> str | None:
        for route in self.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
        return None

    async def __call__(self, scope, receive, send):
        handler = self._handler(scope) if scope["type"] == "http" else None
        if handler is None:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(handler, scope["method"], f"{message['status'] // 100}xx").inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def http_metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
