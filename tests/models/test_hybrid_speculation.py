"""Speculative decoding on the hybrid models (Qwen3-Next, Qwen3.5-MoE). A verifying step folds
every draft into the recurrent state, so a rejected one is rolled back: the state is copied to
a snapshot slot before the step and back after a rejection, and the kept tokens are computed
again (scheduler.py). Greedy tokens equal transformers' with drafts right and wrong, batched
and alone, with prefix caching on and off and under preemption; n-gram and draft-model
proposers change no output; every block, slot and saved state is free afterwards."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.proposer import Proposer
from tests.conftest import GOLDEN_DIR
from tests.step_bound import bound_steps
from test_new_families_engine import assert_all_free, golden

HYBRID = ["qwen3_next", "qwen3_5_moe"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class Replay(Proposer):
    """Drafts from the known greedy continuation, each right with probability p (seeded)."""

    def __init__(self, prompts, continuations, k: int, p: float):
        self.cont = {tuple(pr): c for pr, c in zip(prompts, continuations)}
        self.k, self.p, self.rng = k, p, np.random.default_rng(0)

    def retain(self, running_ids) -> None:
        pass

    def propose(self, requests, limits):
        out = []
        for req, limit in zip(requests, limits):
            m = len(req.output_token_ids)
            drafts = np.array(self.cont[tuple(req.prompt_token_ids)][m:m + min(self.k, limit)])
            wrong = self.rng.random(len(drafts)) >= self.p
            drafts[wrong] = (drafts[wrong] + 1) % 256
            out.append(drafts.tolist())
        return out


def make_llm(tiny_checkpoint, name, spec, caching=True, **kw):
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                block_size=4, num_kv_blocks=96, warmup=False)
    if caching:
        args["num_cached_states"] = 24
    llm = LLM(tiny_checkpoint(name), enable_prefix_caching=caching, speculative_config=spec,
              **{**args, **kw})
    bound_steps(llm.engine)         # a broken rollback fails in seconds instead of hanging
    return llm


def checkpoint(name: str) -> str:
    """The tiny checkpoint's path (conftest's tiny_checkpoint, for the module's fixtures)."""
    return os.path.join(GOLDEN_DIR, "ckpt", name)


@pytest.fixture(scope="module")
def ngram_engines():
    """name -> (engine with n-gram drafts and prefix caching, its own proposer), built once for
    the two tests of that config (a fresh engine re-traces its step programs: seconds on 2
    cores); each test sets the proposer it needs and counts from what the engine had done."""
    engines = {}

    def get(name):
        if name not in engines:
            llm = make_llm(checkpoint, name, NGRAM)
            engines[name] = (llm, llm.engine.core.proposer)
        return engines[name]
    return get


@pytest.fixture(scope="module")
def plain_greedy():
    """(name, prompts) -> the greedy tokens of the engine without drafts (one per family)."""
    memo = {}

    def get(name, prompts, max_tokens):
        key = (name, tuple(map(tuple, prompts)), max_tokens)
        if key not in memo:
            memo[key] = generate(make_llm(checkpoint, name, None), prompts, max_tokens)
        return memo[key]
    return get


def generate(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def counts(llm, since: dict | None = None) -> dict:
    """The engine's rollbacks and drafts (since the `since` counts: a shared engine's)."""
    m = llm.get_metrics()
    assert m["num_state_rollbacks_total"] == llm.engine.scheduler.num_state_rollbacks
    now = {"rollbacks": llm.engine.scheduler.num_state_rollbacks,
           "accepted": m["spec_decode_num_accepted_tokens_total"],
           "drafted": m["spec_decode_num_draft_tokens_total"]}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("name", HYBRID)
def test_right_and_wrong_drafts_keep_the_greedy_tokens_of_transformers(name, caching, tiny_checkpoint,
                                                                      ngram_engines):
    prompts, want = golden(name)
    llm = ngram_engines(name)[0] if caching else make_llm(tiny_checkpoint, name, NGRAM, caching)
    before = counts(llm)
    llm.engine.core.proposer = Replay(prompts, want, k=3, p=0.6)
    assert generate(llm, prompts, len(want[0])) == want
    assert [generate(llm, [p], len(w))[0] for p, w in zip(prompts, want)] == want
    c = counts(llm, before)
    assert c["rollbacks"] > 0 and 0 < c["accepted"] < c["drafted"]     # both ways exercised
    assert_all_free(llm)


@pytest.mark.parametrize("name", HYBRID)
def test_preempted_speculating_requests_resume_with_the_right_state(name, tiny_checkpoint):
    prompts, want = golden(name)
    # 22 blocks of 4 tokens: the three requests (5, 17 and 40 prompt tokens + 17) cannot all fit
    llm = make_llm(tiny_checkpoint, name, NGRAM, num_kv_blocks=22)
    llm.engine.core.proposer = Replay(prompts, want, k=3, p=0.6)
    assert generate(llm, prompts, len(want[0])) == want
    assert llm.get_metrics()["num_preemptions_total"] > 0 and counts(llm)["rollbacks"] > 0
    assert_all_free(llm)


@pytest.mark.parametrize("spec", [NGRAM, {"method": "draft_model", "num_speculative_tokens": 2}],
                         ids=["ngram", "draft_model"])
@pytest.mark.parametrize("name", HYBRID)
def test_proposers_change_no_greedy_output(name, spec, tiny_checkpoint, ngram_engines, plain_greedy):
    """On repetitive prompts (n-gram proposes from them) and with a tiny Llama on the same
    vocabulary as the draft model."""
    if spec["method"] == "draft_model":
        spec = {**spec, "model": tiny_checkpoint("llama")}
    rng = np.random.default_rng(1)
    prompts = [(rng.integers(3, 256, size=3).tolist() * 4)[:n] for n in (7, 12, 9)]
    want = plain_greedy(name, prompts, 20)
    if spec["method"] == "ngram":        # the engine of the test above, its n-gram proposer back
        llm, proposer = ngram_engines(name)
        llm.engine.core.proposer = proposer
    else:
        llm = make_llm(tiny_checkpoint, name, spec)
    before = counts(llm)
    assert generate(llm, prompts, 20) == want
    assert counts(llm, before)["drafted"] > 0
    assert_all_free(llm)
