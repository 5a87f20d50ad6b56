"""What completions and chat share: run the prompts, answer whole or as a stream."""

from __future__ import annotations

import logging
from typing import Callable

from fastapi.responses import JSONResponse, Response

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.context import ServerContext
from jaxserve.server.generation import (ClientDisconnected, ClosingStreamingResponse, GenerationSet,
                                        until_disconnect)
from jaxserve.server.streaming import StreamFormatter, sse_events

# nginx's "client closed request": never seen by the client, but visible in access logs.
CLIENT_CLOSED_REQUEST = 499

logger = logging.getLogger("jaxserve.server.requests")


def log_request(ctx: ServerContext, request_id: str, token_ids: list[int], text: str | None,
                params: SamplingParams) -> None:
    """--enable-log-requests: the request's id, prompt (cut at --max-log-len) and parameters."""
    cut = ctx.max_log_len
    shown_text = text if text is None or cut is None else text[:cut]
    shown_ids = token_ids if cut is None else token_ids[:cut]
    logger.info("received request %s: prompt: %r, prompt_token_ids: %s, params: %s",
                request_id, shown_text, shown_ids, params)


async def run_generation(ctx: ServerContext, request, request_id: str,
                         prompts: list[tuple[list[int], str | None]], params: list[SamplingParams],
                         stream: StreamFormatter | None,
                         body: Callable[[list[RequestOutput]], dict], lora_request=None) -> Response:
    if stream is not None:    # a stream sends what is new: the engine hands out only that
        params = [p.clone(output_kind="delta") for p in params]
    generation = GenerationSet(ctx.engine, request_id, prompts, params, lora_request)
    if ctx.log_requests:
        for rid, (ids, text), sp in zip(generation.request_ids, prompts, params):
            log_request(ctx, rid, ids, text, sp)
    handed_to_stream = False
    try:
        if stream is not None:
            # NOTE: wait for the first output before answering 200, so that a refusal by the
            # engine (overloaded, dead, invalid) still gets its own status code.
            first = await until_disconnect(request, generation.next_outputs())
            handed_to_stream = True
            return ClosingStreamingResponse(sse_events(stream, generation, first),
                                            on_close=generation.close, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        outputs = await until_disconnect(request, generation.wait_all_finished())
        return JSONResponse(body(outputs))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not handed_to_stream:
            generation.close()
