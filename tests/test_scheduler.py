"""Scheduler: token budget, chunked prefill, prefix hits, preemption, stop checks."""

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_messages import RunnerOutput


def make(max_tokens=64, max_seqs=4, blocks=32, block_size=4, max_len=64, caching=True, long_prefill=0):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                     max_model_len=max_len, long_prefill_token_threshold=long_prefill),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), blocks)


def req(rid, n, max_tokens=4, **kw):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=(2,))


def result(out, tokens):
    """A RunnerOutput giving each sampling request of `out` its tokens: `tokens` is one token
    for all, or a list with one entry (an int or a list of ints) per scheduled request."""
    per = tokens if isinstance(tokens, list) else [tokens] * len(out.scheduled)
    sampled = [([t] if isinstance(t, int) else list(t)) if r.sample else []
               for r, t in zip(out.scheduled, per)]
    return RunnerOutput(out.req_ids, sampled, [None] * len(sampled))


def run_step(s, token=7):
    out = s.schedule()
    s.update(out, result(out, token))
    return out


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s = make(max_tokens=8)
    s.add_request(req("a", 20))
    outs = [run_step(s) for _ in range(3)]
    assert [o.scheduled[0].num_tokens for o in outs] == [8, 8, 4]
    assert [o.scheduled[0].sample for o in outs] == [False, False, True]
    assert s.requests["a"].output_token_ids == [7]


def test_long_prefill_token_threshold_cuts_prefill_chunks_not_decodes():
    s = make(max_tokens=32, long_prefill=6)
    s.add_request(req("a", 3))
    run_step(s)                                   # a: short prompt, now decoding
    s.add_request(req("b", 14))
    s.add_request(req("c", 5))
    outs = [run_step(s) for _ in range(3)]
    sizes = [{c.req_id: c.num_tokens for c in o.scheduled} for o in outs]
    # b is cut to 6 tokens a step although the budget (32) would take it whole; c fits.
    assert sizes == [{"a": 1, "b": 6, "c": 5}, {"a": 1, "b": 6, "c": 1}, {"a": 1, "b": 2, "c": 1}]
    assert [c.sample for c in outs[2].scheduled] == [True, True, True]


def test_running_requests_come_before_waiting_ones():
    s = make(max_tokens=10)
    s.add_request(req("a", 8))
    run_step(s)                       # a prefilled, now decoding
    s.add_request(req("b", 30))
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    assert [c.num_tokens for c in out.scheduled] == [1, 9]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for r in "abc":
        s.add_request(req(r, 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_prefix_hit_starts_further_on():
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)                       # computes 10 tokens, caches 2 full blocks, finishes
    assert "a" not in s.requests
    s.add_request(req("b", 10, max_tokens=1))
    out = s.schedule()
    assert out.scheduled[0].start_position == 8 and out.scheduled[0].num_tokens == 2
    assert s.prefix_hits == 8 and s.prefix_queries == 20


def test_fully_cached_prompt_still_computes_one_token():
    s = make()
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    out = s.schedule()
    assert out.scheduled[0].start_position == 4 and out.scheduled[0].sample


def test_preemption_frees_newest_and_recomputes():
    s = make(max_tokens=64, blocks=7, block_size=4)    # 6 usable blocks
    # Each fits alone (11 + 12 tokens = 6 blocks), not both together.
    s.add_request(req("old", 11, max_tokens=12))
    s.add_request(req("new", 11, max_tokens=12))
    run_step(s)                                          # 3 blocks each: pool full
    for _ in range(3):
        run_step(s)
    assert s.num_preemptions >= 1
    assert s.requests["new"].status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    assert s.requests["old"].status == RequestStatus.RUNNING
    for _ in range(100):
        if not s.requests:
            break
        run_step(s)
    assert not s.requests and s.pool.num_used == 0


def test_stop_conditions():
    s = make()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("ign", 3, max_tokens=2, ignore_eos=True))
    run_step(s, token=2)
    assert s.requests.keys() == {"ign"}
    s.add_request(req("len", 3, max_tokens=2))
    run_step(s, token=5)
    assert s.requests.keys() == {"len"}            # ign reached max_tokens
    run_step(s, token=5)
    assert not s.requests and s.pool.num_used == 0


def test_min_tokens_defers_eos_and_stop_token_ids():
    s = make()
    r = req("m", 3, max_tokens=10, min_tokens=2, stop_token_ids=[9])
    s.add_request(r)
    run_step(s, token=9)
    assert "m" in s.requests
    run_step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_abort_frees_blocks():
    s = make()
    s.add_request(req("a", 9))
    run_step(s)
    assert s.pool.num_used == 3
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.pool.num_used == 0 and not s.running


def test_next_step_is_scheduled_before_the_tokens_arrive():
    s = make()
    s.add_request(req("a", 5, max_tokens=3))
    first = s.schedule()                       # prefill, samples token 1 (a placeholder)
    second = s.schedule()                      # decode of the placeholder token
    assert second.scheduled[0].num_tokens == 1 and second.scheduled[0].start_position == 5
    assert not second.new_requests and first.new_requests[0].req_id == "a"
    assert s.requests["a"].num_output_placeholders == 2
    s.update(first, result(first, 11))
    third = s.schedule()                       # token 11 known, token 2 a placeholder
    assert third.scheduled[0].start_position == 6
    s.update(second, result(second, 12))
    # max_tokens=3: the token now pending ends the request, so nothing more is computed.
    assert s.schedule().scheduled == []
    s.update(third, result(third, 13))
    assert not s.requests and s.pool.num_used == 0


def test_tokens_after_a_finish_are_dropped():
    s = make()
    r = req("a", 5, max_tokens=10)
    s.add_request(r)
    first = s.schedule()
    second = s.schedule()
    s.update(first, result(first, 2))          # EOS: finished while `second` is in flight
    assert r.status == RequestStatus.FINISHED_STOPPED and s.pool.num_used == 0
    s.update(second, result(second, 42))
    assert r.output_token_ids == [2]


def test_admission_keeps_the_blocks_running_requests_need_next():
    s = make(blocks=4, block_size=4)             # 3 usable blocks
    s.add_request(req("a", 3, max_tokens=4))
    run_step(s)                                  # a: 3 prompt tokens in block 1
    b = req("b", 8, max_tokens=1)
    b.prompt_token_ids = list(range(300, 308))   # no prefix shared with a
    s.add_request(b)
    out = s.schedule()
    # This step fills a's block, so its next token needs a new one: b (2 blocks) would fit
    # in the 2 free blocks now, but a would preempt it at the very next step. b waits.
    assert out.req_ids == ["a"] and not out.preempted_ids
    s.update(out, result(out, 7))
    for _ in range(10):
        if not s.requests:
            break
        run_step(s)
    assert not s.requests and s.num_preemptions == 0 and s.pool.num_used == 0


def test_prefill_chunk_is_cut_to_end_at_a_step_size_it_would_barely_cross():
    """20 decodes + a 245-token prompt would run padded to 512; cut, the step is exactly 256
    and the last 9 prompt tokens join the next step."""
    s = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1024),
                  CacheConfig(block_size=16), 512, step_sizes=(1, 16, 32, 64, 128, 256, 512, 1024, 2048))
    for i in range(20):
        s.add_request(req(f"d{i}", 3, max_tokens=50))
    run_step(s)                                   # all 20 prefilled, now decoding
    s.add_request(req("long", 245))
    out = run_step(s)
    assert out.num_tokens == 256 and out.scheduled[-1].num_tokens == 236
    assert not out.scheduled[-1].sample
    out = run_step(s)
    assert out.num_tokens == 29 and out.scheduled[-1].sample          # 20 decodes + the last 9
    # A chunk that would spill far past a step size is left whole (padding costs less).
    s.add_request(Request("mid", list(range(1000, 1200)), SamplingParams(max_tokens=4), eos_token_ids=(2,)))
    out = run_step(s)
    assert out.scheduled[-1].num_tokens == 200 and out.num_tokens == 221
    # Below FIT_MIN_STEP nothing is cut: 21 decodes + 100 = 121 tokens, padded to 128.
    s.add_request(Request("short", list(range(2000, 2100)), SamplingParams(max_tokens=4), eos_token_ids=(2,)))
    assert run_step(s).scheduled[-1].num_tokens == 100


def test_fit_cuts_the_last_chunk_that_can_take_the_cut():
    sizes = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
    s = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=2048),
                  CacheConfig(block_size=16), 512, step_sizes=sizes)
    s.add_request(req("long", 600, max_tokens=4))
    out = run_step(s)
    assert out.num_tokens == 512 and not out.scheduled[0].sample      # 600 would pad to 1024
    for i in range(30):
        s.add_request(Request(f"d{i}", [3000 + i, 5], SamplingParams(max_tokens=50), eos_token_ids=(2,)))
    out = run_step(s)
    # long's last 88 tokens come first, then 30 two-token prompts: 148 tokens would pad to
    # 256; the two-token chunks cannot give up 20 tokens, so long's chunk does: 68 + 60 = 128.
    assert out.num_tokens == 128 and out.scheduled[0].num_tokens == 68
    assert s.requests["long"].num_computed_tokens == 580 and not out.scheduled[0].sample
    out = run_step(s)
    assert out.scheduled[0].num_tokens == 20 and out.scheduled[0].sample


def test_messages_are_plain_data_and_round_trip_through_pickle():
    import pickle

    from jaxserve.core.request import Request as LiveRequest

    s = make(max_tokens=8)
    s.add_request(req("a", 10))
    out = s.schedule()
    res = result(out, 7)
    for message in (out, res):
        back = pickle.loads(pickle.dumps(message))
        assert back == message

        def walk(x):
            assert not isinstance(x, LiveRequest), f"a live Request inside {type(message).__name__}"
            if isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)
            elif hasattr(x, "__dataclass_fields__"):
                for name in x.__dataclass_fields__:
                    walk(getattr(x, name))
        walk(message)


def test_running_requests_send_only_new_blocks():
    s = make(max_tokens=64, block_size=4)
    s.add_request(req("a", 7, max_tokens=10))
    first = run_step(s)                           # 7 tokens: blocks for 2 of 4 slots
    assert len(first.scheduled[0].new_block_ids[0]) == 2
    second = run_step(s)                          # token 8 fits in the second block
    assert second.scheduled[0].new_block_ids == [[]]
    third = run_step(s)                           # token 9 needs a third block
    assert len(third.scheduled[0].new_block_ids[0]) == 1
    assert s.kv.blocks["a"] == first.scheduled[0].new_block_ids[0] + third.scheduled[0].new_block_ids[0]


def test_draft_tokens_count_in_the_budget_and_rejections_roll_back():
    s = make(max_tokens=64, block_size=4)
    r = req("a", 6, max_tokens=20)
    s.add_request(r)
    run_step(s, token=7)                          # prefill: 6 computed, output [7]
    assert r.num_computed_tokens == 6
    r.spec_token_ids = [8, 9, 10]                 # a proposer's drafts
    out = s.schedule()
    sched = out.scheduled[0]
    # The known token 7 plus 3 drafts: 4 tokens at positions 6..9, all verified at once.
    assert (sched.start_position, sched.num_tokens, sched.spec_token_ids) == (6, 4, [8, 9, 10])
    assert sched.sample and r.num_computed_tokens == 10
    # 2 drafts right (8, 9), then the target's own token 11 instead of 10: 3 tokens kept.
    s.update(out, result(out, [[8, 9, 11]]))
    assert r.output_token_ids == [7, 8, 9, 11]
    assert r.num_computed_tokens == 10 - (3 + 1 - 3)   # position 9's KV (draft 10) is garbage
    # All drafts rejected: one token kept, num_computed back to before the drafts + 1.
    r.spec_token_ids = [1, 1]
    out = s.schedule()
    assert out.scheduled[0].num_tokens == 3 and r.num_computed_tokens == 12
    s.update(out, result(out, [[5]]))
    assert r.output_token_ids[-1] == 5 and r.num_computed_tokens == 10
    assert r.num_computed_tokens == r.num_tokens - 1    # the newest token is still to compute


def test_drafts_never_exceed_max_tokens_and_a_budget_cut_keeps_the_first_drafts():
    s = make(max_tokens=3, max_seqs=1, block_size=4)
    r = req("a", 2, max_tokens=3)
    s.add_request(r)
    run_step(s, token=7)
    r.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == [8, 9]     # budget 3: the known token + 2 drafts
    s.update(out, result(out, [[8, 9, 12]]))
    assert r.output_token_ids == [7, 8, 9] and "a" not in s.requests   # max_tokens=3 reached
    assert s.pool.num_used == 0


def test_finished_ids_wait_for_a_step_that_runs():
    # an empty schedule() is never dispatched: the runner must still hear of every finish
    s = make()
    s.add_request(req("a", 3, max_tokens=1))
    run_step(s)
    assert not s.requests
    assert s.schedule().scheduled == []                # nothing to run: nothing sent
    s.add_request(req("b", 3, max_tokens=1))
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and out.req_ids == ["b"]


def verify_then_ahead():
    """A request in decode (output [7]) whose step verifying drafts 8, 9, 10 (positions 6..9)
    is in flight, and the step scheduled past them with drafts 12, 13: (s, r, verify, ahead)."""
    s = make(max_tokens=64, block_size=4)
    r = req("a", 6, max_tokens=20)
    s.add_request(r)
    run_step(s, token=7)
    r.spec_token_ids = [8, 9, 10]
    verify = s.schedule()
    r.spec_token_ids = [12, 13]
    return s, r, verify, s.schedule()


def test_a_step_scheduled_past_drafts_starts_after_them_and_goes_on_when_all_are_kept():
    s, r, verify, ahead = verify_then_ahead()
    # Before `verify` is read, `ahead` assumes its 3 drafts kept: it computes the token
    # sampled after them (position 10, on the device) and its own 2 drafts.
    sched = ahead.scheduled[0]
    assert (sched.start_position, sched.num_tokens, sched.spec_token_ids, sched.sample) == (10, 3, [12, 13], True)
    assert r.num_computed_tokens == 13 and r.num_output_placeholders == 2
    s.update(verify, result(verify, [[8, 9, 10, 11]]))      # all kept
    assert r.output_token_ids == [7, 8, 9, 10, 11] and r.num_computed_tokens == 13
    assert r.inflight_drafts == [12, 13]                    # the step ahead's, still out
    third = s.schedule()                          # past the step ahead's drafts in turn
    assert (third.scheduled[0].start_position, third.scheduled[0].num_tokens) == (13, 1)
    s.update(ahead, result(ahead, [[12, 5]]))     # draft 12 kept, 13 not: `third` is void
    assert r.output_token_ids[-2:] == [12, 5] and r.num_computed_tokens == r.num_tokens - 1
    assert r.inflight_drafts == [] and r.num_output_placeholders == 0
    assert s.update(third, result(third, 9)) == [] and r.output_token_ids[-1] == 5


def test_a_rejected_draft_voids_the_chunk_scheduled_past_it():
    s, r, verify, ahead = verify_then_ahead()
    s.update(verify, result(verify, [[8, 3]]))    # draft 9 rejected: position 10 never came
    assert r.output_token_ids == [7, 8, 3]
    # The step ahead's chunk is void: the request goes on from what it kept, its counts as
    # if that step had not been scheduled.
    assert r.num_computed_tokens == r.num_tokens - 1 == 8
    assert r.num_output_placeholders == 0 and r.inflight_drafts == []
    r.spec_token_ids = [4]
    again = s.schedule()                          # token 3 known to the host now, plus a draft
    assert (again.scheduled[0].start_position, again.scheduled[0].num_tokens) == (8, 2)
    assert s.update(ahead, result(ahead, [[12, 13, 14]])) == []    # never read
    assert r.output_token_ids == [7, 8, 3]
    s.update(again, result(again, [[4, 6]]))
    assert r.output_token_ids == [7, 8, 3, 4, 6] and r.num_computed_tokens == r.num_tokens - 1
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.pool.num_used == 0


def test_a_step_past_drafts_never_reaches_past_max_tokens():
    s = make(max_tokens=64, block_size=4)
    r = req("a", 6, max_tokens=5)
    s.add_request(r)
    run_step(s, token=7)
    r.spec_token_ids = [8, 9, 10]                 # up to 4 tokens more: 5 in all
    verify = s.schedule()
    assert s.schedule().scheduled == []           # all kept would reach max_tokens: stop here
    s.update(verify, result(verify, [[8, 9, 10, 11]]))
    assert r.output_token_ids == [7, 8, 9, 10, 11] and "a" not in s.requests


def test_a_step_taken_back_after_a_void_leaves_the_void_drafts_out():
    """A rejection voids the chunk scheduled past it; the step scheduled next (from what the
    request kept) fails to dispatch and is taken back: the void chunk's drafts must not count
    as in flight again, or the request would run past what it holds."""
    s, r, verify, ahead = verify_then_ahead()
    s.update(verify, result(verify, [[8, 3]]))    # `ahead` is void now
    r.spec_token_ids = [4]
    failed = s.schedule()
    s.unschedule(failed)                          # its inputs could not be built
    assert r.inflight_drafts == [] and r.spec_token_ids == [4]
    assert r.num_computed_tokens == r.num_tokens - 1
    s.update(ahead, result(ahead, [[12, 13, 14]]))
    again = s.schedule()
    assert (again.scheduled[0].start_position, again.scheduled[0].num_tokens) == (8, 2)
    s.update(again, result(again, [[4, 6]]))
    assert r.output_token_ids == [7, 8, 3, 4, 6] and r.num_computed_tokens == r.num_tokens - 1
