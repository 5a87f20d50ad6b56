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

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, **kwargs):
        super().__init__(**kwargs)
        self.ctx, self.req = ctx, req

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
                                     self.req.top_logprobs or 0)
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        return {"index": index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": logprobs, "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason}


def chat_body(ctx: ServerContext, req: ChatCompletionRequest, request_id: str, created: int,
              outputs: list[RequestOutput]) -> dict:
    (out,) = outputs
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], req.top_logprobs or 0)
        choices.append({"index": c.index,
                        "message": {"role": "assistant", "content": _echo_text(req) + c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": created,
            "model": ctx.model_name, "choices": choices, "usage": usage(outputs)}


async def create_chat_completion(ctx: ServerContext, request, req: ChatCompletionRequest):
    check_request(req)
    ctx.check_model(req.model)
    prompt = await ctx.in_tokenizer_thread(chat_prompt, ctx, req)
    params = chat_sampling_params(ctx, req, prompt)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = ChatStream(
        ctx, req, request_id=request_id, model=ctx.model_name, created=created, n=req.n,
        include_usage=include_usage) if req.stream else None
    return await run_generation(ctx, request, request_id, [(prompt.token_ids, prompt.text)], [params],
                                stream, lambda outputs: chat_body(ctx, req, request_id, created, outputs))
