"""/v1/responses and /v1/messages without a model: the translations (request -> chat messages,
chat result -> each API's shape, reasoning included), the store, the fields the SDKs send,
errors mid-stream. The real-model and SDK checks are in server_agent_api_tests.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from stubs import RecordingEngine

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.agent_bridge import BlockSplitter, chat_result
from jaxserve.server.app import build_app
from jaxserve.server.context import ServerContext
from jaxserve.server.inputs import PromptInput
from jaxserve.server.messages import MessagesStream, chat_fields as messages_chat_fields, message_body
from jaxserve.server.messages_protocol import MessagesRequest
from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.responses import ResponseBuilder, ResponsesStream, input_messages
from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.responses_store import ResponsesStore
from jaxserve.server.serving_chat import ChatRun
from jaxserve.server.tools import ToolPlan

# What the chat path answers when a reasoning parser split the thinking off (issue 63's field).
CHAT_WITH_REASONING = {
    "choices": [{"index": 0, "message": {"role": "assistant", "reasoning": "France's capital is Paris.",
                                         "content": "Paris.", "tool_calls": []},
                 "finish_reason": "stop", "stop_reason": None}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}


def test_chat_result_with_reasoning_becomes_a_reasoning_item_and_a_thinking_block():
    result = chat_result(CHAT_WITH_REASONING)
    req = ResponsesRequest.model_validate({"input": "Capital of France?"})
    response = ResponseBuilder(req, "resp_1", 0, "m").response(result)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "France's capital is Paris."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Paris."
    assert response["usage"]["output_tokens"] == 9 and response["status"] == "completed"
    body = message_body("msg_1", "m", result)
    assert body["content"] == [{"type": "thinking", "thinking": "France's capital is Paris.", "signature": ""},
                               {"type": "text", "text": "Paris."}]
    assert body["stop_reason"] == "end_turn"


def _run() -> tuple[ServerContext, ChatRun]:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    return (ServerContext(RecordingEngine(), ("stub",)),
            ChatRun(req, ToolPlan("none", None, None), PromptInput([1, 2, 3], "hi"), SamplingParams()))


def _stream_events(stream, deltas: list[dict]) -> list[dict]:
    events = stream.start()
    for delta in deltas:
        events += stream.translate(stream.splitter.feed(delta))
    return events + stream.translate(stream.splitter.close())


def test_streamed_reasoning_opens_its_own_item_and_block_before_the_text():
    deltas = [{"reasoning": "Thinking"}, {"reasoning": " more."}, {"content": "Paris"}, {"content": "."}]
    ctx, run = _run()
    req = ResponsesRequest.model_validate({"input": "hi"})
    events = _stream_events(ResponsesStream(ctx, run, ResponseBuilder(req, "resp_1", 0, "stub"), None), deltas)
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert events[6]["text"] == "Thinking more." and events[8]["item"]["content"][0]["text"] == "Thinking more."
    assert events[9]["output_index"] == 1 and events[-1]["item"]["content"][0]["text"] == "Paris."

    events = _stream_events(MessagesStream(ctx, run, "msg_1", 0), deltas)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "Thinking"}
    assert events[7]["delta"] == {"type": "text_delta", "text": "Paris"}


def test_block_splitter_streams_a_named_call_and_starts_a_block_per_call():
    splitter = BlockSplitter()
    events = splitter.feed({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]})
    events += splitter.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]})
    events += splitter.feed({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]})
    events += splitter.feed({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]})
    events += splitter.close()
    assert [(what, b.call_id, piece) for what, b, piece in events] == [
        ("open", "c1", ""), ("delta", "c1", '{"a":'), ("delta", "c1", " 1}"), ("close", "c1", ""),
        ("open", "c2", ""), ("delta", "c2", "{}"), ("close", "c2", "")]
    assert [(b.name, b.text) for b in splitter.blocks] == [("f", '{"a": 1}'), ("g", "{}")]


def test_responses_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert input_messages(req) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_anthropic_blocks_become_chat_messages():
    req = MessagesRequest.model_validate({"max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                                          "stop_sequences": ["END"], "top_k": 5, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "Thanks."}]}]})
    fields = messages_chat_fields(req)
    assert fields["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: timeout"},
        {"role": "user", "content": "Thanks."}]
    assert (fields["stop"], fields["top_k"], fields["max_tokens"]) == (["END"], 5, 5)
    assert "continue_final_message" not in fields
    prefill = MessagesRequest.model_validate({"max_tokens": 5, "messages": [
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]})
    fields = messages_chat_fields(prefill)
    assert fields["continue_final_message"] and not fields["add_generation_prompt"]


def test_store_evicts_the_oldest_by_count_and_by_size():
    store = ResponsesStore(max_entries=2, max_chars=10**6)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2
    small = ResponsesStore(max_entries=100, max_chars=200)
    small.put({"id": "a", "x": "y" * 100}, [])
    small.put({"id": "b", "x": "y" * 100}, [])
    assert small.get("a") is None and small.get("b") is not None
    assert small.delete("b") and not small.delete("b") and len(small) == 0


class ScriptedEngine(RecordingEngine):
    """Answers with the given delta outputs, one after the other (the last one finished)."""

    def __init__(self, pieces: list[tuple[str, str | None]], error_at: int | None = None):
        super().__init__()
        self.pieces, self.error_at = pieces, error_at

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        self.params.append(sampling_params)
        for i, (text, finish) in enumerate(self.pieces):
            out = RequestOutput(request_id, prompt, list(prompt_token_ids),
                                [CompletionOutput(0, text, [7], finish_reason=finish)], finished=finish is not None)
            if i == self.error_at:
                out.error = "the device fell over"
                # NOTE: a pause, so that the stream has begun (answered 200) before the error comes
                await asyncio.sleep(0.2)
            yield out


def _client(engine) -> TestClient:
    return TestClient(build_app(ServerContext(engine, ("stub",))), raise_server_exceptions=False)


def test_fields_the_sdks_send_are_accepted_and_store_false_is_not_kept():
    with _client(ScriptedEngine([("ok", "stop")])) as client:
        r = client.post("/v1/responses", json={
            "input": "hi", "store": False, "metadata": {"k": "v"}, "include": ["reasoning.encrypted_content"],
            "truncation": "auto", "reasoning": {"effort": "low"}, "service_tier": "auto", "user": "u",
            "parallel_tool_calls": False, "prompt_cache_key": "p", "top_k": 3, "seed": 1,
            "tools": [], "tool_choice": "auto"})
        assert r.status_code == 200, r.text
        assert r.json()["metadata"] == {"k": "v"} and r.json()["output"][0]["content"][0]["text"] == "ok"
        assert client.get(f"/v1/responses/{r.json()['id']}").status_code == 404
        m = client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"}, json={
            "model": "stub", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "service_tier": "auto", "output_config": {"effort": "low"}, "top_k": 3,
            "tool_choice": {"type": "auto"}})
        assert m.status_code == 200, m.text
    params = client.app.state.ctx.engine.params
    assert [p.top_k for p in params] == [3, 3] and params[0].seed == 1


def test_an_engine_error_mid_stream_ends_with_each_apis_error_event():
    pieces = [("Par", None), ("is", None), ("", "stop")]
    with _client(ScriptedEngine(pieces, error_at=1)) as client:
        r = client.post("/v1/responses", json={"input": "hi", "stream": True})
        m = client.post("/v1/messages", json={"max_tokens": 4, "stream": True,
                                              "messages": [{"role": "user", "content": "hi"}]})
    last = r.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error" and json.loads(last[1][6:])["message"].endswith("the device fell over")
    last = m.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    assert json.loads(last[1][6:]) == {"type": "error", "error": {
        "type": "api_error", "message": "the request failed: the device fell over"}}
    assert "[DONE]" not in r.text + m.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_errors_are_in_anthropics_shape(path):
    with _client(ScriptedEngine([("ok", "stop")])) as client:
        r = client.post(path, content=b'{"messages": [')
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]


def test_x_api_key_is_a_key_too_and_openapi_shows_the_bodies():
    ctx = ServerContext(ScriptedEngine([("ok", "stop")]), ("stub",), api_keys=("secret",))
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(ctx)) as client:
        assert client.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code == 200
        refused = client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        refused = client.post("/v1/responses", json={"input": "hi"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"x-api-key": "secret"}).status_code == 200
        spec = client.get("/openapi.json").json()
    for path, field in (("/v1/responses", "input"), ("/v1/messages", "max_tokens"),
                        ("/v1/messages/count_tokens", "messages")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert field in spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_token_ids_include_a_chunk_without_text(path):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with _client(ScriptedEngine([("Par", None), ("", None), ("is", "stop")])) as client:
        r = client.post(path, json={**body, "max_tokens": 4, "stream": True, "return_token_ids": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == [7, 7, 7]
    with _client(ScriptedEngine([("Paris", "stop")])) as client:
        plain = client.post(path, json={**body, "max_tokens": 4}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain


def test_an_answer_cut_by_max_tokens_is_incomplete_and_stops_on_max_tokens():
    cut = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]},
        "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    result = chat_result(cut)
    response = ResponseBuilder(ResponsesRequest.model_validate({"input": "x"}), "resp_1", 0, "m").response(result)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in response["output"]] == [("message", "completed"),
                                                                      ("function_call", "incomplete")]
    body = message_body("msg_1", "m", result)
    assert body["stop_reason"] == "max_tokens"
    assert body["content"][1] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def test_requests_are_counted_per_route_template_and_status_class():
    with _client(ScriptedEngine([("ok", "stop")])) as client:
        rid = client.post("/v1/responses", json={"input": "hi"}).json()["id"]
        client.get(f"/v1/responses/{rid}")
        client.get("/v1/responses/resp_missing")
        client.post("/v1/messages", json={"messages": []})
        client.get("/no/such/path")
        text = client.get("/metrics").text
    counts = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("http_requests_total")}
    assert counts == {
        'http_requests_total{handler="/v1/responses",method="POST",status="2xx"}': 1.0,
        'http_requests_total{handler="/v1/responses/{response_id}",method="GET",status="2xx"}': 1.0,
        'http_requests_total{handler="/v1/responses/{response_id}",method="GET",status="4xx"}': 1.0,
        'http_requests_total{handler="/v1/messages",method="POST",status="4xx"}': 1.0}
