"""Saved linear-attention states for prefix caching of hybrid models (vLLM's "align" mode).

A recurrent layer's state after token t summarises the whole prefix, so it cannot be rebuilt
from blocks: a prefix hit can resume only where a request's state was copied aside. These
copies live in the state arrays' extra slots (after the live ones) and are keyed by the hash
of the full block that ends at that boundary (prefix_cache.py's chain, the same as the paged
blocks'), so a saved state means "the state after this exact prefix".

A slot is free, reserved (a save is on its way: the step that computes the state has been
scheduled, its block not registered yet) or saved (findable). Saved states are evicted least
recently used first; using one (a hit) makes it the most recent. Nothing references a saved
state after a hit: the hit copies it into the request's own slot.
"""

from __future__ import annotations

from collections import OrderedDict

NO_SLOT = 0   # "no save": slot 0 is the null slot, never a saved state's


class StateCache:
    def __init__(self, slots: range):
        self.num_slots = len(slots)
        self.free: list[int] = list(reversed(slots))          # pop() takes the lowest
        self.saved: OrderedDict[bytes, int] = OrderedDict()   # hash -> slot, oldest use first

    @property
    def num_reserved(self) -> int:
        """Slots whose save is on its way (0 once no step is in flight: nothing leaked)."""
        return self.num_slots - len(self.free) - len(self.saved)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.saved

    def use(self, block_hash: bytes) -> int:
        """The slot holding the state after `block_hash`'s prefix, now the most recently used."""
        self.saved.move_to_end(block_hash)
        return self.saved[block_hash]

    def reserve(self) -> int:
        """A slot for a new save: a free one, else the least recently used saved state's
        (NO_SLOT when every slot has a save on its way)."""
        if self.free:
            return self.free.pop()
        if self.saved:
            return self.saved.popitem(last=False)[1]
        return NO_SLOT

    def register(self, slot: int, block_hash: bytes) -> bool:
        """The reserved `slot` now holds the state after `block_hash`'s prefix. False: a state
        was saved for it already; that one is kept and `slot` goes back."""
        if block_hash in self.saved:
            self.release(slot)
            return False
        self.saved[block_hash] = slot
        return True

    def release(self, slot: int) -> None:
        """Give back a reserved slot whose save will not be registered."""
        self.free.append(slot)

    def drop(self, block_hash: bytes) -> None:
        """Forget the state after `block_hash`'s prefix (its block was evicted: no hit can
        reach it any more)."""
        slot = self.saved.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)

    def clear(self) -> None:
        while self.saved:
            self.free.append(self.saved.popitem()[1])
