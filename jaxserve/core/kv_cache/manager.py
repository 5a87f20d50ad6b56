"""The cache manager: groups a model's layers by cache spec and hands each request its share.

Layers whose spec is a `PagedSpec` (K/V, an MLA latent, an indexer's keys) form the paged
group: one block table per request, blocks from one `BlockPool`, prefix caching over full
blocks (a hash chain, LRU). Layers whose spec is a `StateSpec` (linear attention's conv and
recurrent state) form the state group: one slot per running request, slot 0 the null slot
that padding sequences point at. Arrays a spec names in `window_arrays` form the sliding-window
group (kv_cache/window_group.py), below.

The sliding-window group (vLLM's "KV cache groups"; DeepSeek V4's window K=V rows and
compressor inputs, ~95 % of its bytes per token, read only `window` tokens back):
- its own BlockPool and num_window_blocks, and a window table per request over the same
  logical blocks as the full table (StepInput.window_block_tables), so a slot is found alike;
- freeing: before a running request's chunk is scheduled, `slide(request, floor)` returns the
  blocks wholly before floor - window + 1 and sets their entries to the null block. floor is
  the oldest position any later step of the request can start at: its computed count, or the
  start of a chunk still in flight (a rejected draft sends it back to that chunk's start plus
  its kept tokens; a step taken back, to its start). So a request holds about
  ceil((window + chunk) / P) + 1 window blocks however long it runs. The runner's copy of the
  table keeps the old ids of freed entries: nothing reads or writes there any more;
- prefix caching: the window blocks are registered under the same hash chain as the full
  group's (its own pool's index) and, once freed, stay findable until reused (LRU). A hit
  must be a hit in every group: resuming after L blocks reads window blocks
  first_needed(L * P) .. L - 1, so the full group's run of hits is cut back to the longest L
  whose window blocks are all cached (vLLM's sliding-window manager does the same search);
  the window table starts with null entries below them;
- sizing (`window_blocks`): what max_num_seqs running requests hold at once (each its window,
  lookahead and two partial blocks; all together two steps' token budgets of chunks: the one
  in flight and the one being scheduled), plus one window (and a partial block) a sequence
  of retention for prefix hits (a finished request's last window: a chat's next turn), never
  more than the full group's count; the full group takes the rest of the budget.

Prefix caching of a model with a state group (vLLM's "align" mode): a hit must be a hit in
every group, and a state cannot be rebuilt from blocks, so a hit resumes only at a block
boundary where some request's state was saved (kv_cache/state_cache.py: extra slots after the
live ones, keyed by the block hash chain). The scheduler plans a save when a chunk ends on a
block boundary (`plan_state_save`; it aligns chunk ends for this), the runner copies the live
slot there after the step, and `commit_state_save` registers it once the block itself is
registered. On a hit, `admit` returns the copy of the saved state into the request's slot. A
saved state goes when its block is evicted, or least recently used first when a save needs
its slot.

Sizing: one memory budget pays for the state slots first (max_num_seqs + 1, so admission never
waits for one, plus the saved states'), then for as many blocks as fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jaxserve.core.kv_cache.block_pool import BlockPool
from jaxserve.core.kv_cache.prefix_cache import ROOT_HASH, extend_block_hashes, root_hash
from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec
from jaxserve.core.kv_cache.state_cache import NO_SLOT, StateCache
from jaxserve.core.kv_cache.window_group import WindowGroup

NULL_SLOT = 0
PAGED, WINDOW, STATE = "paged", "window", "state"


def group_kinds(specs: Sequence[PagedSpec | StateSpec]) -> list[str]:
    """The cache groups a model's layers form, in a fixed order (paged, window, state)."""
    for s in specs:
        if not isinstance(s, (PagedSpec, StateSpec)):
            raise TypeError(f"a layer's cache spec must be a PagedSpec or a StateSpec; got {s!r}")
    kinds = {PAGED if isinstance(s, PagedSpec) else STATE for s in specs}
    if window_of(specs):
        kinds.add(WINDOW)
    return [k for k in (PAGED, WINDOW, STATE) if k in kinds]


def window_of(specs) -> int:
    """Tokens back the window group's arrays are read (the most any layer reads), 0: no group."""
    return max((s.sliding_window for s in specs if isinstance(s, PagedSpec) and s.window_arrays),
               default=0)


def bytes_per_block(specs, block_size: int, itemsize: int, window: bool = False) -> int:
    """Bytes one block of the full group (window: of the window group) takes over every layer."""
    return itemsize * sum(s.elements_per_block(block_size, window) for s in specs
                          if isinstance(s, PagedSpec))


def window_blocks(specs, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                  lookahead: int, num_blocks: int | None = None) -> int:
    """The window group's blocks (module doc), the null block included; 0 without the group.
    lookahead: positions a request may hold past its chunk (drafts, a proposer's chained
    writes, a multi-step decode's later steps). At most num_blocks (the full group's: a
    request's window table never holds more than its full one)."""
    window = window_of(specs)
    if not window:
        return 0
    # (two steps' budgets: a chunk scheduled while the step before is in flight keeps the
    # window back from that step's chunk, whose drafts may yet be rejected)
    live = (max_num_seqs * (-(-(window + lookahead) // block_size) + 2)
            + 2 * -(-max_num_batched_tokens // block_size))
    retained = max_num_seqs * (-(-window // block_size) + 1)
    want = live + retained + 1
    return want if num_blocks is None else max(2, min(want, num_blocks))


def bytes_per_slot(specs, itemsize: int) -> int:
    """Bytes one state slot takes over every state layer (its float32 arrays at 4 bytes)."""
    return sum((4 if name in s.float32 else itemsize) * math.prod(shape)
               for s in specs if isinstance(s, StateSpec) for name, shape in s.arrays)


# Saved states for prefix caching take at most this share of what the budget leaves after the
# live state slots, when their number is not configured: one saved state of a large hybrid
# model weighs as much as hundreds of blocks (Qwen3.5-397B: ~190 MB, 45 linear layers of
# 64 value heads' 128 x 128 f32 recurrent state).
CACHED_STATES_BUDGET_SHARE = 0.25


def auto_cached_states(specs, *, itemsize: int, budget_bytes: int | None, max_num_seqs: int) -> int:
    """Saved states kept for prefix hits when not configured: one per sequence of a step, but
    no more than CACHED_STATES_BUDGET_SHARE of the budget left after the live slots (no budget
    given: an explicit block count, so max_num_seqs)."""
    if STATE not in group_kinds(specs) or PAGED not in group_kinds(specs):
        return 0
    if budget_bytes is None:
        return max_num_seqs
    per_slot = bytes_per_slot(specs, itemsize)
    left = budget_bytes - (max_num_seqs + 1) * per_slot
    return max(0, min(max_num_seqs, int(left * CACHED_STATES_BUDGET_SHARE) // per_slot))


def size_caches(specs, *, block_size: int, itemsize: int, budget_bytes: int, max_num_seqs: int,
                useful_blocks: int, cached_states: int = 0, num_window_blocks: int = 0) -> tuple[int, int]:
    """(num_blocks, num_slots) for one memory budget: the state slots first (live ones and
    `cached_states` saved ones) and the window group's `num_window_blocks` (window_blocks),
    then as many full-group blocks as fit, but no more than `useful_blocks` (every sequence at
    full length) and at least 2."""
    kinds = group_kinds(specs)
    num_slots = max_num_seqs + 1 + cached_states if STATE in kinds else 0
    left = (budget_bytes - num_slots * bytes_per_slot(specs, itemsize)
            - num_window_blocks * bytes_per_block(specs, block_size, itemsize, window=True))
    if PAGED not in kinds:
        return 2, num_slots          # a stub pool: nothing pages
    per_block = bytes_per_block(specs, block_size, itemsize)
    return max(2, min(left // per_block, useful_blocks)), num_slots


class KVCacheManager:
    def __init__(self, specs, *, block_size: int, num_blocks: int, num_slots: int = 0,
                 enable_prefix_caching: bool = True, num_cached_states: int = 0,
                 num_window_blocks: int = 0):
        """num_slots: every state slot, the null one and the last `num_cached_states` (saved
        states for prefix hits) included. num_window_blocks: the window group's (a model
        with one: window_blocks)."""
        self.kinds = group_kinds(specs)
        self.window: WindowGroup | None = None
        if WINDOW in self.kinds:
            self.window = WindowGroup(window_of(specs), block_size, num_window_blocks,
                                      enable_prefix_caching)
            if STATE in self.kinds and enable_prefix_caching:
                # NOTE: a hit would have to end where a state was saved AND have its window
                # blocks cached: no model has both kinds yet, so the search is not built
                raise ValueError("prefix caching of a model with both a sliding-window group and "
                                 "per-request state is not supported")
        self.block_size = block_size
        self.has_state = STATE in self.kinds
        live = num_slots - num_cached_states
        if self.has_state and live < 2:
            raise ValueError(f"a model with per-request state needs >= 2 state slots besides the "
                             f"{num_cached_states} saved ones; got {num_slots}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.num_slots = num_slots
        self.num_live_slots = live             # the null slot and the requests' own
        self.free_slots = list(range(live - 1, NULL_SLOT, -1))   # pop() takes the lowest
        # Saved states (module docstring): only with prefix caching, a paged group and slots.
        self.states: StateCache | None = None
        if (self.has_state and PAGED in self.kinds and enable_prefix_caching
                and num_cached_states > 0):
            self.states = StateCache(range(live, num_slots))
            self.pool.on_evict = self.states.drop
        self.blocks: dict[str, list[int]] = {}     # request -> its block table (paged group)
        self.slots: dict[str, int] = {}            # request -> its state slot
        self.hashes: dict[str, list[bytes]] = {}   # request -> hashes of its full blocks
        self.roots: dict[str, bytes] = {}          # request -> its hash chain's root, if salted
        self.registered: dict[str, int] = {}       # request -> its leading blocks already cached
        self.output_saves: dict[str, bytes] = {}   # request -> its latest state saved past its prompt

    # -- figures ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold `num_tokens` tokens (the full group's)."""
        have = len(self.blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def lacks(self, request_id: str, num_tokens: int) -> bool:
        """Whether some group has too few free blocks for the request to hold `num_tokens`."""
        if self.blocks_needed(request_id, num_tokens) > self.pool.num_free:
            return True
        w = self.window
        return w is not None and w.needed(request_id, num_tokens) > w.pool.num_free

    def slide(self, request_id: str, floor: int) -> None:
        """Free the request's window blocks wholly before what a step starting at `floor` reads
        (floor: the oldest position any later step of it can start at; module doc)."""
        if self.window is not None:
            self.window.slide(request_id, floor)

    # -- prefix hits -----------------------------------------------------------------------
    def prefix_hits(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Cached blocks matching the request's leading full blocks, a hit in every group. At
        least one token is always left to compute, so the step still produces its logits."""
        hashes = self.hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, self.roots.get(request_id, ROOT_HASH))
        if self.has_state and self.states is None:
            return []                # no saved states: no hit could resume the state
        hits = []
        for h in hashes[:(len(token_ids) - 1) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if self.window is not None:  # the longest run whose window blocks are cached too
            del hits[self.window.cut_hits(request_id, hashes, len(hits)):]
        if self.has_state:           # the longest run that ends where a state was saved
            n = len(hits)
            while n and not self.states.has(hashes[n - 1]):
                n -= 1
            del hits[n:]
        return hits

    def salt_blocks(self, request_id: str, salt: str | None) -> None:
        """Key the request's blocks by `salt` too (its LoRA adapter; None: nothing to add): a
        prefix hit never crosses salts (prefix_cache.root_hash)."""
        if salt:
            self.roots[request_id] = root_hash(salt)

    def free_blocks_after_hits(self, hits: list[int]) -> int:
        """Free blocks left once `hits` are taken (unreferenced cached blocks count as free)."""
        return self.pool.num_free - self.pool.num_reclaimable(hits)

    def can_admit(self, request_id: str, hits: list[int], num_tokens: int, reserve: int) -> bool:
        """Whether every group keeps `reserve` blocks free once the request, its prefix_hits
        `hits` taken, holds `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(hits)
        if self.free_blocks_after_hits(hits) - need < reserve:
            return False
        w = self.window
        return w is None or w.free_after_hits(request_id, len(hits)) - need >= reserve

    # -- allocation ------------------------------------------------------------------------
    def admit(self, request_id: str, hits: list[int], num_tokens: int) -> tuple[int, int] | None:
        """Start a request's tables: take its prefix hits, blocks for `num_tokens` tokens and a
        state slot. The caller has checked that the blocks are free. Returns the state copy a
        hit of a model with state needs before its first step, (saved slot, its live slot)."""
        self.pool.touch(hits)
        need = max(0, -(-num_tokens // self.block_size) - len(hits))
        self.blocks[request_id] = hits + self.pool.allocate(need)
        if self.window is not None:
            self.window.admit(request_id, len(hits), num_tokens)
        if not self.has_state:
            return None
        slot = self.slots[request_id] = self.free_slots.pop()
        if not hits:
            return None
        return self.states.use(self.hashes[request_id][len(hits) - 1]), slot

    # -- saved states (models with a state group) -----------------------------------------
    @property
    def saves_states(self) -> bool:
        """Chunks ending on block boundaries save their state (the scheduler aligns them)."""
        return self.states is not None

    def plan_state_save(self, request_id: str, end: int) -> int:
        """A slot to copy the request's state into after the step that computes its first `end`
        tokens (a block boundary), or NO_SLOT: not a boundary, already saved, or no slot."""
        if self.states is None or end % self.block_size:
            return NO_SLOT
        hashes = self.hashes.get(request_id, ())
        j = end // self.block_size - 1
        if j < len(hashes) and self.states.has(hashes[j]):
            return NO_SLOT
        return self.states.reserve()

    def plan_loop_save(self, request_id: str, start: int, end: int, longest: int) -> int:
        """plan_state_save for a multi-step decode step computing positions start .. end - 1:
        at its last block boundary (its loop copies the state there: worker/step_program.py),
        if the request, `longest` tokens at most, can reach it."""
        end = end // self.block_size * self.block_size
        return self.plan_state_save(request_id, end) if start < end <= longest else NO_SLOT

    def commit_state_save(self, request_id: str, end: int, slot: int, in_output: bool) -> None:
        """The step saving the state after `end` tokens into `slot` ran: findable once the block
        ending there is registered (call after cache_full_blocks), else the slot goes back.
        `in_output`: `end` lies past the prompt. Such a save replaces the request's previous
        one there: only the latest can serve a hit (a preempted request resuming, the next
        turn of a chat), and saving every block of every decode would flush the prompts'."""
        hashes = self.hashes.get(request_id, ())
        j = end // self.block_size - 1
        if j >= len(hashes) or self.pool.lookup(hashes[j]) is None:
            self.states.release(slot)
            return
        if self.states.register(slot, hashes[j]) and in_output:
            previous = self.output_saves.get(request_id)
            if previous is not None and previous != hashes[j]:   # (equal: recomputed after
                self.states.drop(previous)                        # a preemption, saved again)
            self.output_saves[request_id] = hashes[j]

    def release_state_save(self, slot: int) -> None:
        """A planned save that will not be registered (its request ended, its step never ran)."""
        self.states.release(slot)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()     # drops the saved states too (pool.on_evict)
        if self.window is not None:
            self.window.pool.reset_prefix_cache()

    def grow(self, request_id: str, num_tokens: int, need: int | None = None) -> list[int]:
        """Blocks so the request holds `num_tokens` tokens (`need`: blocks_needed of that,
        when the caller has it); returns the new ones."""
        if need is None:
            need = self.blocks_needed(request_id, num_tokens)
        if not need:
            return []
        new = self.pool.allocate(need)
        self.blocks[request_id] += new
        return new

    def grow_groups(self, request_id: str, num_tokens: int) -> list[list[int]]:
        """`grow` in every group (the caller checked `lacks`): per group, the ids the request
        gained, nothing in a state group (its slot was sent at admission)."""
        new = self.grow(request_id, num_tokens)
        if self.kinds == [PAGED]:        # the common case, at every step of every request
            return [new]
        return [new if k == PAGED else self.window.grow(request_id, num_tokens) if k == WINDOW
                else [] for k in self.kinds]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's ids per group, in self.kinds order: its block table, its window table
        (null entries where freed), its [state slot]."""
        return [list(self.blocks.get(request_id, ())) if k == PAGED else
                list(self.window.tables.get(request_id, ())) if k == WINDOW
                else [self.slots[request_id]] for k in self.kinds]

    def cache_full_blocks(self, request_id: str, token_slice: Callable[[int, int], list[int]],
                          num_computed: int) -> None:
        """Register the blocks that the first `num_computed` tokens fill (their KV is written).
        `token_slice(start, end)`: the request's token ids there, asked for only when a block
        was filled (building every request's whole token list each step cost ~0.2 ms at 256)."""
        if not self.pool.enable_caching:
            return
        hashes = self.hashes.setdefault(request_id, [])
        full = num_computed // self.block_size
        if len(hashes) < full:
            extend_block_hashes(hashes, token_slice(0, full * self.block_size), self.block_size,
                                self.roots.get(request_id, ROOT_HASH))
        blocks = self.blocks.get(request_id, [])
        # Only the blocks filled since the last call: the earlier ones are registered already
        # (a step at 256 sequences otherwise walked every block of every table).
        first, end = self.registered.get(request_id, 0), min(full, len(hashes), len(blocks))
        for j in range(first, end):
            self.pool.cache_block(blocks[j], hashes[j])
        if end > first:
            self.registered[request_id] = end
        if self.window is not None:
            self.window.cache_full_blocks(request_id, hashes, full)

    def free(self, request_id: str, forget: bool = True) -> None:
        """Give back the request's blocks and slot (preemption keeps its hashes: forget=False)."""
        blocks = self.blocks.pop(request_id, None)
        self.registered.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)
        if self.window is not None:
            self.window.free(request_id)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        if forget:
            self.hashes.pop(request_id, None)
            self.roots.pop(request_id, None)
            self.output_saves.pop(request_id, None)     # its last save stays (a next turn's)
