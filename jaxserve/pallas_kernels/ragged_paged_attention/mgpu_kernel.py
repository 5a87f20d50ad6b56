"""The Mosaic GPU ragged paged attention kernel's body (Hopper: wgmma, TMA, warp
specialisation); its design, layouts and wrapper: mgpu.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.pallas_kernels.ragged_paged_attention.reference import LOG2E

ROWS_PER_WG = 64          # wgmma M per warpgroup
TILE_FIELDS = ("seq", "t0", "seq_begin", "seq_end", "offset")   # sequence_tile_map's rows
LSE_COLS = 8              # a split's log-sum-exp is stored as [rows, 8] (TMA boxes >= 16 bytes)


def rpa_mgpu_kernel(
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
