"""Reasoning parsers on the strings the families' templates and models produce, whole and
streamed (token by token through the real detokenizer, and in 3-character pieces that split
the tags), and the thinking switch as the templates render it."""

from __future__ import annotations

import pytest
from families import awkward_deltas, deepseek_v31, minimax_m2, qwen3, token_deltas

from jaxserve.parsers.reasoning import REASONING_PARSERS, Phase, reasoning_parser

USER = [{"role": "user", "content": "What is 2+2?"}]


def _streamed(parser, prompt, kwargs, deltas):
    s = parser.stream(prompt, kwargs)
    parts = [s.feed(d) for d in deltas] + [s.feed("", final=True)]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    return (reasoning if s.saw_reasoning else None), (content or None)


def _check(name, tok, prompt, kwargs, output, want):
    parser = reasoning_parser(name)
    assert parser.split(output, prompt, kwargs) == want
    assert _streamed(parser, prompt, kwargs, token_deltas(tok, output)) == want
    for size in (1, 2, 3, 5):
        assert _streamed(parser, prompt, kwargs, awkward_deltas(output, size)) == want


def test_qwen3_hybrid_thinks_from_its_own_tag():
    tok = qwen3()
    prompt = tok.apply_chat_template(USER)
    assert prompt.endswith("<|im_start|>assistant\n")
    _check("qwen3", tok, prompt, {}, "<think>\nTwo and two.\n</think>\n\n4", ("\nTwo and two.\n", "\n\n4"))
    # no thinking written: all content, nothing held back at the end
    _check("qwen3", tok, prompt, {}, "4, the answer <thin", (None, "4, the answer <thin"))


def test_qwen3_enable_thinking_false_is_all_content():
    tok = qwen3()
    prompt = tok.apply_chat_template(USER, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    parser = reasoning_parser("qwen3")
    assert parser.initial_phase(prompt, {"enable_thinking": False}) is Phase.CONTENT
    assert not parser.thinks_first(prompt, {"enable_thinking": False})
    # even text that looks like a tag is the answer's
    _check("qwen3", tok, prompt, {}, "It is <think>4</think>.", (None, "It is <think>4</think>."))


def test_qwen3_thinking_template_leaves_the_tag_open():
    tok = qwen3()
    prompt = tok.apply_chat_template(USER) + "<think>\n"      # Qwen3-*-Thinking-2507's prompt
    _check("qwen3", tok, prompt, {}, "Two and two.\n</think>\n\n4", ("Two and two.\n", "\n\n4"))


def test_deepseek_r1_starts_in_the_thinking():
    tok = deepseek_v31()
    _check("deepseek_r1", tok, None, {}, "<think>\nhmm\n</think>\n\n**4**", ("\nhmm\n", "\n\n**4**"))
    _check("deepseek_r1", tok, None, {}, "hmm</think>4", ("hmm", "4"))
    _check("deepseek_r1", tok, None, {}, "still thinking", ("still thinking", None))   # cut by max_tokens


def test_deepseek_v3_thinks_only_when_asked():
    tok = deepseek_v31()
    thinking = tok.apply_chat_template(USER, thinking=True)
    plain = tok.apply_chat_template(USER)
    assert thinking.endswith("<｜Assistant｜><think>") and plain.endswith("<｜Assistant｜></think>")
    _check("deepseek_v3", tok, thinking, {"thinking": True}, "Two and two.</think>4", ("Two and two.", "4"))
    _check("deepseek_v3", tok, plain, {}, "Two and two.</think>4", (None, "Two and two.</think>4"))
    _check("deepseek_v3", tok, thinking, {"enable_thinking": True}, "a</think>b", ("a", "b"))


def test_minimax_m2_never_writes_the_opening_tag():
    tok = minimax_m2()
    prompt = tok.apply_chat_template(USER)
    assert prompt.endswith("]~b]ai\n<think>\n")
    out = "The user asks a sum.\n</think>\n\n4"
    _check("minimax_m2", tok, prompt, {}, out, ("The user asks a sum.\n", "\n\n4"))
    _check("minimax_m2_append_think", tok, prompt, {}, out, (None, "<think>" + out))


def test_tags_split_across_deltas_are_held_back_not_lost():
    s = reasoning_parser("deepseek_r1").stream(None)
    assert s.feed("abc</th").reasoning == "abc"        # "</th" may be the end tag: held back
    d = s.feed("ink>answer")
    assert (d.reasoning, d.content) == ("", "answer")
    s = reasoning_parser("deepseek_r1").stream(None)
    assert s.feed("a</").reasoning == "a"
    assert s.feed("b>c").reasoning == "</b>c"          # it was not a tag after all


def test_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError) as e:
        reasoning_parser("deepseek")
    for name in REASONING_PARSERS:
        assert name in str(e.value)
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3", "qwen3", "minimax_m2",
                                      "minimax_m2_append_think"}
