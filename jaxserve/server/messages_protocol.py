"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Strict types as protocol.py. Content blocks and tools are parsed one by one in messages.py
(by their `type`), so that a block or tool of a kind this server lacks (images, documents,
server tools) gets a 400 naming it. Fields the `anthropic` SDK and Claude Code send
(metadata, thinking, service_tier, ...) are declared, so that they are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class MessageParam(_Body):
    role: str                    # checked in messages.py, which names the allowed roles
    content: str | list[dict[str, Any]]


class ToolParam(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Body):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None     # accepted; a reasoning parser decides what shows


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Structured output (Anthropic's {"type": "json_schema", "schema": ...}), either spelling.
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Refused when given (messages.py): they need servers this one does not run.
    mcp_servers: list[Any] | None = None
    container: str | dict[str, Any] | None = None
