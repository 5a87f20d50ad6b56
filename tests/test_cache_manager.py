"""The cache manager: layers grouped by cache spec, sized from one budget, per-group tables,
freeing and prefix hits per group."""

import pytest

from jaxserve.core.kv_cache.manager import (PAGED, STATE, KVCacheManager, bytes_per_block,
                                       bytes_per_slot, group_kinds, size_caches)
from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec

KV = PagedSpec((("k", (2, 8)), ("v", (2, 8))))            # 32 elements per token
STATE_SPEC = StateSpec((("conv", (6, 3)), ("ssm", (2, 4, 4))))   # 18 + 32 = 50 per slot
HYBRID = [STATE_SPEC, STATE_SPEC, STATE_SPEC, KV]          # three linear layers, one full


def test_groups_and_sizes_from_one_budget():
    assert group_kinds([KV, KV]) == [PAGED]
    assert group_kinds(HYBRID) == [PAGED, STATE]
    assert bytes_per_block(HYBRID, block_size=4, itemsize=2) == 4 * 2 * 32
    assert bytes_per_slot(HYBRID, itemsize=2) == 3 * 50 * 2
    # 8 sequences: 9 slots (one null) = 2,700 bytes first; the other 7,300 buy 28 blocks.
    blocks, slots = size_caches(HYBRID, block_size=4, itemsize=2, budget_bytes=10_000,
                                max_num_seqs=8, useful_blocks=1000)
    assert (blocks, slots) == ((10_000 - 9 * 300) // 256, 9)
    # Never more blocks than every sequence at full length needs.
    assert size_caches([KV], block_size=4, itemsize=2, budget_bytes=10**9, max_num_seqs=8,
                       useful_blocks=17) == (17, 0)
    with pytest.raises(TypeError, match="PagedSpec or a StateSpec"):
        group_kinds([("k", (1,))])


def test_allocation_and_freeing_per_group():
    m = KVCacheManager(HYBRID, block_size=4, num_blocks=9, num_slots=3)
    m.admit("a", [], 10)                        # 3 blocks and a slot
    m.admit("b", [], 1)
    a_blocks, a_slot = m.group_block_ids("a")
    assert len(a_blocks) == 3 and 0 not in a_blocks and a_slot != [0]
    assert m.group_block_ids("b")[1] != a_slot and m.num_free_blocks == 8 - 4
    assert m.grow("a", 13) and len(m.blocks["a"]) == 4
    assert m.grow("a", 16) == []                # still fits in 4 blocks
    m.free("a")
    assert m.num_free_blocks == 8 - 1 and "a" not in m.slots
    m.admit("c", [], 4)
    assert m.group_block_ids("c")[1] == a_slot   # the freed slot serves the next request
    with pytest.raises(ValueError, match="state slots"):
        KVCacheManager(HYBRID, block_size=4, num_blocks=9, num_slots=1)


def test_prefix_hits_per_group():
    tokens = list(range(100, 113))              # 3 full blocks of 4, then one token
    paged = KVCacheManager([KV], block_size=4, num_blocks=16)
    paged.admit("a", [], len(tokens))
    paged.cache_full_blocks("a", lambda a, b: tokens[a:b], len(tokens))
    hits = paged.prefix_hits("b", tokens)
    assert hits == paged.blocks["a"][:3]        # full blocks only, one token left to compute
    assert paged.prefix_hits("c", tokens[:8]) == paged.blocks["a"][:1]
    paged.free("a")                             # freed but cached: still a hit until reused
    assert paged.prefix_hits("d", tokens) == hits
    # A model with a state group keeps no state at block boundaries: no hits, though its
    # paged layers register their full blocks.
    hybrid = KVCacheManager(HYBRID, block_size=4, num_blocks=16, num_slots=3)
    hybrid.admit("a", [], len(tokens))
    hybrid.cache_full_blocks("a", lambda a, b: tokens[a:b], len(tokens))
    assert len(hybrid.pool.cached) == 3
    assert hybrid.prefix_hits("b", tokens) == []
