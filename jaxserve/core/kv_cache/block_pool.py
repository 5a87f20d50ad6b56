"""The pool of KV-cache blocks: a free queue, reference counts and the prefix-cache index.

Block 0 is the null block: never handed out, it absorbs the KV writes of padding tokens and
fills unused block-table entries.

A freed block keeps its contents (and its hash, if it was full): it sits in the free queue,
still findable by the prefix cache, until it is reused. Allocation takes blocks from the
front of the queue, so the least recently freed cached block is evicted first (LRU).
Free-but-cached blocks count as free in usage figures.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved); got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}          # hash -> block holding that content
        # Insertion order = eviction order; values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Called with the hash of each cached block as it is evicted (a hybrid model's saved
        # states at that block's boundary go with it: kv_cache/state_cache.py).
        self.on_evict: Callable[[Hashable], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def num_reclaimable(self, blocks: Iterable[int]) -> int:
        """How many of these cached blocks sit in the free queue (touching them uses free space)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on prefix-cache hits, pulling unreferenced ones out of the free queue."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block. Freed cached blocks join the back of the queue,
        tail blocks first (they are the least likely to be shared); uncached ones the front."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def cache_block(self, block: int, block_hash: Hashable) -> None:
        """Record that `block` holds the full block identified by `block_hash`."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block; keep that one
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.block_hash[b] = None
            if self.on_evict is not None:
                self.on_evict(h)
        self.cached.clear()

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            self.cached.pop(h, None)
            if self.on_evict is not None:
                self.on_evict(h)
