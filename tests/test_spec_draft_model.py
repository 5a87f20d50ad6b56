"""The draft-model proposer: greedy outputs equal those without speculation (batched and
alone; tests/test_spec_default_model.py has the default model with a tiny draft); a perfect
draft is always accepted; the draft's cache is freed; bad drafts are refused."""

import os

import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, spec_counts, token_ids, write_tiny_llama
from tests.test_spec_decode import MAX_LEN, prompts

TINY = os.path.join(GOLDEN_DIR, "ckpt", "llama")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def draft_config(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def model():
    return loader.load_model(TINY, dtype="float32")


@pytest.fixture(scope="module")
def want(model):
    return token_ids(make_llm(model, max_len=MAX_LEN).generate(prompts(4), GREEDY, use_tqdm=False))


def test_the_target_as_its_own_draft_is_always_accepted(model, want):
    llm = make_llm(model, draft_config(TINY), max_len=MAX_LEN)
    assert token_ids(llm.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    c = spec_counts(llm)
    assert c["spec_decode_num_drafts_total"] > 0
    assert c["spec_decode_num_accepted_tokens_total"] == c["spec_decode_num_draft_tokens_total"]
    # it drafts ahead of the device, so steps were scheduled past drafts, none voided
    assert llm.engine.scheduler.num_chunks_past_drafts > 0 == llm.engine.scheduler.num_void_chunks
    proposer = llm.engine.core.proposer
    assert [token_ids(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts(2)] == want[:2]
    llm.generate(prompts(1), SamplingParams(max_tokens=1), use_tqdm=False)   # ends the others
    assert llm.engine.scheduler.pool.num_used == 0
    assert proposer.kv.pool.num_used == 0 and not proposer.cached


def test_an_unrelated_draft_changes_no_greedy_output(model, want, tmp_path):
    llm = make_llm(model, draft_config(write_tiny_llama(tmp_path / "d", 256), k=2), max_len=MAX_LEN)
    assert token_ids(llm.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert spec_counts(llm)["spec_decode_num_draft_tokens_total"] > 0
    assert llm.engine.scheduler.num_void_chunks > 0      # its wrong drafts voided steps ahead


def test_drafts_that_do_not_fit_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match=r"'model'.*vocabulary \(256 tokens\).*100"):
        make_llm(model, draft_config(write_tiny_llama(tmp_path / "v", 100)), max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"'model'.*max_model_len \(40\).*allows 16"):
        make_llm(model, draft_config(write_tiny_llama(tmp_path / "p", 256, max_position_embeddings=16)),
                 max_len=MAX_LEN)


def test_preempted_requests_draft_again_from_scratch(model, want):
    llm = make_llm(model, draft_config(TINY), max_len=MAX_LEN, num_kv_blocks=14)
    assert token_ids(llm.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert llm.get_metrics()["num_preemptions_total"] > 0
    assert spec_counts(llm)["spec_decode_num_accepted_tokens_total"] > 0
    llm.generate(prompts(1), SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.scheduler.pool.num_used == 0
    assert llm.engine.core.proposer.kv.pool.num_used == 0
