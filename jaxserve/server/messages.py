"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): a translation
onto the chat path (agent_bridge.py).

- `system` (a string or text blocks) is the system message; `messages` hold text, `tool_use`
  (an assistant's calls) and `tool_result` blocks (tool messages); earlier `thinking` blocks
  are dropped, as templates drop earlier thinking. A last assistant message is a prefill:
  the answer continues it (chat's continue_final_message).
- `max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences`; `tools` with `input_schema`
  and `tool_choice` auto / any / tool / none (chat's auto / required / named / none: a forced
  choice is a grammar, as in chat); `output_format` json_schema -> structured output.
- The answer's blocks become `thinking`, `text` and `tool_use` content blocks; stop_reason is
  end_turn, max_tokens, stop_sequence or tool_use.
- Errors, from validation to the engine's, come in Anthropic's shape.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Awaitable

import pydantic
from fastapi.responses import JSONResponse, Response

from jaxserve.server.agent_bridge import (Block, BlockEvent, ChatResult, TranslatedStream, chat_request,
                                          prepare, run_translated, tool_input, with_extras)
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError, bad_request, from_validation_error
from jaxserve.server.inputs import chat_prompt
from jaxserve.server.messages_protocol import (CountTokensRequest, MessagesRequest, TextBlock, ToolChoiceParam,
                                               ToolParam, ToolResultBlock, ToolUseBlock)
from jaxserve.server.serving_chat import ChatRun

ROLES = ("user", "assistant")
# The chat path's names for what this API calls otherwise (its errors are translated).
NAMES = {"stop": "stop_sequences", "response_format": "output_format"}
# vLLM's sampling extras a request may carry as extra body fields.
SAMPLING_EXTRAS = ("min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "min_tokens", "ignore_eos", "logit_bias", "stop_token_ids")


async def in_anthropic_shape(work: Awaitable) -> Response:
    """The route's answer, its errors in Anthropic's shape instead of OpenAI's."""
    try:
        return await work
    except APIError as e:
        return e.anthropic_response()


def _block(model: type[pydantic.BaseModel], block: dict, param: str):
    try:
        return model.model_validate(block)
    except pydantic.ValidationError as e:
        raise bad_request(f"{param}: {from_validation_error(e).message}", param=param) from None


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _message(i: int, role: str, content: str | list[dict]) -> list[dict]:
    """One Anthropic message as chat messages: tool results are tool messages of their own."""
    if role not in ROLES:
        raise bad_request(f"messages[{i}].role is {role!r}; allowed roles: {', '.join(ROLES)} "
                          f"(the system prompt is the top-level system field)", param=f"messages[{i}].role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        param, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_block(TextBlock, block, param).text)
        elif kind == "tool_use" and role == "assistant":
            use = _block(ToolUseBlock, block, param)
            calls.append({"id": use.id, "type": "function",
                          "function": {"name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            result = _block(ToolResultBlock, block, param)
            if texts:     # text before a result stays before it
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            text = _text(result.content)
            out.append({"role": "tool", "tool_call_id": result.tool_use_id,
                        "content": f"Error: {text}" if result.is_error else text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
            raise bad_request(f"{param}.type {kind!r} is not supported in a {role} message here; "
                              f"allowed: {allowed}", param=f"{param}.type")
    if texts or calls or not out:
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _tools(req: CountTokensRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise APIError(400, f"tools[{i}].type {kind!r} is not supported by this server: only "
                                f"custom tools with an input_schema (server tools run nowhere here)",
                           param=f"tools[{i}].type", code="unsupported_parameter")
        t = _block(ToolParam, tool, f"tools[{i}]")
        function = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            function["description"] = t.description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: ToolChoiceParam | None, tools: list | None):
    if choice is None or (not tools and choice.type in ("auto", "none")):
        return None     # "auto" with no tools: there is nothing to choose
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _response_format(req: MessagesRequest) -> dict | None:
    fmt = req.output_format
    if fmt is None and req.output_config is not None:
        fmt = req.output_config.get("format")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request('output_format must be {"type": "json_schema", "schema": {...}}', param="output_format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_fields(req: CountTokensRequest) -> dict:
    """The ChatCompletionRequest this request runs as."""
    if not req.messages:
        raise bad_request("messages is empty; give at least one message", param="messages")
    messages = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _message(i, m.role, m.content)
    fields: dict[str, Any] = {"model": req.model, "messages": messages, "tools": _tools(req),
                              "tool_choice": _tool_choice(req.tool_choice, req.tools)}
    if req.messages[-1].role == "assistant":    # a prefilled answer: the model continues it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if req.tool_choice is not None:
        fields["parallel_tool_calls"] = not req.tool_choice.disable_parallel_tool_use
    if isinstance(req, MessagesRequest):
        for field in ("mcp_servers", "container"):
            if getattr(req, field) is not None:
                raise APIError(400, f"{field} is not supported by this server", param=field,
                               code="unsupported_parameter")
        fields.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, stop=req.stop_sequences, response_format=_response_format(req))
    return with_extras(fields, req.model_extra, SAMPLING_EXTRAS, "/v1/messages")


# ---- the answer ---------------------------------------------------------------------------

def _tool_id(block: Block) -> str:
    return "toolu_" + (block.call_id or "").removeprefix("chatcmpl-tool-")


def content_block(block: Block, whole: bool = True) -> dict:
    """A block as Anthropic's content block; `whole` False: as a stream opens it (empty)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    return {"type": "tool_use", "id": _tool_id(block), "name": block.name,
            "input": tool_input(block.text) if whole else {}}


def stop_reason(result: ChatResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if any(b.kind == "tool" for b in result.blocks):
        return "tool_use", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message_body(message_id: str, model: str, result: ChatResult) -> dict:
    reason, sequence = stop_reason(result)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [content_block(b) for b in result.blocks], "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(result.prompt_tokens, result.completion_tokens)}


class MessagesStream(TranslatedStream):
    """Anthropic's event sequence: message_start, ping, content blocks, message_delta, message_stop."""

    def __init__(self, ctx: ServerContext, run: ChatRun, message_id: str, created: int):
        super().__init__(ctx, run, message_id, created)
        self.input_tokens = len(run.prompt.token_ids)

    def error_chunk(self, error: APIError) -> dict:
        return error.anthropic_body()

    def opening(self) -> list[dict]:
        message = {"id": self.request_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(self.input_tokens, 0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def translate(self, events: list[BlockEvent]) -> list[dict]:
        out = []
        for what, block, piece in events:
            index = self.splitter.blocks.index(block)
            if what == "open":
                out.append({"type": "content_block_start", "index": index,
                            "content_block": content_block(block, whole=False)})
            elif what == "delta":
                if block.kind == "reasoning":
                    delta = {"type": "thinking_delta", "thinking": piece}
                elif block.kind == "text":
                    delta = {"type": "text_delta", "text": piece}
                else:
                    delta = {"type": "input_json_delta", "partial_json": piece}
                out.append({"type": "content_block_delta", "index": index, "delta": delta})
            else:
                out.append({"type": "content_block_stop", "index": index})
        return out

    def closing(self, result: ChatResult) -> list[dict]:
        reason, sequence = stop_reason(result)
        return [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens}},
                {"type": "message_stop"}]


async def create_message(ctx: ServerContext, request, req: MessagesRequest):
    run = await prepare(ctx, chat_fields(req), NAMES)
    message_id, created = f"msg_{uuid.uuid4().hex}", int(time.time())
    stream = MessagesStream(ctx, run, message_id, created) if req.stream else None
    return await run_translated(ctx, request, run, message_id, created, stream,
                                lambda result: message_body(message_id, ctx.model_name, result))


async def count_tokens(ctx: ServerContext, req: CountTokensRequest) -> JSONResponse:
    """The prompt's length as the chat template renders it, with the tools it would show."""
    chat_req = chat_request(chat_fields(req), NAMES)
    ctx.check_model(chat_req.model)
    shown = chat_req.tools if chat_req.tool_choice != "none" else None
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in shown] if shown else None
    prompt = await ctx.in_tokenizer_thread(chat_prompt, ctx, chat_req, tools)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})
