"""/v1/responses and /v1/messages through the real server and the official `openai` and
`anthropic` SDKs, on the default model (SmolLM2-135M-Instruct, greedy).

Imported by test_server.py (so that they share its engine). Both APIs are translations onto
the chat path, so a greedy answer must be exactly the chat endpoint's answer to the same
conversation, token counts included; a forced tool call must satisfy its schema.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_agent_invalid import INVALID_AGENT

QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER_SCHEMA}
# NOTE: the anthropic SDK (2.x) has no sampling arguments any more; the API still takes them.
GREEDY = {"temperature": 0}
MESSAGES_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}


def _chat(served, messages, max_tokens=16):
    return served.client().chat.completions.create(model=served.model, messages=messages,
                                                   max_completion_tokens=max_tokens, temperature=0)


def _anthropic(served, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, **kwargs)


# ---- /v1/responses ------------------------------------------------------------------------

def test_responses_answers_paris_as_chat_does(served):
    chat = _chat(served, [{"role": "user", "content": QUESTION}])
    r = served.client().responses.create(model=served.model, input=QUESTION, max_output_tokens=16,
                                         temperature=0)
    assert "Paris" in r.output_text
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"


def test_responses_stream_events_add_up_to_the_whole_answer(served):
    kwargs = dict(model=served.model, input=QUESTION, instructions="Answer in one sentence.",
                  max_output_tokens=16, temperature=0)
    whole = served.client().responses.create(**kwargs)
    # the SDK's stream helper: its events, and the answer it puts together from them
    with served.client().responses.stream(**kwargs) as stream:
        events = list(stream)
        assert stream.get_final_response().output_text == whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed" if whole.status == "completed"
                          else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call_satisfies_the_schema(served, stream):
    client = served.client()
    kwargs = dict(model=served.model, input="What is the weather in Paris?", max_output_tokens=40,
                  temperature=0, tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "get_weather"})
    if stream:    # through the SDK's stream helper, which puts the call together from the events
        with client.responses.stream(**kwargs) as s:
            events = list(s)
            response = s.get_final_response()
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == done.arguments == response.output[0].arguments
    else:
        response = client.responses.create(**kwargs)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    if not stream:    # the next turn hands the call's output back
        answer = client.responses.create(model=served.model, previous_response_id=response.id, max_output_tokens=8,
                                         temperature=0, tools=[RESPONSES_TOOL], tool_choice="none",
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "Sunny, 21 degrees"}])
        assert answer.output and answer.output[0].type == "message" and answer.output_text


def test_responses_second_turn_continues_the_stored_conversation(served):
    client = served.client()
    first = client.responses.create(model=served.model, input="My name is Ada.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=served.model, input="What is my name?", max_output_tokens=8,
                                     temperature=0, previous_response_id=first.id)
    chat = _chat(served, [{"role": "user", "content": "My name is Ada."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], max_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=served.model, input="Again?", previous_response_id=first.id)


def test_responses_json_schema_text_format(served):
    r = served.client().responses.create(
        model=served.model, input="Describe the weather in Paris as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), WEATHER_SCHEMA)


# ---- /v1/messages -------------------------------------------------------------------------

def test_messages_answers_paris_as_chat_does(served):
    chat = _chat(served, [{"role": "user", "content": QUESTION}])
    client = _anthropic(served)
    m = client.messages.create(model=served.model, max_tokens=16, extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])
    (block,) = m.content
    assert block.type == "text" and "Paris" in block.text
    assert block.text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    counted = client.messages.count_tokens(model=served.model, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == m.usage.input_tokens


def test_messages_stream_equals_whole_and_stop_sequence(served):
    client = _anthropic(served)
    kwargs = dict(model=served.model, max_tokens=16, extra_body=GREEDY, system="You are a geography teacher.",
                  messages=[{"role": "user", "content": QUESTION}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # a stop sequence from inside the answer ends it there
    word = whole.content[0].text.split()[-1]
    cut = client.messages.create(stop_sequences=[word], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use_satisfies_the_schema(served, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=served.model, max_tokens=40, extra_body=GREEDY, tools=[MESSAGES_TOOL],
                  tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    client = _anthropic(served)
    if stream:
        with client.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kwargs)
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert m.stop_reason == "tool_use"
    if not stream:    # the next turn hands the tool's result back
        answer = client.messages.create(
            model=served.model, max_tokens=8, extra_body=GREEDY, tools=[MESSAGES_TOOL], tool_choice={"type": "none"},
            messages=ask + [{"role": "assistant", "content": [use.model_dump()]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": "Sunny, 21 degrees"}]}])
        assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_messages_x_api_key_and_anthropic_auth_errors(served):
    from conftest import AUTH_KEYS

    ok = anthropic.Anthropic(base_url=served.auth_url, api_key=AUTH_KEYS[1], max_retries=0)
    m = ok.messages.create(model=served.model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert m.stop_reason == "max_tokens"
    bad = anthropic.Anthropic(base_url=served.auth_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=served.model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


# ---- both ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,path,body,status,param", INVALID_AGENT, ids=[c[0] for c in INVALID_AGENT])
def test_agent_api_bad_input_gets_4xx_in_the_apis_error_shape(served, name, path, body, status, param):
    r = httpx.post(served.url + path, json=body)
    assert r.status_code == status, r.text
    if path.startswith("/v1/messages"):
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"].endswith("_error")
        assert param in error["error"]["message"]
    else:
        assert r.json()["error"]["param"] == param, r.text


def test_agent_api_disconnects_abort_and_requests_are_counted(served):
    long = {"model": served.model, "max_tokens": 400, "ignore_eos": True}
    before = served.metrics()

    async def quit_after_two_events(path: str, body: dict) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", served.url + path, json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen == 4:
                        return

    async def main():
        await asyncio.gather(
            quit_after_two_events("/v1/messages", {**long, "stream": True,
                                                   "messages": [{"role": "user", "content": "A long story:"}]}),
            quit_after_two_events("/v1/responses", {"model": served.model, "max_output_tokens": 400,
                                                    "ignore_eos": True, "stream": True, "input": "A long story:"}))

    asyncio.run(main())
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_used_blocks"] == 0
    assert m["jaxserve:request_abort_total"] - before.get("jaxserve:request_abort_total", 0) == 2
    key = 'http_requests_total{handler="%s",method="POST",status="2xx"}'
    for path in ("/v1/messages", "/v1/responses"):
        assert m[key % path] - before.get(key % path, 0) == 1


# ---- vLLM's return_token_ids --------------------------------------------------------------

def _sse_data(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("case", ["completion", "chat"])
def test_return_token_ids_whole_and_streamed(served, case):
    ref = served.reference[case]
    prompt, params = served.cases[case]
    if case == "completion":
        path, body = "/v1/completions", {"prompt": prompt}
    else:
        path, body = "/v1/chat/completions", {"messages": prompt}
    body.update(model=served.model, max_tokens=params.max_tokens, temperature=0, return_token_ids=True)
    whole = httpx.post(served.url + path, json=body).json()
    (choice,) = whole["choices"]
    prompt_ids = choice["prompt_token_ids"] if case == "completion" else whole["prompt_token_ids"]
    assert prompt_ids == ref.prompt_token_ids and choice["token_ids"] == ref.outputs[0].token_ids
    chunks = _sse_data(httpx.post(served.url + path, json={**body, "stream": True}))
    first = chunks[0]["choices"][0] if case == "completion" else chunks[0]
    assert first["prompt_token_ids"] == ref.prompt_token_ids
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == ref.outputs[0].token_ids
