"""Server-sent events: the engine's delta outputs -> per-choice chunks -> `data: {...}` lines.

A stream's requests run with `output_kind="delta"`: each output holds only what is new since
the last (the output processor holds back a tail that may yet become a stop string, since
text once sent cannot be taken back), so nothing here re-diffs cumulative lists.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.errors import APIError
from jaxserve.server.generation import GenerationSet

logger = logging.getLogger("jaxserve.server")

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(outputs: list[RequestOutput], completion: int | None = None) -> dict:
    """Token counts of whole outputs (or, for a stream, of the completion tokens it counted)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion is None:
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class ChoiceDelta:
    text: str                            # new text
    token_ids: list[int]                 # new tokens
    logprobs: list                       # their logprobs (empty when not asked)
    first: bool                          # the first delta of this choice
    finish_reason: str | None            # set on the last delta only
    stop_reason: int | str | None


class ChoiceCursor:
    """Where one choice's stream stands: started, finished, tokens sent."""

    def __init__(self):
        self.tokens_sent = 0
        self.started = False
        self.done = False

    def advance(self, c: CompletionOutput) -> ChoiceDelta | None:
        """`c` is a delta output: only what is new. None once the choice has finished."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        delta = ChoiceDelta(text=c.text, token_ids=list(c.token_ids), logprobs=list(c.logprobs or []),
                            first=not self.started,
                            finish_reason=c.finish_reason if finished else None,
                            stop_reason=c.stop_reason if finished else None)
        self.tokens_sent += len(c.token_ids)
        self.started = True
        self.done = finished
        return delta


class StreamFormatter:
    """One API's chunk shapes; subclasses say how a choice delta looks."""

    object_name = ""

    def __init__(self, request_id: str, model: str, created: int, n: int, include_usage: bool):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.n = n
        self.include_usage = include_usage
        self.cursors: dict[int, ChoiceCursor] = {}

    def envelope(self, choices: list[dict], usage_: dict | None = None) -> dict:
        out = {"id": self.request_id, "object": self.object_name, "created": self.created,
               "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage_
        return out

    def start(self) -> list[dict]:
        return []

    # How chunks, an error and the end are written: OpenAI's chat / completions SSE here; the
    # Responses and Messages APIs name each event (agent_bridge.py).
    def encode(self, chunk: dict) -> str:
        return sse(chunk)

    def error_chunk(self, error: APIError) -> dict:
        return error.body()

    def done(self) -> str:
        return DONE

    def choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
               delta: ChoiceDelta) -> dict | None:
        raise NotImplementedError

    def chunks(self, news: list[tuple[int, RequestOutput]]) -> list[dict]:
        """Chunks for the delta outputs that arrived, in order: [(prompt index, output)]."""
        chunks = []
        for prompt_index, out in news:
            for c in out.outputs:
                index = prompt_index * self.n + c.index
                delta = self.cursors.setdefault(index, ChoiceCursor()).advance(c)
                choice = None if delta is None else self.choice(index, prompt_index, out, c, delta)
                if choice is not None:
                    chunks.append(self.envelope([choice]))
        return chunks

    def end(self, outputs: list[RequestOutput]) -> list[dict]:
        sent = sum(c.tokens_sent for c in self.cursors.values())
        return [self.envelope([], usage(outputs, sent))] if self.include_usage else []


async def sse_events(formatter: StreamFormatter, generation: GenerationSet,
                     first_news: list[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """The whole event stream of one request, ending in `data: [DONE]` (errors included)."""
    try:
        for chunk in formatter.start():
            yield formatter.encode(chunk)
        news = first_news
        while True:
            for chunk in formatter.chunks(news):
                yield formatter.encode(chunk)
            if generation.finished:
                break
            news = await generation.next_outputs()
        for chunk in formatter.end(generation.latest):
            yield formatter.encode(chunk)
    except APIError as e:
        yield formatter.encode(formatter.error_chunk(e))
    except Exception as e:   # a bug here must still end the stream in the documented way
        logger.exception("stream failed")
        error = APIError(500, f"the stream failed: {type(e).__name__}", code="internal_error")
        yield formatter.encode(formatter.error_chunk(error))
    yield formatter.done()
