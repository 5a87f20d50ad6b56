"""Tool-call parsers on the strings the families write (Qwen3's from its own chat template;
the others as their templates render an assistant's calls), whole and streamed: token by
token through the real tokenizers and in small character pieces that split the markers. The
streamed pieces must put together to the whole result, arguments included."""

from __future__ import annotations

import json

import pytest
from families import awkward_deltas, deepseek_v31, minimax_m2, qwen3, token_deltas

from jaxserve.parsers.tools import TOOL_PARSERS, tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_time", {"zone": "Asia/Tokyo"})


def _streamed(name, deltas):
    s = tool_parser(name).stream(TOOLS)
    content, calls = "", {}
    for i, d in enumerate(deltas + [""]):
        out = s.feed(d, final=i == len(deltas))
        content += out.content
        for c in out.calls:
            if c.name is not None:
                assert c.index not in calls
                calls[c.index] = [c.name, ""]
            calls[c.index][1] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], s


def _check(name, tok, text, content, calls):
    whole = tool_parser(name).extract(text, TOOLS)
    assert whole[0] == content
    assert [(n, json.loads(a)) for n, a in whole[1]] == calls
    for deltas in [token_deltas(tok, text)] + [awkward_deltas(text, k) for k in (1, 2, 7)]:
        got_content, got_calls, _ = _streamed(name, deltas)
        assert got_content.strip() == (content or "")
        assert got_calls == whole[1]
    return whole


def _qwen3_template_output(calls) -> str:
    """The assistant turn Qwen3's own chat template renders for these calls."""
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = qwen3().apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("\n").removesuffix("<|im_end|>")
    return turn.removeprefix("<think>\n\n</think>\n\n")     # (the template's empty thinking)


def test_hermes_on_qwen3s_template():
    text = _qwen3_template_output([PARIS, TOKYO])
    assert text.startswith('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city"')
    _check("hermes", qwen3(), text, "Let me check.", [PARIS, TOKYO])


def test_hermes_streams_arguments_in_pieces():
    text = _qwen3_template_output([PARIS])
    s = tool_parser("hermes").stream(TOOLS)
    pieces = [c.arguments for d in token_deltas(qwen3(), text) for c in s.feed(d).calls]
    pieces += [c.arguments for c in s.feed("", final=True).calls]
    assert len([p for p in pieces if p]) > 3 and "".join(pieces) == '{"city": "Paris", "days": 3}'


QWEN3_CODER = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
               "<parameter=zone>\nAsia/Tokyo\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("name", ["qwen3_coder", "qwen3_xml"])
def test_qwen3_coder_xml(name):
    _check(name, qwen3(), QWEN3_CODER, "Let me check.", [PARIS, TOKYO])


def test_qwen3_coder_streams_one_parameter_at_a_time():
    s = tool_parser("qwen3_coder").stream(TOOLS)
    pieces = [c.arguments for d in awkward_deltas(QWEN3_CODER, 4) for c in s.feed(d).calls if c.index == 0]
    assert pieces == ["{", '"city": "Paris"', ', "days": 3', "}"]


def test_minimax_m2():
    text = ('Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n'
            '<parameter name="zone">Asia/Tokyo</parameter>\n</invoke>\n</minimax:tool_call>')
    assert "<minimax:tool_call>" in minimax_m2().hf.convert_ids_to_tokens(minimax_m2().encode(text))
    _check("minimax_m2", minimax_m2(), text, "Let me check.", [PARIS, TOKYO])


def test_deepseek_v31():
    text = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
            '{"zone": "Asia/Tokyo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    _check("deepseek_v31", deepseek_v31(), text, "Let me check.", [PARIS, TOKYO])


def test_deepseek_v3():
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
            'get_time\n```json\n{"zone": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    _check("deepseek_v3", deepseek_v31(), text, None, [PARIS, TOKYO])


def test_deepseek_v32_dsml():
    text = ('Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter name="zone" string="true">Asia/Tokyo'
            '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    _check("deepseek_v32", deepseek_v31(), text, "Let me check.", [PARIS, TOKYO])


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "Asia/Tokyo"}',
])
def test_mistral(text):
    _check("mistral", qwen3(), text, None, [PARIS, TOKYO])


def test_pythonic():
    _check("pythonic", qwen3(), '[get_weather(city="Paris", days=3), get_time(zone="Asia/Tokyo")]', None,
           [PARIS, TOKYO])
    _check("pythonic", qwen3(), "Plain [words].", "Plain [words].", [])


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'),   # not JSON
    ("hermes", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'),                  # not a tool
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),           # not an object
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),                 # cut short
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\""),
    ("pythonic", "[get_weather(city=Paris)]"),
])
def test_a_call_that_is_not_valid_is_text(name, text):
    assert tool_parser(name).extract(text, TOOLS) == (text, [])
    content, _, s = _streamed(name, awkward_deltas(text, 3))
    assert s.result() == (text, []) and content == text     # the stream's content: all of it too


def test_plain_content_streams_as_it_comes_but_holds_a_possible_marker():
    s = tool_parser("qwen3_coder").stream(TOOLS)
    assert s.feed("It is sunny <tool").content == "It is sunny"
    assert s.feed("bar> today.").content == " <toolbar> today."


def test_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError) as e:
        tool_parser("qwen3")
    for name in ("hermes", "llama3_json", "qwen3_coder", "qwen3_xml", "deepseek_v3", "deepseek_v31",
                 "deepseek_v32", "minimax_m2", "mistral", "pythonic"):
        assert name in TOOL_PARSERS and name in str(e.value)
