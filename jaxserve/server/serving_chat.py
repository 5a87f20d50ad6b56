"""POST /v1/chat/completions: messages -> chat template -> assistant message(s), whole or streamed."""

from __future__ import annotations

import time
import uuid

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.context import ServerContext
from jaxserve.server.inputs import chat_prompt, chat_sampling_params
from jaxserve.server.logprobs import chat_logprobs
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.serving import run_generation
from jaxserve.server.streaming import ChoiceDelta, StreamFormatter, usage
from jaxserve.server.structured import check_compiles, field_of, structured_outputs
from jaxserve.server.tool_parsers import SAFE_CONTENT
from jaxserve.server.tools import (ToolPlan, finish_reason, new_call_id, parse_output, tool_call,
                                   tool_plan)
from jaxserve.server.unsupported import check_request


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, if it is the assistant's (being continued)."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    content = req.messages[-1].content
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class ChatStream(StreamFormatter):
    object_name = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, **kwargs):
        super().__init__(**kwargs)
        self.ctx, self.req, self.plan = ctx, req, plan
        self.call_ids: dict[int, str] = {}     # named tool choice: each choice's call id
        self.content_sent: dict[int, int] = {}  # auto: characters of each choice sent as content
        self.texts: dict[int, str] = {}         # auto, required: each choice's text so far

    def start(self) -> list[dict]:
        # OpenAI opens every choice with a delta that carries only the role.
        echo = _echo_text(self.req)
        return [self.envelope([{"index": i, "delta": {"role": "assistant", "content": echo},
                                "logprobs": None, "finish_reason": None}]) for i in range(self.n)]

    def choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
               delta: ChoiceDelta) -> dict | None:
        logprobs = None
        if self.req.logprobs and delta.token_ids:
            logprobs = chat_logprobs(self.ctx.tokenizer, delta.token_ids, delta.logprobs,
                                     self.req.top_logprobs or 0,
                                     self.ctx.tokens_as_ids(self.req.return_tokens_as_token_ids))
        body, finish = self._delta(index, delta)
        if not body and logprobs is None and finish is None:
            return None
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": delta.stop_reason}

    def _delta(self, index: int, delta: ChoiceDelta) -> tuple[dict, str | None]:
        """The delta's body and finish reason. A named tool's arguments stream as they come;
        the other tool modes send their calls once the output is whole (they are parsed)."""
        mode = self.plan.mode
        if mode == "none":
            return ({"content": delta.text} if delta.text else {}), delta.finish_reason
        if mode == "named":
            call = {"index": 0, "function": {"arguments": delta.text}}
            if delta.first:
                self.call_ids[index] = new_call_id()
                call = tool_call(self.plan.name, delta.text, 0, self.call_ids[index])
            return ({"tool_calls": [call]} if delta.text or delta.first else {}), delta.finish_reason
        text = self.texts[index] = self.texts.get(index, "") + delta.text   # deltas: put together
        sent = self.content_sent.get(index, 0)
        if delta.finish_reason is None:
            # auto: text that cannot be part of a call streams; required: nothing is content
            safe = SAFE_CONTENT[self.plan.parser](text) if mode == "auto" else 0
            if safe <= sent:
                return {}, None
            self.content_sent[index] = safe
            return {"content": text[sent:safe]}, None
        content, calls = parse_output(self.plan, text)
        # The whole output is parsed. Without calls it all is content; with calls the content
        # is the (stripped) text before the first one, of which `sent` raw characters went out.
        if not calls:
            rest = text[sent:]
        else:
            rest = (content or "")[len(text[:sent].lstrip()):]
        body = {"content": rest} if rest else {}
        if calls:
            body["tool_calls"] = [tool_call(name, args, i) for i, (name, args) in enumerate(calls)]
        return body, finish_reason(self.plan, delta.finish_reason, calls)


def chat_body(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, request_id: str,
              created: int, outputs: list[RequestOutput]) -> dict:
    (out,) = outputs
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                                     ctx.tokens_as_ids(req.return_tokens_as_token_ids))
        message = {"role": "assistant", "content": _echo_text(req) + c.text}
        reason = c.finish_reason
        if plan.mode != "none":
            content, calls = parse_output(plan, c.text)
            message = {"role": "assistant", "content": content,
                       "tool_calls": [tool_call(name, args) for name, args in calls]}
            reason = finish_reason(plan, reason, calls)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": created,
            "model": ctx.model_name, "choices": choices, "usage": usage(outputs)}


async def create_chat_completion(ctx: ServerContext, request, req: ChatCompletionRequest):
    check_request(req)
    lora = ctx.check_model(req.model)
    plan = tool_plan(ctx, req, structured_outputs(req))
    prompt = await ctx.in_tokenizer_thread(chat_prompt, ctx, req, plan.tools)
    params = chat_sampling_params(ctx, req, prompt, plan.structured)
    await check_compiles(ctx, params, "tools" if plan.mode in ("required", "named") else field_of(req))
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = ChatStream(
        ctx, req, plan, request_id=request_id, model=ctx.response_model(lora), created=created, n=req.n,
        include_usage=include_usage) if req.stream else None
    return await run_generation(ctx, request, request_id, [(prompt.token_ids, prompt.text)], [params],
                                stream, lambda outputs: {**chat_body(ctx, req, plan, request_id, created, outputs),
                                                         "model": ctx.response_model(lora)}, lora)
