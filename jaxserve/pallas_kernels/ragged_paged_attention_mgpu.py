"""Ragged paged attention for prefill-heavy batches, as a Hopper kernel in Mosaic GPU.

Same problem, layouts and semantics as `ragged_paged_attention` (see that module's docstring;
`ref_ragged_paged_attention` there is the reference): causal attention of a ragged batch of
query tokens over a paged KV cache, GQA, decode rows (qlen 1) and padding sequences allowed,
padding tokens after query_start_loc[-1] get zeros. Not supported (ValueError): sliding_window,
soft_cap, dtypes other than f16/bf16 (q and cache alike), head dims not a multiple of 64,
G = N // K not in {1, 2, 4, 8}, cache block sizes P not a multiple of 8 or not dividing block_kv.
T not a multiple of 8 works but costs a padded copy of q (engine token buckets avoid it).

Layouts (per layer):
    q_TNE           f16/bf16[T, N, E]     this step's queries
    k_cache_NPKE    f16/bf16[NB, P, K, E] paged keys (viewed as [NB*P, K*E] by the kernel)
    v_cache_NPKE    f16/bf16[NB, P, K, E] paged values
    query_start_loc i32[S+1], seq_lens i32[S], block_tables i32[S, B]
    -> o_TNE        [T, N, E] in q's dtype

Legend: T tokens, S sequences, N query heads, K kv heads, G = N // K, E head dim, NB cache
blocks, P slots per block, B blocks per sequence, BQ = 64 // G tokens per warpgroup tile,
CT = compute_wgs * BQ tokens per CTA, BKV keys per pipeline step (block_kv), W ring stages
(num_stages), X key-range splits (num_splits).

Design:
  * A persistent grid: one CTA per SM (num_ctas), each looping over work items (query tile,
    kv head h, split) handed out in rounds (CTA c takes the c-th item of even rounds and the
    c-th from the end of odd ones), with three warpgroups (the prefill configuration; the
    decode one has one compute warpgroup). The K/V ring and its barriers carry from one item
    to the next, so the memory warpgroup fetches the next item's keys while the compute
    warpgroups finish the last one. Two compute warpgroups own 64 rows each = BQ tokens x the
    G query heads of kv head h (GQA: K/V read once per group), ordered (head, token) so that
    each head's BQ tokens are one strided [BQ, E] TMA copy of q. One memory warpgroup walks the
    same key steps and fills a W-deep ring of [BKV, E] K
    and V tiles in shared memory page by page: BKV // P TMA copies of [P, E] from the cache
    viewed as [NB*P, K*E], through the block table, all arriving on one barrier per stage;
    the compute warpgroups hand a stage back through "consumed" barriers.
  * Small loads are kept off the warpgroups' paths where that is cheap: in the "sequence"
    tiling every field of a tile is in the tile map (passed with the block table as one
    buffer; query_start_loc and seq_lens are not read), and each warpgroup loads an item's
    fields ahead and carries them, computing nothing from them until they are used (the
    memory warpgroup one item ahead, the compute warpgroups two: they start the next item's q
    copy during the current one when q_buffers = 2); the memory warpgroup loads block-table
    entries bt_ahead key steps before their copies; a stored output is waited for only until
    its buffer has been read. Still on the path: the chain at the kernel's start (tile count,
    the first item's fields, its first block-table entries), each sequence's first bt_ahead
    lookups, and the "flat" tiling's per-tile search.
  * Per key step: wgmma S = Q K^T into registers, online softmax in exp2 units (the causal
    mask only on steps that need it), wgmma O += P V with P from registers. A two-party
    "schedule" barrier makes the two compute warpgroups alternate, so one's softmax overlaps
    the other's matmuls (FA3's ping-pong). Tiles are handed out longest-context first.
  * Two ways of tiling the tokens (`tiling=`):
    "sequence" (default): each tile serves one sequence, so decode rows get tiles of their own
      and run in parallel. The tiles come from a small map computed by XLA before the launch
      (sequence_tile_map: each tile's sequence, first token, its sequence's token bounds and
      position offset, longest causal range first, and their count), so the persistent grid
      never visits the idle tiles of the engine's mostly empty sequence slots. A tile starts
      at its sequence's first token rounded down to 8 (TMA copies into the 8-row-tiled q
      buffer must start on a row that is a multiple of 8; an unaligned start came out wrong on
      the H200), and only the rows of the sequence are stored: from an untiled staging buffer,
      as a ladder of BQ, BQ/2, ..., 1
      row TMA stores (TMA boxes are static). That buffer needs Mosaic GPU's Lane lowering
      semantics (Warpgroup semantics' layout inference tiles it and rejects the row slices).
    "flat": tile j is tokens [j*CT, (j+1)*CT) whatever sequences they belong to, with one key
      loop per sequence present (rows of other sequences masked out); no other tile writes
      those rows, so whole tiles are stored. Lowered with Warpgroup semantics, ~5% faster than
      "sequence" on prefill-only batches, but the loops of a tile run one after the other, so
      a tile full of decode rows is very slow (8x "sequence" on 32 decodes beside a 1K chunk):
      only for batches without decode rows.

Why Mosaic GPU: our Triton kernel (ragged_paged_attention.py) gathers K/V with per-row pointer
loads and stays at ~34 % of the 794 TFLOP/s bf16 rate on a 2,048-token prefill; Hopper's rate
needs wgmma + TMA + warp specialisation, which Pallas' Triton lowering does not expose and
Mosaic GPU does. On that prefill this kernel runs at 0.91-0.94x cuDNN's speed while reading K/V
through the block table (cuDNN gets them dense) and ~1.45x the Triton kernel's (H200;
BENCHMARKS.md, "Kernels"). The XLA ops before the kernel (the tile map with its sort, padded
copies of the small inputs) depend only on the step's query_start_loc and seq_lens, so the
engine's step computes them once for all layers (CSE).
Decode configuration (DECODE_CONFIG: one compute warpgroup, a 4-deep ring of 64-key steps,
key-range splits merged by log-sum-exp, a second q buffer, bt_ahead = 2): correct, but slower
than the Triton kernel on most decode cases, so ragged_paged_attention never dispatches it.
Each CTA needs ~180 KB of shared memory, so one runs per SM, and with static rounds a CTA's
fixed start (the first copies go out ~3 us after launch) and uneven ends are not hidden;
balancing them needs items handed out dynamically (a fetch-and-add, which Mosaic GPU's Pallas
API lacks in jax 0.11.2).
Tried and slower: 64-key steps with 3 or 4 stages for prefill (3 stages of 128 keys do not fit
in shared memory beside "sequence"'s staging buffer), no schedule barrier, other launch orders.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.pallas_kernels.ragged_paged_attention import (  # noqa: F401 (re-exported)
    LOG2E, _validate, prefill_heavy, ref_ragged_paged_attention)
from jaxserve.pallas_kernels.dispatch import H200, absent_refs, num_sms
from jaxserve.pallas_kernels.split_merge import merge_splits

ROWS_PER_WG = 64          # wgmma M per warpgroup
COMPUTE_WGS = 2           # prefill: two compute warpgroups (FA3 ping-pong); decode: one
TILE_FIELDS = ("seq", "t0", "seq_begin", "seq_end", "offset")   # sequence_tile_map's rows
LSE_COLS = 8              # a split's log-sum-exp is stored as [rows, 8] (TMA boxes >= 16 bytes)
# Tile configurations by measurement (module docstring): prefill-heavy batches fill the GPU
# with query tiles; decode batches have 1 token per sequence, so one compute warpgroup, a deeper
# ring of smaller key steps and key-range splits (num_splits: None = default_num_splits).
PREFILL_CONFIG = dict(block_kv=128, num_stages=2, compute_wgs=2, num_splits=1, q_buffers=1,
                      bt_ahead=0)
DECODE_CONFIG = dict(block_kv=64, num_stages=4, compute_wgs=1, num_splits=None, q_buffers=2,
                     bt_ahead=2)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


MAX_SMEM_BYTES = 232448   # shared memory per block on an H100/H200 (227 KiB)


def _smem_bytes(head_dim: int, block_kv: int, num_stages: int, tiling: str, itemsize: int,
                compute_wgs: int = COMPUTE_WGS, num_splits: int = 1, q_buffers: int = 1) -> int:
    """Shared memory of the GPU path: q tiles, the output staging ("sequence" tiling; f32 plus
    the log-sum-exp when the key range is split) and the K/V ring (barriers are a few hundred
    bytes; the margin covers them)."""
    rows = compute_wgs * ROWS_PER_WG
    staging = 0
    if tiling == "sequence":
        staging = (rows * head_dim * itemsize if num_splits == 1
                   else rows * (head_dim + LSE_COLS) * 4)
    q_and_ring = q_buffers * rows * head_dim + 2 * num_stages * block_kv * head_dim
    return itemsize * q_and_ring + staging


def _check_supported(q_TNE, k_cache, block_kv, num_stages, sliding_window, soft_cap,
                     tiling="sequence", compute_wgs=COMPUTE_WGS, num_splits=1, q_buffers=1,
                     bt_ahead=0):
    if sliding_window is not None or soft_cap is not None:
        raise ValueError("ragged_paged_attention_mgpu supports neither sliding_window nor "
                         "soft_cap; use ragged_paged_attention(impl='pallas') for those")
    _, n, e = q_TNE.shape
    _, p, kh, _ = k_cache.shape
    g = n // kh
    if q_TNE.dtype != k_cache.dtype or jnp.dtype(q_TNE.dtype) not in (
            jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q and the cache must share one dtype, float16 or bfloat16; got "
                         f"{q_TNE.dtype} and {k_cache.dtype}")
    if e % 64:
        raise ValueError(f"head dim E must be a multiple of 64 (wgmma/TMA tiles); got {e}")
    if g not in (1, 2, 4, 8):
        raise ValueError(f"query heads per kv head G = N // K must be 1, 2, 4 or 8; got {g}")
    if block_kv % 64 or block_kv % p:
        raise ValueError(f"block_kv must be a multiple of 64 and of the block size P={p}; "
                         f"got {block_kv}")
    if p % 8:
        raise ValueError(f"cache block size P must be a multiple of 8; got {p}")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2; got {num_stages}")
    if compute_wgs not in (1, 2):
        raise ValueError(f"compute_wgs must be 1 or 2; got {compute_wgs}")
    if num_splits < 1 or (num_splits > 1 and tiling != "sequence"):
        raise ValueError(f"num_splits must be >= 1, and 1 with tiling='flat'; got {num_splits}")
    if q_buffers not in (1, 2):
        raise ValueError(f"q_buffers must be 1 or 2; got {q_buffers}")
    if bt_ahead < 0:
        raise ValueError(f"bt_ahead must be >= 0; got {bt_ahead}")
    smem = _smem_bytes(e, block_kv, num_stages, tiling, jnp.dtype(q_TNE.dtype).itemsize,
                       compute_wgs, num_splits, q_buffers)
    if smem > MAX_SMEM_BYTES - 4096:
        raise ValueError(f"head dim E={e} with block_kv={block_kv} and num_stages={num_stages} "
                         f"needs {smem} bytes of shared memory; at most "
                         f"{MAX_SMEM_BYTES - 4096} fit (use a smaller block_kv or E <= 128)")


def _own_buffer(x_N):
    """x as int32 in a buffer of its own, padded by 1..64 entries (the kernel reads only the
    first N). NOTE: a Mosaic GPU call needs 256-byte aligned operands, and inside the engine's
    step these small arrays are slices of one packed input, which XLA passes as views at any
    offset ("Input buffer 1 is not 256-byte aligned" on the H200); a padded copy is a fresh,
    aligned allocation (a zero pad would be a no-op and keep the view)."""
    n = x_N.shape[0]
    return jnp.pad(x_N.astype(jnp.int32), (0, 64 - n % 64))


def sequence_tile_map(query_start_loc_S1, seq_lens_S, num_tokens: int, num_tiles: int,
                      tile_tokens: int, *, longest_first_block_kv: int | None = None) -> jax.Array:
    """The tiles of the "sequence" tiling -> i32[F * num_tiles + 1], F = len(TILE_FIELDS):
    entry f * num_tiles + j is field f of tile j: its sequence (S for the padding tokens past
    query_start_loc[S]), its first token, the first and end token of its sequence (the padding
    tokens: qsl[S] and num_tokens) and the offset from a token to its position (seq_len - end);
    the last entry is the number of tiles. Entries of the tiles past it are unused (-1, 0...).
    Sequence s needs ceil((end - start) / CT) tiles from its first token rounded down to 8 (TMA
    row alignment; see the kernel), in order. num_tiles = T // CT + S + 1 is enough whatever
    the batch: each sequence needs at most qsl[s+1] // CT - qsl[s] // CT + 1 tiles, CT being a
    multiple of 8 (see the tests). With longest_first_block_kv, the tiles are ordered by their
    number of key steps of that size, most first (stable): the persistent kernel hands them out
    in that order, so the longest start first and the rest even out the CTAs' loads (longest
    processing time first); the gain measured on multi-sequence prefill steps was small, and
    the sort costs ~5 us of XLA ops once per step."""
    qsl = query_start_loc_S1.astype(jnp.int32)
    begin_S1 = qsl                                              # S real + the padding one
    end_S1 = jnp.append(qsl[1:], jnp.int32(num_tokens))
    first_S1 = jnp.bitwise_and(begin_S1, -8)
    tiles_S1 = jnp.where(end_S1 > begin_S1, pl.cdiv(end_S1 - first_S1, tile_tokens), 0)
    ends_S1 = jnp.cumsum(tiles_S1)                              # one past each one's last tile
    j_J = jnp.arange(num_tiles, dtype=jnp.int32)
    # NOTE: a comparison matrix, not searchsorted's loop: one small fusion ((T/CT + S) x S)
    seq_J = jnp.minimum(jnp.sum(ends_S1[None, :] <= j_J[:, None], axis=1, dtype=jnp.int32),
                        qsl.shape[0] - 1)
    t0_J = first_S1[seq_J] + (j_J - (ends_S1[seq_J] - tiles_S1[seq_J])) * tile_tokens
    idle = j_J >= ends_S1[-1]
    if longest_first_block_kv:
        num_seqs = qsl.shape[0] - 1
        real = seq_J < num_seqs                                 # not the padding tokens' tiles
        s_c = jnp.minimum(seq_J, num_seqs - 1)
        kv_end = jnp.minimum(t0_J + tile_tokens, end_S1[seq_J]) + seq_lens_S[s_c] - end_S1[seq_J]
        steps = jnp.where(real, pl.cdiv(kv_end, longest_first_block_kv), 0)
        # a stable sort by comparison matrices (NOTE: jnp.argsort's sort op, interpreted next
        # to the Mosaic GPU interpreter, hung on 2 CPU cores; on the GPU these are two fusions)
        key = jnp.where(idle, 1, -steps)
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) &
                                                   (j_J[None, :] < j_J[:, None]))
        rank_J = jnp.sum(before, axis=1, dtype=jnp.int32)         # where tile j goes
        order = jnp.argmax(rank_J[None, :] == j_J[:, None], axis=1)
        seq_J, t0_J, idle = seq_J[order], t0_J[order], idle[order]
    seq_lens_S1 = jnp.append(seq_lens_S.astype(jnp.int32), end_S1[-1])   # padding: offset 0
    fields = (seq_J, t0_J, begin_S1[seq_J], end_S1[seq_J], seq_lens_S1[seq_J] - end_S1[seq_J])
    return jnp.concatenate([jnp.where(idle, -1 if f == 0 else 0, x) for f, x in enumerate(fields)]
                           + [ends_S1[-1:]])





def supports(q_TNE, k_cache, *, sliding_window=None, soft_cap=None,
             block_kv: int = PREFILL_CONFIG["block_kv"],
             num_stages: int = PREFILL_CONFIG["num_stages"],
             compute_wgs: int = PREFILL_CONFIG["compute_wgs"], num_splits: int | None = 1,
             q_buffers: int = PREFILL_CONFIG["q_buffers"], bt_ahead: int = 0) -> bool:
    """Whether this kernel handles these shapes and options (the prefill configuration by
    default; num_splits None counts as 1).
    ragged_paged_attention's impl="pallas" falls back to the Triton kernel otherwise."""
    try:
        _check_supported(q_TNE, k_cache, block_kv, num_stages, sliding_window, soft_cap,
                         compute_wgs=compute_wgs, num_splits=num_splits or 1,
                         q_buffers=q_buffers, bt_ahead=bt_ahead)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _rpa_mgpu_kernel(
    # inputs (GMEM)
    qsl_ref, seq_lens_ref, bt_ref, map_ref, q_ref, k_ref, v_ref,
    # outputs (GMEM): o, or with key-range splits each split's o (f32) and log-sum-exp
    o_ref, lse_ref,
    # scratch (SMEM)
    q_smem, o_smem, lse_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, sched_bar,
    p_smem,
    *, tiling, num_tokens, num_seqs, blocks_per_seq, block_size, group, head_dim, block_kv,
    num_stages, num_tiles, kv_heads, num_ctas, sm_scale, schedule_barrier, heavy_first,
    interpret, compute_wgs, num_splits, q_buffers, bt_ahead, bt_offset):
    bq = ROWS_PER_WG // group              # tokens per warpgroup tile
    ct = compute_wgs * bq                  # tokens per tile
    pages = block_kv // block_size         # TMA copies per K (or V) tile
    flat = tiling == "flat"
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    # Work items (tile, kv head, split), tile-major: the CTAs take them in rounds of num_ctas,
    # CTA c the c-th of even rounds and the c-th from the end of odd ones, so that with the
    # tiles ordered longest first every CTA gets a similar share of long and short ones.
    tiles_here = jnp.int32(num_tiles) if flat else map_ref[len(TILE_FIELDS) * num_tiles]
    per_tile = kv_heads * num_splits
    num_items = tiles_here * per_tile
    rounds = lax.div(num_items + (num_ctas - 1), jnp.int32(num_ctas))

    def last_at_or_before(key, x, n):
        """Largest s in [0, n] with key(s) <= x, for a nondecreasing key (unrolled search)."""
        lo, hi = jnp.int32(0), jnp.int32(n)
        for _ in range(max(1, n.bit_length())):
            mid = lax.div(lo + hi + 1, jnp.int32(2))
            up = key(mid) <= x
            lo, hi = jnp.where(up, mid, lo), jnp.where(up, hi, mid - 1)
        return lo

    def work_item(k):
        """This CTA's k-th item: whether it exists, its kv head, split and tile (a dict also
        holding the tile's first token t0 and its first sequence; for "flat" tiling how many
        sequences have tokens in it, for "sequence" tiling the bounds of that sequence's tokens
        and its position offset). NOTE: "sequence" items are only loaded here, nothing is
        computed from the loaded values, so that loading an item ahead never waits for them."""
        c = jnp.where(lax.rem(k, jnp.int32(2)) == 0, cta, num_ctas - 1 - cta)
        w = k * num_ctas + c
        valid = w < num_items
        w = jnp.minimum(w, jnp.maximum(num_items - 1, 0))
        item = dict(valid=valid, h=lax.rem(lax.div(w, jnp.int32(num_splits)), jnp.int32(kv_heads)),
                    split=lax.rem(w, jnp.int32(num_splits)))
        j = lax.div(w, jnp.int32(per_tile))
        if flat and heavy_first:   # later tiles have longer causal ranges: run them first
            j = tiles_here - 1 - j
        if flat:
            # tile j is tokens [j*CT, (j+1)*CT) whatever sequences they belong to: one key loop
            # per sequence present; whole tiles are stored (no other item writes these rows).
            t0 = j * ct
            total = qsl_ref[num_seqs]
            s_first = last_at_or_before(lambda s: qsl_ref[s], t0, num_seqs - 1)
            s_last = last_at_or_before(lambda s: qsl_ref[s], jnp.minimum(t0 + ct, total) - 1,
                                       num_seqs - 1)
            n_seqs = jnp.where(t0 < total, s_last - s_first + 1, 0)
            item.update(t0=t0, s_first=s_first, seq_begin=None, seq_end=None,
                        n_seqs=jnp.where(valid, n_seqs, 0))
        else:
            # tile j of the batch: its sequence (S for the padding tokens past qsl[S], a pseudo-
            # sequence that gets zeros) and first token come from sequence_tile_map (which
            # orders them longest first for heavy_first).
            # NOTE: a tile starts at its sequence's first token rounded down to 8: a TMA copy
            # into the 8-row-tiled q buffer views q as 8-row tiles and splits the start row
            # into (row // 8, row % 8), so a copy starting inside a tile loads wrong rows (seen
            # on the H200). The extra rows belong to the previous sequence and are not stored.
            # All of a tile's fields are in the map, so an item costs one round of loads.
            item.update(s_first=map_ref[j], **{f: map_ref[i * num_tiles + j]
                                               for i, f in enumerate(TILE_FIELDS) if i})
        return item

    def seqs_in(item):
        """How many sequences the item's key loops serve (the padding tile's: none)."""
        if flat:
            return item["n_seqs"]
        return jnp.where(item["valid"] & (item["s_first"] != num_seqs), 1, 0)

    def seq_info(item, i):
        """(sequence, first token, end token, pos offset, first and end key step) of the i-th
        sequence with tokens in the item's tile; the position of token t is t + offset; with
        splits, the item's share of the key steps."""
        s = item["s_first"] + i
        if flat:
            q_begin = qsl_ref[s]
            q_end = qsl_ref[s + 1]
            offset = seq_lens_ref[s] - q_end
        else:
            q_begin, q_end, offset = item["seq_begin"], item["seq_end"], item["offset"]
        lo = jnp.maximum(item["t0"], q_begin)
        hi = jnp.minimum(item["t0"] + ct, q_end)
        kv_end = jnp.where(hi > lo, hi + offset, 0)
        steps = lax.div(kv_end + (block_kv - 1), jnp.int32(block_kv))
        if num_splits == 1:
            return s, q_begin, q_end, offset, jnp.int32(0), steps
        per_split = lax.div(steps + (num_splits - 1), jnp.int32(num_splits))
        lo = jnp.minimum(item["split"] * per_split, steps)
        return s, q_begin, q_end, offset, lo, jnp.minimum(lo + per_split, steps)

    def sync_schedule():
        plgpu.barrier_arrive(sched_bar)
        plgpu.barrier_wait(sched_bar)

    @pl.when(wg < compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        scale = sm_scale * LOG2E
        rows = ROWS_PER_WG
        if schedule_barrier:
            pl.when(wg == 1)(sync_schedule)

        def copy_q(k, item):
            """Start the q copy of this CTA's k-th item into q buffer k % q_buffers."""
            buf = lax.rem(k, jnp.int32(q_buffers))

            @pl.when(item["valid"])
            def _copy():
                tq = item["t0"] + wg * bq
                for g in range(group):
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(tq, bq), item["h"] * group + g],
                                            q_smem.at[wg, buf, pl.ds(g * bq, bq)],
                                            q_bar.at[wg * q_buffers + buf])

        # NOTE: an item's fields are loaded two items ahead and carried: a load of them on
        # the spot stalls the warpgroup for a memory latency (~1 us under a full memory load)
        first_items = (work_item(jnp.int32(0)), work_item(jnp.int32(1)))
        if q_buffers > 1:
            copy_q(jnp.int32(0), first_items[0])

        def one_item(k, carry):
            base, item, item_next = carry
            item_after = work_item(k + 2)
            h, split, tq = item["h"], item["split"], item["t0"] + wg * bq
            buf = lax.rem(k, jnp.int32(q_buffers))
            qs = q_smem.at[wg, buf]
            if q_buffers > 1:
                # the next item's q arrives during this one (its buffer was last read by the
                # previous item's matmuls, which are done)
                copy_q(k + 1, item_next)
            else:
                copy_q(k, item)

            @pl.when(item["valid"])
            def _wait_q():
                with jax.named_scope("q_wait"):
                    plgpu.barrier_wait(q_bar.at[wg * q_buffers + buf])

            acc = plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32),
                                    plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))

            def key_step(jj, carry, *, base, masked, q_begin, q_end, offset):
                acc, m_i, l_i = carry
                slot = lax.rem(base + jj, jnp.int32(num_stages))
                with jax.named_scope("k_wait"):
                    plgpu.barrier_wait(k_bar.at[slot])

                def qk_matmul(acc_ref):
                    plgpu.wgmma(acc_ref, qs, k_smem.at[slot].transpose((1, 0)))
                    if schedule_barrier:
                        sync_schedule()
                    return acc_ref[...]

                s = pl.run_scoped(qk_matmul, plgpu.ACC((rows, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    r = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 0,
                                               layout=plgpu.Layout.WGMMA)
                    c = plgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1,
                                               layout=plgpu.Layout.WGMMA)
                    tok = lax.rem(r, jnp.int32(bq)) + tq
                    vis = c + jj * block_kv <= tok + offset              # causal
                    if flat:   # rows of other sequences in the tile take no part in this loop
                        vis = vis & (tok >= q_begin) & (tok < q_end)
                    s = jnp.where(vis, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                # NOTE: a row whose keys so far are all masked keeps m = -inf; shifting it by 0
                # keeps exp2 at exactly 0 instead of NaN.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_safe)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(qs.dtype)
                if schedule_barrier:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    plgpu.barrier_arrive(sched_bar)
                with jax.named_scope("v_wait"):
                    plgpu.barrier_wait(v_bar.at[slot])
                if schedule_barrier:
                    plgpu.barrier_wait(sched_bar)
                if interpret:
                    # NOTE: interpret mode has no rule for run_state (it would leak the wgmma
                    # effect), for storing into an accumulator, nor for a wgmma operand held in
                    # registers: P goes through shared memory and P V is added from a zeroed
                    # ACC.
                    p_smem.at[wg][...] = p16
                    plgpu.commit_smem()

                    def pv_scoped(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot])
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_scoped,
                                              plgpu.ACC((rows, head_dim), jnp.float32))
                else:
                    def pv_matmul(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv_matmul)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def one_sequence(i, carry):
                base, acc, m_i, l_i = carry
                _, q_begin, q_end, offset, lo, hi = seq_info(item, i)
                # steps whose keys all (stored) rows of this warpgroup see need no mask
                full = jnp.clip(lax.div(tq + offset + 1, jnp.int32(block_kv)), lo, hi)
                if flat:   # ... and only if all its rows belong to this sequence
                    full = jnp.where((q_begin <= tq) & (q_end >= tq + bq), full, lo)
                # ring slot of step jj: (base + jj - lo) % num_stages, as the memory
                # warpgroup counts
                kw = dict(base=base - lo, q_begin=q_begin, q_end=q_end, offset=offset)
                carry = lax.fori_loop(lo, full, functools.partial(key_step, masked=False, **kw),
                                      (acc, m_i, l_i))
                acc, m_i, l_i = lax.fori_loop(full, hi,
                                              functools.partial(key_step, masked=True, **kw),
                                              carry)
                return base + hi - lo, acc, m_i, l_i

            base, acc, m_i, l_i = lax.fori_loop(0, seqs_in(item), one_sequence,
                                                (base, acc, m_i, l_i))
            empty = l_i == 0.0                            # padding rows: acc is 0, output 0
            l_safe = jnp.where(empty, 1.0, l_i)
            acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])

            def store_rows(src, dst):
                """Only the rows of this sequence: TMA boxes have static shapes, so the n rows
                are written as the binary digits of n (a ladder of bq, bq/2, ..., 1-row stores)
                from an untiled buffer (row-granular slices). dst(g, first_token, size) is the
                target."""
                seq_begin, seq_end = item["seq_begin"], item["seq_end"]
                first = jnp.clip(seq_begin - tq, 0, bq)
                n = jnp.clip(jnp.minimum(tq + bq, seq_end) - jnp.maximum(tq, seq_begin), 0, bq)
                n = jnp.where(item["valid"], n, 0)
                for g in range(group):
                    done = first
                    size = bq
                    while size >= 1:
                        @pl.when(lax.bitwise_and(n, jnp.int32(size)) != 0)
                        def _store(size=size, done=done, g=g):
                            plgpu.copy_smem_to_gmem(src.at[pl.ds(g * bq + done, size)],
                                                    dst(g, tq + done, size))
                        done = done + lax.bitwise_and(n, jnp.int32(size))
                        size //= 2

            if num_splits > 1:
                # this split's normalised output (f32) and log2-sum-exp2 (-inf when it saw no
                # key), merged afterwards; the lse is broadcast over LSE_COLS columns (TMA
                # boxes need 16+ bytes a row)
                lse = jnp.where(empty, -jnp.inf, m_i + jnp.log(l_safe) * LOG2E)
                os, ls = o_smem.at[wg], lse_smem.at[wg]
                os[...] = acc
                ls[...] = lax.broadcast_in_dim(lse, (ROWS_PER_WG, LSE_COLS), [0])
                plgpu.commit_smem()
                store_rows(os, lambda g, t, size: o_ref.at[split, pl.ds(t, size), h * group + g])
                store_rows(ls, lambda g, t, size: lse_ref.at[split, pl.ds(t, size),
                                                             h * group + g])
            elif flat:   # whole tiles; rows past T are clipped by the TMA unit
                qs[...] = acc.astype(qs.dtype)
                plgpu.commit_smem()

                @pl.when(item["valid"])
                def _store():
                    for g in range(group):
                        plgpu.copy_smem_to_gmem(qs.at[pl.ds(g * bq, bq)],
                                                o_ref.at[pl.ds(tq, bq), h * group + g])
            else:
                os = o_smem.at[wg]
                os[...] = acc.astype(os.dtype)
                plgpu.commit_smem()
                store_rows(os, lambda g, t, size: o_ref.at[pl.ds(t, size), h * group + g])
            # the staging buffers (and q's) are rewritten by the next item: wait until the
            # stores have read them (their writes complete before the kernel ends)
            with jax.named_scope("store_wait"):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return base, item_next, item_after

        lax.fori_loop(0, rounds, one_item, (jnp.int32(0), *first_items))
        plgpu.wait_smem_to_gmem(0)
        if schedule_barrier:
            pl.when(wg == 0)(sync_schedule)

    @pl.when(wg == compute_wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def one_item(k, carry):
            base, item = carry
            item_next = work_item(k + 1)      # loaded one item ahead (see the compute NOTE)
            col = pl.ds(item["h"] * head_dim, head_dim)

            def one_sequence(i, base):
                s, _, _, _, lo, hi = seq_info(item, i)
                table = bt_offset + s * blocks_per_seq

                def pages_of(jj):   # the cache blocks of key step jj (clamped into the row)
                    return tuple(bt_ref[table + jnp.minimum(jj * pages + c, blocks_per_seq - 1)]
                                 for c in range(pages))

                # NOTE: block-table entries are loaded bt_ahead key steps before their copies
                # (a FIFO carried in registers): each load takes a memory latency, ~1 us once
                # the copies fill the memory system, and loaded on the spot it would hold up
                # every step's copies.
                def fill(jj, fifo):
                    n = base + jj - lo
                    slot = lax.rem(n, jnp.int32(num_stages))
                    fifo = fifo + pages_of(jj + bt_ahead)
                    pages_here, fifo = fifo[:pages], fifo[pages:]
                    for cache, smem, ready, free in ((k_ref, k_smem, k_bar, k_free),
                                                     (v_ref, v_smem, v_bar, v_free)):
                        @pl.when(n >= num_stages)
                        def _wait_free():
                            with jax.named_scope("free_wait"):
                                plgpu.barrier_wait(free.at[slot])

                        with jax.named_scope("issue"):
                            for c, page in enumerate(pages_here):
                                plgpu.copy_gmem_to_smem(
                                    cache.at[pl.ds(page * block_size, block_size), col],
                                    smem.at[slot, pl.ds(c * block_size, block_size)],
                                    ready.at[slot])
                    return fifo

                lax.fori_loop(lo, hi, fill, sum((pages_of(lo + d) for d in range(bt_ahead)), ()))
                return base + hi - lo

            return lax.fori_loop(0, seqs_in(item), one_sequence, base), item_next

        total_steps, _ = lax.fori_loop(0, rounds, one_item, (jnp.int32(0), work_item(jnp.int32(0))))

        # NOTE: observe the last releases too: every phase of a barrier is then waited on by
        # the thread that waits on it at all (interpret mode checks this when the CTA ends).
        @pl.loop(jnp.maximum(total_steps - num_stages, 0), total_steps)
        def _drain(n):
            slot = lax.rem(n, jnp.int32(num_stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])




# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


def default_num_splits(num_tokens: int, num_seqs: int, kv_heads: int, context: int,
                       block_kv: int, num_ctas: int = H200.num_sms) -> int:
    """Key-range splits for decode-heavy batches: as many as keep the work items (sequences x
    kv heads x splits) within one round of the persistent grid, with at least two key steps
    per split (at most 32); 1 for prefill-heavy batches. A second, partial round costs a whole
    item's time (H200: one 8K-token decode took 13.5 us in 16 splits, 128 items, and 22.0 in
    17). Approximate: it counts min(T, S) sequences, not the padding tokens' tile nor sequences
    that span several tiles."""
    if prefill_heavy(num_tokens, num_seqs):
        return 1
    work = max(min(num_tokens, num_seqs) * kv_heads, 1)
    return int(max(1, min(num_ctas // work, context // (2 * block_kv), 32)))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "tiling", "block_kv", "num_stages",
    "schedule_barrier", "heavy_first", "interpret", "compute_wgs", "num_splits", "num_ctas",
    "q_buffers", "bt_ahead"))
def ragged_paged_attention_mgpu(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1,
                                seq_lens_S, block_tables_SB, *, sm_scale: float,
                                sliding_window: int | None = None, soft_cap: float | None = None,
                                tiling: str = "sequence", block_kv: int = 128, num_stages: int = 2,
                                compute_wgs: int = COMPUTE_WGS, num_splits: int | None = 1,
                                schedule_barrier: bool = True, heavy_first: bool = True,
                                num_ctas: int | None = None, q_buffers: int = 1,
                                bt_ahead: int = 0,
                                interpret: bool | plgpu.InterpretGPUParams | None = None
                                ) -> jax.Array:
    """Causal attention of a ragged batch over a paged KV cache -> o f[T, N, E].

    The defaults are the prefill configuration (PREFILL_CONFIG); DECODE_CONFIG is the one for
    decode-heavy batches.
    tiling: "sequence" (each tile serves one sequence: any batch, decode rows included) or
    "flat" (tiles of the token axis whatever the sequences: faster on prefill-only batches, but
    a tile runs one key loop per sequence in it, so decode rows serialise: never use it for
    batches with decode rows).
    block_kv: keys per pipeline step (multiple of 64 and of P); num_stages: depth of the K/V
    ring in shared memory; compute_wgs: compute warpgroups per CTA (64 query rows each);
    num_splits: work items per query tile and kv head along the key range ("sequence" tiling;
    partial outputs merged by their log-sum-exp afterwards; None = default_num_splits);
    schedule_barrier: make two compute warpgroups alternate (FA3 ping-pong); heavy_first: hand
    out the tiles with the longest causal range first; num_ctas: CTAs of the persistent grid
    (default: one per SM of the GPU, fewer if there are fewer work items); q_buffers: 2 copies
    the next work item's q during the current one (shared memory for a second q tile);
    bt_ahead: key steps ahead of its copies that the memory warpgroup loads the block-table
    entries (registers: up to (bt_ahead + 1) x block_kv // P of them, in a warpgroup capped at
    40; a sequence's last bt_ahead steps load entries that go unused); interpret: run in
    Mosaic GPU interpret mode (default: when no GPU is present; an InterpretGPUParams sets its
    options, e.g. race detection in the tests).
    """
    _validate(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB)
    if tiling not in ("sequence", "flat"):
        raise ValueError(f"tiling must be 'sequence' or 'flat'; got {tiling!r}")
    t, n, e = q_TNE.shape
    nb, p, kh, _ = k_cache_NPKE.shape
    s, b = block_tables_SB.shape
    g = n // kh
    num_ctas = num_ctas or num_sms()
    if num_splits is None:
        num_splits = (default_num_splits(t, s, kh, b * p, block_kv, num_ctas)
                      if tiling == "sequence" else 1)
    _check_supported(q_TNE, k_cache_NPKE, block_kv, num_stages, sliding_window, soft_cap, tiling,
                     compute_wgs, num_splits, q_buffers, bt_ahead)
    schedule_barrier = schedule_barrier and compute_wgs == 2
    ct = compute_wgs * (ROWS_PER_WG // g)
    # NOTE: q is copied into 8-row tiled shared memory, and Mosaic GPU then wants T to be a
    # multiple of 8 (or below 8): pad odd token counts (a copy of q; engine buckets avoid it).
    t_pad = t if t % 8 == 0 or t < 8 else t + (-t) % 8
    # flat: tiles of the token axis; sequence: at most qsl[s+1] // CT - qsl[s] // CT + 1 tiles
    # per sequence (sequence_tile_map)
    num_tiles = pl.cdiv(t_pad, ct) if tiling == "flat" else t_pad // ct + s + 1
    if t_pad != t:
        q_TNE = jnp.pad(q_TNE, ((0, t_pad - t), (0, 0), (0, 0)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    interpret_params = (interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                        else plgpu.InterpretGPUParams() if interpret else None)
    interpret = interpret_params is not None
    num_ctas = min(num_ctas, num_tiles * kh * num_splits)
    dtype = q_TNE.dtype
    split = num_splits > 1
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(
        _rpa_mgpu_kernel, tiling=tiling, num_tokens=t_pad, num_seqs=s, blocks_per_seq=b,
        block_size=p, group=g, head_dim=e, block_kv=block_kv, num_stages=num_stages,
        num_tiles=num_tiles, sm_scale=float(sm_scale), schedule_barrier=schedule_barrier,
        heavy_first=heavy_first, interpret=interpret, compute_wgs=compute_wgs,
        num_splits=num_splits, kv_heads=kh, num_ctas=num_ctas, q_buffers=q_buffers,
        bt_ahead=bt_ahead,
        bt_offset=len(TILE_FIELDS) * num_tiles + 1 if tiling == "sequence" else 0)
    if split:
        out_type = (jax.ShapeDtypeStruct((num_splits, t_pad, n, e), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, t_pad, n, LSE_COLS), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct((t_pad, n, e), dtype)
        kernel = absent_refs(kernel, 8)   # seven inputs, then o: no lse
    rows = (compute_wgs, ROWS_PER_WG)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((compute_wgs, q_buffers, ROWS_PER_WG, e), dtype, transforms=tiled),
            # untiled output staging for row-granular stores ("sequence" tiling only)
            plgpu.SMEM((*rows, e), jnp.float32 if split else dtype)
            if tiling == "sequence" else None,
            plgpu.SMEM((*rows, LSE_COLS), jnp.float32) if split else None,
            plgpu.SMEM((num_stages, block_kv, e), dtype, transforms=tiled),
            plgpu.SMEM((num_stages, block_kv, e), dtype, transforms=tiled),
            plgpu.Barrier(num_arrivals=g, num_barriers=compute_wgs * q_buffers),
            plgpu.Barrier(num_arrivals=block_kv // p, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=block_kv // p, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=2),
            # P staging for interpret mode only (see the NOTE in the kernel)
            plgpu.SMEM((*rows, block_kv), dtype, transforms=tiled) if interpret else None,
        ),
        # persistent: each CTA loops over work items (see the kernel)
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        # NOTE: "sequence" needs Lane semantics: under Warpgroup semantics the layout inference
        # tiles the output buffer in 8 rows and rejects the row-granular store slices; "flat"
        # runs ~7% faster under Warpgroup semantics.
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane if tiling == "sequence"
            else plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
        kernel_name=f"ragged_paged_attention_mgpu_{tiling}_bkv{block_kv}_w{num_stages}"
                    f"_c{compute_wgs}_x{num_splits}_q{q_buffers}_a{bt_ahead}",
    )
    bt_flat = block_tables_SB.reshape(s * b).astype(jnp.int32)
    if tiling == "sequence":
        # The kernel reads the map (which holds every tile's bounds) and the block table only:
        # one buffer, bt_offset entries in, computed in the map's fusion; a fresh allocation,
        # so aligned (see _own_buffer). query_start_loc and seq_lens are not read.
        meta = jnp.concatenate([
            sequence_tile_map(query_start_loc_S1, seq_lens_S, t_pad, num_tiles, ct,
                              longest_first_block_kv=block_kv if heavy_first else None),
            bt_flat])
        small = (meta, meta, meta, meta)
    else:   # the map is not read
        small = (_own_buffer(query_start_loc_S1), _own_buffer(seq_lens_S), _own_buffer(bt_flat),
                 jnp.zeros(64, jnp.int32))
    outs = call(*small, q_TNE, k_cache_NPKE.reshape(nb * p, kh * e),
                v_cache_NPKE.reshape(nb * p, kh * e))
    if split:
        # NOTE: interpreted, the merge is plain XLA: the Triton merge kernel's interpreter
        # after Mosaic GPU's interpreted kernel in one program deadlocked on 2 CPU cores
        o_TNE = merge_splits(outs[0], outs[1][..., 0], out_dtype=dtype,
                             impl="xla" if interpret else "pallas", interpret=False)
    else:
        o_TNE = outs
    return o_TNE[:t] if t_pad != t else o_TNE


