"""The draft-model proposer: greedy outputs equal those without speculation (batched and
alone; tests/test_spec_default_model.py has the default model with a tiny draft); a perfect
draft is always accepted; the draft's cache is freed; a draft shorter than max_model_len
drafts only below its length; a draft of another vocabulary is refused."""

import json
import os
import shutil

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


def test_a_draft_of_another_vocabulary_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match=r"'model'.*vocabulary \(256 tokens\).*100"):
        make_llm(model, draft_config(write_tiny_llama(tmp_path / "v", 100)), max_len=MAX_LEN)


def short_target(tmp_path, positions: int) -> str:
    """The target's own checkpoint claiming `positions` positions: a draft that agrees with
    the target (its drafts are accepted) but is shorter than max_model_len."""
    path = tmp_path / "short"
    shutil.copytree(TINY, path)
    with open(path / "config.json") as f:
        hf = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump({**hf, "max_position_embeddings": positions}, f)
    return str(path)


@pytest.mark.parametrize("draft", ["target", "random"])
def test_a_draft_shorter_than_max_model_len_drafts_only_below_its_length(model, tmp_path, draft):
    """vLLM caps a draft model's length: past it a request goes on without drafts."""
    path = (short_target(tmp_path, 16) if draft == "target"
            else write_tiny_llama(tmp_path / "p", 256, max_position_embeddings=16))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = token_ids(make_llm(model, max_len=MAX_LEN).generate(prompts(4), params, use_tqdm=False))
    llm = make_llm(model, draft_config(path), max_len=MAX_LEN)
    proposer = llm.engine.core.proposer
    assert proposer.max_positions == 16 == proposer.runner.config.scheduler.max_model_len
    last = []                             # the last position of each request's drafts
    propose = proposer.propose

    def recording(requests, limits, tails=None):
        drafts = propose(requests, limits, tails)
        for i, (req, d) in enumerate(zip(requests, drafts)):
            ahead = len(tails[i]) + 1 if tails else 0    # its first token is the step's own
            if len(d) > (1 if tails else 0):
                last.append(req.num_tokens + ahead + len(d) - 1 - (1 if tails else 0))
        return drafts

    proposer.propose = recording
    assert token_ids(llm.generate(prompts(4), params, use_tqdm=False)) == plain
    assert last and max(last) < 16          # drafts while positions allow, none past them
    assert all(len(p["prompt_token_ids"]) + 20 > 16 for p in prompts(4))   # all went past
    if draft == "target":
        c = spec_counts(llm)
        assert c["spec_decode_num_accepted_tokens_total"] == c["spec_decode_num_draft_tokens_total"] > 0
    llm.generate(prompts(1), SamplingParams(max_tokens=1), use_tqdm=False)   # ends the others
    assert llm.engine.scheduler.pool.num_used == 0
    assert proposer.kv.pool.num_used == 0 and not proposer.cached


def test_preempted_requests_draft_again_from_scratch(model, want):
    llm = make_llm(model, draft_config(TINY), max_len=MAX_LEN, num_kv_blocks=14)
    assert token_ids(llm.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert llm.get_metrics()["num_preemptions_total"] > 0
    assert spec_counts(llm)["spec_decode_num_accepted_tokens_total"] > 0
    llm.generate(prompts(1), SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.scheduler.pool.num_used == 0
    assert llm.engine.core.proposer.kv.pool.num_used == 0
