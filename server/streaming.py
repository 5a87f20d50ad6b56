"""Server-sent events: cumulative engine outputs -> per-choice deltas -> `data: {...}` lines.

The engine hands back cumulative text; a stream sends only what is new. The engine already
holds back a tail that may become a stop string (text once sent cannot be taken back), so
the cumulative text only ever grows.
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


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class ChoiceDelta:
    text: str                            # new text
    token_start: int                     # new tokens are token_ids[token_start:token_end]
    token_end: int
    first: bool                          # the first delta of this choice
    finish_reason: str | None            # set on the last delta only
    stop_reason: int | str | None


class ChoiceCursor:
    """How much of one choice's cumulative output has been sent."""

    def __init__(self):
        self.text_sent = 0
        self.tokens_sent = 0
        self.started = False
        self.done = False

    def advance(self, c: CompletionOutput) -> ChoiceDelta | None:
        if self.done:
            return None
        finished = c.finish_reason is not None
        delta = ChoiceDelta(text=c.text[self.text_sent:], token_start=self.tokens_sent,
                            token_end=len(c.token_ids), first=not self.started,
                            finish_reason=c.finish_reason if finished else None,
                            stop_reason=c.stop_reason if finished else None)
        self.text_sent = max(self.text_sent, len(c.text))
        self.tokens_sent = len(c.token_ids)
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

    def choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
               delta: ChoiceDelta) -> dict | None:
        raise NotImplementedError

    def chunks(self, news: dict[int, RequestOutput]) -> list[dict]:
        chunks = []
        for prompt_index, out in sorted(news.items()):
            for c in out.outputs:
                index = prompt_index * self.n + c.index
                delta = self.cursors.setdefault(index, ChoiceCursor()).advance(c)
                choice = None if delta is None else self.choice(index, prompt_index, out, c, delta)
                if choice is not None:
                    chunks.append(self.envelope([choice]))
        return chunks

    def end(self, outputs: list[RequestOutput]) -> list[dict]:
        return [self.envelope([], usage(outputs))] if self.include_usage else []


async def sse_events(formatter: StreamFormatter, generation: GenerationSet,
                     first_news: dict[int, RequestOutput]) -> AsyncIterator[str]:
    """The whole event stream of one request, ending in `data: [DONE]` (errors included)."""
    try:
        for chunk in formatter.start():
            yield sse(chunk)
        news = first_news
        while True:
            for chunk in formatter.chunks(news):
                yield sse(chunk)
            if generation.finished:
                break
            news = await generation.next_outputs()
        for chunk in formatter.end(generation.latest):
            yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    except Exception as e:   # a bug here must still end the stream in the documented way
        logger.exception("stream failed")
        yield sse(APIError(500, f"the stream failed: {type(e).__name__}", code="internal_error").body())
    yield DONE
