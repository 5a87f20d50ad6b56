"""What the Responses API (responses.py) and the Messages API (messages.py) share.

Both are translations: the request becomes a ChatCompletionRequest that runs on the chat path
(serving_chat.prepare_chat: the same validation, chat template, tools and their grammars,
structured output and sampling), and the chat result (a whole message, or the stream's
deltas) comes back as a sequence of blocks, each reasoning, text or one tool call, which
each API writes in its own shape. A whole answer goes through the same BlockSplitter as a
stream's deltas, so the two cannot disagree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

import pydantic

from jaxserve.outputs import RequestOutput
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError, bad_request, from_validation_error
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.serving import run_generation
from jaxserve.server.serving_chat import ChatRun, ChatStream, chat_body, prepare_chat
from jaxserve.server.streaming import usage


@dataclass
class Block:
    kind: Literal["reasoning", "text", "tool"]
    text: str = ""               # the reasoning, the text, or the call's arguments (JSON text)
    name: str | None = None      # tool: the function
    call_id: str | None = None   # tool: the chat path's call id


# (what happened, the block, the new piece of text): "open" and "close" carry no text.
BlockEvent = tuple[Literal["open", "delta", "close"], Block, str]


class BlockSplitter:
    """Chat deltas (or a whole chat message: one delta) -> blocks opened, grown and closed in
    order. A delta's reasoning comes before its content, its content before its tool calls."""

    def __init__(self):
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, delta: dict) -> list[BlockEvent]:
        events = []
        # NOTE: `reasoning` is set only when the server runs a reasoning parser.
        if delta.get("reasoning"):
            events += self._add("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._add("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):    # a call's first delta carries its id and name
                events += self._start(Block("tool", name=function.get("name"), call_id=call["id"]))
            events += self._add("tool", function.get("arguments") or "")
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [("close", block, "")]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return events + [("open", block, "")]

    def _add(self, kind: str, piece: str) -> list[BlockEvent]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._start(Block(kind))
        if piece:
            self._open.text += piece
            events.append(("delta", self._open, piece))
        return events


@dataclass(frozen=True)
class ChatResult:
    """A finished chat answer as blocks, with why it ended and its token counts."""
    blocks: list[Block]
    finish_reason: str | None        # the chat path's: "stop", "length", "tool_calls", ...
    stop_reason: int | str | None    # the stop string (or token id) that ended it
    prompt_tokens: int
    completion_tokens: int


def chat_result(body: dict) -> ChatResult:
    """A chat completion body (serving_chat.chat_body) of one choice -> ChatResult."""
    (choice,) = body["choices"]
    splitter = BlockSplitter()
    splitter.feed(choice["message"])
    splitter.close()
    u = body["usage"]
    return ChatResult(splitter.blocks, choice["finish_reason"], choice.get("stop_reason"),
                      u["prompt_tokens"], u["completion_tokens"])


def tool_input(arguments: str) -> Any:
    """A call's arguments as a value; text that is not JSON (a call cut short) as {}."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


# ---- errors in each API's own terms -------------------------------------------------------

def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """The chat path's error with its field names in the translated API's terms
    ({"max_tokens": "max_output_tokens", ...})."""
    def swap(text: str) -> str:
        for chat_name, own in names.items():
            text = re.sub(rf"\b{re.escape(chat_name)}\b", own, text)
        return text

    param = None if error.param is None else swap(error.param)
    return APIError(error.status, swap(error.message), param=param, code=error.code, headers=error.headers)


def with_extras(fields: dict, extras: dict | None, allowed: tuple[str, ...], endpoint: str) -> dict:
    """The chat request's fields: `fields`, plus the request's extra fields (a chat-only field
    not in `allowed` is a 400 naming `endpoint`; anything else goes on as chat treats unknown
    fields), without those left at None."""
    fields = dict(fields)
    for name, value in (extras or {}).items():
        if name in ChatCompletionRequest.model_fields and name not in allowed:
            raise bad_request(f"{name} is a chat completions field, not one of {endpoint}", param=name)
        fields[name] = value
    return {k: v for k, v in fields.items() if v is not None}


def chat_request(fields: dict, names: dict[str, str]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as e:
        raise renamed(from_validation_error(e), names) from None


async def prepare(ctx: ServerContext, fields: dict, names: dict[str, str]) -> ChatRun:
    """The translated request (the ChatCompletionRequest's fields), checked as chat checks it."""
    try:
        return await prepare_chat(ctx, chat_request(fields, names))
    except APIError as e:
        raise renamed(e, names) from None


# ---- running it --------------------------------------------------------------------------

class TranslatedStream(ChatStream):
    """The chat stream of one choice, its deltas turned into another API's named events.
    Subclasses say what opens and closes the stream and what each block event becomes."""

    def __init__(self, ctx: ServerContext, run: ChatRun, request_id: str, created: int):
        super().__init__(ctx, run.req, run.plan, run.prompt.text, request_id=request_id,
                         model=ctx.model_name, created=created, n=1, include_usage=False)
        self.splitter = BlockSplitter()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    # -- what subclasses write
    def opening(self) -> list[dict]:
        raise NotImplementedError

    def translate(self, events: list[BlockEvent]) -> list[dict]:
        raise NotImplementedError

    def closing(self, result: ChatResult) -> list[dict]:
        raise NotImplementedError

    # -- StreamFormatter
    def start(self) -> list[dict]:
        return self.opening()

    def chunks(self, news: list[tuple[int, RequestOutput]]) -> list[dict]:
        events = []
        for chunk in super().chunks(news):
            for choice in chunk["choices"]:
                events += self.translate(self.splitter.feed(choice["delta"]))
                if choice["finish_reason"] is not None:
                    self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    def end(self, outputs: list[RequestOutput]) -> list[dict]:
        events = self.translate(self.splitter.close())
        counts = usage(outputs, sum(c.tokens_sent for c in self.cursors.values()))
        result = ChatResult(self.splitter.blocks, self.finish_reason, self.stop_reason,
                            counts["prompt_tokens"], counts["completion_tokens"])
        return events + self.closing(result)

    def encode(self, event: dict) -> str:
        # Both APIs name each event (SSE `event:` line) as its data's "type"; the SDKs read both.
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def done(self) -> str:
        return ""     # neither API ends with `data: [DONE]`


async def run_translated(ctx: ServerContext, request, run: ChatRun, request_id: str, created: int,
                         stream: TranslatedStream | None, body: Callable[[ChatResult], dict]):
    """Runs the chat request; answers with body(result), or the stream's events."""
    prompt = run.prompt

    def whole(outputs: list[RequestOutput]) -> dict:
        return body(chat_result(chat_body(ctx, run.req, run.plan, request_id, created, outputs,
                                          prompt.text)))

    return await run_generation(ctx, request, request_id, [(prompt.token_ids, prompt.text)], [run.params],
                                stream, whole, run.lora)
