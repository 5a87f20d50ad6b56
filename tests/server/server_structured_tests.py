"""Structured output and tool calls through the real server and the official `openai` client.

Imported by test_server.py (so that they share its engine: one file per xdist worker builds
it once). The default model (SmolLM2-135M) writes what the grammar lets it, so each check
is on the output's shape: it parses, has the schema's keys and types, is one of the choices,
fully matches the regex, calls a listed function with arguments that satisfy its schema.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person (name, age, member) as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                 "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_chat(client, **kwargs) -> tuple[str, list[dict], str]:
    """(content, tool calls put together from their deltas, finish_reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_output_has_the_schemas_keys_and_types(served, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = served.client().chat.completions.create(model=served.model, messages=ASK_PERSON, max_tokens=40,
                                                temperature=temperature, seed=7, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_schema_streamed_equals_whole(served):
    kwargs = dict(model=served.model, messages=ASK_PERSON, max_tokens=40, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    whole = served.client().chat.completions.create(**kwargs).choices[0].message.content
    content, calls, finish = _stream_chat(served.client(), **kwargs)
    assert content == whole and calls == [] and finish == "stop"


def test_json_object_parses(served):
    messages = [{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}]
    r = served.client().chat.completions.create(model=served.model, messages=messages, max_tokens=40,
                                                temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choice_returns_one_of_the_choices(served, field):
    choices = ["Paris", "London", "Rome"]
    body = {"guided_choice": choices} if field == "guided_choice" else {"structured_outputs": {"choice": choices}}
    r = served.client().completions.create(model=served.model, prompt="The capital of France is",
                                           max_tokens=8, temperature=0, extra_body=body)
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_regex_output_fully_matches(served, stream):
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"   # (\d: any script's digits)
    kwargs = dict(model=served.model, prompt="Today's date is", max_tokens=16, temperature=0.9, seed=3,
                  extra_body={"guided_regex": regex})
    if stream:
        text = "".join(c.choices[0].text for c in served.client().completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = served.client().completions.create(**kwargs).choices[0].text
    assert re.fullmatch(regex, text), text


def test_a_lark_grammar_constrains_the_output(served):
    grammar = 'start: "yes" | "no" | "it depends"'
    r = served.client().completions.create(model=served.model, prompt="Is water wet?", max_tokens=8,
                                           temperature=0, extra_body={"guided_grammar": grammar})
    assert r.choices[0].text in ("yes", "no", "it depends")


def _check_call(name: str, arguments: str) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_tool_calls_that_satisfy_the_schema(served, stream):
    kwargs = dict(model=served.model, messages=ASK_WEATHER, max_tokens=60, temperature=0,
                  tools=[WEATHER, TIME], tool_choice="required")
    if stream:
        content, calls, finish = _stream_chat(served.client(), **kwargs)
    else:
        r = served.client().chat.completions.create(**kwargs)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        content = message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls]
    assert calls and finish == "tool_calls" and not content
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        _check_call(call["name"], call["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_calls_that_function(served, stream):
    kwargs = dict(model=served.model, messages=ASK_WEATHER, max_tokens=40, temperature=0.9, seed=1,
                  tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        _, calls, finish = _stream_chat(served.client(), **kwargs)
    else:
        r = served.client().chat.completions.create(**kwargs)
        finish = r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert len(calls) == 1 and calls[0]["name"] == "get_time" and finish == "stop"
    _check_call("get_time", calls[0]["arguments"])


def test_32_concurrent_requests_with_distinct_schemas_all_conform(served):
    def schema(i):
        return {"type": "object", "properties": {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "ok": {"type": "boolean"}},
                "required": [f"field_{i}", "ok"], "additionalProperties": False}

    async def one(client, i):
        r = await client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": f"Fill in field_{i} as JSON."}],
            max_tokens=16, temperature=0.9, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema(i)}})
        return r.choices[0].message.content

    async def run():
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    for i, text in enumerate(asyncio.run(run())):
        jsonschema.validate(json.loads(text), schema(i))
    served.wait_idle()


def test_an_invalid_schema_is_a_400_and_the_server_serves_on(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(
            model=served.model, messages=ASK_PERSON, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert e.value.body["param"] == "response_format" and "objekt" in e.value.body["message"]
    test_choice_returns_one_of_the_choices(served, "guided_choice")
