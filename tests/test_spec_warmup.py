"""After warm-up a speculating engine compiles nothing: the target's verifying programs (every
draft-row count its scheduler can produce) and the proposer's own programs (a draft model's
steps, an EAGLE3 head's pass and chained drafts per bucket) are compiled by warm-up, the ones
past the plain programs in the background."""

import contextlib
import os

import jax
import jax.numpy as jnp
import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from jaxserve.worker.step_program import token_buckets
from jaxserve.worker import verify_rows
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, write_eagle3_head
from tests.test_spec_decode import prompts

TINY = os.path.join(GOLDEN_DIR, "ckpt", "llama")


@pytest.fixture(scope="module")
def model():
    return loader.load_model(TINY, dtype="float32")


@contextlib.contextmanager
def compiles():
    """The XLA compiles that happen inside the block (a list, filled as they happen)."""
    seen = []

    def listener(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def speculating_engine(method, model, tmp_path, k=3):
    """An engine of `method` whose drafts are accepted at some steps, not all (warm-up on)."""
    cfg, params, tok = model
    # n-gram and EAGLE3 on a target that always picks token 0 (its final norm is 0): after two
    # 0s the n-gram drafts 0s, the head (its logits 0 too) always drafts 0; greedy requests
    # accept every draft, random ones (uniform over the vocabulary) nearly none
    always_0 = (cfg, {**params, "final_norm": jnp.zeros_like(params["final_norm"])}, tok)
    if method == "ngram":
        model, spec = always_0, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3}
    elif method == "draft_model":     # the target as its own draft: random sampling rejects some
        spec = {"method": "draft_model", "model": TINY, "num_speculative_tokens": k}
    else:
        head = write_eagle3_head(tmp_path / "head", cfg, draft_vocab=cfg.vocab_size,
                                 aux_layers=(0, 1, 1), zero_norm=True)
        model, spec = always_0, {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    return make_llm(model, spec, max_num_seqs=8, max_tokens=32, max_len=64, warmup=True)


def mixed_workload(llm):
    """Prefills beside decodes, greedy and random requests (accepting some drafts, not all),
    logprobs and top-p (the full programs), 8 then 1 then 2 requests (steps of 1 to 32
    tokens)."""
    ps = prompts(7) + [{"prompt_token_ids": list(range(3, 33))}]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    random = SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)
    full = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=7, logprobs=2, ignore_eos=True)
    llm.generate(ps, [greedy, random, full, greedy, greedy, random, greedy, greedy], use_tqdm=False)
    llm.generate(ps[3], greedy, use_tqdm=False)
    llm.generate(ps[:2], [random, full], use_tqdm=False)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_after_warmup_a_speculating_engine_compiles_nothing(method, model, tmp_path):
    llm = speculating_engine(method, model, tmp_path)
    llm.engine.wait_for_warmup()
    steps = []          # (step tokens, drafts, accepted drafts of each drafting request) per step

    def record(outcome):
        drafts = [len(s.spec_token_ids) for s in outcome.scheduled.scheduled]
        kept = [len(t) for t in outcome.result.sampled_token_ids]
        steps.append((outcome.scheduled.num_tokens, sum(drafts),
                      [n - 1 for d, n in zip(drafts, kept) if d]))

    llm.engine.step_listeners.append(record)
    with compiles() as seen:
        mixed_workload(llm)
    assert seen == []
    # what the workload covered: verifying steps of both buckets, lone decodes, accepted
    # counts of a request's drafts from none to all
    assert {llm.engine.runner.bucket(n)[0] for n, d, _ in steps if d} == {16, 32}
    assert any(n == 1 for n, _, _ in steps)
    accepted = {a for _, _, counts in steps for a in counts}
    assert 0 in accepted and 3 in accepted, accepted
    assert llm.engine.scheduler.pool.num_used == 0


def reachable_draft_rows(t_prev: int, t: int, k: int, max_num_seqs: int) -> set[int]:
    """Padded draft-row counts of every verifying step a scheduler can give bucket (t_prev, t]:
    by brute force over the drafts of each of the step's S sequences (0: a sequence without
    drafts, or none: a prefill chunk of any length, or padding)."""
    import itertools

    s = min(t, max_num_seqs)
    found = set()
    for drafts in itertools.product(range(k + 1), repeat=s):
        m, n = sum(1 for d in drafts if d), sum(drafts)
        least = n + m                      # each drafting sequence computes its token and drafts
        most = t if m < s else least       # another sequence's prefill fills the step
        if n and least <= t and most > t_prev:
            found.add(verify_rows.padded(n))
    return found


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("max_num_seqs", [1, 2, 5])
def test_warmup_draft_rows_are_every_count_a_step_can_have(k, max_num_seqs):
    buckets = token_buckets(40)
    for t_prev, t in zip([0] + buckets, buckets):
        want = reachable_draft_rows(t_prev, t, k, max_num_seqs)
        assert set(verify_rows.warmup_draft_rows(t_prev, t, k, max_num_seqs)) == want, (t, want)


def test_a_pass_waits_for_its_program_still_compiling(model, tmp_path, monkeypatch):
    """The EAGLE3 head's programs compile after warm-up returns; a pass that needs one waits
    for it instead of compiling its own (the jitted step never compiles), and outputs are
    those of an engine whose programs were all ready."""
    import time

    from jaxserve.spec_decode import hidden_steps

    calls, original = [], hidden_steps._compile

    def slow(step, args):
        calls.append(args[5].shape)        # the target's hidden states (_run_pass)
        time.sleep(0.5)
        return original(step, args)

    monkeypatch.setattr(hidden_steps, "_compile", slow)
    llm = speculating_engine("eagle3", model, tmp_path)
    proposer = llm.engine.core.proposer
    assert not all(f.done() for f in proposer._pending.values())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts(3), greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [[0] * 8] * 3
    llm.engine.wait_for_warmup()
    assert sorted(calls) == sorted((t, 3 * model[0].hidden_size) for t in llm.engine.runner.buckets)
    assert proposer._step._cache_size() == 0
