"""Prefix caching of the hybrid models (Qwen3-Next, Qwen3.5-MoE) through the whole engine:
the same greedy tokens (and first-token logprobs within 2e-3) with caching on and off, when
requests hit the cache in the middle of a running batch and when a preempted request resumes
from its own saved state; the hits show in the metrics; nothing is left held afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from test_new_families_engine import STEPS, assert_all_free, golden

LOGPROB_ATOL = 2e-3


def make_llm(tiny_checkpoint, name, caching: bool, **kw):
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                block_size=4, num_kv_blocks=96, num_cached_states=24, warmup=False)
    return LLM(tiny_checkpoint(name), enable_prefix_caching=caching, **{**args, **kw})


def run_arrivals(llm, arrivals):
    """arrivals: (step, prompt) in order; each prompt is added once that many steps have run.
    Returns per prompt (greedy tokens, the first token's logprob) and the steps' outcomes."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    outcomes = []
    eng.step_listeners.append(outcomes.append)
    done, pending, steps = {}, list(enumerate(arrivals)), 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= steps:
            i, (_, prompt) = pending.pop(0)
            eng.add_request(str(i), prompt, params)
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[int(out.request_id)] = (c.token_ids, c.logprobs[0][c.token_ids[0]].logprob)
        steps += 1
    eng.step_listeners.remove(outcomes.append)
    return [done[i] for i in range(len(arrivals))], outcomes


def assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_hits_in_the_middle_of_a_batch_match_caching_off(name, tiny_checkpoint):
    prompts, greedy = golden(name)
    long_prompt = prompts[2]                                   # 40 tokens
    branch = long_prompt[:26] + [7, 11, 13, 17, 19, 23]        # shares 26 tokens with it
    # the long prompt alone first; then a batch into which its repeat and a branch of it
    # arrive while the others decode (one before the first request finished prefilling)
    arrivals = [(0, long_prompt), (12, prompts[1]), (13, prompts[0]), (15, long_prompt),
                (16, branch), (16, long_prompt[:30])]
    results = {}
    for caching in (False, True):
        llm = make_llm(tiny_checkpoint, name, caching)
        results[caching], outcomes = run_arrivals(llm, arrivals)
        assert_all_free(llm)
        hits = llm.get_metrics()["prefix_cache_hits_total"]
        loads = [o.scheduled.state_loads for o in outcomes if o.scheduled.state_loads]
        if not caching:
            assert hits == 0 and not loads
            continue
        # the first run saved its states where its 16-token chunks ended (16, 32, 40): the
        # repeat resumes at 32 (40 would leave nothing to compute), the branch and the
        # 30-token prefix at 16
        assert hits == 32 + 16 + 16 and len(loads) >= 2
        mixed = [o.scheduled for o in outcomes if o.scheduled.state_loads]
        assert all(len(m.scheduled) > 1 for m in mixed)       # each hit beside running requests
    assert_same(results[True], results[False])
    for i in (0, 1, 2, 3):      # the golden prompts agree with transformers, cached or not
        assert results[True][i][0] == greedy[[2, 1, 0, 2][i]][:STEPS]


def test_a_preempted_request_resumes_from_its_saved_state(tiny_checkpoint):
    name = "qwen3_next"
    prompts, greedy = golden(name)
    longest = max(len(p) for p in prompts) + STEPS
    blocks = -(-longest // 4) * 3 // 2 + 1          # about one and a half sequences
    kw = dict(max_num_seqs=3, max_model_len=(blocks - 1) * 4, num_kv_blocks=blocks)
    arrivals = [(0, p) for p in prompts]
    results = {}
    for caching in (False, True):
        llm = make_llm(tiny_checkpoint, name, caching, **kw)
        results[caching], outcomes = run_arrivals(llm, arrivals)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_free(llm)
        preempted = {rid for o in outcomes for rid in o.scheduled.preempted_ids}
        resumed = [r for o in outcomes if o.scheduled.state_loads
                   for r in o.scheduled.scheduled if r.req_id in preempted and r.start_position]
        assert bool(resumed) == caching
    assert_same(results[True], results[False])
    assert [t for t, _ in results[True]] == [g[:STEPS] for g in greedy]


def test_warmup_compiles_the_state_copies(tiny_checkpoint):
    """After warm-up, steps with state loads and saves compile nothing (the copies have one
    small program per pair-count bucket)."""
    import jax

    llm = LLM(tiny_checkpoint("qwen3_next"), dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=64, block_size=4, num_kv_blocks=64,
              num_cached_states=16)
    llm.engine.runner.wait_for_warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    prompts, _ = golden("qwen3_next")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for _ in range(2):            # the second time from the saved states
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits_total"] > 0
    assert compiles == []


def test_a_proposer_reading_hidden_states_is_refused_on_a_hybrid_model(tiny_checkpoint):
    """MTP / EAGLE3 would read the rows a state rollback computes again: refused, not wrong
    (n-gram and draft models run: test_hybrid_speculation.py)."""
    with pytest.raises(ValueError, match=r"'mtp' is not supported .*recurrent state.*ngram, draft_model"):
        make_llm(tiny_checkpoint, "qwen3_next", False,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 1})
