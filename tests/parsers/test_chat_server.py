"""Reasoning and tool-call parsing through the HTTP server with the `openai` client, each
family's real tokenizer and chat template. The engine is a stand-in that answers with a given
text as its tokens (one per streamed output, decoded by the real detokenizer, so tags and
markers arrive as the model's tokens do); the server code under test is the real one."""

from __future__ import annotations

import json

import openai
import pytest
from families import deepseek_v31, minimax_m2, qwen3, qwen3_special_think

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.parsers.reasoning import reasoning_parser
from jaxserve.server.app import build_app
from jaxserve.server.background import BackgroundServer
from jaxserve.server.context import ServerContext
from jaxserve.tokenizer import IncrementalDetokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


class Config:
    class scheduler:
        max_model_len = 4096

    class model:
        vocab_size = 200_000
    max_logprobs = 5


class TokenEngine:
    """Answers every request with `answer` (given as text, generated as its token ids)."""
    model_name = "family"
    is_healthy = True
    config = Config

    class grammars:          # grammars are the engine's (tests/test_structured_thinking.py)
        @staticmethod
        def check(structured):
            pass

    def __init__(self, tokenizer, answer: str):
        self.tokenizer, self.answer = tokenizer, answer
        self.prompts, self.params = [], []

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        self.prompts.append(prompt)
        self.params.append(sampling_params)
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)
        detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids))
        if sampling_params.output_kind != "delta":
            yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                                [CompletionOutput(0, self.answer, ids, finish_reason="stop")], finished=True)
            return
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield RequestOutput(request_id, prompt, list(prompt_token_ids),
                                [CompletionOutput(0, detok.add([t]), [t], finish_reason="stop" if last else None)],
                                finished=last)

    async def abort(self, request_id):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(tokenizer, answer, reasoning=None, tools=None, **kwargs):
        engine = TokenEngine(tokenizer, answer)
        ctx = ServerContext(engine, ("family",), reasoning_parser=reasoning and reasoning_parser(reasoning),
                            enable_auto_tool_choice=tools is not None, tool_call_parser=tools, **kwargs)
        server = BackgroundServer(build_app(ctx)).start()
        servers.append(server)
        return engine, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    yield start
    for s in servers:
        s.stop()


def _both(client, **body):
    """(the whole message, the stream put together: reasoning, content, calls, finish)."""
    whole = client.chat.completions.create(model="family", **body).choices[0]
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="family", stream=True, **body):
        for c in chunk.choices:
            d = c.delta.model_dump()
            reasoning += d.get("reasoning") or ""
            assert d.get("reasoning_content") == d.get("reasoning")
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], [tc["function"]["name"], ""])
                entry[1] += tc["function"]["arguments"] or ""
            finish = c.finish_reason or finish
    return whole, (reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish)


def test_qwen3_thinking_then_answer(serve):
    engine, client = serve(qwen3(), "<think>\nParis is in France.\n</think>\n\nSunny.", reasoning="qwen3")
    whole, streamed = _both(client, messages=USER)
    msg = whole.message.model_dump()
    assert msg["reasoning"] == msg["reasoning_content"] == "\nParis is in France.\n"
    assert msg["content"] == "\n\nSunny." and whole.finish_reason == "stop"
    assert streamed == ("\nParis is in France.\n", "\n\nSunny.", [], "stop")


def test_include_reasoning_false_drops_the_thinking(serve):
    engine, client = serve(qwen3(), "<think>\nParis is in France.\n</think>\n\nSunny.", reasoning="qwen3")
    whole, streamed = _both(client, messages=USER, extra_body={"include_reasoning": False})
    assert whole.message.model_dump()["reasoning"] is None and whole.message.content == "\n\nSunny."
    assert streamed == ("", "\n\nSunny.", [], "stop")


def test_qwen3_thinking_switch_reaches_the_template(serve):
    engine, client = serve(qwen3(), "Sunny.", reasoning="qwen3",
                           default_chat_template_kwargs={"enable_thinking": False})
    whole, streamed = _both(client, messages=USER)
    assert whole.message.content == "Sunny." and whole.message.model_dump()["reasoning"] is None
    assert engine.prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")    # the server's default
    client.chat.completions.create(model="family", messages=USER,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n")                        # the request's own wins


def test_qwen3_thinking_then_a_tool_call(serve):
    answer = ('<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
    engine, client = serve(qwen3(), answer, reasoning="qwen3", tools="hermes")
    whole, streamed = _both(client, messages=USER, tools=TOOLS)
    (call,) = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert whole.message.model_dump()["reasoning"] == "\nI should look it up.\n"
    assert whole.finish_reason == "tool_calls" and not (whole.message.content or "").strip()
    assert streamed[0] == "\nI should look it up.\n" and not streamed[1].strip()
    assert streamed[2] == [("get_weather", call.function.arguments)] and streamed[3] == "tool_calls"


def test_deepseek_v31_thinking_asked_and_its_call_format(serve):
    answer = ("Need the weather.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
              '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    engine, client = serve(deepseek_v31(), answer, reasoning="deepseek_v3", tools="deepseek_v31")
    whole, streamed = _both(client, messages=USER, tools=TOOLS, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert engine.prompts[0].endswith("<｜Assistant｜><think>")
    assert whole.message.model_dump()["reasoning"] == "Need the weather." and whole.message.content == "Checking."
    assert streamed == ("Need the weather.", "Checking.", [("get_weather", '{"city": "Paris"}')], "tool_calls")


def test_minimax_m2_reasoning_and_invoke_calls(serve):
    answer = ('The user wants weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
              '<parameter name="city">Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
              '</minimax:tool_call>')
    engine, client = serve(minimax_m2(), answer, reasoning="minimax_m2", tools="minimax_m2")
    whole, streamed = _both(client, messages=USER, tools=TOOLS)
    assert whole.message.model_dump()["reasoning"] == "The user wants weather.\n"
    assert whole.message.tool_calls[0].function.arguments == '{"city": "Paris", "days": 2}'
    assert streamed[0] == "The user wants weather.\n"
    assert streamed[2] == [("get_weather", '{"city": "Paris", "days": 2}')]


def test_invalid_call_is_text_not_an_error(serve):
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    engine, client = serve(qwen3(), answer, tools="hermes")
    whole, streamed = _both(client, messages=USER, tools=TOOLS)
    assert whole.message.content == answer and not whole.message.tool_calls and whole.finish_reason == "stop"
    assert streamed[3] == "stop"


def test_response_format_waits_for_the_end_of_thinking(serve):
    engine, client = serve(qwen3(), '<think>\nA JSON object.\n</think>\n\n{"city": "Paris"}', reasoning="qwen3")
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    whole, streamed = _both(client, messages=USER, response_format=fmt)
    assert json.loads(whole.message.content) == {"city": "Paris"}
    assert whole.message.model_dump()["reasoning"] == "\nA JSON object.\n" == streamed[0]
    end = qwen3().encode("</think>", add_special_tokens=False)
    assert [p.structured_outputs.reasoning_end_token_id for p in engine.params] == end * 2
    # thinking switched off: the prompt closes the thinking, the grammar holds from the start
    client.chat.completions.create(model="family", messages=USER, response_format=fmt,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.params[-1].structured_outputs.reasoning_end_token_id is None


def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
    engine, client = serve(qwen3(), call.format("Paris") + "\n" + call.format("Rome"), tools="hermes")
    whole, streamed = _both(client, messages=USER, tools=TOOLS)
    assert [c.function.arguments for c in whole.message.tool_calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
    whole, streamed = _both(client, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.arguments for c in whole.message.tool_calls] == ['{"city": "Paris"}']
    assert streamed[2] == [("get_weather", '{"city": "Paris"}')]


def test_named_tool_choice_after_thinking(serve):
    engine, client = serve(qwen3(), '<think>\nEasy.\n</think>\n\n{"city": "Paris"}', reasoning="qwen3")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed = _both(client, messages=USER, tools=TOOLS, tool_choice=choice)
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert whole.message.model_dump()["reasoning"] == "\nEasy.\n" == streamed[0]
    assert streamed[2] == [("get_weather", '{"city": "Paris"}')]
    end = qwen3().encode("</think>", add_special_tokens=False)
    assert engine.params[0].structured_outputs.reasoning_end_token_id == end[0]     # its grammar waits too


def test_mistral_calls_keep_their_special_tokens_in_the_text(serve):
    engine, client = serve(qwen3(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', tools="mistral")
    whole, _ = _both(client, messages=USER, tools=TOOLS)
    assert whole.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert [p.skip_special_tokens for p in engine.params] == [False, False]
    engine2, client2 = serve(qwen3(), "Sunny.", tools="hermes")
    client2.chat.completions.create(model="family", messages=USER, tools=TOOLS)
    assert engine2.params[0].skip_special_tokens


def test_special_think_tags_are_kept_in_the_text(serve):
    tok = qwen3_special_think()
    assert tok.decode(tok.encode("a</think>b", add_special_tokens=False)) == "ab"
    engine, client = serve(tok, "<think>\nHmm.\n</think>\n\nSunny.", reasoning="qwen3")
    whole = client.chat.completions.create(model="family", messages=USER).choices[0]
    assert engine.params[0].skip_special_tokens is False
    assert whole.message.model_dump()["reasoning"] == "\nHmm.\n"
    engine, client = serve(qwen3(), "Sunny.", reasoning="qwen3")
    client.chat.completions.create(model="family", messages=USER)
    assert engine.params[0].skip_special_tokens is True
