"""POST /v1/chat/completions: messages -> chat template -> assistant message(s), whole or streamed."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.parsers.tools import tool_parser
from jaxserve.server.context import ServerContext
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.inputs import PromptInput, chat_prompt, chat_sampling_params
from jaxserve.server.logprobs import chat_logprobs
from jaxserve.server.protocol import AssistantMessage, ChatCompletionRequest, DeltaMessage
from jaxserve.server.serving import run_generation
from jaxserve.server.streaming import ChoiceDelta, StreamFormatter, usage
from jaxserve.server.structured import check_compiles, field_of, structured_outputs
from jaxserve.server.tools import (ToolPlan, finish_reason, new_call_id, output_stream, tool_call,
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


class ChoiceSplit:
    """One choice's output -> its thinking (the reasoning parser's), its content and its tool
    calls (the plan's stream), fed text deltas; a whole output is one final feed."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan,
                 prompt_text: str | None):
        parser = ctx.reasoning_parser
        self.thinking = None if parser is None else parser.stream(
            prompt_text, ctx.template_kwargs(req.chat_template_kwargs))
        self.include_reasoning = req.include_reasoning
        self.tools = output_stream(plan)
        # parallel_tool_calls false: the first call only (as vLLM)
        self.max_calls = None if req.parallel_tool_calls else 1
        self.call_ids: dict[int, str] = {}
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        if self.thinking is not None:
            split = self.thinking.feed(text, final)
            if split.reasoning and self.include_reasoning:
                self.reasoning.append(split.reasoning)
                out.reasoning = out.reasoning_content = split.reasoning
            text = split.content
        if self.tools is None:
            content = text
        else:
            d = self.tools.feed(text, final)
            content = d.content
            calls = [c for c in d.calls if self.max_calls is None or c.index < self.max_calls]
            if calls:
                out.tool_calls = [self._call_delta(c) for c in calls]
        if content:
            self.content.append(content)
            out.content = content
        return out

    def _call_delta(self, c) -> dict:
        if c.name is None:
            return {"index": c.index, "function": {"arguments": c.arguments}}
        self.call_ids[c.index] = new_call_id()
        return tool_call(c.name, c.arguments, c.index, self.call_ids[c.index])

    def message(self, echo: str) -> tuple[AssistantMessage, list]:
        """After the final feed: the whole message, and its calls."""
        thought = self.thinking is not None and self.thinking.saw_reasoning and self.include_reasoning
        reasoning = "".join(self.reasoning) if thought else None
        if self.tools is not None:
            content, calls = self.tools.result()
            calls = calls[:self.max_calls]
        else:
            content, calls = echo + "".join(self.content), []
            if self.thinking is not None:
                content = content or None
        return AssistantMessage(content=content, reasoning=reasoning, reasoning_content=reasoning,
                                tool_calls=[tool_call(name, args) for name, args in calls]), calls


class ChatStream(StreamFormatter):
    object_name = "chat.completion.chunk"

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan,
                 prompt_text: str | None, prompt_token_ids: list[int] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.ctx, self.req, self.plan, self.prompt_text = ctx, req, plan, prompt_text
        self.prompt_token_ids = prompt_token_ids   # return_token_ids: sent in the first chunk
        self.splits: dict[int, ChoiceSplit] = {}

    def start(self) -> list[dict]:
        # OpenAI opens every choice with a delta that carries only the role.
        echo = _echo_text(self.req)
        chunks = [self.envelope([{"index": i, "delta": {"role": "assistant", "content": echo},
                                  "logprobs": None, "finish_reason": None}]) for i in range(self.n)]
        if self.req.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.prompt_token_ids
        return chunks

    def choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
               delta: ChoiceDelta) -> dict | None:
        logprobs = None
        if self.req.logprobs and delta.token_ids:
            logprobs = chat_logprobs(self.ctx.tokenizer, delta.token_ids, delta.logprobs,
                                     self.req.top_logprobs or 0,
                                     self.ctx.tokens_as_ids(self.req.return_tokens_as_token_ids))
        split = self.splits.get(index)
        if split is None:
            split = self.splits[index] = ChoiceSplit(self.ctx, self.req, self.plan, self.prompt_text)
        body = split.feed(delta.text, delta.finish_reason is not None).body()
        finish = delta.finish_reason
        if finish is not None and split.tools is not None:
            finish = finish_reason(self.plan, finish, split.tools.result()[1])
        ids = self.req.return_token_ids and delta.token_ids   # every id is sent, text or not
        if not body and logprobs is None and finish is None and not ids:
            return None
        choice = {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": delta.stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return choice


def chat_body(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, request_id: str,
              created: int, outputs: list[RequestOutput], prompt_text: str | None = None) -> dict:
    """`prompt_text`: the rendered prompt (where the thinking starts; default: the output's)."""
    (out,) = outputs
    choices = []
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                                     ctx.tokens_as_ids(req.return_tokens_as_token_ids))
        split = ChoiceSplit(ctx, req, plan, prompt_text if prompt_text is not None else out.prompt)
        split.feed(c.text, final=True)
        message, calls = split.message(_echo_text(req))
        choices.append({"index": c.index, "message": message.body(), "logprobs": logprobs,
                        "finish_reason": finish_reason(plan, c.finish_reason, calls),
                        "stop_reason": c.stop_reason})
        if req.return_token_ids:
            choices[-1]["token_ids"] = list(c.token_ids)
    body = {"id": request_id, "object": "chat.completion", "created": created,
            "model": ctx.model_name, "choices": choices, "usage": usage(outputs)}
    if req.return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    return body


@dataclass(frozen=True)
class ChatRun:
    """A chat request checked and ready for the engine: what /v1/chat/completions and the APIs
    translated onto it (responses.py, messages.py) run."""
    req: ChatCompletionRequest
    plan: ToolPlan
    prompt: PromptInput
    params: SamplingParams
    lora: LoRARequest | None = None    # the adapter the request's `model` names (None: the base)


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest) -> ChatRun:
    check_request(req)
    lora = ctx.check_model(req.model)
    plan = tool_plan(ctx, req, structured_outputs(req))
    prompt = await ctx.in_tokenizer_thread(chat_prompt, ctx, req, plan.tools)
    structured = plan.structured
    if ctx.reasoning_parser is not None:     # a grammar constrains the answer, after the thinking
        structured = ctx.reasoning_parser.grammar_after_thinking(
            structured, lambda text: ctx.tokenizer.encode(text, add_special_tokens=False), prompt.text,
            ctx.template_kwargs(req.chat_template_kwargs))
    params = chat_sampling_params(ctx, req, prompt, structured)
    # the parsers read tags and call markers as text: special ones must not be dropped
    if (plan.mode == "auto" and tool_parser(plan.parser).needs_special_tokens) or (
            ctx.reasoning_parser is not None and ctx.reasoning_parser.needs_special_tokens(ctx.tokenizer.is_special_token)):
        params = params.clone(skip_special_tokens=False)
    await check_compiles(ctx, params, "tools" if plan.mode in ("required", "named") else field_of(req))
    return ChatRun(req, plan, prompt, params, lora)


async def create_chat_completion(ctx: ServerContext, request, req: ChatCompletionRequest):
    run = await prepare_chat(ctx, req)
    plan, prompt, params, lora = run.plan, run.prompt, run.params, run.lora
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = ChatStream(
        ctx, req, plan, prompt.text, prompt.token_ids, request_id=request_id,
        model=ctx.response_model(lora), created=created, n=req.n,
        include_usage=include_usage) if req.stream else None
    return await run_generation(ctx, request, request_id, [(prompt.token_ids, prompt.text)], [params],
                                stream, lambda outputs: {**chat_body(ctx, req, plan, request_id, created,
                                                                     outputs, prompt.text),
                                                         "model": ctx.response_model(lora)}, lora)
