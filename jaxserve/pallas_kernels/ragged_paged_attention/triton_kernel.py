"""Ragged paged attention's Triton kernel (Pallas' Triton lowering; interpreted on a CPU): any
batch of decode rows and prompt chunks, with key-range splits for decode grids. Problem,
layouts and the grid's design: the package's docstring (__init__.py); its tiling comes whole
from the wrapper (tiling.choose_tiling)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, whole
from jaxserve.pallas_kernels.ragged_paged_attention.reference import LOG2E
from jaxserve.pallas_kernels.ragged_paged_attention.tiling import (
    VECTOR_SEARCH_MAX_SEQS, num_tiles, tile_rows)
from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling
from jaxserve.pallas_kernels.split_merge import merge_splits


def _item_steps(seq_len, qlen, *, block_k: int, sliding_window: int | None):
    """Key steps of a sequence's (tile, kv head) items, at most: its last tile's causal end
    from its first tile's window start (exact for one-tile sequences, decode rows)."""
    kv_lo = 0
    if sliding_window is not None:
        kv_lo = jnp.maximum(seq_len - qlen - sliding_window + 1, 0) // block_k * block_k
    return jnp.maximum(pl.cdiv(seq_len - kv_lo, block_k), 0)


def fill_split_counts(item_steps, items, programs, most):
    """Splits of each sequence's items in a fill_splits grid of `programs` programs (vectors
    over sequences: key steps of one item, items): one each, and the spare programs (programs
    - items in all) shared out in proportion to an item's key steps, so that a long context's
    items get more of them; at most `most`, and at most the item's steps. With equal steps
    that is programs // items each within those caps. They take at most `programs` programs
    in all (given items <= programs): sum(items x (1 + floor(steps x spare / work))) <= items
    + spare."""
    spare = programs - jnp.sum(items)
    work = jnp.maximum(jnp.sum(items * item_steps), 1)
    extra = item_steps * spare // work
    return jnp.clip(1 + extra, 1, jnp.minimum(most, jnp.maximum(item_steps, 1)))




def rpa_kernel(
    # inputs
    qsl_ref, seq_lens_ref, bt_ref, q_ref, k_ref, v_ref,
    # outputs
    o_ref, lse_ref, live_ref,
    *, sm_scale, sliding_window, soft_cap, block_q, g, gp, kv_heads, head_dim, block_size,
    blocks_per_seq, block_k, num_splits, num_tokens, num_seqs, fast_exp2, mask_all_steps,
    heavy_first, prefetch_slots, heads_inner, fill_splits):
    if fill_splits:   # grid (P,): the work item and split come from the busy count, below
        p, num_programs = pl.program_id(0), pl.num_programs(0)
    else:
        j, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        if heads_inner:   # grid (K, J, X): a tile's kv heads are neighbours in launch order
            j, h = h, j
        if heavy_first:   # launch the last query tiles (longest causal range) first
            j = num_tiles(num_tokens, num_seqs, block_q) - 1 - j
    rows = tile_rows(block_q, gp)
    n = kv_heads * g
    # --- which sequence and query tile: the last s whose first tile start(s) is <= j (start is
    # nondecreasing; sequences without tiles share the next one's start and are never picked)
    if num_seqs <= VECTOR_SEARCH_MAX_SEQS:   # exact starts: prefix sum of the tile counts
        # NOTE: every sequence's bounds and length come in one round of loads and the program
        # picks its own from registers, rather than loading them again after the search: one
        # memory latency less before the first K/V copy (0.1-0.2 us off split decode grids).
        s_all = jnp.arange(pl.next_power_of_2(num_seqs + 1), dtype=jnp.int32)
        begin_all = plgpu.load(qsl_ref.at[jnp.minimum(s_all, num_seqs)])
        end_all = jnp.where(s_all < num_seqs,
                            plgpu.load(qsl_ref.at[jnp.minimum(s_all + 1, num_seqs)]), num_tokens)
        len_all = plgpu.load(seq_lens_ref.at[jnp.minimum(s_all, num_seqs - 1)])
        tiles_all = jnp.where(s_all <= num_seqs, pl.cdiv(end_all - begin_all, block_q), 0)
        start_all = jnp.cumsum(tiles_all) - tiles_all
        if fill_splits:
            # each sequence's (tile, kv head) items get splits in proportion to their key
            # steps (fill_split_counts), and the programs of every split, in sequence order,
            # are dealt over the grid
            real = s_all < num_seqs
            items_all = jnp.where(real, tiles_all, 0) * kv_heads
            x_all = fill_split_counts(
                _item_steps(len_all, end_all - begin_all, block_k=block_k,
                            sliding_window=sliding_window),
                items_all, num_programs, fill_splits)
            progs_all = items_all * x_all
            pstart_all = jnp.cumsum(progs_all) - progs_all
            # NOTE: the busy programs are spread evenly over the grid (the i-th is program
            # floor(i P / busy)), not packed at its start: packed, they ran ~10 % slower on an
            # H200 (why idle programs slow the busy ones at all was not found out)
            busy = jnp.sum(progs_all)
            i = pl.cdiv(p * busy, num_programs)
            idle = (i >= busy) | ((i * num_programs) // jnp.maximum(busy, 1) != p)
            # the program's sequence: the last whose programs start at or before i (those
            # without items share the next one's start and are never picked by a busy
            # program; an idle one may pick one, and stores nothing)
            seq = jnp.sum(((pstart_all <= i) & real).astype(jnp.int32)) - 1
        else:
            seq = jnp.sum(((start_all <= j) & (s_all <= num_seqs)).astype(jnp.int32)) - 1

        def pick(x_all):
            return jnp.sum(jnp.where(s_all == seq, x_all, 0))

        first_tile = pick(start_all)
        if fill_splits:
            live_splits = pick(x_all)
            local = i - pick(pstart_all)
            split = local % live_splits
            j = first_tile + local // live_splits // kv_heads
            h = local // live_splits % kv_heads
            real_tokens = jnp.sum(jnp.where(s_all == num_seqs, begin_all, 0))

            @pl.when(p == 0)
            def _():
                live_ref[num_tokens] = real_tokens
        q_begin, q_end, own_len = pick(begin_all), pick(end_all), pick(len_all)
    else:                                    # binary search over start(s) = qsl[s] // BQ + s
        def start(s, qsl_s):
            return qsl_s // block_q + s

        def search(_, lo_hi):
            lo, hi = lo_hi
            mid = (lo + hi + 1) // 2
            go_up = start(mid, qsl_ref[mid]) <= j
            return jnp.where(go_up, mid, lo), jnp.where(go_up, hi, mid - 1)

        seq, _ = jax.lax.fori_loop(0, max(1, (num_seqs + 1).bit_length()), search,
                                   (jnp.int32(0), jnp.int32(num_seqs)))
        first_tile = start(seq, qsl_ref[seq])
        q_begin = qsl_ref[seq]
        q_end = jnp.where(seq == num_seqs, num_tokens, qsl_ref[jnp.minimum(seq + 1, num_seqs)])
        own_len = seq_lens_ref[jnp.minimum(seq, num_seqs - 1)]
    is_pad = seq == num_seqs          # the padding pseudo-sequence: empty context, zero output
    if fill_splits:                   # a program past the busy items: no keys, no store
        is_pad |= idle
    qlen = q_end - q_begin
    qblk = j - first_tile
    seq_len = jnp.where(is_pad, qlen, own_len)

    r = jnp.arange(rows, dtype=jnp.int32)
    real_row = r < block_q * gp
    # NOTE: padding rows get token ids past the batch: they alias no real row (see the store)
    tok_R = jnp.where(real_row, q_begin + qblk * block_q + r // gp, num_tokens + r)
    head_R = h * g + r % gp
    valid_R = (tok_R < q_end) & (r % gp < g) & real_row
    if fill_splits:
        valid_R &= ~idle
    pos_R = seq_len - qlen + (tok_R - q_begin)

    # --- key range: causal end of the tile, window start, then this split's share (in steps)
    first_pos = seq_len - qlen + qblk * block_q
    last_pos = jnp.minimum(first_pos + block_q, seq_len) - 1
    kv_end = jnp.where(is_pad | (qblk * block_q >= qlen), 0, last_pos + 1)
    kv_begin = 0
    if sliding_window is not None:
        window_R = pos_R - sliding_window      # the last key before each row's window
        kv_begin = jnp.maximum(first_pos - sliding_window + 1, 0) // block_k * block_k
    steps = jnp.maximum(pl.cdiv(kv_end - kv_begin, block_k), 0)
    # each row's last visible key: its causal edge or the tile's end, so that masking a score
    # is one compare (padding rows' positions lie past kv_end)
    last_R = jnp.minimum(pos_R, kv_end - 1)
    per_split = pl.cdiv(steps, live_splits if fill_splits else num_splits)
    step_lo = jnp.minimum(split * per_split, steps)
    step_hi = jnp.minimum(step_lo + per_split, steps)
    # steps whose keys every row sees: no mask needed there (most of a long context)
    full_hi = jnp.clip((first_pos + 1 - kv_begin) // block_k, step_lo, step_hi)
    full_lo = step_lo
    if sliding_window is not None:
        full_lo = jnp.clip(pl.cdiv(last_pos - sliding_window + 1 - kv_begin, block_k), step_lo,
                           full_hi)

    # NOTE: every index is an integer array (no pl.ds mixed in) because interpret mode only
    # discharges all-array (or all-slice) indexers; Triton makes the same pointers of both.
    e_1E = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[jnp.minimum(tok_R, num_tokens - 1)[:, None],
                            jnp.minimum(head_R, n - 1)[:, None], e_1E])       # [R, E]
    cols_1E = h * head_dim + e_1E
    # scores are kept in log2 units so the softmax uses exp2 (one MUFU op on the GPU)
    score_scale = sm_scale * LOG2E if soft_cap is None else sm_scale

    def exp2(x):
        if not fast_exp2:
            return jnp.exp2(x)
        return plgpu.elementwise_inline_asm(
            "ex2.approx.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]

    def key_positions(step):
        return kv_begin + step * block_k + jnp.arange(block_k, dtype=jnp.int32)

    def slots(step):
        kpos = key_positions(step)
        lblk = jnp.minimum(kpos // block_size, blocks_per_seq - 1)
        page = plgpu.load(bt_ref.at[jnp.minimum(seq, num_seqs - 1) * blocks_per_seq + lblk])
        return page * block_size + kpos % block_size

    def body(step, carry, *, masked):
        acc, m_R, l_R, slot = carry
        kpos = key_positions(step)
        if prefetch_slots:   # this step's slots came from the last one; look up the next's
            next_slot = slots(step + 1)
        else:
            slot = next_slot = slots(step)
        k = plgpu.load(k_ref.at[slot[:, None], cols_1E])                      # [BK, E]
        v = plgpu.load(v_ref.at[slot[:, None], cols_1E])                      # [BK, E]
        s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * score_scale   # [R, BK]
        if soft_cap is not None:
            s = (soft_cap * LOG2E) * jnp.tanh(s / soft_cap)
        if masked:
            vis = kpos[None, :] <= last_R[:, None]
            if sliding_window is not None:
                vis &= kpos[None, :] > window_R[:, None]
            s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m_R, s.max(axis=1))
        # NOTE: rows that have seen no visible key keep m = -inf; shifting by 0 there keeps
        # exp2() at exactly 0 instead of NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = exp2(s - m_safe[:, None])
        corr = exp2(m_R - m_safe)
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_new, l_R * corr + p.sum(axis=1), next_slot

    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32), slots(step_lo))
    masked_body = functools.partial(body, masked=True)
    if mask_all_steps:   # one loop: a third of the code, and one pipeline for Triton to fill
        acc, m_R, l_R, _ = jax.lax.fori_loop(step_lo, step_hi, masked_body, carry)
    else:
        carry = jax.lax.fori_loop(step_lo, full_lo, masked_body, carry)       # window edge
        carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
        acc, m_R, l_R, _ = jax.lax.fori_loop(full_hi, step_hi, masked_body, carry)  # causal edge

    empty = l_R == 0.0
    o = acc / jnp.where(empty, 1.0, l_R)[:, None]
    # NOTE: stores use the unclamped (token, head) of each row: masked-off rows then never
    # alias a real row (interpret mode would otherwise write back stale values over it).
    if lse_ref is None:
        plgpu.store(o_ref.at[tok_R[:, None], head_R[:, None], e_1E], o.astype(o_ref.dtype),
                    mask=valid_R[:, None])
    else:   # split x's normalised partial and log2-sum-exp2 (-inf when it saw no key)
        x_R = jnp.full((rows,), split, jnp.int32)
        plgpu.store(o_ref.at[x_R[:, None], tok_R[:, None], head_R[:, None], e_1E], o,
                    mask=valid_R[:, None])
        lse = jnp.where(empty, -jnp.inf, m_R + jnp.log2(jnp.where(empty, 1.0, l_R)))
        plgpu.store(lse_ref.at[x_R, tok_R, head_R], lse, mask=valid_R)
        if fill_splits:   # the merge reads this many splits of each of the tile's tokens
            # NOTE: rows left out index past live (a token's other heads would alias it)
            first = valid_R & (r % gp == 0) & (split == 0)
            plgpu.store(live_ref.at[jnp.where(first, tok_R, num_tokens + 1 + r)],
                        jnp.full((rows,), live_splits, jnp.int32), mask=first)



def triton_ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1,
                                  seq_lens_S, block_tables_SB, *, sm_scale: float,
                                  sliding_window: int | None, soft_cap: float | None,
                                  tiling: Tiling, interpret: bool) -> jax.Array:
    """The kernel at a whole `tiling` (every field set: tiling.choose_tiling) -> o f[T, N, E]."""
    t, n, e = q_TNE.shape
    nb, p, kh, _ = k_cache_NPKE.shape
    s, b = block_tables_SB.shape
    g = n // kh
    gp = pl.next_power_of_2(g)
    num_splits, fill = tiling.num_splits, tiling.fill_splits
    if fill and s > VECTOR_SEARCH_MAX_SEQS:
        raise ValueError(f"fill_splits needs at most {VECTOR_SEARCH_MAX_SEQS} sequence slots "
                         f"(it counts the busy ones in one vector load); got S={s}")
    tiles = num_tiles(t, s, tiling.block_q)
    kernel = functools.partial(
        rpa_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=tiling.block_q, g=g, gp=gp, kv_heads=kh, head_dim=e, block_size=p,
        blocks_per_seq=b, block_k=tiling.block_k, num_splits=num_splits, num_tokens=t,
        num_seqs=s, fast_exp2=not interpret, mask_all_steps=tiling.mask_all_steps,
        heavy_first=tiling.heavy_first, prefetch_slots=tiling.prefetch_slots,
        heads_inner=tiling.heads_inner, fill_splits=num_splits if fill else 0)
    split_out = num_splits > 1
    if split_out:   # every split's partial and log-sum-exp (and with fill, what was written)
        out_shape = (jax.ShapeDtypeStruct((num_splits, t, n, e), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, t, n), jnp.float32))
        out_specs = (whole(num_splits, t, n, e), whole(num_splits, t, n))
        if fill:    # each token's split count, then the tokens written
            out_shape += (jax.ShapeDtypeStruct((t + 1,), jnp.int32),)
            out_specs += (whole(t + 1),)
        else:
            kernel = absent_refs(kernel, 8)    # six inputs, o and lse: no live
    else:
        out_shape = (jax.ShapeDtypeStruct((t, n, e), q_TNE.dtype),)
        out_specs = (whole(t, n, e),)
        kernel = absent_refs(kernel, 7, 8)     # six inputs, then o: no lse, no live
    if fill:        # each program finds its item and split
        grid = (tiling.fill_programs,)
        if grid[0] < tiles * kh:
            raise ValueError(f"fill_programs={grid[0]} must be at least the grid's "
                             f"{tiles * kh} (query tile, kv head) items")
    else:
        grid = ((kh, tiles) if tiling.heads_inner else (tiles, kh)) + (num_splits,)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(s + 1), whole(s), whole(s * b), whole(t, n, e), whole(nb * p, kh * e),
                  whole(nb * p, kh * e)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{tiling.block_q}_bk{tiling.block_k}_x{num_splits}"
             + ("_fill" if fill else ""),
    )(query_start_loc_S1.astype(jnp.int32), seq_lens_S.astype(jnp.int32),
      block_tables_SB.astype(jnp.int32).reshape(s * b), q_TNE,
      k_cache_NPKE.reshape(nb * p, kh * e), v_cache_NPKE.reshape(nb * p, kh * e))
    if not split_out:
        return outs[0]
    return merge_splits(*outs, out_dtype=q_TNE.dtype, impl="pallas", interpret=interpret)
