"""Tool calling on /v1/chat/completions: `tools` + `tool_choice` -> a plan, output -> tool_calls.

- "none" (or no tools): plain chat; the tools are not shown to the model.
- "required": the output is forced (a grammar) to a JSON array of {"name", "parameters"}
  objects, one of the listed functions each, with that function's parameter schema.
- a named function: the output is forced to that function's parameters (its arguments).
- "auto" (the default when tools are given): the tools go through the chat template and the
  model's own tool-call format is parsed (jaxserve/parsers/); needs the server's
  `--enable-auto-tool-choice --tool-call-parser NAME`, as vLLM.
Every mode's output goes through a stream (`output_stream`: feed text deltas, get content and
tool-call deltas); a whole response is one final feed, so both agree.
Structured output (response_format, ...) together with a forced tool choice is refused.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from jaxserve.server.context import ServerContext
from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.parsers.calls import CallDelta, ToolDelta
from jaxserve.parsers.tools import tool_parser
from jaxserve.structured.params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str                        # "none", "auto", "required" or "named"
    tools: list[dict] | None         # rendered by the chat template (None: not shown)
    structured: StructuredOutputsParams | None   # the grammar forcing the call
    name: str | None = None          # the named function
    parser: str | None = None        # auto: the tool-call parser


def _parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def required_schema(tools, parallel: bool) -> dict:
    """A JSON array of calls, each {"name": one function, "parameters": its schema}."""
    items = [{"type": "object",
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(ctx: ServerContext, req: ChatCompletionRequest, structured) -> ToolPlan:
    """What the request's tools ask for; `structured` is its response_format & co (or None)."""
    tools, choice = req.tools or [], req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", None, structured)
    if not tools:
        raise bad_request(f"tool_choice {_choice_text(choice)} needs tools", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    rendered = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    if choice == "auto":
        if not ctx.enable_auto_tool_choice or ctx.tool_call_parser is None:
            raise bad_request('tool_choice "auto" (the default when tools are given) needs the server '
                              'started with --enable-auto-tool-choice and --tool-call-parser; or set '
                              'tool_choice to "required", "none" or a named function', param="tool_choice")
        return ToolPlan("auto", rendered, structured, parser=ctx.tool_call_parser)
    if structured is not None:
        raise bad_request("a forced tool_choice and response_format / structured outputs cannot be "
                          "combined", param="tool_choice")
    if choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls)
        return ToolPlan("required", rendered, _grammar(schema))
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(names)})", param="tool_choice")
    tool = tools[names.index(name)]
    return ToolPlan("named", rendered, _grammar(_parameters(tool)), name=name)


def _grammar(schema: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise bad_request(f"tools: {e}", param="tools") from e


def _choice_text(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, index: int | None = None, call_id: str | None = None) -> dict:
    call = {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if index is not None:
        call["index"] = index
    return call


class NamedStream:
    """A named function's forced output: all of it is that call's arguments, streamed."""

    def __init__(self, name: str):
        self.name, self.text, self.started = name, "", False

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        if not self.started:     # whitespace before the object (after a thinking block) is no argument
            text = text.lstrip()
        self.text += text
        if not text and (self.started or not final):
            return ToolDelta()
        first, self.started = not self.started, True
        return ToolDelta(calls=[CallDelta(0, self.name if first else None, text)])

    def result(self) -> tuple[str | None, list[tuple[str, str]]]:
        return None, [(self.name, self.text)]


class RequiredStream:
    """tool_choice "required": a JSON array of {"name", "parameters"} (its grammar's), read
    once whole (cut short by max_tokens: it stays text)."""

    def __init__(self):
        self.text, self.parsed = "", None

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        self.text += text
        if not final:
            return ToolDelta()
        try:
            self.parsed = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                           for c in json.loads(self.text)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return ToolDelta(self.text)
        return ToolDelta(calls=[CallDelta(i, n, a) for i, (n, a) in enumerate(self.parsed)])

    def result(self) -> tuple[str | None, list[tuple[str, str]]]:
        return (None, self.parsed) if self.parsed is not None else (self.text or None, [])


def output_stream(plan: ToolPlan):
    """The stream that reads one choice's content for `plan` (None: plain content)."""
    if plan.mode == "named":
        return NamedStream(plan.name)
    if plan.mode == "required":
        return RequiredStream()
    if plan.mode == "auto":
        return tool_parser(plan.parser).stream(plan.tools)
    return None


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(function name, arguments JSON)]) of a finished output."""
    stream = output_stream(plan)
    if stream is None:
        return text, []
    stream.feed(text, final=True)
    return stream.result()


def finish_reason(plan: ToolPlan, reason: str | None, calls: list) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named choice
    that ran to its end is "stop"."""
    if calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason
