"""Scheduler: token budget, chunked prefill, prefix hits, preemption, stop checks."""

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler


def make(max_tokens=64, max_seqs=4, blocks=32, block_size=4, max_len=64, caching=True, long_prefill=0):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                     max_model_len=max_len, long_prefill_token_threshold=long_prefill),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), blocks)


def req(rid, n, max_tokens=4, **kw):
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=(2,))


def run_step(s, token=7):
    out = s.schedule()
    s.update(out, [token if c.sample else None for c in out.chunks])
    return out


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s = make(max_tokens=8)
    s.add_request(req("a", 20))
    outs = [run_step(s) for _ in range(3)]
    assert [len(o.chunks[0].token_ids) for o in outs] == [8, 8, 4]
    assert [o.chunks[0].sample for o in outs] == [False, False, True]
    assert s.requests["a"].output_token_ids == [7]


def test_long_prefill_token_threshold_cuts_prefill_chunks_not_decodes():
    s = make(max_tokens=32, long_prefill=6)
    s.add_request(req("a", 3))
    run_step(s)                                   # a: short prompt, now decoding
    s.add_request(req("b", 14))
    s.add_request(req("c", 5))
    outs = [run_step(s) for _ in range(3)]
    sizes = [{c.request.request_id: len(c.token_ids) for c in o.chunks} for o in outs]
    # b is cut to 6 tokens a step although the budget (32) would take it whole; c fits.
    assert sizes == [{"a": 1, "b": 6, "c": 5}, {"a": 1, "b": 6, "c": 1}, {"a": 1, "b": 2, "c": 1}]
    assert [c.sample for c in outs[2].chunks] == [True, True, True]


def test_running_requests_come_before_waiting_ones():
    s = make(max_tokens=10)
    s.add_request(req("a", 8))
    run_step(s)                       # a prefilled, now decoding
    s.add_request(req("b", 30))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert [len(c.token_ids) for c in out.chunks] == [1, 9]


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    for r in "abc":
        s.add_request(req(r, 3))
    out = s.schedule()
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_prefix_hit_starts_further_on():
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)                       # computes 10 tokens, caches 2 full blocks, finishes
    assert "a" not in s.requests
    s.add_request(req("b", 10, max_tokens=1))
    out = s.schedule()
    assert out.chunks[0].start_position == 8 and len(out.chunks[0].token_ids) == 2
    assert s.prefix_hits == 8 and s.prefix_queries == 20


def test_fully_cached_prompt_still_computes_one_token():
    s = make()
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    out = s.schedule()
    assert out.chunks[0].start_position == 4 and out.chunks[0].sample


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
    from jaxserve.scheduler import PENDING_TOKEN
    s = make()
    s.add_request(req("a", 5, max_tokens=3))
    first = s.schedule()                       # prefill, samples token 1 (pending)
    second = s.schedule()                      # decode of the pending token
    assert second.chunks[0].token_ids == [PENDING_TOKEN] and second.chunks[0].start_position == 5
    assert s.requests["a"].num_pending_tokens == 2
    s.update(first, [11])
    third = s.schedule()                       # token 11 known, token 2 pending
    assert third.chunks[0].token_ids == [PENDING_TOKEN] and third.chunks[0].start_position == 6
    s.update(second, [12])
    # max_tokens=3: the token now pending ends the request, so nothing more is computed.
    assert s.schedule().chunks == []
    s.update(third, [13])
    assert not s.requests and s.pool.num_used == 0


def test_tokens_after_a_finish_are_dropped():
    s = make()
    r = req("a", 5, max_tokens=10)
    s.add_request(r)
    first = s.schedule()
    second = s.schedule()
    s.update(first, [2])                       # EOS: finished while `second` is in flight
    assert r.status == RequestStatus.FINISHED_STOPPED and s.pool.num_used == 0
    s.update(second, [42])
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
    assert [c.request.request_id for c in out.chunks] == ["a"] and not out.preempted_ids
    s.update(out, [7])
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
    assert out.num_tokens == 256 and len(out.chunks[-1].token_ids) == 236
    assert not out.chunks[-1].sample
    out = run_step(s)
    assert out.num_tokens == 29 and out.chunks[-1].sample          # 20 decodes + the last 9
    # A chunk that would spill far past a step size is left whole (padding costs less).
    s.add_request(Request("mid", list(range(1000, 1200)), SamplingParams(max_tokens=4), eos_token_ids=(2,)))
    out = run_step(s)
    assert len(out.chunks[-1].token_ids) == 200 and out.num_tokens == 221
    # Below FIT_MIN_STEP nothing is cut: 21 decodes + 100 = 121 tokens, padded to 128.
    s.add_request(Request("short", list(range(2000, 2100)), SamplingParams(max_tokens=4), eos_token_ids=(2,)))
    assert len(run_step(s).chunks[-1].token_ids) == 100


def test_fit_cuts_the_last_chunk_that_can_take_the_cut():
    sizes = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
    s = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=2048),
                  CacheConfig(block_size=16), 512, step_sizes=sizes)
    s.add_request(req("long", 600, max_tokens=4))
    out = run_step(s)
    assert out.num_tokens == 512 and not out.chunks[0].sample      # 600 would pad to 1024
    for i in range(30):
        s.add_request(Request(f"d{i}", [3000 + i, 5], SamplingParams(max_tokens=50), eos_token_ids=(2,)))
    out = run_step(s)
    # long's last 88 tokens come first, then 30 two-token prompts: 148 tokens would pad to
    # 256; the two-token chunks cannot give up 20 tokens, so long's chunk does: 68 + 60 = 128.
    assert out.num_tokens == 128 and len(out.chunks[0].token_ids) == 68
    assert s.requests["long"].num_computed_tokens == 580 and not out.chunks[0].sample
    out = run_step(s)
    assert len(out.chunks[0].token_ids) == 20 and out.chunks[0].sample
