"""The sliding-window cache group (kv_cache/manager.py, window_group.py): window blocks freed
as a request advances, both groups freed on finish / abort / preemption, prefix hits cut back
to where the window's blocks are still cached, and the sizing of the two pools."""

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache.block_pool import NULL_BLOCK
from jaxserve.core.kv_cache.manager import (PAGED, WINDOW, KVCacheManager, bytes_per_block,
                                            group_kinds, size_caches, window_blocks)
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_messages import RunnerOutput
from jaxserve.sampling_params import SamplingParams

P, W = 4, 8
# a V4-like layer: per-token rows read W tokens back, one entry per 4 tokens kept for good
SPEC = PagedSpec((("kv", (2,)), ("comp", (3,))), sliding_window=W, tokens_per_row=(("comp", 4),),
                 window_arrays=("kv",))
TOKENS = list(range(100, 140))               # 10 blocks


def manager(window_blocks=32, blocks=64):
    return KVCacheManager([SPEC, SPEC], block_size=P, num_blocks=blocks, num_window_blocks=window_blocks)


def advance(m, rid, tokens, chunk=P):
    """The scheduler's way for one request: admit, then per chunk slide, grow, register."""
    m.admit(rid, [], chunk)
    done, held = 0, []
    while done < len(tokens):
        m.slide(rid, done)
        m.grow_groups(rid, done + chunk)
        done = min(done + chunk, len(tokens))
        m.cache_full_blocks(rid, lambda a, b: tokens[a:b], done)
        held.append(sum(b != NULL_BLOCK for b in m.window.tables[rid]))
    return held


def test_groups_specs_and_sizes():
    assert group_kinds([SPEC]) == [PAGED, WINDOW]
    assert bytes_per_block([SPEC], P, 2) == 2 * 3            # one entry row a block
    assert bytes_per_block([SPEC], P, 2, window=True) == 2 * P * 2
    # each of 4 sequences: (8 + 2) / 4 -> 3 blocks + 2; two steps' budgets of 16 tokens: 8;
    # retention 4 x (2 + 1); the null block
    assert window_blocks([SPEC], block_size=P, max_num_seqs=4, max_num_batched_tokens=16,
                         lookahead=2) == 4 * 5 + 8 + 12 + 1
    assert window_blocks([SPEC], block_size=P, max_num_seqs=4, max_num_batched_tokens=16,
                         lookahead=2, num_blocks=9) == 9
    blocks, _ = size_caches([SPEC], block_size=P, itemsize=2, budget_bytes=10_000, max_num_seqs=4,
                            useful_blocks=10**6, num_window_blocks=37)
    assert blocks == (10_000 - 37 * 16) // 6
    with pytest.raises(ValueError, match="window_arrays"):
        PagedSpec((("kv", (2,)),), window_arrays=("kv",))
    with pytest.raises(ValueError, match="window_arrays"):
        PagedSpec((("kv", (2,)),), sliding_window=4, window_arrays=("k",))


def test_window_blocks_are_freed_as_the_request_advances():
    m = manager()
    held = advance(m, "a", TOKENS)
    # a chunk of 4 from position s reads back to s - 7: at most 3 blocks behind the chunk's
    assert max(held) <= -(-(W + P) // P) + 1 and held[-1] < len(TOKENS) // P
    table = m.window.tables["a"]
    assert len(table) == len(m.blocks["a"]) == 10 and table[:7] == [NULL_BLOCK] * 7
    assert NULL_BLOCK not in m.blocks["a"]                 # the entries stay on the full table
    m.free("a")
    assert m.pool.num_free == 63 and m.window.pool.num_free == 31   # nothing leaks


def test_hit_after_the_window_was_freed():
    m = manager()
    advance(m, "a", TOKENS)
    m.free("a")
    # every window block of a was registered before it was freed: cached, free, findable
    hits = m.prefix_hits("b", TOKENS + [1])
    assert len(hits) == 10
    assert m.can_admit("b", hits, 41, reserve=0)
    m.admit("b", hits, 41)
    table = m.window.tables["b"]
    # resuming at 40 reads back to 33: blocks 8 and 9 from the cache, 0..7 null, one new
    assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:] and len(table) == 11
    assert m.window.pool.ref_counts[table[8]] == 1
    m.free("b")
    assert m.pool.num_free == 63 and m.window.pool.num_free == 31


def test_hit_cut_back_to_where_the_window_blocks_are_cached():
    m = manager()
    advance(m, "a", TOKENS)
    window_ids = [m.pool.lookup(h) for h in m.hashes["a"]]    # the full group's blocks
    hashes = list(m.hashes["a"])
    m.free("a")
    pool = m.window.pool
    # evict the window block of tokens 32..35 (block 8) alone: the others are used again and
    # freed, so it is the least recently freed cached block
    keep = [pool.lookup(h) for j, h in enumerate(hashes) if j != 8]
    pool.touch(keep)
    pool.free(keep)
    pool.allocate(pool.num_free - len(pool.cached) + 1)
    assert pool.lookup(hashes[8]) is None and pool.lookup(hashes[7]) is not None
    # resuming at 40 or 36 would read block 8; at 32, blocks 6 and 7 (both cached)
    hits = m.prefix_hits("b", TOKENS + [1])
    assert hits == window_ids[:8] and m.window._hits["b"][1] == [NULL_BLOCK] * 6 + [
        pool.lookup(hashes[6]), pool.lookup(hashes[7])]


def _scheduler(window_blocks, blocks=64, max_seqs=2):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8, max_model_len=64),
                     CacheConfig(block_size=P), blocks, cache_specs=[SPEC], num_window_blocks=window_blocks)


def _run_step(s):
    out = s.schedule()
    sampled = [[7] if r.sample else [] for r in out.scheduled]
    s.update(out, RunnerOutput(out.req_ids, sampled, [None] * len(sampled)))
    return out


def _req(rid, n, max_tokens):
    return Request(rid, list(range(200, 200 + n)), SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True), eos_token_ids=(2,))


def test_scheduler_slides_sends_the_tables_and_frees_both_groups():
    s = _scheduler(window_blocks=40)
    s.add_request(_req("a", 30, max_tokens=6))
    held, sent = [], []
    while s.requests:
        out = _run_step(s)
        sent += out.scheduled[0].new_block_ids[1] if out.scheduled else []
        if "a" in s.kv.window.tables:
            held.append(sum(b != NULL_BLOCK for b in s.kv.window.tables["a"]))
    assert max(held) <= -(-(W + 8) // P) + 1      # a chunk of 8 and 8 tokens back
    assert len(sent) == -(-36 // P)                # every window block reached the runner
    assert s.pool.num_used == 0 and s.kv.window.pool.num_used == 0


def test_abort_and_preemption_free_both_groups():
    s = _scheduler(window_blocks=40, blocks=12)
    s.add_request(_req("a", 24, max_tokens=12))
    s.add_request(_req("b", 24, max_tokens=12))
    while s.requests and not s.num_preemptions:
        _run_step(s)
    assert s.num_preemptions         # 11 usable blocks hold less than both at 36 tokens
    preempted = next(r for r in s.waiting)
    assert preempted.request_id not in s.kv.window.tables
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.pool.num_used == 0 and s.kv.window.pool.num_used == 0


def test_the_window_pool_counts_in_lacks():
    m = manager(window_blocks=4)                     # 3 usable window blocks, 63 full ones
    m.admit("a", [], 8)
    assert m.lacks("a", 16) and not m.lacks("a", 12)
    m.slide("a", 12)                                 # a step from 12 reads back to 5: block 0 goes
    assert m.window.tables["a"][0] == NULL_BLOCK and not m.lacks("a", 16)
    m.free("a")
    assert m.window.pool.num_free == 3


def test_a_short_window_pool_makes_requests_wait_never_fail():
    s = _scheduler(window_blocks=7)
    s.add_request(_req("a", 20, max_tokens=4))
    s.add_request(_req("b", 20, max_tokens=4))
    for _ in range(40):
        if not s.requests:
            break
        _run_step(s)
    assert not s.requests
    assert s.pool.num_used == 0 and s.kv.window.pool.num_used == 0
