"""Ragged paged attention's tiling rules: from a step's shapes (and, for padded decode buckets,
how busy they are) to the Triton kernel's `Tiling` (choose_tiling). The device enters only
through its tuning entry (tuning.py: SM count, occupancy); every number below was measured on
an H200 (the kernel and its grids: triton_kernel.py and the package docstring).

Legend: T tokens, S sequence slots, N query heads, K kv heads, G = N // K (Gp: rounded up to
a power of two), E head dim, BQ tokens per query tile, BK keys per step, X key-range splits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.dispatch import num_sms
from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling, tuning

def num_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size along query tiles; the padding tokens past query_start_loc[S] form a last
    pseudo-sequence S. Up to VECTOR_SEARCH_MAX_SEQS sequences, sequence s owns exactly
    ceil(qlen_s / BQ) tiles from the sum of the earlier ones' (all computed in each program):
    at most (T + (S + 1)(BQ - 1)) / BQ in all, i.e. no program left idle by a batch of
    decodes. Past it (binary search), start(s) = query_start_loc[s] // BQ + s: a closed form
    that never gives fewer than ceil(qlen_s / BQ) tiles, at the cost of up to S + 1 idle ones."""
    if num_seqs <= VECTOR_SEARCH_MAX_SEQS:
        return (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q
    return num_tokens // block_q + num_seqs + 1


def tile_rows(block_q: int, gp: int) -> int:
    """Rows of a query tile: BQ tokens x Gp heads, padded to 16 (the smallest tensor-core
    tile; the padding rows are masked off)."""
    return max(block_q * gp, 16)



# Up to this many sequences a program finds its own by comparing j with every start(s) at once
# (three loads and a prefix sum in registers); past it, a binary search (log2 S dependent loads).
VECTOR_SEARCH_MAX_SEQS = 2048

def default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
    """Tokens per query tile: about the mean query length, so decode tiles stay small, with
    at least 16 rows (the smallest tensor-core tile) and at most 64 rows. The one-token bucket
    (a lone decode) gets a one-token tile: a larger one leaves the sequence an empty second
    tile, twice the programs. Other buckets keep multi-token tiles even when they hold no more
    tokens than sequence slots: the engine's buckets (S = min(T, max_num_seqs)) cannot tell
    decodes from a prompt chunk, and one-token tiles re-read a chunk's context for every token
    (1.6-2.6 x slower on a prompt chunk, H200), for 0-2 % on pure decode batches."""
    if num_tokens == 1:
        return 1
    gp = pl.next_power_of_2(group)
    bq = pl.next_power_of_2(max(1, num_tokens // max(num_seqs, 1)))
    return max(1, min(max(bq, 16 // gp), max(1, 64 // gp)))


def waves(programs: int, per_sm: int) -> int:
    """Rounds of `per_sm` programs on every SM that a grid of `programs` takes."""
    return pl.cdiv(programs, per_sm * num_sms())


def default_block_k(block_q: int, group: int, context: int, num_splits: int = 1, *,
                    programs: int | None = None, head_dim: int | None = None,
                    itemsize: int | None = None, num_warps: int = 4,
                    num_stages: int = 2) -> int:
    """Keys per step: 128 by default for decode-like tiles (fewer, longer loads), 64 for
    prefill tiles and for splits of at most 256 keys (more steps to overlap; an H200 sweep).

    An unsplit decode grid of `programs` programs (E = 128, 2-byte K/V, 4 warps, 2 stages: the
    case measured; the wrapper passes `programs` only for decode buckets, T <= S) takes 64-key
    steps when it fits in one wave of them but not in one wave of 128-key ones (397-660
    programs on an H200; of the engine's power-of-two buckets, 512: 64 sequences x 8 kv heads or
    128 x 4), where they took ~10 % off (64 x 1K decodes: 72.9 -> 65.9 us, level with cuDNN).
    Past one wave 128-key steps were as fast or faster (or 64-key 3-stage ones:
    many_wave_decode). The rule sees the bucket, not how many of its slots hold a sequence:
    512-program buckets three quarters full or less take 2-18 % longer with it."""
    rows = tile_rows(block_q, pl.next_power_of_2(group))
    short_splits = num_splits > 1 and context // num_splits <= 256
    block_k = 128 if rows <= 16 and not short_splits else 64
    measured = num_splits == 1 and (head_dim, itemsize, num_warps, num_stages) == (128, 2, 4, 2)
    if block_k == 128 and measured and programs and (
            waves(programs, tuning().decode_programs_per_sm[64]) == 1
            < waves(programs, tuning().decode_programs_per_sm[128])):
        block_k = 64
    return max(16, min(block_k, pl.next_power_of_2(context)))


def _measured_decode_grid(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int,
                          busy_seqs: int | None, *, head_dim: int,
                          itemsize: int) -> tuple[int, int] | None:
    """(programs, busy programs) of an unsplit decode grid (T <= S) in the case the decode
    tiling rules were measured on (the wrapper's 16-row query tile, E = 128, 2-byte K/V), else
    None. Busy programs: `busy_seqs` sequences with query tokens (None: all num_seqs; at most
    T hold one) x kv_heads."""
    group = num_heads // kv_heads
    block_q = default_block_q(num_tokens, num_seqs, group)
    if num_tokens > num_seqs or (head_dim, itemsize,
                                 tile_rows(block_q, pl.next_power_of_2(group))) != (128, 2, 16):
        return None
    busy = min(num_seqs if busy_seqs is None else busy_seqs, num_seqs, num_tokens)
    return num_tiles(num_tokens, num_seqs, block_q) * kv_heads, busy * kv_heads


def pipelined_decode(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int,
                     busy_seqs: int | None, *, head_dim: int = 128, itemsize: int = 2) -> int:
    """Keys per step of the pipelined tiling for a decode grid (T <= S) that takes it, else 0.
    Only the case measured: the wrapper's default 16-row query tile, E = 128, 2-byte K/V
    (sliding windows and soft caps give the same results; their speed was not timed).

    A pipelined program takes its whole key range unsplit, looks up each step's slots in that
    step (prefetch_slots=False) and runs 5 stages: Triton's pipeliner then copies the
    block-table entries asynchronously a stage ahead of the K/V copies and double-buffers K/V in
    shared memory (140 KiB at 128 keys, 72 KiB at 64), so no plain global load is left in the
    loop and the next step's copy overlaps this step's math (Triton 3.9's output, read on CPU
    with benchmarks/triton_ir.py; with 2 stages, or 3 with slots looked up in their step,
    Triton keeps one K/V buffer). With the
    default mask_all_steps the keys are one masked loop, so the pipeline is not drained before
    a separate last-step loop. Two regions:

    - At most one program per SM (<= num_sms()): 128-key steps (one program an SM), instead of
      splitting to fill the SMs and merging; e.g. 16 x 1K decodes 10 % faster (H200).
    - Over one and at most two programs per SM (up to 2 x num_sms()), which the default leaves
      unsplit where the busy count is said (fill_splits where it is not): 64-key steps (72 KiB,
      so both programs of an SM fit), 0.7-6 % faster than the default 128-key 2-stage steps;
      at 512 programs it was 17 % slower, so not there.

    It needs more busy programs than tuning().pipelined_min_fill of the SMs (`busy_seqs` sequences with
    query tokens, at least; None: all num_seqs): a lone program streams only ~32 GB/s, so a
    padded bucket holding a few long decodes would stream them through a few SMs; below the
    bound the tiling wins or loses by the context, which the wrapper cannot see (a runtime
    value). Hence a padded bucket's caller (the engine) says how many slots are busy; a full
    bucket of 67-103 programs gets this tiling through split_decode_tiling."""
    grid = _measured_decode_grid(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs,
                                 head_dim=head_dim, itemsize=itemsize)
    if grid is None:
        return 0
    programs, busy = grid
    if busy <= tuning().pipelined_min_fill * num_sms():
        return 0
    if programs <= num_sms():
        return 128
    return 64 if programs <= 2 * num_sms() else 0


def wave_fill(programs: int, per_sm: int) -> float:
    """Busy share of the program slots over the waves a grid takes (1.0: its last wave full)."""
    return programs / (waves(programs, per_sm) * per_sm * num_sms())


def many_wave_decode(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int,
                     busy_seqs: int | None = None, *, head_dim: int = 128,
                     itemsize: int = 2) -> bool:
    """Whether an unsplit decode grid (T <= S; the wrapper's 16-row tile, E = 128, 2-byte K/V:
    the case measured) past one wave of 64-key 2-stage steps takes 64-key steps with slots
    looked up in their step and 3 stages instead of the 128-key 2-stage default: where that
    tiling's waves of busy programs are fuller (tuning().async_64_programs_per_sm against
    tuning().decode_programs_per_sm[128]): 0.6-1.3 % less time at 1,024-2,048 programs, 6 % more at 768
    (96 x 1K, where its waves are emptier) on an H200; hence the rule.

    Busy programs: `busy_seqs` sequences with query tokens (at least; None: all num_seqs; 0: not
    said, as the engine passes below its floor) x kv_heads. Launched with kv heads inner, a
    padded bucket's busy programs run first, so their count sets the waves. The tiling holds
    over several ranges of busy counts; the engine only uses the top one (tiling_busy_floor:
    one more program per bucket)."""
    grid = _measured_decode_grid(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs,
                                 head_dim=head_dim, itemsize=itemsize)
    if grid is None:
        return False
    programs, busy = grid
    return (busy > 0 and waves(programs, tuning().decode_programs_per_sm[64]) > 1 and
            wave_fill(busy, tuning().async_64_programs_per_sm)
            > wave_fill(busy, tuning().decode_programs_per_sm[128]))


def pipelined_busy_floor(kv_heads: int) -> int:
    """The fewest busy sequences at which pipelined_decode can hold."""
    return int(tuning().pipelined_min_fill * num_sms()) // kv_heads + 1


class DecodeTiling(NamedTuple):
    """A decode grid's tiling in place of the default, with slots looked up in their step."""
    num_splits: int          # key-range splits; with fill_splits, the most an item takes
    block_k: int             # keys per step
    num_stages: int
    fill_splits: bool = False  # splits per item set in the kernel from the items' key steps


# Splits of a decode grid of fewer programs than SMs (split_decode_tiling) take 128-key steps
# from this many keys a split, 64-key ones below (the faster in every H200 case timed but at
# exactly 512, which could go either way).
SPLIT_128_KEYS = 512


def default_fill_programs(items: int) -> int:
    """A fill_splits grid's programs for a decode grid of `items` (query tile, kv head) items:
    one num_sms() more than the waves of one program an SM that the items take (64-key 5-stage
    steps: 72 KiB, three fit an SM), two more past 2 x num_sms() items: 264 for up to num_sms()
    items, 396 up to 2 x num_sms(), 792 up to 4 x num_sms() (skewed steps only). Each was the
    fastest of its neighbours in most cases timed on an H200 (one num_sms() more or fewer)."""
    # NOTE: 660 (265-396 items) was not timed.
    waves = pl.cdiv(items, num_sms())
    return num_sms() * (waves + (1 if waves <= 2 else 2))


def split_decode_tiling(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int,
                        busy_seqs: int | None, *, context: int, head_dim: int = 128,
                        itemsize: int = 2, skewed: bool = False) -> DecodeTiling | None:
    """The tiling of a decode grid (T <= S; the measured case of _measured_decode_grid) of at
    most one program per SM, or two where its busy count is not said, or four where the step
    is `skewed` (its contexts; a one-slot bucket never is): pipelined programs (5
    stages, slots looked up in their step), the key range split to fill the SMs; None for
    larger grids (the other rules) and where no split is possible in a padded bucket (the
    default then).

    - Every slot busy (busy_seqs None or the whole bucket; a one-slot bucket always): X =
      num_sms() // programs splits (at most 32, at least 64 keys each), 128-key steps (one
      program an SM) from SPLIT_128_KEYS keys a split, else 64-key. X = 1 from 67 programs up:
      pipelined_decode's tiling, below its busy bound too.
    - Busy count not said or short of the bucket (a padded bucket below its tiling_busy_floor,
      or one whose contexts are skewed), or `skewed` (then for grids of up to
      SKEWED_FILL_MAX_WAVES programs an SM, full ones too): fill_splits over
      default_fill_programs (264, 396, 660 or 792) programs of 64-key steps; the kernel counts
      the busy (tile, kv head) items and gives each one split and a share of the spare programs
      in proportion to its key steps (fill_split_counts: P // items each with even contexts, at
      most the item's steps; at most num_splits = min(P // kv_heads, 32, context // 64)), its
      busy programs spread evenly over the grid. Sharing by key steps is what keeps one long
      context from setting the step's end: one 32K decode among three of 1K in a 16-slot
      bucket, 62.7 -> 41.9 us (H200; cuDNN with key lengths 51.6); with even contexts it costs
      0.5-2 %. Grids of up to two programs an SM with few busy slots stream on a few SMs
      without it (2 of 32 slots x 8K: 141.9 -> 25.4 us).

    Not kept: fill grids of 132 programs of 128-key steps, or of 396 below num_sms() items
    (within 1-8 % either way)."""
    grid = _measured_decode_grid(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs,
                                 head_dim=head_dim, itemsize=itemsize)
    if grid is None or grid[0] > (SKEWED_FILL_MAX_WAVES if skewed else 2) * num_sms():
        return None
    programs, busy = grid
    full = min(num_tokens, num_seqs) == 1 or (not skewed and busy == programs)
    if full and programs <= num_sms():
        x = max(1, min(num_sms() // programs, 32, context // 64))
        return DecodeTiling(x, 128 if x == 1 or context // x >= SPLIT_128_KEYS else 64, 5)
    if full:
        return None
    most = min(default_fill_programs(programs) // kv_heads, 32, context // 64)
    return DecodeTiling(most, 64, 5, fill_splits=True) if most > 1 else None


def special_decode_tiling(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int,
                          busy_seqs: int | None, *, context: int = 32768, head_dim: int = 128,
                          itemsize: int = 2, skewed: bool = False) -> DecodeTiling | None:
    """The decode tiling that replaces the default for this grid: pipelined_decode's (unsplit,
    5 stages), many_wave_decode's (unsplit, 64 keys, 3 stages) or split_decode_tiling's; None
    where none holds. context: the bucket's keys a sequence (B x P). skewed: the caller says
    the step's contexts are skewed (skewed_contexts): fill_splits for grids of up to
    SKEWED_FILL_MAX_WAVES x num_sms() programs, whatever the busy count."""
    kw = dict(head_dim=head_dim, itemsize=itemsize)
    if skewed:
        fill = split_decode_tiling(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs,
                                   context=context, skewed=True, **kw)
        if fill:
            return fill
    step = pipelined_decode(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs, **kw)
    if step:
        return DecodeTiling(1, step, 5)
    if many_wave_decode(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs, **kw):
        return DecodeTiling(1, 64, 3)
    return split_decode_tiling(num_tokens, num_seqs, num_heads, kv_heads, busy_seqs,
                               context=context, **kw)


def tiling_busy_floor(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int, *,
                      context: int = 32768, head_dim: int = 128, itemsize: int = 2) -> int:
    """The fewest busy sequences from which a padded decode bucket is tiled as the full one
    (special_decode_tiling, with busy_seqs = that count), every count up to full included; 0
    where the busy count changes nothing (a full bucket keeps the default, or is tiled as one
    whose count is not said). A caller that pads steps to buckets (the engine) passes
    busy_seqs = this floor from it up and 0 below: one more program per such bucket, not one
    per busy count."""
    def tiling(busy):
        return special_decode_tiling(num_tokens, num_seqs, num_heads, kv_heads, busy,
                                     context=context, head_dim=head_dim, itemsize=itemsize)
    floor = min(num_seqs, num_tokens)
    full = tiling(floor)
    if full is None or tiling(0) == full:
        return 0
    while floor > 1 and tiling(floor - 1) == full:
        floor -= 1
    return floor


# A step whose longest context is over this many times its chunks' mean is "skewed": a full
# bucket's tiling (unsplit, or split alike by the grid's size) then waits on its longest
# sequence's programs, while fill_splits shares the programs by each one's key steps. On an
# H200, fill_splits took 10-44 % off full buckets from a ratio of 1.88 up, was mixed at
# 1.23-1.51 and 4-21 % slower with even contexts (1.52-1.87 not timed).
SKEWED_CONTEXT_RATIO = 1.8
# A caller that says a step is skewed gets fill_splits for decode grids of up to this many
# programs an SM (special_decode_tiling): beyond two, only skewed steps take it (H200, 64
# slots: one 16K decode among 1K ones 454.6 -> 89.5 us; even contexts would lose 21 %). Larger
# grids not timed.
SKEWED_FILL_MAX_WAVES = 4


def skewed_contexts(seq_lens) -> bool:
    """Whether a step's contexts (its chunks' seq_lens, host-side) are skewed enough that a
    caller that pads steps to buckets should run it as one (SKEWED_CONTEXT_RATIO): busy_seqs 0
    where that already is fill_splits, else the kernel's `skewed` (the engine:
    models/attention.py AttentionBackend.plan)."""
    lens = np.asarray(seq_lens)
    return lens.size > 1 and lens.max() > SKEWED_CONTEXT_RATIO * lens.mean()


def prefill_heavy(num_tokens: int, num_seqs: int) -> bool:
    """More than two tokens per sequence slot: mostly prompt chunks (a static test on the
    step's shapes). Such batches need no key-range splits, and on a GPU go to the Mosaic kernel."""
    return num_tokens > 2 * num_seqs


def splits_to_fill(num_tokens: int, num_seqs: int, kv_heads: int, context: int, *,
                   programs: int, min_keys: int) -> int:
    """Key-range splits (at most 32) that bring a decode-heavy grid of one program per
    (sequence, kv head) up to about `programs`, keeping at least `min_keys` keys per split;
    prefill-heavy batches already fill the GPU with query tiles (1)."""
    if prefill_heavy(num_tokens, num_seqs):
        return 1
    work = max(min(num_tokens, num_seqs) * kv_heads, 1)
    return int(max(1, min(pl.cdiv(programs, work), context // min_keys, 32)))


def default_num_splits(num_tokens: int, num_seqs: int, kv_heads: int, block_q: int,
                       context: int) -> int:
    """Split the key range only when the grid has fewer programs than SMs, then until it has
    about four per SM, keeping at least 64 keys per split (from an H200 sweep over 1-32
    sequences of 1K-32K keys). The measured decode case (E = 128 in 2-byte K/V, 16-row tiles)
    takes split_decode_tiling instead."""
    if min(num_tokens, num_seqs) * kv_heads >= num_sms():
        return 1
    return splits_to_fill(num_tokens, num_seqs, kv_heads, context, programs=512, min_keys=64)


def choose_tiling(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int, *, context: int,
                  head_dim: int, itemsize: int, busy_seqs: int | None, skewed: bool,
                  interpret: bool, asked: Tiling = Tiling()) -> Tiling:
    """The whole tiling of a Triton-kernel call: the fields `asked` sets, the rest from the
    rules (the wrapper's docstring says which). context: keys a sequence (B x P)."""
    t, s, kh = num_tokens, num_seqs, kv_heads
    g = num_heads // kv_heads
    special = None if asked.tuned() else special_decode_tiling(
        t, s, num_heads, kh, busy_seqs, context=context, head_dim=head_dim, itemsize=itemsize,
        skewed=skewed)
    block_k, num_splits, num_stages = asked.block_k, asked.num_splits, asked.num_stages
    prefetch_slots = asked.prefetch_slots
    fill = special.fill_splits if special else bool(asked.fill_splits)
    if special:
        num_splits, step, num_stages, _ = special
        prefetch_slots = False
        block_k = max(16, min(step, pl.next_power_of_2(context)))   # <= the context
    block_q = asked.block_q or default_block_q(t, s, g)
    num_stages = num_stages or 2
    num_splits = num_splits or default_num_splits(t, s, kh, block_q, context)
    fill = fill and num_splits > 1
    rows = tile_rows(block_q, pl.next_power_of_2(g))
    tiles = num_tiles(t, s, block_q)
    num_warps = asked.num_warps or (4 if rows <= 64 else 8)
    # the grid's size only for decode buckets (no more tokens than sequence slots): the rule
    # was measured on those, not on buckets of prompt chunks and decodes (T > S)
    programs = tiles * kh * num_splits if t <= s else None
    block_k = block_k or default_block_k(block_q, g, context, num_splits, programs=programs,
                                         head_dim=head_dim, itemsize=itemsize,
                                         num_warps=num_warps, num_stages=num_stages)
    heavy = prefill_heavy(t, s)

    def unless_asked(value, default):
        return default if value is None else value

    return Tiling(
        block_q=block_q, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages,
        mask_all_steps=unless_asked(asked.mask_all_steps, interpret or (t <= s and rows <= 16)),
        heavy_first=unless_asked(asked.heavy_first, heavy),
        prefetch_slots=unless_asked(prefetch_slots, heavy),
        heads_inner=bool(unless_asked(asked.heads_inner, t <= s and num_splits == 1)),
        fill_splits=fill,
        fill_programs=(asked.fill_programs or default_fill_programs(tiles * kh)) if fill else 0)


class BucketHints(NamedTuple):
    """What a caller that pads steps to buckets (the attention backend) needs of a bucket's
    tilings, found once per bucket."""
    busy_floor: int          # tiling_busy_floor: busy_seqs to pass from this many busy up
    skew_fills: bool         # a skewed step takes fill_splits (busy_seqs 0)
    skew_apart: bool         # ... and that needs `skewed` said (a program of its own)


def bucket_hints(num_tokens: int, num_seqs: int, num_heads: int, kv_heads: int, *,
                 context: int, head_dim: int, itemsize: int) -> BucketHints:
    """The bucket's hints: its busy floor, and whether a skewed step (skewed_contexts) takes
    fill_splits, and whether that differs from the tiling without a busy count."""
    shape = (num_tokens, num_seqs, num_heads, kv_heads)
    kw = dict(context=context, head_dim=head_dim, itemsize=itemsize)
    skew = special_decode_tiling(*shape, 0, skewed=True, **kw)
    fills = bool(skew and skew.fill_splits)
    apart = fills and skew != special_decode_tiling(*shape, 0, **kw)
    return BucketHints(tiling_busy_floor(*shape, **kw), fills, apart)
