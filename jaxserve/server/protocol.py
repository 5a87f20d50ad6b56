"""Request bodies of the OpenAI-compatible API (pydantic, strict types).

Strict mode: a string where a number belongs is a 400, not a silent conversion; NaN and
infinities are refused. The generation requests keep the fields they do not declare
(`model_extra`): unsupported.py refuses those that ask for a missing feature and logs the
rest once. vLLM's sampling extensions (top_k, min_p, repetition_penalty, ...) are accepted
as extra body fields, as the `openai` client's `extra_body` sends them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Limits that keep one request from asking for absurd work; each is far above real use.
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_SEED = 2**63 - 1

# Token ids are range-checked against the vocabulary later (inputs.check_token_ids and
# SamplingParams.validate).
TokenIds = list[int]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field takes it as its alias.
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: TokenIds | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    # vLLM's extension: logprobs name tokens "token_id:N" (None: the server's flag decides)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and the output's token ids beside the text (a stream: the prompt's
    # in the first chunk, each chunk's new ids in its choice)
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    user: str | None = None
    # Structured output (at most one of them; server/structured.py reads them).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    # str | batch of str | token ids | batch of token ids
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # Any string is parsed so that an unknown role gets a message naming the allowed ones.
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None              # a tool message: the call it answers
    # An assistant's earlier thinking (vLLM's field, and its legacy name), for templates that
    # show it again (Qwen3's reads reasoning_content).
    reasoning: str | None = None
    reasoning_content: str | None = None


# ---- response side: what the chat path answers (the Responses / Messages APIs translate these)

class AssistantMessage(BaseModel):
    """A chat completion choice's message. With a reasoning parser the thinking is in
    `reasoning` (and vLLM's legacy `reasoning_content`, the same text), the answer in `content`."""
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] = Field(default_factory=list)

    def body(self) -> dict:
        return self.model_dump()


class DeltaMessage(BaseModel):
    """One streamed chunk's `delta`: only the fields that carry something are sent."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None    # OpenAI's tool-call deltas, each with its "index"

    def body(self) -> dict:
        return self.model_dump(exclude_none=True)


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True       # vLLM's: false drops the thinking (a reasoning parser's)
    add_special_tokens: bool = False     # the chat template already places special tokens
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
