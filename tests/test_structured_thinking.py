"""Structured output after thinking: with `reasoning_end_token_id` set (a reasoning parser is
on and the output thinks first), a request's grammar waits for that token: its rows stay
all-allowed and its matcher consumes nothing until then; drafts follow the same rule and the
switch is undone with the matcher's rollback. ("~" stands for `</think>` in the tiny
tokenizer.)"""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.parsers.reasoning import DeepSeekR1
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.structured import masks
from jaxserve.structured.compiler import GrammarCompiler
from tests.test_structured import ckpt_dir, llm, tiny_tokenizer  # noqa: F401

ALL = np.full(32, 0xFF, np.uint8)


@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(tiny_tokenizer(), 256, [2])


def _ids(text):
    return [tiny_tokenizer().encode(c)[0] for c in text]


def _request(grammars, so, output=(), end=None):
    g = masks.RequestGrammar(grammars.matcher(so), thinking_end=end)
    return types.SimpleNamespace(req_id="r", grammar=g, output_token_ids=list(output))


def _fill(grammars, req, rows=1, drafts=(), draft_rows=()):
    allowed = np.full((rows, 32), 0xFF, np.uint8)
    masks.fill_step_masks(grammars, allowed, [masks.ConstrainedRows(0, req, False, drafts, draft_rows)], None)
    return allowed


def _fresh_mask(grammars, so, consumed=()):
    m = grammars.matcher(so)
    assert m.consume_tokens(list(consumed))
    allowed = np.full((1, 32), 0xFF, np.uint8)
    masks.fill_masks(grammars.executor, allowed, [(0, m)], grammars.mask_words)
    return allowed[0]


def test_the_grammar_starts_after_the_end_of_thinking(grammars):
    so = SO(regex="ab")
    (end,) = _ids("~")
    thinking = _ids("xyz")
    req = _request(grammars, so, thinking, end)
    np.testing.assert_array_equal(_fill(grammars, req)[0], ALL)       # thinking: anything goes
    req.output_token_ids.append(end)
    np.testing.assert_array_equal(_fill(grammars, req)[0], _fresh_mask(grammars, so))
    assert not req.grammar.thinking
    req.output_token_ids += _ids("a")
    np.testing.assert_array_equal(_fill(grammars, req)[0], _fresh_mask(grammars, so, _ids("a")))
    # without the end token named, the grammar holds from the first token
    plain = _request(grammars, so)
    np.testing.assert_array_equal(_fill(grammars, plain)[0], _fresh_mask(grammars, so))


def test_drafts_across_the_end_of_thinking(grammars):
    so = SO(regex="ab")
    x, y, end, a, z = _ids("xy~az")
    req = _request(grammars, so, [x], end)
    assert req.grammar.valid_drafts(req.output_token_ids, [y, y]) == 2        # all thinking
    assert req.grammar.valid_drafts(req.output_token_ids, [y, end, a]) == 3
    assert req.grammar.valid_drafts(req.output_token_ids, [y, end, z, a]) == 2
    allowed = _fill(grammars, req, rows=4, drafts=(y, end, a), draft_rows=(1, 2, 3))
    np.testing.assert_array_equal(allowed[1], ALL)                            # predicts y: thinking
    np.testing.assert_array_equal(allowed[2], ALL)                            # predicts the end
    np.testing.assert_array_equal(allowed[3], _fresh_mask(grammars, so))      # the grammar's first token
    np.testing.assert_array_equal(allowed[0], _fresh_mask(grammars, so, [a]))  # the bonus row
    assert req.grammar.thinking and req.grammar.consumed == 1                 # rolled back
    np.testing.assert_array_equal(_fill(grammars, req)[0], ALL)


def test_engine_output_thinks_then_matches(llm):   # noqa: F811
    """The bias makes "~" the greedy choice at every step: the first token ends the thinking,
    then the grammar forbids "~" and the output is the regex's."""
    (end,) = _ids("~")
    bias = {end: 100.0}
    waits = SamplingParams(temperature=0, max_tokens=8, logit_bias=bias,
                           structured_outputs=SO(regex="ab", reasoning_end_token_id=end))
    at_once = SamplingParams(temperature=0, max_tokens=8, logit_bias=bias, structured_outputs=SO(regex="ab"))
    out_waits, out_at_once = llm.generate(["q", "q"], [waits, at_once], use_tqdm=False)
    assert out_waits.outputs[0].text == "~ab"
    assert out_at_once.outputs[0].text == "ab"


def test_reasoning_end_token_id_is_not_a_client_field():
    with pytest.raises(ValueError, match="no field 'reasoning_end_token_id'"):
        SO.from_dict({"regex": "a", "reasoning_end_token_id": 3})
    with pytest.raises(ValueError, match="reasoning_end_token_id must be a token id"):
        SO(regex="a", reasoning_end_token_id=-1)


class TildeThink(DeepSeekR1):
    """deepseek_r1's rules with "~" for `</think>` (one token in the tiny vocabulary)."""
    start_tag, end_tag = "<", "~"


def test_llm_chat_splits_reasoning_and_constrains_the_answer(llm):   # noqa: F811
    chat = LLM.from_engine(llm.engine)
    chat.reasoning = TildeThink()
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}~{% endif %}")
    (end,) = _ids("~")
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: 100.0},
                            structured_outputs=SO(regex="ab"))
    (out,) = chat.chat([{"role": "user", "content": "q"}], params, use_tqdm=False, chat_template=template)
    c = out.outputs[0]
    assert (c.text, c.reasoning, c.content) == ("~ab", "", "ab")
    # thinking switched off: the prompt ends the thinking, the grammar holds from the start
    (out,) = chat.chat([{"role": "user", "content": "q"}], params, use_tqdm=False, chat_template=template,
                       chat_template_kwargs={"enable_thinking": False})
    c = out.outputs[0]
    assert (c.text, c.reasoning, c.content) == ("ab", None, "ab")
