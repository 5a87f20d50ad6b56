"""Speculative decoding on the real default model: n-gram drafts on repetitive prompts are
accepted and counted, and change no greedy output (batched, with stop strings); a
tiny draft model on the default model's vocabulary changes none either."""

import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from tests.spec_helpers import make_llm, spec_counts, token_ids, write_tiny_llama

PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat on",
           "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
           "Paris is the capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def engine(model, spec=None):
    return make_llm(model, spec, max_len=64, block_size=16, max_tokens=16)   # buckets 1 and 16 only


@pytest.fixture(scope="module")
def model():
    return loader.load_model(None, dtype="float32")


@pytest.fixture(scope="module")
def plain(model):
    return engine(model)


@pytest.fixture(scope="module")
def ngram(model):
    return engine(model, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4})


def test_ngram_drafts_on_repetitive_prompts_are_accepted(plain, ngram):
    want = token_ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(ngram.generate(PROMPTS, GREEDY, use_tqdm=False)) == want   # (alone: test_spec_decode.py)
    c = spec_counts(ngram)
    assert c["spec_decode_num_accepted_tokens_total"] >= 4, c
    assert ngram.engine.scheduler.pool.num_used == 0


def test_stop_strings_inside_accepted_drafts(plain, ngram):
    stop = SamplingParams(temperature=0, max_tokens=12, stop=[" mat"], include_stop_str_in_output=False)
    want = plain.generate(PROMPTS[:1], stop, use_tqdm=False)[0].outputs[0]
    got = ngram.generate(PROMPTS[:1], stop, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
    assert got.finish_reason == "stop" and not got.text.endswith(" mat")


def test_a_tiny_draft_model_on_the_same_vocabulary(model, plain, tmp_path_factory):
    draft = write_tiny_llama(tmp_path_factory.mktemp("draft"), model[0].vocab_size)
    spec = engine(model, {"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    want = token_ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert spec_counts(spec)["spec_decode_num_drafts_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0
