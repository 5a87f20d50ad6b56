"""From a parsed request body to what the engine takes: prompt token ids and SamplingParams.

Everything the engine would refuse is checked here first, so that the client gets a 400
naming the field and the allowed range before any stream has started.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.context import ServerContext
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.structured import structured_outputs
from jaxserve.server.protocol import (MAX_STOP_STRINGS, ChatCompletionRequest, ChatMessage,
                                      CompletionRequest, SamplingFields)

CHAT_ROLES = ("system", "user", "assistant", "tool")
logger = logging.getLogger(__name__)
# Template arguments a request may not override through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "chat_template", "tools",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "documents", "tokenizer_kwargs", "return_tensors", "padding",
                             "truncation", "max_length", "return_assistant_tokens_mask"}


@dataclass(frozen=True)
class PromptInput:
    token_ids: list[int]
    text: str | None                     # the prompt as text (for echo); None if given as ids


def check_token_ids(ctx: ServerContext, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"{param} holds token id {bad[0]}, outside the vocabulary: token ids "
                          f"must be in [0, {ctx.vocab_size - 1}]", param=param)


def check_prompt_length(ctx: ServerContext, num_prompt_tokens: int, max_tokens: int | None,
                        prompt_param: str, max_tokens_param: str) -> int:
    """The max_tokens the request gets: as asked, or what is left of max_model_len."""
    limit = ctx.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request(f"{prompt_param} is empty; give at least one token", param=prompt_param)
    if num_prompt_tokens >= limit:
        raise bad_request(f"{prompt_param} is {num_prompt_tokens} tokens; this server's "
                          f"max_model_len is {limit}, so a prompt may have at most {limit - 1} "
                          f"tokens (leaving room for one generated token)", param=prompt_param,
                          code="context_length_exceeded")
    if max_tokens is None:
        # --generation-config's max_new_tokens caps what is left of the context (as vLLM).
        return min(limit - num_prompt_tokens, ctx.default_sampling.get("max_tokens", limit))
    if num_prompt_tokens + max_tokens > limit:
        raise bad_request(f"this model's maximum context length (max_model_len) is {limit} tokens, "
                          f"but {num_prompt_tokens + max_tokens} were asked for ({num_prompt_tokens} "
                          f"in the prompt, {max_tokens} in {max_tokens_param}); {max_tokens_param} "
                          f"must be <= {limit - num_prompt_tokens} for this prompt",
                          param=max_tokens_param, code="context_length_exceeded")
    return max_tokens


# ---- completions --------------------------------------------------------------------------

def completion_prompts(ctx: ServerContext, req: CompletionRequest) -> list[PromptInput]:
    """Normalise the four prompt forms (str, [str], [int], [[int]]) to token ids (blocking)."""
    p = req.prompt
    if isinstance(p, str):
        items = [p]
    elif not p:
        raise bad_request("prompt is an empty list; give a string, a list of strings or token ids",
                          param="prompt")
    elif isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    out = []
    for i, item in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{name} is an empty string", param="prompt")
            tokenizer = ctx.require_tokenizer("prompt")
            out.append(PromptInput(tokenizer.encode(item, add_special_tokens=req.add_special_tokens), item))
        else:
            if not item:
                raise bad_request(f"{name} is an empty list of token ids", param="prompt")
            check_token_ids(ctx, item, name)
            out.append(PromptInput(list(item), None))
    return out


def completion_sampling_params(ctx: ServerContext, req: CompletionRequest,
                               prompt: PromptInput) -> SamplingParams:
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) here: best-of ranking is not supported",
                          param="best_of")
    check_logprobs_limit(ctx, req.logprobs, "logprobs")
    max_tokens = check_prompt_length(ctx, len(prompt.token_ids), req.max_tokens, "prompt", "max_tokens")
    # echo + logprobs lists the prompt's tokens with their logprobs too (as vLLM does).
    prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
    return build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=req.logprobs,
                                 prompt_logprobs=prompt_lp, structured_outputs=structured_outputs(req))


# ---- chat ---------------------------------------------------------------------------------

def _message_dict(i: int, m: ChatMessage) -> dict:
    role = "system" if m.role == "developer" else m.role
    if role not in CHAT_ROLES:
        raise bad_request(f"messages[{i}].role is {m.role!r}; allowed roles: "
                          f"{', '.join(CHAT_ROLES)} (and 'developer', read as 'system')",
                          param=f"messages[{i}].role")
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        content = "\n".join(part.text for part in m.content)
    out = {"role": role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    thinking = m.reasoning if m.reasoning is not None else m.reasoning_content
    if thinking is not None:     # templates that show earlier thinking read this name (Qwen3)
        out["reasoning_content"] = thinking
    if m.tool_calls:
        # Templates read the arguments as a mapping (HF's convention), clients send JSON text.
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool = False, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The chat template applied to the messages (blocking)."""
    if not messages:
        raise bad_request("messages is empty; give at least one message", param="messages")
    conversation = [_message_dict(i, m) for i, m in enumerate(messages)]
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          param="continue_final_message")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}",
                          param="chat_template_kwargs")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    tokenizer = ctx.require_tokenizer("messages")
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except APIError:
        raise
    except Exception as e:   # jinja errors, bad kwargs, a model without a template
        raise bad_request(f"the chat template could not be applied to these messages: {e}",
                          param="messages") from e


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest, tools: list[dict] | None = None) -> PromptInput:
    """Messages (and the tools to show the model) -> template text -> token ids (blocking)."""
    text = render_chat(ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
                       ctx.template_kwargs(req.chat_template_kwargs), tools)
    if tools and ctx.first_time("template drops tools") and text == render_chat(
            ctx, req.messages, req.add_generation_prompt, req.continue_final_message,
            ctx.template_kwargs(req.chat_template_kwargs)):
        logger.warning("the chat template ignores `tools`: the model never sees the tool "
                       "definitions, so it will not call them (pass --chat-template with a "
                       "template that renders tools)")
    return PromptInput(ctx.tokenizer.encode(text, add_special_tokens=req.add_special_tokens), text)


def chat_sampling_params(ctx: ServerContext, req: ChatCompletionRequest, prompt: PromptInput,
                         structured=None) -> SamplingParams:
    """`structured`: the StructuredOutputsParams of the request (or of its tool choice)."""
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    check_logprobs_limit(ctx, logprobs, "top_logprobs")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_prompt_length(ctx, len(prompt.token_ids), asked, "messages", param)
    return build_sampling_params(ctx, req, max_tokens=max_tokens, logprobs=logprobs,
                                 structured_outputs=structured)


# ---- shared -------------------------------------------------------------------------------

def check_logprobs_limit(ctx: ServerContext, value: int | None, param: str) -> None:
    if value is not None and value > ctx.max_logprobs:
        raise bad_request(f"{param} must be in [0, {ctx.max_logprobs}] (the server's --max-logprobs); "
                          f"got {value}", param=param)


def build_sampling_params(ctx: ServerContext, req: SamplingFields, *, max_tokens: int,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          structured_outputs=None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings; got {len(stop)}", param="stop")
    check_logprobs_limit(ctx, req.prompt_logprobs, "prompt_logprobs")
    if req.prompt_logprobs is not None:
        prompt_logprobs = req.prompt_logprobs
    fields = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, seed=req.seed,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids, skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=structured_outputs)
    # Only the fields the client set, else --generation-config's; SamplingParams' own
    # defaults (vLLM's) fill the rest.
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = ctx.default_sampling.get(name)
        if value is not None:
            fields[name] = value
    if fields.get("top_k", 0) >= ctx.vocab_size:
        # NOTE: keeping every token means no top-k at all; and the engine's int32 sampling
        # arrays could not hold an arbitrarily large integer.
        fields["top_k"] = 0
    try:   # SamplingParams names the field, the allowed range and the value in its errors
        params = SamplingParams(**fields)
        params.validate(max_logprobs=ctx.max_logprobs, vocab_size=ctx.vocab_size)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=param if param in fields else None) from e
    return params
