"""Tool-call parsers for tool_choice "auto": a model's own tool-call format -> tool calls.

Chosen with vLLM's `--tool-call-parser NAME` (and `--enable-auto-tool-choice`):
- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, after optional text (the content);
- `llama3_json` (Llama 3.1/3.2): the whole output is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`.
Each returns (content or None, [(name, arguments as a JSON string)]). Text that is not a
well-formed call stays content: a model that answered in words answered in words.
"""

from __future__ import annotations

import json
import re

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj, args_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            call = _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:           # a malformed call: the whole output stays text
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


def _safe_hermes(text: str) -> int:
    """How much of `text` is content for sure: up to a `<tool_call>`, or up to a tail that
    could still become one."""
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    for keep in range(min(len(text), len("<tool_call>") - 1), 0, -1):
        if "<tool_call>".startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _safe_llama3_json(text: str) -> int:
    """A Llama-3 call is the whole output: nothing is sure until the output shows it is not one."""
    body = text.lstrip()
    if not body or body.startswith("{") or body.startswith("<|python_tag|>") or "<|python_tag|>".startswith(body):
        return 0
    return len(text)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
# parser -> (text so far -> how many of its leading characters a stream may send as content)
SAFE_CONTENT = {"hermes": _safe_hermes, "llama3_json": _safe_llama3_json}
