"""tool_choice "auto": the tool-call parsers, and the app turning a model's calls into tool_calls.

The default model does not write tool calls of its own, so the app is run with a stand-in
engine that answers with a given text (what a Hermes or Llama-3 model would write).
Forced calls (required, named) run on the real model: server_structured_tests.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from stubs import RecordingEngine

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.app import build_app
from jaxserve.server.context import ServerContext
from jaxserve.parsers.tools import tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("text,content,calls", [
    ("Just words.", "Just words.", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", '{"x": 1}')]),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
     '"arguments": {"y": "z"}}</tool_call>', "Let me look.", [("f", "{}"), ("g", '{"y": "z"}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),    # cut before the end tag
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
])
def test_hermes_parser(text, content, calls):
    assert tool_parser("hermes").extract(text, None) == (content, calls)


@pytest.mark.parametrize("text,content,calls", [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "f", "parameters": {"x": 1}}', None, [("f", '{"x": 1}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"a": [1]}}', None,
     [("f", "{}"), ("g", '{"a": [1]}')]),
    ('{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {"x": 1}', []),   # cut short
    ('{"city": "Paris"}', '{"city": "Paris"}', []),                                          # no name: text
])
def test_llama3_json_parser(text, content, calls):
    assert tool_parser("llama3_json").extract(text, None) == (content, calls)


class ScriptedEngine(RecordingEngine):
    """Answers every request with `text`, finished with `finish_reason` "stop"."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        self.params.append(sampling_params)
        yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                            [CompletionOutput(0, self.text, [1, 2], finish_reason="stop")], finished=True)


def _client(text: str, parser: str = "hermes") -> TestClient:
    ctx = ServerContext(ScriptedEngine(text), ("stub",), enable_auto_tool_choice=True, tool_call_parser=parser)
    return TestClient(build_app(ctx), raise_server_exceptions=False)


BODY = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 8}


def test_auto_tool_calls_in_a_whole_response():
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    with _client(text) as client:
        r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_auto_tool_calls_streamed():
    text = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    with _client(text, "llama3_json") as client:
        r = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def assemble_calls(deltas: list[dict]) -> list[tuple[str, str]]:
    """Streamed tool-call deltas put together: each call's name (its first delta) and its
    argument pieces concatenated, in index order."""
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function"
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert "name" not in tc["function"]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


class ChunkedEngine(ScriptedEngine):
    """Answers with `text` a few characters per output: delta outputs when asked (streams),
    else cumulative ones."""

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        delta = sampling_params.output_kind == "delta"
        for end in range(3, len(self.text) + 3, 3):
            await asyncio.sleep(0.01)     # one output at a time reaches the stream
            done = end >= len(self.text)
            text, ids = (self.text[end - 3:end], [end // 3]) if delta else (self.text[:end], list(range(end // 3)))
            yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                                [CompletionOutput(0, text, ids, finish_reason="stop" if done else None)],
                                finished=done)


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'I will check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     "I will check.", [("get_weather", '{"city": "Oslo"}')]),
    ("hermes", "No tools <tool today.", "No tools <tool today.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", "Plain words here.", "Plain words here.", []),
])
def test_auto_streams_content_and_call_arguments_as_they_come(parser, text, content, calls):
    ctx = ServerContext(ChunkedEngine(text), ("stub",), enable_auto_tool_choice=True, tool_call_parser=parser)
    with TestClient(build_app(ctx)) as client:
        r = client.post("/v1/chat/completions", json={**BODY, "stream": True})
        whole = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    pieces = [d["content"] for d in deltas if d.get("content")]
    got_calls = assemble_calls(deltas)
    assert "".join(pieces).strip() == content == (whole["content"] or "")
    assert got_calls == calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    if not calls:
        assert len(pieces) > 1            # streamed as it came, not once at the end


def test_auto_without_a_call_is_plain_content_and_tools_reach_the_template():
    engine = ScriptedEngine("It is sunny.")
    seen = []
    engine.tokenizer = type(engine.tokenizer)()
    engine.tokenizer.apply_chat_template = lambda messages, add_generation_prompt=True, **kw: (
        seen.append(kw.get("tools")) or "prompt")
    ctx = ServerContext(engine, ("stub",), enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(build_app(ctx)) as client:
        r = client.post("/v1/chat/completions", json=BODY)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "It is sunny." and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    # (the second render, without tools, checks once whether the template shows them)
    assert seen == [TOOLS, None] and engine.params[0].structured_outputs is None


def test_tool_messages_and_earlier_calls_reach_the_template():
    engine = ScriptedEngine("Done.")
    seen = []
    engine.tokenizer = type(engine.tokenizer)()
    engine.tokenizer.apply_chat_template = lambda messages, add_generation_prompt=True, **kw: (
        seen.append(messages) or "prompt")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    with TestClient(build_app(ServerContext(engine, ("stub",)))) as client:
        assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).status_code == 200
    assistant, tool = seen[0][1], seen[0][2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool == {"role": "tool", "content": "cold", "tool_call_id": "c1"}
