"""Prefix caching for hybrid models (vLLM's "align" mode), without a model: the saved-state
pool, the cache manager's hits and saves, the scheduler's aligned chunks, state loads and
saves in the step messages, and the device copies that carry them out. Nothing leaks."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache.manager import KVCacheManager, auto_cached_states, bytes_per_slot
from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec
from jaxserve.core.kv_cache.state_cache import NO_SLOT, StateCache
from jaxserve.core.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.worker.state_copies import StateCopier, pair_buckets
from jaxserve.core.step_messages import RunnerOutput

KV = PagedSpec((("k", (2, 8)), ("v", (2, 8))))
STATE = StateSpec((("conv", (6, 3)), ("ssm", (2, 4, 4))), float32=("ssm",))
HYBRID = [STATE, STATE, STATE, KV]
P = 4                      # tokens per block
LIVE = 5                   # the null slot and 4 requests' slots
CACHED = 6                 # saved states


def tokens(n, base=100):
    return list(range(base, base + n))


# -- the saved-state pool ------------------------------------------------------------------
def test_state_cache_reserves_registers_and_evicts_least_recently_used():
    c = StateCache(range(10, 13))
    a, b, d = c.reserve(), c.reserve(), c.reserve()
    assert (a, b, d) == (10, 11, 12) and c.num_reserved == 3
    assert c.reserve() == NO_SLOT                 # every slot has a save on its way
    assert c.register(a, b"A") and c.register(b, b"B")
    assert not c.register(d, b"A")                # already saved: kept, d goes back
    assert c.num_reserved == 0 and c.free == [d]
    assert c.use(b"A") == a                       # A is now the most recent
    c.reserve()                                   # takes the free slot
    assert c.reserve() == b and not c.has(b"B")   # then evicts B, the least recently used
    c.release(b)
    c.drop(b"A")
    assert not c.has(b"A") and c.num_reserved == 1
    c.clear()


# -- the cache manager -----------------------------------------------------------------------
def manager(**kw):
    return KVCacheManager(HYBRID, block_size=P, num_blocks=32, num_slots=LIVE + CACHED,
                          num_cached_states=CACHED, **kw)


def prefill(m, rid, toks, saves_at):
    """Admit, compute and register `toks`, saving the state at each of `saves_at`."""
    m.admit(rid, [], len(toks))
    slots = [(end, m.plan_state_save(rid, end)) for end in saves_at]
    m.cache_full_blocks(rid, lambda a, b: toks[a:b], len(toks))
    for end, slot in slots:
        m.commit_state_save(rid, end, slot, in_output=False)


def test_a_hit_resumes_at_the_longest_prefix_with_a_saved_state():
    m = manager()
    toks = tokens(18)                             # 4 full blocks
    prefill(m, "a", toks, saves_at=[8])
    assert len(m.pool.cached) == 4 and len(m.states.saved) == 1
    hits = m.prefix_hits("b", toks)
    assert hits == m.blocks["a"][:2]              # blocks hit up to 16, a state only at 8
    live_a = m.slots["a"]
    load = m.admit("b", hits, len(toks))
    assert load == (m.states.saved[m.hashes["b"][1]], m.slots["b"]) and m.slots["b"] != live_a
    # Without a saved state no hit, though the blocks are cached
    other = manager()
    prefill(other, "a", toks, saves_at=[])
    assert other.prefix_hits("b", toks) == [] and len(other.pool.cached) == 4


def test_saves_are_planned_only_at_boundaries_not_saved_yet():
    m = manager()
    toks = tokens(12)
    prefill(m, "a", toks, saves_at=[8])
    m.prefix_hits("b", toks)
    assert m.plan_state_save("b", 6) == NO_SLOT           # not a block boundary
    assert m.plan_state_save("b", 8) == NO_SLOT           # saved already
    slot = m.plan_state_save("b", 12)
    assert slot != NO_SLOT
    m.commit_state_save("b", 16, slot, in_output=False)   # block 4 never registered: back
    assert m.states.num_reserved == 0 and len(m.states.saved) == 1


def test_a_saved_state_goes_with_its_block():
    m = KVCacheManager(HYBRID, block_size=P, num_blocks=4, num_slots=LIVE + CACHED,
                       num_cached_states=CACHED)           # 3 usable blocks
    toks = tokens(8)
    prefill(m, "a", toks, saves_at=[4, 8])
    m.free("a")
    assert len(m.states.saved) == 2
    m.admit("b", [], 12)                                   # reuses all 3 blocks: evicted
    assert not m.pool.cached and not m.states.saved and len(m.states.free) == CACHED


def test_a_requests_output_saves_replace_each_other():
    m = manager()
    toks = tokens(16)
    m.admit("a", [], 16)
    m.cache_full_blocks("a", lambda a, b: toks[a:b], 16)
    m.prefix_hits("a", toks)                                # hashes of all four blocks
    for end in (8, 12, 16):                                 # say its prompt had 5 tokens
        slot = m.plan_state_save("a", end)
        m.commit_state_save("a", end, slot, in_output=True)
    assert list(m.states.saved) == [m.hashes["a"][3]]      # only the latest is kept
    m.states.drop(m.hashes["a"][3])                         # evicted, then saved again (as
    slot = m.plan_state_save("a", 16)                       # a preempted request recomputing)
    m.commit_state_save("a", 16, slot, in_output=True)
    assert list(m.states.saved) == [m.hashes["a"][3]]
    m.free("a")
    assert len(m.states.saved) == 1 and not m.output_saves


def test_no_saved_states_without_prefix_caching_or_slots():
    assert not KVCacheManager(HYBRID, block_size=P, num_blocks=8, num_slots=LIVE + CACHED,
                              num_cached_states=CACHED, enable_prefix_caching=False).saves_states
    assert not KVCacheManager(HYBRID, block_size=P, num_blocks=8, num_slots=LIVE).saves_states
    with pytest.raises(ValueError, match="besides the 4 saved ones"):
        KVCacheManager(HYBRID, block_size=P, num_blocks=8, num_slots=5, num_cached_states=4)


def test_default_number_of_saved_states():
    per = bytes_per_slot(HYBRID, 2)
    assert auto_cached_states(HYBRID, itemsize=2, budget_bytes=None, max_num_seqs=8) == 8
    # a quarter of what the 17 live slots leave, 40 slots' worth: 10 (not max_num_seqs, 16)
    assert auto_cached_states(HYBRID, itemsize=2, budget_bytes=57 * per, max_num_seqs=16) == 10
    assert auto_cached_states([KV], itemsize=2, budget_bytes=None, max_num_seqs=8) == 0


# -- the scheduler ---------------------------------------------------------------------------
def scheduler(budget=10, caching=True, cached=CACHED, specs=HYBRID, blocks=32, steps=1):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64,
                                     num_scheduler_steps=steps),
                     CacheConfig(block_size=P, enable_prefix_caching=caching), blocks,
                     cache_specs=specs, num_slots=LIVE + cached if STATE in specs else 0,
                     num_cached_states=cached)


def request(rid, n, max_tokens=1, base=100):
    return Request(rid, tokens(n, base), SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,))


def step(s, token=7):
    out = s.schedule()
    sampled = [[token] if r.sample else [] for r in out.scheduled]
    s.update(out, RunnerOutput(out.req_ids, sampled, [None] * len(sampled)))
    return out


def drain(s):
    outs = []
    while s.requests:
        outs.append(step(s))
    return outs


def assert_nothing_held(s):
    assert s.pool.num_used == 0 and not s.kv.slots
    assert len(s.kv.free_slots) == s.kv.num_live_slots - 1
    assert s.kv.states is None or s.kv.states.num_reserved == 0


def test_chunks_end_on_block_boundaries_and_save_there():
    s = scheduler()
    s.add_request(request("a", 22))
    outs = drain(s)
    # budget 10: 8 (cut to a boundary), 8, 4 (22 crosses 20: cut there too), then the last 2
    assert [(o.scheduled[0].start_position, o.scheduled[0].num_tokens) for o in outs] == \
        [(0, 8), (8, 8), (16, 4), (20, 2)]
    live = outs[0].scheduled[0].new_block_ids[1][0]
    assert [[(src == live, dst) for src, dst in o.state_saves] for o in outs] == \
        [[(True, o.scheduled[0].save_state_slot)] for o in outs[:3]] + [[]]
    assert len(s.kv.states.saved) == 3
    assert_nothing_held(s)
    # Without a state group, or without caching, the chunks are as before
    for plain in (scheduler(specs=[KV], cached=0), scheduler(caching=False)):
        plain.add_request(request("a", 22))
        assert [o.scheduled[0].num_tokens for o in drain(plain)] == [10, 10, 2]


def test_a_multi_step_loop_saves_at_its_last_boundary_within_the_longest_length():
    """3 decode steps a launch over blocks of 4: the loop computing positions 6..8 saves at
    8, inside it (the loop copies the state: no state_saves pair for the runner to copy
    after the step), committed there; the next loop's boundary, 12, lies past the request's
    longest length (6 + 5 tokens), so it plans none."""
    s = scheduler(steps=3)
    s.add_request(request("a", 6, max_tokens=5))
    outs = []
    while s.requests:
        out = s.schedule()
        sampled = [[7] * r.num_steps if r.sample else [] for r in out.scheduled]
        s.update(out, RunnerOutput(out.req_ids, sampled, [None] * len(sampled)))
        outs.append(out)
    got = [(o.num_steps, o.scheduled[0].start_position, bool(o.scheduled[0].save_state_slot),
            len(o.state_saves)) for o in outs]
    assert got == [(1, 0, True, 1), (1, 4, False, 0), (3, 6, True, 0), (3, 9, False, 0)]
    assert len(s.kv.states.saved) == 2               # at 4 (the prompt's chunk) and at 8
    assert_nothing_held(s)


def test_a_hit_loads_the_saved_state_into_the_new_requests_slot():
    s = scheduler()
    s.add_request(request("a", 22))
    drain(s)
    s.add_request(request("b", 22))
    out = s.schedule()
    (src, dst), = out.state_loads
    assert out.scheduled[0].start_position == 20 and out.num_cached_tokens == 20
    assert dst == out.scheduled[0].new_block_ids[1][0] and src == s.kv.states.saved[s.kv.hashes["b"][4]]
    assert s.prefix_hits == 20
    s.update(out, RunnerOutput(out.req_ids, [[7]], [None]))
    assert_nothing_held(s)


def test_a_hit_in_the_middle_of_a_batch():
    s = scheduler(budget=16)
    s.add_request(request("a", 13, max_tokens=6))
    s.add_request(request("x", 5, max_tokens=6, base=500))
    for _ in range(3):
        step(s)
    s.add_request(request("b", 14))       # a's 13 prompt tokens and one more
    out = s.schedule()
    new = out.scheduled[-1]
    assert new.req_id == "b" and new.start_position == 12 and len(out.state_loads) == 1
    assert {r.req_id for r in out.scheduled} == {"a", "x", "b"}
    s.update(out, RunnerOutput(out.req_ids, [[7] if r.sample else [] for r in out.scheduled],
                               [None] * 3))
    drain(s)
    assert_nothing_held(s)


def test_planned_saves_go_back_when_their_step_does_not_count():
    # the request ends before its step's update (an abort while it is in flight)
    s = scheduler()
    s.add_request(request("a", 22))
    out = s.schedule()
    assert out.state_saves and s.kv.states.num_reserved == 1
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.update(out, RunnerOutput(out.req_ids, [[]], [None]))
    assert_nothing_held(s)
    assert not s.kv.states.saved
    # the step is taken back (its inputs could not be built)
    s.add_request(request("b", 22))
    out = s.schedule()
    s.unschedule(out)
    assert s.kv.states.num_reserved == 0
    drain(s)
    assert_nothing_held(s)


def test_a_preempted_request_resumes_from_its_saved_state():
    s = scheduler(budget=32, blocks=8)            # 7 usable blocks: 20 tokens each do not fit twice
    s.add_request(request("old", 8, max_tokens=12))
    s.add_request(request("new", 8, max_tokens=12, base=300))
    outs = [step(s) for _ in range(40) if s.requests]
    assert s.num_preemptions >= 1 and not s.requests
    # "new" was preempted with 12 tokens, its state saved at 8 (the prompt) and 12; it resumes
    # at 8, the last boundary before its last known token, from the state saved there
    (resumed,) = [o for o in outs if o.state_loads]
    assert [(r.req_id, r.start_position, r.num_tokens) for r in resumed.scheduled] == [("new", 8, 4)]
    assert_nothing_held(s)


def test_no_saves_with_drafts():
    s = scheduler(budget=16)
    s.add_request(request("a", 8, max_tokens=8))
    step(s)                                       # the prompt, then token 7 at position 8
    s.requests["a"].spec_token_ids = [5, 6, 9]    # positions 8..11: ends on a boundary, 12
    out = s.schedule()
    assert out.scheduled[0].num_tokens == 4 and not out.state_saves
    s.update(out, RunnerOutput(out.req_ids, [[5, 6]], [None]))    # one draft kept
    assert s.requests["a"].num_computed_tokens == 10
    drain(s)
    assert_nothing_held(s)


# -- the device copies -----------------------------------------------------------------------
def test_state_copier_copies_the_named_slots_of_state_layers_only():
    rng = np.random.default_rng(0)
    caches = [{"conv": jnp.asarray(rng.standard_normal((8, 6, 3)), jnp.float32),
               "ssm": jnp.asarray(rng.standard_normal((8, 2, 4, 4)), jnp.float32)},
              {"k": jnp.asarray(rng.standard_normal((4, 4, 2, 8)), jnp.float32)}]
    before = [{n: np.asarray(a) for n, a in c.items()} for c in caches]
    copier = StateCopier([0], max_pairs=4)
    assert pair_buckets(4) == [1, 2, 4] and pair_buckets(6) == [1, 2, 4, 6]
    copier.warmup(caches)
    caches = copier(caches, [(1, 6), (2, 7), (3, 5)])     # 3 pairs, padded to 4 with (0, 0)
    for name in ("conv", "ssm"):
        want = before[0][name].copy()
        want[[6, 7, 5]] = before[0][name][[1, 2, 3]]
        np.testing.assert_array_equal(np.asarray(caches[0][name]), want)
    np.testing.assert_array_equal(np.asarray(caches[1]["k"]), before[1]["k"])
    with pytest.raises(ValueError, match="at most 4"):
        copier(caches, [(1, 2)] * 5)
