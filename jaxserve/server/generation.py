"""Running one HTTP request's prompts on the engine, and stopping them when the client leaves.

Each prompt's `engine.generate` is consumed by its own asyncio task that puts its outputs
(cumulative for a whole answer, delta for a stream) into one queue. NOTE: the tasks are plain asyncio tasks, not the route's own task:
starlette cancels a streaming route through an anyio cancel scope, which cancels *every*
later await in that scope, so cleanup there could never await anything. Here, cleanup is
synchronous (cancel the tasks; the engine aborts a request whose generator is cancelled) plus
a fire-and-forget `engine.abort` for good measure.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.errors import APIError, bad_request, overloaded

logger = logging.getLogger("jaxserve.server")

_background: set[asyncio.Task] = set()   # fire-and-forget aborts, kept alive until done


def engine_error(exc: BaseException) -> APIError:
    """The HTTP status for an exception out of engine.generate."""
    from jaxserve.engine import EngineDeadError, EngineOverloadedError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return overloaded(f"the server is overloaded: {exc}; retry later")
    if isinstance(exc, EngineDeadError):
        return overloaded(f"the engine has stopped: {exc}", code="engine_stopped")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, f"the request failed: {type(exc).__name__}: {exc}", code="internal_error")


class ClientDisconnected(Exception):
    pass


class GenerationSet:
    """The engine requests of one HTTP request (one per prompt), merged into one queue."""

    def __init__(self, engine, request_id: str, prompts: list[tuple[list[int], str | None]],
                 params: list[SamplingParams], lora_request=None):
        self.engine = engine
        # (passed only when set: the engine's test doubles take no adapters)
        self._lora = {"lora_request": lora_request} if lora_request is not None else {}
        self.request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}"
                            for i in range(len(prompts))]
        self.latest: list[RequestOutput | None] = [None] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._consume(i, ids, text, sp))
                       for i, ((ids, text), sp) in enumerate(zip(prompts, params))]

    async def _consume(self, index: int, token_ids, text, params) -> None:
        try:
            async for out in self.engine.generate(token_ids, params, self.request_ids[index], prompt=text,
                                                  **self._lora):
                self._queue.put_nowait((index, out))
        except Exception as e:   # handed to the route, which maps it to a status (cancellation passes)
            self._queue.put_nowait((index, e))

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.latest)

    async def next_outputs(self) -> list[tuple[int, RequestOutput]]:
        """Waits for news, then takes all that is queued, in order: [(prompt index, output)]."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        news = []
        for index, item in items:
            if isinstance(item, Exception):
                raise engine_error(item)
            if item.error is not None or any(c.finish_reason == "error" for c in item.outputs):
                raise APIError(500, f"the request failed: {item.error or 'error in the engine'}",
                               code="internal_error")
            self.latest[index] = item
            news.append((index, item))
        return news

    async def wait_all_finished(self) -> list[RequestOutput]:
        while not self.finished:
            await self.next_outputs()
        return list(self.latest)

    def close(self) -> None:
        """Stops whatever still runs (synchronous: safe inside a cancelled scope)."""
        for task in self._tasks:
            task.cancel()
        for request_id, out in zip(self.request_ids, self.latest):
            if out is None or not out.finished:
                try:
                    task = asyncio.get_running_loop().create_task(self.engine.abort(request_id))
                except RuntimeError:   # no loop left (shutdown); the engine goes with it
                    continue
                _background.add(task)
                task.add_done_callback(_background.discard)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """`await work`, unless the client disconnects first (then ClientDisconnected)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        work_task.cancel()


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, however the stream ends."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
