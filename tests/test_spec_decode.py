"""Speculative decoding end to end on a tiny random-weight Llama: n-gram drafts change no
greedy output (batched or alone, with penalties, min_tokens, logprobs, n > 1), never pass
max_tokens or max_model_len, are counted in the metrics, and leave no block behind."""

import os

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from jaxserve.spec_decode import ngram
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.proposer import Proposer
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, spec_counts, token_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model():
    return loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", "llama"), dtype="float32")


MAX_LEN = 40      # short enough for a test to run requests into it


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def spec(model):
    return make_llm(model, NGRAM, max_len=MAX_LEN)


def prompts(n):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        motif = rng.integers(3, 256, size=2 + i % 3).tolist()
        out.append({"prompt_token_ids": motif * (2 + i % 2) + rng.integers(3, 256, size=i % 4).tolist()})
    return out


def ngram_reference(tokens, min_n, max_n, k):
    """The definition: for n from max_n down, the first earlier window equal to the last n
    tokens proposes what followed it."""
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(3)
    for trial in range(300):
        toks = rng.integers(0, 1 + trial % 6, size=rng.integers(1, 40))
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert ngram.propose(toks, lo, hi, 3) == ngram_reference(toks, lo, hi, 3), (toks, lo, hi)


def test_ngram_proposer_keeps_each_requests_ids_up_to_date():
    from jaxserve.core.request import Request

    prop = ngram.NgramProposer(SpeculativeConfig("ngram", 2, 1, 2))
    req = Request("a", [1, 2, 3], SamplingParams())
    req.output_token_ids += [1, 2]
    assert prop.propose([req], [2]) == [[3, 1]]
    req.output_token_ids += [3] + [4] * 40          # the buffer grows
    assert prop.propose([req], [2]) == [[4, 4]]
    assert prop._tokens(req).tolist() == req.all_token_ids
    prop.retain(set())
    assert not prop._ids


def test_ngram_proposes_what_followed_the_longest_suffix():
    toks = np.array([5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7])
    assert ngram.propose(toks, 1, 3, 2) == [8, 1]        # "5 6 7" first came before "8 1"
    assert ngram.propose(toks, 1, 3, 9) == [8, 1, 6, 7, 9, 5, 6, 7]
    assert ngram.propose(np.array([1, 2, 3]), 1, 3, 2) == []
    assert ngram.propose(np.array([4, 4]), 1, 3, 3) == [4]


def test_greedy_with_drafts_equals_without_batched_and_alone(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = token_ids(plain.generate(prompts(6), greedy, use_tqdm=False))
    assert token_ids(spec.generate(prompts(6), greedy, use_tqdm=False)) == want
    before = spec_counts(spec)
    alone = [token_ids(spec.generate(p, greedy, use_tqdm=False))[0] for p in prompts(6)[:3]]
    assert alone == want[:3]
    counts = spec_counts(spec)
    assert counts["spec_decode_num_drafts_total"] > before["spec_decode_num_drafts_total"]
    assert counts["spec_decode_num_accepted_tokens_total"] > 0
    assert counts['spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert (counts["spec_decode_num_accepted_tokens_total"]
            <= counts["spec_decode_num_draft_tokens_total"])
    assert spec.engine.scheduler.pool.num_used == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_is_never_exceeded(plain, spec, max_tokens):
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = spec.generate(prompts(3), p, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [max_tokens] * 3
    assert token_ids(outs) == token_ids(plain.generate(prompts(3), p, use_tqdm=False))


def test_max_model_len_is_never_exceeded(spec):
    outs = spec.generate(prompts(4), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    for p, o in zip(prompts(4), outs):
        assert len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) == MAX_LEN
        assert o.outputs[0].finish_reason == "length"
    assert spec.engine.scheduler.pool.num_used == 0


def test_penalties_min_tokens_and_logprobs_see_the_drafts(plain, spec):
    """A draft row samples after the drafts before it: its penalties' history and min_tokens
    count must include them, so greedy outputs and logprobs stay those without drafts."""
    params = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=8, logprobs=3),
              SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)]
    ps = prompts(3)
    want = plain.generate(ps, params, use_tqdm=False)
    got = spec.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got[1:], want[1:]):
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs)
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert list(lg) == list(lw)
            assert np.allclose([x.logprob for x in lg.values()], [x.logprob for x in lw.values()],
                               atol=1e-4)


def test_n_samples_and_random_sampling_with_drafts(plain, spec):
    greedy_n = SamplingParams(temperature=0, max_tokens=8, n=2, ignore_eos=True)
    assert token_ids(spec.generate(prompts(2), greedy_n, use_tqdm=False)) == \
        token_ids(plain.generate(prompts(2), greedy_n, use_tqdm=False))
    rand = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, n=3, seed=7, ignore_eos=True)
    outs = spec.generate(prompts(2), rand, use_tqdm=False)
    assert all(len(c.token_ids) == 9 for o in outs for c in o.outputs)
    assert spec.engine.scheduler.pool.num_used == 0


def test_bad_speculative_configs_name_the_key():
    with pytest.raises(ValueError, match=r"'method'.*ngram, draft_model"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'.*1 to 8.*9"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 9})
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'.*1 to 8.*0"):
        SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match=r"unknown key 'lookahead'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1})
    with pytest.raises(ValueError, match=r"'prompt_lookup_max'.*>= prompt_lookup_min"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match=r"'model'"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


def test_the_interface_takes_vllms_speculative_config(capsys):
    import argparse

    from jaxserve.engine import builder
    from jaxserve.engine.args import add_engine_arguments, engine_kwargs
    from jaxserve.spec_decode.ngram import NgramProposer

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args([os.path.join(GOLDEN_DIR, "ckpt", "llama"), "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
    kwargs = engine_kwargs(args)
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle9", "num_speculative_tokens": 2}'])
    assert "speculative_config['method'] must be one of ngram, draft_model" in capsys.readouterr().err
    engine = builder.from_engine_args(**dict(kwargs, warmup=False, max_model_len=64))
    assert isinstance(engine.core.proposer, NgramProposer)
    assert engine.config.speculative.prompt_lookup_max == 3
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'.*1 to 8"):
        builder.from_engine_args(kwargs["model"], speculative_config={"method": "ngram",
                                                                     "num_speculative_tokens": 12})


def test_preemption_and_prefix_hits_with_drafts(model, plain):
    """Drafts' blocks are taken back by preemption and rolled back positions never enter the
    prefix cache: outputs stay those without drafts, and every block comes back."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ps = prompts(6)
    small = make_llm(model, NGRAM, max_len=MAX_LEN, num_kv_blocks=14)
    outs = small.generate(ps, greedy, use_tqdm=False)
    assert token_ids(outs) == token_ids(plain.generate(ps, greedy, use_tqdm=False))
    # The same prompt again: its blocks (written with drafts) are found in the prefix cache.
    again = {"prompt_token_ids": ps[5]["prompt_token_ids"] + outs[5].outputs[0].token_ids[:8]}
    assert token_ids(small.generate(again, greedy, use_tqdm=False)) == \
        token_ids(plain.generate(again, greedy, use_tqdm=False))
    m = small.get_metrics()
    assert m["num_preemptions_total"] > 0 and m["prefix_cache_hits_total"] > 0
    assert m["spec_decode_num_accepted_tokens_total"] > 0
    assert small.engine.scheduler.pool.num_used == 0


def test_warmup_compiles_the_verifying_steps_of_decode(model):
    import jax

    llm = make_llm(model, NGRAM, max_len=MAX_LEN, max_num_seqs=4, max_tokens=16)
    assert not llm.engine.runner._executables               # (warm-up off in make_llm)
    llm.engine.runner.warmup()
    llm.engine.runner.wait_for_warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert spec_counts(llm)["spec_decode_num_drafts_total"] > 0
    assert compiles == []


def test_metrics_count_accepted_drafts_per_position_on_the_server_too():
    from prometheus_client import generate_latest

    from jaxserve.metrics import EngineMetrics
    from jaxserve.spec_decode import metrics as spec_metrics
    from jaxserve.core.step_messages import RunnerOutput, ScheduledRequest, SchedulerOutput

    m = EngineMetrics()
    before = m.as_dict()
    sched = [ScheduledRequest("a", 5, 4, [[]], True, [7, 8, 9]), ScheduledRequest("b", 3, 3, [[]], True, [1, 2]),
             ScheduledRequest("c", 0, 5, [[]], True)]
    out = SchedulerOutput([], sched, [], 12, [], 0)
    spec_metrics.record(m, out, RunnerOutput(["a", "b", "c"], [[7, 8, 4], [5], [3]], [None] * 3))
    d = m.as_dict()
    assert (d["spec_decode_num_drafts_total"], d["spec_decode_num_draft_tokens_total"],
            d["spec_decode_num_accepted_tokens_total"]) == (2, 5, 2)
    assert d['spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 1
    assert d['spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 1
    assert spec_metrics.mean_acceptance_length(before, d) == 2.0
    text = generate_latest(m.registry).decode()
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
    assert "jaxserve:spec_decode_num_drafts_total 2.0" in text


class ReplayProposer(Proposer):
    """Drafts from each prompt's recorded greedy continuation, wrong at every position p with
    p % 5 == 3 (past the tokens assumed kept ahead of the device: `tails`)."""
    pipelines = True

    def __init__(self, recorded, k, vocab, wrong=True):
        self.recorded, self.k, self.vocab, self.wrong = recorded, k, vocab, wrong

    def retain(self, running_ids):
        pass

    def propose(self, requests, limits, tails=None):
        out = []
        for i, (req, lim) in enumerate(zip(requests, limits)):
            m = len(req.output_token_ids) + (len(tails[i]) if tails else 0)
            cont = self.recorded[tuple(req.prompt_token_ids)]
            out.append([(t + 1) % self.vocab if self.wrong and (m + j) % 5 == 3 else t
                        for j, t in enumerate(cont[m:m + lim])])
        return out


@pytest.mark.parametrize("wrong", [False, True])
def test_the_engine_schedules_past_drafts_and_voids_what_a_rejection_overturns(model, plain, wrong):
    """A proposer of token ids only drafts ahead of the device, so the engine pipelines while
    it speculates: greedy output is unchanged whether its drafts are all right or some are
    wrong (each rejection voids the request's next chunk), and nothing leaks."""
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ps = prompts(4)
    want = token_ids(plain.generate(ps, greedy, use_tqdm=False))
    llm = make_llm(model, NGRAM, max_len=MAX_LEN)
    core, sched = llm.engine.core, llm.engine.scheduler
    core.proposer = ReplayProposer({tuple(p["prompt_token_ids"]): w[0] for p, w in zip(ps, want)},
                                   3, model[0].vocab_size, wrong)
    assert token_ids(llm.generate(ps, greedy, use_tqdm=False)) == want
    assert sched.num_chunks_past_drafts > 0
    assert (sched.num_void_chunks > 0) == wrong
    counts = spec_counts(llm)
    if not wrong:       # every draft kept: 14 tokens in few steps
        assert counts["spec_decode_num_accepted_tokens_total"] == counts["spec_decode_num_draft_tokens_total"]
    assert [token_ids(llm.generate(p, greedy, use_tqdm=False))[0] for p in ps[:2]] == want[:2]
    assert sched.pool.num_used == 0 and not sched.requests


def two_sample_chi2_pvalue(a, b) -> float:
    """p-value of a chi-square test that samples a and b (same size) come from one
    distribution over categories (values seen fewer than 10 times in all pooled)."""
    from scipy.stats import chi2_contingency
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys])
    cb = np.array([b.count(k) for k in keys])
    rare = ca + cb < 10
    table = np.stack([np.append(ca[~rare], ca[rare].sum()), np.append(cb[~rare], cb[rare].sum())])
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 3, table        # else the test could not tell them apart
    return float(chi2_contingency(table)[1])


def test_random_sampling_through_pipelined_speculation_keeps_the_target_distribution(model, plain):
    """Drafts of the greedy continuation under random sampling: many are rejected, so chunks
    scheduled past them are voided and rebuilt; each position's kept token must still be
    distributed as without speculation (two-sample tests over 600 seeded samples each, of the
    prefixes to the second, third and fourth tokens, which verification decides)."""
    ps = prompts(1)
    greedy = token_ids(plain.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False))[0][0]
    # (at 0.1 the tiny model's greedy token holds ~85 % of each position: drafts kept often,
    # rejected often enough, and each prefix's distribution has several frequent values)
    params = SamplingParams(temperature=0.1, max_tokens=6, ignore_eos=True, n=600, seed=11)
    llm = make_llm(model, NGRAM, max_len=MAX_LEN, max_num_seqs=64, max_tokens=256)
    llm.engine.core.proposer = ReplayProposer({tuple(ps[0]["prompt_token_ids"]): greedy + [5] * 8},
                                              3, model[0].vocab_size, wrong=False)
    want = token_ids(plain.generate(ps, params, use_tqdm=False))[0]
    got = token_ids(llm.generate(ps, params, use_tqdm=False))[0]
    assert llm.engine.scheduler.num_void_chunks > 0 and llm.engine.scheduler.num_chunks_past_drafts > 0
    c = spec_counts(llm)
    assert 0 < c["spec_decode_num_accepted_tokens_total"] < c["spec_decode_num_draft_tokens_total"]
    for pos in (1, 2, 3):
        p = two_sample_chi2_pvalue([tuple(s[:pos + 1]) for s in want], [tuple(s[:pos + 1]) for s in got])
        assert p > 1e-3, (pos, p)
    # the test can tell: always keeping the draft (greedy) at position 1 is far from it
    forced = [s[:1] + [greedy[1]] for s in got]
    assert two_sample_chi2_pvalue([tuple(s[:2]) for s in want], [tuple(s) for s in forced]) < 1e-6
    assert llm.engine.scheduler.pool.num_used == 0


@pytest.mark.parametrize("abort_at", [1, 2, 3, 5])
def test_aborts_while_steps_past_drafts_are_in_flight_leak_nothing(model, plain, abort_at):
    """Requests aborted at any step of a pipelined, speculating engine (steps past drafts in
    flight, some void) free every block; the others' greedy output is unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ps = prompts(4)
    want = token_ids(plain.generate(ps, greedy, use_tqdm=False))
    llm = make_llm(model, NGRAM, max_len=MAX_LEN)
    eng = llm.engine
    eng.core.proposer = ReplayProposer({tuple(p["prompt_token_ids"]): w[0] for p, w in zip(ps, want)},
                                       3, model[0].vocab_size, wrong=True)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p["prompt_token_ids"], greedy)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == abort_at:
            assert eng.abort_request("0") and eng.abort_request("2")
    assert done == {"1": want[1][0], "3": want[3][0]}
    assert eng.scheduler.pool.num_used == 0 and not eng.scheduler.requests
    assert eng.scheduler.num_chunks_past_drafts > 0
