"""The sliding-window cache group (kv_cache/manager.py's design note): arrays a position reads
only `window` tokens back of (PagedSpec.window_arrays: DeepSeek V4's window K=V rows and
compressor inputs), on blocks of their own.

A request's window table is indexed by the same logical blocks as its full table (token t in
entry t // P), so the model finds a position's slot the same way in both; entries wholly older
than the oldest token any future step of the request can read hold the null block, their
blocks back in this group's pool. A freed block that was registered stays findable by its
hash (the request's hash chain, shared with the full group) until the pool reuses it, as
any freed cached block does (block_pool.py: LRU).
"""

from __future__ import annotations

from jaxserve.core.kv_cache.block_pool import NULL_BLOCK, BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class WindowGroup:
    def __init__(self, window: int, block_size: int, num_blocks: int, enable_caching: bool):
        self.window = window            # tokens a position reads back, itself included
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[int]] = {}     # request -> its window table (null: freed)
        self.freed: dict[str, int] = {}            # request -> leading entries set to null
        self.registered: dict[str, int] = {}       # request -> leading entries looked at
        self._hits: dict[str, tuple[int, list[int]]] = {}   # request -> (full hits, its table)

    def first_needed(self, start: int) -> int:
        """The first logical block a step starting at position `start` reads."""
        return max(0, start - self.window + 1) // self.block_size

    # -- prefix hits -----------------------------------------------------------------------
    def cut_hits(self, request_id: str, hashes: list[bytes], n: int) -> int:
        """The longest prefix of n full-group hit blocks whose window blocks are cached too:
        resuming after L blocks reads blocks first_needed(L * P) .. L - 1. Keeps that prefix's
        window table for admit()."""
        present = []                    # present[j]: run of cached blocks ending at j
        found = []
        for j in range(n):
            b = self.pool.lookup(hashes[j])
            found.append(b if b is not None else NULL_BLOCK)
            present.append((present[-1] + 1 if j and present[-1] else 1) if b is not None else 0)
        while n and present[n - 1] < n - self.first_needed(n * self.block_size):
            n -= 1
        lo = self.first_needed(n * self.block_size) if n else 0
        self._hits[request_id] = (n, [NULL_BLOCK] * lo + found[lo:n])
        return n

    def hit_table(self, request_id: str, num_hits: int) -> list[int]:
        """The window table of a request admitted with `num_hits` full-group hits."""
        n, table = self._hits.pop(request_id, (0, []))
        if n != num_hits:
            raise RuntimeError(f"request {request_id}: admitted with {num_hits} hit blocks, its "
                               f"window lookup found {n}")
        return table

    def free_after_hits(self, request_id: str, num_hits: int) -> int:
        n, table = self._hits.get(request_id, (0, []))
        hits = [b for b in table if b != NULL_BLOCK] if n == num_hits else []
        return self.pool.num_free - self.pool.num_reclaimable(hits)

    # -- allocation ------------------------------------------------------------------------
    def admit(self, request_id: str, num_hits: int, num_tokens: int) -> list[int]:
        table = self.hit_table(request_id, num_hits)
        self.pool.touch([b for b in table if b != NULL_BLOCK])
        self.freed[request_id] = self.first_needed(num_hits * self.block_size) if num_hits else 0
        self.registered[request_id] = num_hits
        table += self.pool.allocate(max(0, blocks_for(num_tokens, self.block_size) - len(table)))
        self.tables[request_id] = table
        return table

    def needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.tables.get(request_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        new = self.pool.allocate(self.needed(request_id, num_tokens))
        self.tables[request_id] += new
        return new

    def slide(self, request_id: str, start: int) -> None:
        """Free the blocks wholly before what a step starting at `start` reads (no later step
        of the request starts earlier: the scheduler's bound)."""
        table = self.tables.get(request_id)
        if table is None:
            return
        first, end = self.freed.get(request_id, 0), min(self.first_needed(start), len(table))
        if end <= first:
            return
        gone = [b for b in table[first:end] if b != NULL_BLOCK]
        table[first:end] = [NULL_BLOCK] * (end - first)
        self.freed[request_id] = end
        self.pool.free(gone)

    def cache_full_blocks(self, request_id: str, hashes: list[bytes], full: int) -> None:
        table = self.tables.get(request_id, [])
        first, end = self.registered.get(request_id, 0), min(full, len(hashes), len(table))
        for j in range(first, end):
            if table[j] != NULL_BLOCK:      # (freed before it was registered: not cached)
                self.pool.cache_block(table[j], hashes[j])
        if end > first:
            self.registered[request_id] = end

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        self.freed.pop(request_id, None)
        self.registered.pop(request_id, None)
        self._hits.pop(request_id, None)
        if table:
            self.pool.free([b for b in table if b != NULL_BLOCK])
