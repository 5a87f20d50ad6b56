"""When the engine pipelines behind speculative steps (spec_decode/pacing.py) and how soon a step
it waited for launches the next (engine/core.py): the rule's unit behaviour, and on the tiny
random-weight Llama (f32) greedy output with drafts equal to greedy without, whichever way
the core goes."""

import pytest

from jaxserve import SamplingParams
from jaxserve.core.request import Request
from jaxserve.core.step_messages import RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxserve.spec_decode.pacing import DraftPacing
from tests.spec_helpers import make_llm, token_ids
from tests.test_spec_decode import MAX_LEN, NGRAM, ReplayProposer, model, plain, prompts  # noqa: F401


def _step(drafts: dict[str, int], kept: dict[str, int]):
    """A step's messages: request -> drafts verified, request -> tokens kept (0: void)."""
    scheduled = [ScheduledRequest(rid, 0, k + 1, {}, True, [5] * k) for rid, k in drafts.items()]
    out = SchedulerOutput([], scheduled, [], sum(s.num_tokens for s in scheduled), [], 0)
    return out, RunnerOutput(list(drafts), [[7] * kept[rid] for rid in drafts], [None] * len(drafts))


def _running(*ids: str, drafting: str = "abcd") -> list[Request]:
    """Running requests; those in `drafting` have drafts in the step in flight."""
    return [Request(rid, [1, 2], SamplingParams(), inflight_drafts=[5, 5, 5] if rid in drafting else [])
            for rid in ids]


def test_low_acceptance_turns_pipelining_off_and_high_acceptance_back_on():
    pacing, a = DraftPacing(max_void_rate=0.25, weight=0.25), _running("a")
    assert pacing.pipelines(a)                     # nothing seen: pipelined
    for _ in range(3):                             # all drafts kept: stays on
        pacing.observe(*_step({"a": 3}, {"a": 4}))
    assert pacing.void_rate(a) == 0.0 and pacing.pipelines(a)
    pacing.observe(*_step({"a": 3}, {"a": 2}))     # one rejection: 1 - 0.75
    assert pacing.void_rate(a) == pytest.approx(0.25) and pacing.pipelines(a)
    pacing.observe(*_step({"a": 3}, {"a": 1}))
    assert pacing.void_rate(a) == pytest.approx(1 - 0.75 ** 2) and not pacing.pipelines(a)
    assert pacing.pipelines(_running("a", drafting=""))     # no drafts in flight: nothing to void
    for _ in range(4):                             # acceptance back: on again
        pacing.observe(*_step({"a": 3}, {"a": 4}))
    assert pacing.pipelines(a)


def test_void_chunks_undrafted_and_new_requests():
    pacing = DraftPacing(max_void_rate=0.25, weight=0.5)
    pacing.observe(*_step({"a": 3, "b": 2}, {"a": 1, "b": 0}))   # b's chunk was void: no news
    assert pacing.kept_all == {"a": 0.5} and pacing.prior == 0.5
    pacing.observe(*_step({"a": 3, "c": 0}, {"a": 2, "c": 1}))   # c drafts nothing
    assert pacing.void_rate(_running("a")) == pytest.approx(0.75) and not pacing.pipelines(_running("a"))
    # one request of four likely void (the others without drafts in flight): the three would pay the wait
    four = _running("a", "b", "c", "d", drafting="a")
    assert pacing.void_rate(four) == pytest.approx(0.75 / 4) and pacing.pipelines(four)
    # a new request starts from every request's running rate, not from 1
    assert pacing.void_rate(_running("e", drafting="e")) == pytest.approx(1 - pacing.prior) and pacing.prior == 0.25
    pacing.retain(["b"])
    assert pacing.kept_all == {}
    assert DraftPacing().void_rate([]) == 0.0


@pytest.mark.parametrize("kwargs,text", [({"max_void_rate": 1.5}, "max_void_rate"),
                                         ({"weight": 0.0}, "weight")])
def test_bad_settings_name_the_field(kwargs, text):
    with pytest.raises(ValueError, match=text):
        DraftPacing(**kwargs)


class MostlyWrong(ReplayProposer):
    """The recorded continuation with every draft after the first wrong."""

    def propose(self, requests, limits, tails=None):
        return [[t if j == 0 else (t + 1) % self.vocab for j, t in enumerate(drafts)]
                for drafts in super().propose(requests, limits, tails)]


def _replay_run(model, ps, want, proposer, pacing: bool):
    llm = make_llm(model, NGRAM, max_len=MAX_LEN)
    core = llm.engine.core
    core.proposer = proposer({tuple(p["prompt_token_ids"]): w[0] for p, w in zip(ps, want)},
                             3, model[0].vocab_size, False)
    core.pacing = DraftPacing() if pacing else None      # off by default (engine/core.py)
    got = token_ids(llm.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                 use_tqdm=False))
    sched = llm.engine.scheduler
    assert sched.pool.num_used == 0 and not sched.requests
    return got, sched.num_void_chunks, sched.num_chunks_past_drafts


def test_the_core_waits_while_drafts_are_mostly_rejected_and_greedy_is_unchanged(model, plain):
    ps = prompts(1)
    want = token_ids(plain.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                    use_tqdm=False))
    got, void, _ = _replay_run(model, ps, want, MostlyWrong, pacing=True)
    always, void_always, _ = _replay_run(model, ps, want, MostlyWrong, pacing=False)
    assert got == want and always == want
    assert void_always >= 8 and void <= 2      # paced: a void or two before it waits
    # all drafts right: the paced core pipelines throughout, as before
    right, void_right, past = _replay_run(model, ps, want, ReplayProposer, pacing=True)
    assert right == want and void_right == 0 and past > 0


def test_a_waited_step_launches_the_next_before_its_outputs_are_processed(model, plain):
    """Penalties make the core wait for each step; the next step is in flight when step()
    returns (launched before the caller detokenizes), and outputs are those of the old order."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    ps = prompts(2)
    llm = make_llm(model, max_len=MAX_LEN)
    core, in_flight = llm.engine.core, []
    core.launch_after_wait = True        # off by default (engine/core.py)
    real = core.step

    def step():
        outcome = real()
        in_flight.append(core._inflight is not None)
        return outcome

    core.step = step
    got = token_ids(llm.generate(ps, params, use_tqdm=False))
    assert sum(in_flight) >= 8          # a step in flight after each but the last ones
    in_flight.clear()
    core.launch_after_wait = False      # as before: launched on the next call
    assert token_ids(llm.generate(ps, params, use_tqdm=False)) == got
    assert not any(in_flight)
    assert got == token_ids(plain.generate(ps, params, use_tqdm=False))
