"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id}: a translation
onto the chat path (agent_bridge.py).

- `input` (a string, or items: messages with text parts, `function_call` and
  `function_call_output` items; `reasoning` items are dropped, as templates drop earlier
  thinking) after the `instructions` (a system message) and, with `previous_response_id`,
  after the stored conversation that response ended (its instructions are not carried over,
  as OpenAI does).
- `max_output_tokens`, `temperature`, `top_p`, vLLM's sampling extras; function `tools` with
  `tool_choice` auto / required / a named function (forced by a grammar, as in chat);
  `text.format` json_schema / json_object -> structured output.
- The answer's blocks become output items: `reasoning`, `message` (output_text), `function_call`.
- Refused, naming the field: built-in tools (web search, file search, ...), background mode,
  server-side conversations, saved prompts, logprobs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pydantic

from jaxserve.server.agent_bridge import (Block, BlockEvent, ChatResult, TranslatedStream, prepare,
                                          run_translated, with_extras)
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError, bad_request, from_validation_error
from jaxserve.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                                                MessageItem, NamedFunctionChoice, ResponsesRequest)
from jaxserve.server.responses_store import ResponsesStore
from jaxserve.server.serving_chat import ChatRun

INPUT_ROLES = ("user", "assistant", "system", "developer")
# The chat path's names for what this API calls otherwise (its errors are translated).
NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
# vLLM's sampling extras a Responses request may carry as extra body fields.
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
                   "logit_bias", "skip_special_tokens", "include_stop_str_in_output")
# `include` values that ask for nothing this server would leave out
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


def _item(model: type[pydantic.BaseModel], item: dict, param: str):
    try:
        return model.model_validate(item)
    except pydantic.ValidationError as e:
        error = from_validation_error(e)
        raise bad_request(f"{param}: {error.message}", param=param) from None


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's `input` as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input is an empty list; give a string or at least one item", param="input")
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            m = _item(MessageItem, item, param)
            if m.role not in INPUT_ROLES:
                raise bad_request(f"{param}.role is {m.role!r}; allowed roles: {', '.join(INPUT_ROLES)}",
                                  param=f"{param}.role")
            messages.append({"role": m.role, "content": _text(m.content)})
        elif kind == "function_call":
            call = _item(FunctionCallItem, item, param)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            # A turn's calls (and any text before them) are one assistant message.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            out = _item(FunctionCallOutputItem, item, param)
            messages.append({"role": "tool", "tool_call_id": out.call_id, "content": _text(out.output)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{param}.type {kind!r} is not supported; this server takes message, "
                              f"function_call, function_call_output and reasoning items",
                              param=f"{param}.type")
    return messages


def _chat_tools(req: ResponsesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}].type {kind!r} is not supported by this server: only "
                                f"function tools (built-in tools such as web_search run nowhere here)",
                           param=f"tools[{i}].type", code="unsupported_parameter")
        f = _item(FunctionTool, tool, f"tools[{i}]")
        tools.append({"type": "function", "function": f.model_dump(exclude={"type"}, exclude_none=True)})
    return tools


def _chat_tool_choice(req: ResponsesRequest):
    choice = req.tool_choice
    if not req.tools and choice in ("auto", "none"):
        return None     # clients send "auto" with no tools: there is nothing to choose
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported: give "
                            f'"auto", "required", "none" or {{"type": "function", "name": ...}}',
                       param="tool_choice", code="unsupported_parameter")
    named = _item(NamedFunctionChoice, choice, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


def check_refused(req: ResponsesRequest) -> None:
    def refuse(field: str, what: str):
        raise APIError(400, f"{field} is not supported by this server: {what}", param=field,
                       code="unsupported_parameter")

    if req.background:
        refuse("background", "background mode is not implemented; send the request and wait, or stream it")
    if req.conversation is not None:
        refuse("conversation", "server-side conversations are not implemented; use previous_response_id")
    if req.prompt is not None:
        refuse("prompt", "saved prompts are not implemented; send instructions and input")
    if req.top_logprobs:
        refuse("top_logprobs", "logprobs are not implemented on /v1/responses; use /v1/chat/completions")
    for value in req.include or []:
        if value not in HARMLESS_INCLUDES:
            refuse("include", f"{value!r} is not implemented (accepted: {', '.join(HARMLESS_INCLUDES)})")


def chat_fields(req: ResponsesRequest, conversation: list[dict]) -> dict:
    """The ChatCompletionRequest this request runs as; `conversation`: the previous response's
    conversation (if any) and this request's input, as chat messages."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += conversation
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": _chat_tools(req),
        "tool_choice": _chat_tool_choice(req), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req)}
    return with_extras(fields, req.model_extra, SAMPLING_EXTRAS, "/v1/responses")


# ---- the answer ---------------------------------------------------------------------------

def _usage(result: ChatResult) -> dict:
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class ResponseBuilder:
    """The response object and its output items, the same for a whole answer and a stream."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, model: str):
        self.req, self.id, self.created, self.model = req, response_id, created, model

    def item_id(self, block: Block, index: int) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "tool": "fc"}[block.kind]
        return f"{prefix}_{self.id.removeprefix('resp_')}_{index}"

    def item(self, block: Block, index: int, status: str = "completed") -> dict:
        item_id = self.item_id(block, index)
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": block.text}] if status != "in_progress" else []
            return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if block.kind == "text":
            content = [self.text_part(block.text)] if status != "in_progress" else []
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": block.text if status != "in_progress" else "", "status": status}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, result: ChatResult | None) -> dict:
        """The response object; `result` None: still running (a stream's first events)."""
        req = self.req
        status, incomplete, output, usage = "in_progress", None, [], None
        if result is not None:
            cut = result.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            last = len(result.blocks) - 1     # a cut answer's last item is the one cut short
            output = [self.item(b, i, "incomplete" if cut and i == last else "completed")
                      for i, b in enumerate(result.blocks)]
            usage = _usage(result)
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "max_tool_calls": req.max_tool_calls, "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
                "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "truncation": req.truncation or "disabled",
                "usage": usage, "user": req.user, "metadata": req.metadata or {}}


def answer_message(result: ChatResult) -> dict:
    """The answer as a chat message, for the stored conversation."""
    text = "".join(b.text for b in result.blocks if b.kind == "text")
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in result.blocks if b.kind == "tool"]
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


class ResponsesStream(TranslatedStream):
    """The Responses API's event sequence, numbered (`sequence_number`)."""

    def __init__(self, ctx: ServerContext, run: ChatRun, builder: ResponseBuilder, on_done):
        super().__init__(ctx, run, builder.id, builder.created)
        self.builder, self.on_done = builder, on_done
        self.sequence = 0

    def encode(self, event: dict) -> str:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return super().encode(event)

    def error_chunk(self, error: APIError) -> dict:
        return {"type": "error", "code": str(error.code), "message": error.message, "param": error.param}

    def opening(self) -> list[dict]:
        response = self.builder.response(None)
        return [{"type": "response.created", "response": response},
                {"type": "response.in_progress", "response": response}]

    def translate(self, events: list[BlockEvent]) -> list[dict]:
        out = []
        for what, block, piece in events:
            index = self.splitter.blocks.index(block)
            at = {"item_id": self.builder.item_id(block, index), "output_index": index}
            if what == "open":
                out.append({"type": "response.output_item.added", "output_index": index,
                            "item": self.builder.item(block, index, "in_progress")})
                if block.kind != "tool":
                    out.append({"type": "response.content_part.added", **at, "content_index": 0,
                                "part": self._part(block, "")})
            elif what == "delta":
                out.append(self._piece_event(block, at, piece))
            else:
                out += self._done_events(block, at)
                out.append({"type": "response.output_item.done", "output_index": index,
                            "item": self.builder.item(block, index)})
        return out

    def _part(self, block: Block, text: str) -> dict:
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return self.builder.text_part(text)

    @staticmethod
    def _piece_event(block: Block, at: dict, piece: str) -> dict:
        if block.kind == "tool":
            return {"type": "response.function_call_arguments.delta", **at, "delta": piece}
        if block.kind == "reasoning":
            return {"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": piece}
        return {"type": "response.output_text.delta", **at, "content_index": 0, "delta": piece, "logprobs": []}

    def _done_events(self, block: Block, at: dict) -> list[dict]:
        if block.kind == "tool":
            return [{"type": "response.function_call_arguments.done", **at, "name": block.name,
                     "arguments": block.text}]
        if block.kind == "reasoning":
            done = {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": block.text}
        else:
            done = {"type": "response.output_text.done", **at, "content_index": 0, "text": block.text,
                    "logprobs": []}
        return [done, {"type": "response.content_part.done", **at, "content_index": 0,
                       "part": self._part(block, block.text)}]

    def closing(self, result: ChatResult) -> list[dict]:
        response = self.on_done(result)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [{"type": kind, "response": response}]


async def create_response(ctx: ServerContext, request, req: ResponsesRequest, store: ResponsesStore):
    history: list[dict] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id {req.previous_response_id!r} names no stored "
                                f"response (never stored, deleted, or evicted from this server's memory)",
                           param="previous_response_id", code="response_not_found")
        history = previous.conversation
    check_refused(req)
    conversation = history + input_messages(req)
    run = await prepare(ctx, chat_fields(req, conversation), NAMES)
    response_id = f"resp_{uuid.uuid4().hex}"
    builder = ResponseBuilder(req, response_id, int(time.time()), ctx.model_name)

    def finish(result: ChatResult) -> dict:
        response = builder.response(result)
        if req.store:
            store.put(response, conversation + [answer_message(result)])
        return response

    stream = ResponsesStream(ctx, run, builder, finish) if req.stream else None
    return await run_translated(ctx, request, run, response_id, builder.created, stream, finish)


def stored_response(store: ResponsesStore, response_id: str) -> dict:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response {response_id!r}", param="response_id",
                       code="response_not_found")
    return entry.response


def delete_response(store: ResponsesStore, response_id: str) -> dict:
    if not store.delete(response_id):
        raise APIError(404, f"no stored response {response_id!r}", param="response_id",
                       code="response_not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
