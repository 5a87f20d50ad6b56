"""POST /v1/completions: prompts (one or a batch) -> choices, whole or streamed."""

from __future__ import annotations

import time
import uuid

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.context import ServerContext
from jaxserve.server.inputs import PromptInput, completion_prompts, completion_sampling_params
from jaxserve.server.logprobs import CompletionLogprobs, merge_completion_logprobs
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.serving import run_generation
from jaxserve.server.streaming import ChoiceDelta, StreamFormatter, usage
from jaxserve.server.structured import check_compiles, field_of
from jaxserve.server.unsupported import check_request


def _prompt_text(ctx: ServerContext, prompt: PromptInput) -> str:
    if prompt.text is not None:
        return prompt.text
    if ctx.tokenizer is None:   # token ids in, no tokenizer: there is no text to echo
        return ""
    return ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


class _Echo:
    """The prompt part of an echoed choice: its text and, if asked, its logprobs."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, prompts: list[PromptInput]):
        self.ctx, self.req, self.prompts = ctx, req, prompts

    def text(self, prompt_index: int) -> str:
        return _prompt_text(self.ctx, self.prompts[prompt_index]) if self.req.echo else ""

    def logprobs(self, prompt_index: int, out: RequestOutput, fmt: CompletionLogprobs) -> list[dict]:
        if not self.req.echo or self.req.logprobs is None:
            return []
        positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return [fmt.format(out.prompt_token_ids, positions)]


class CompletionStream(StreamFormatter):
    object_name = "text_completion"

    def __init__(self, ctx: ServerContext, req: CompletionRequest, echo: _Echo, **kwargs):
        super().__init__(**kwargs)
        self.ctx, self.req, self.echo = ctx, req, echo
        self.logprob_fmts: dict[int, CompletionLogprobs] = {}

    def choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
               delta: ChoiceDelta) -> dict | None:
        text, logprobs = delta.text, None
        if self.req.logprobs is not None:
            fmt = self.logprob_fmts.setdefault(index, CompletionLogprobs(
                self.ctx.tokenizer, as_ids=self.ctx.tokens_as_ids(self.req.return_tokens_as_token_ids)))
            parts = self.echo.logprobs(prompt_index, out, fmt) if delta.first else []
            parts.append(fmt.format(delta.token_ids, delta.logprobs))
            logprobs = merge_completion_logprobs(parts)
        if delta.first:
            text = self.echo.text(prompt_index) + text
        has_tokens = logprobs is not None and logprobs["tokens"]
        ids = self.req.return_token_ids and delta.token_ids   # every id is sent, text or not
        if not text and not has_tokens and delta.finish_reason is None and not ids:
            return None
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if delta.first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice


def completion_body(ctx: ServerContext, req: CompletionRequest, echo: _Echo, request_id: str,
                    created: int, outputs: list[RequestOutput]) -> dict:
    choices = []
    for prompt_index, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                fmt = CompletionLogprobs(ctx.tokenizer,
                                         as_ids=ctx.tokens_as_ids(req.return_tokens_as_token_ids))
                parts = echo.logprobs(prompt_index, out, fmt)
                parts.append(fmt.format(c.token_ids, c.logprobs or []))
                logprobs = merge_completion_logprobs(parts)
            choice = {"index": prompt_index * req.n + c.index,
                      "text": echo.text(prompt_index) + c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = list(c.token_ids)
            if req.prompt_logprobs is not None:      # vLLM's extension: per prompt position
                choice["prompt_logprobs"] = [
                    None if pos is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                       "decoded_token": lp.decoded_token}
                                              for t, lp in pos.items()}
                    for pos in (out.prompt_logprobs or [])]
            choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": created,
            "model": ctx.model_name, "choices": choices, "usage": usage(outputs)}


async def create_completion(ctx: ServerContext, request, req: CompletionRequest):
    check_request(req)
    lora = ctx.check_model(req.model)
    prompts = await ctx.in_tokenizer_thread(completion_prompts, ctx, req)
    params = [completion_sampling_params(ctx, req, p) for p in prompts]
    if params:
        await check_compiles(ctx, params[0], field_of(req))
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echo = _Echo(ctx, req, prompts)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = CompletionStream(
        ctx, req, echo, request_id=request_id, model=ctx.response_model(lora), created=created, n=req.n,
        include_usage=include_usage) if req.stream else None
    return await run_generation(
        ctx, request, request_id, [(p.token_ids, p.text) for p in prompts], params, stream,
        lambda outputs: {**completion_body(ctx, req, echo, request_id, created, outputs),
                         "model": ctx.response_model(lora)}, lora)
