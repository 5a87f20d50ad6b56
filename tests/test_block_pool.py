"""Block pool and prefix-cache hashing: free queue order, ref counts, LRU eviction."""

import pytest

from jaxserve.core.kv_cache.block_pool import BlockPool
from jaxserve.core.kv_cache.prefix_cache import extend_block_hashes


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_free_returns_blocks_and_refcounts_share():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_block(a[0], b"h0")
    pool.touch([a[0]])                      # a second request shares the cached block
    pool.free(a)
    assert pool.num_free == 2               # a[0] still referenced once
    pool.free([a[0]])
    assert pool.num_free == 3 and pool.num_used == 0


def test_cached_free_blocks_stay_findable_until_evicted_lru():
    pool = BlockPool(4)                     # 3 usable blocks
    b = pool.allocate(3)
    for i, blk in enumerate(b):
        pool.cache_block(blk, f"h{i}".encode())
    pool.free([b[0]])
    pool.free([b[1]])
    pool.free([b[2]])
    assert pool.lookup(b"h0") == b[0] and pool.usage == 0.0
    # Reusing one block evicts the least recently freed cached block first.
    pool.allocate(1)
    assert pool.lookup(b"h0") is None
    assert pool.lookup(b"h1") == b[1] and pool.lookup(b"h2") == b[2]


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    b = pool.allocate(3)
    pool.cache_block(b[0], b"keep")
    pool.free(b)
    pool.allocate(2)
    assert pool.lookup(b"keep") == b[0]


def test_touch_takes_blocks_out_of_the_free_queue():
    pool = BlockPool(3)
    b = pool.allocate(1)
    pool.cache_block(b[0], b"x")
    pool.free(b)
    assert pool.num_reclaimable(b) == 1
    pool.touch(b)
    assert pool.num_free == 1 and pool.ref_counts[b[0]] == 1


def test_hash_chain_depends_on_the_whole_prefix():
    h1, h2 = [], []
    extend_block_hashes(h1, [1, 2, 3, 4, 5, 6, 7], 2)
    extend_block_hashes(h2, [9, 2, 3, 4, 5, 6], 2)
    assert len(h1) == 3 and len(h2) == 3
    assert h1[1] != h2[1]                   # same block tokens, different prefix
    h3 = list(h1[:1])
    extend_block_hashes(h3, [1, 2, 3, 4, 5, 6, 7], 2)
    assert h3 == h1                         # incremental extension gives the same chain
