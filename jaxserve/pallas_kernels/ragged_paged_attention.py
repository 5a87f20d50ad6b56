"""Ragged paged attention: one kernel for decode rows and prefill chunks in the same batch.

Every sequence s owns the query tokens query_start_loc[s] : query_start_loc[s+1] of the step
(qlen_s of them) and a context of seq_lens[s] keys in the paged cache, this step's keys
included. Query token i of sequence s sits at absolute position seq_lens[s] - qlen_s + i and
sees the keys at positions 0..that position (the last `sliding_window` of them if set). Decode
rows are simply sequences with qlen 1; GQA shares each kv head among G = N // K query heads.

Layouts (per layer):
    q_TNE           f[T, N, E]     this step's queries (tokens after query_start_loc[-1] are
                                   padding: their output is written as zeros)
    k_cache_NPKE    f[NB, P, K, E] paged keys   (NB cache blocks of P slots; block 0 = null)
    v_cache_NPKE    f[NB, P, K, E] paged values
    query_start_loc i32[S+1]       first token of each sequence; padding sequences repeat it
    seq_lens        i32[S]         context length after this step (0 for padding sequences)
    block_tables    i32[S, B]      physical block of each logical block of each sequence
    -> o_TNE        f[T, N, E]

Legend: T tokens, S sequences, N query heads, K kv heads, G = N // K, E head dim, NB cache
blocks, P slots per block, B blocks per sequence, J query tiles, BQ tokens per query tile,
R = max(BQ * Gp, 16) rows of one tile (Gp = G rounded up to a power of two), BK keys per step,
X context splits (flash-decoding: partial softmaxes merged afterwards).

How the GPU kernel (Triton lowering of pallas_call) is laid out: the grid is (J, K, X), or
(K, J, X) for unsplit decode grids (heads_inner: a tile's kv heads launch side by side, so a
padded bucket's busy programs, the first ones, land on separate SMs); program j finds its
(sequence, query tile) from query_start_loc itself (every sequence's tile count and their
prefix sum, with its bounds and length, from three vector loads; a binary search past
VECTOR_SEARCH_MAX_SEQS sequences), so no XLA kernel runs before the launch, which matters for
small decode steps.
A program loads its R query rows (BQ tokens x the G heads that share kv head k: GQA costs
one read of K/V per group, not per head), walks its causal key range BK keys at a time,
gathering the slots through the block table, and keeps an online softmax (exp2; decode
buckets mask every key step in one loop, other batches only the causal and window edge
steps). With X > 1 each program covers 1/X of the key range and writes a normalised partial
output and its log-sum-exp; a second small kernel (split_merge.py) merges them. This is what
keeps a batch of one or a few long decodes from leaving most SMs idle. Keys per step (BK) also
set how many programs an SM holds at once (their shared memory and registers); default_block_k
takes 64 for decode grids that only then fit in one wave. A decode grid of up to two programs
per SM with most SMs busy is not split but pipelined: 128- or 64-key steps whose K/V Triton
double-buffers (pipelined_decode); one of several waves whose busy programs fill 64-key 3-stage
waves better than 128-key 2-stage ones takes those (many_wave_decode). Both hold for a padded
bucket from tiling_busy_floor busy sequences up, which its caller says (busy_seqs). A decode
grid of fewer programs than SMs is split into one pipelined wave (split_decode_tiling): X from
the grid's size when every slot is busy. In a padded bucket of up to two programs per SM whose
busy count is not said, the grid is 2 or 3 x num_sms() programs and the kernel itself counts the
busy (tile, kv head) items and splits each, in proportion to its key steps, to fill them
(fill_splits: grid (P,), the split counts run-time values that the merge is told through a
small `live` output). The engine also takes that tiling for a full bucket whose contexts are
skewed (skewed_contexts).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, num_sms, resolve_impl, tuning, whole
from jaxserve.pallas_kernels.split_merge import merge_splits

# ---------------------------------------------------------------------------------------------
# Reference (plain jnp, dense per sequence; slow but obviously right)
# ---------------------------------------------------------------------------------------------


def _token_positions(query_start_loc_S1, seq_lens_S, num_tokens: int):
    """(sequence i32[T], absolute position i32[T], is-real bool[T]) of every token."""
    s_count = seq_lens_S.shape[0]
    tok_T = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_T = jnp.searchsorted(query_start_loc_S1[1:], tok_T, side="right").astype(jnp.int32)
    real_T = seq_T < s_count      # tokens past query_start_loc[-1] are padding
    seq_T = jnp.minimum(seq_T, s_count - 1)
    qlen_T = query_start_loc_S1[seq_T + 1] - query_start_loc_S1[seq_T]
    pos_T = seq_lens_S[seq_T] - qlen_T + (tok_T - query_start_loc_S1[seq_T])
    return seq_T, jnp.where(real_T, pos_T, -1), real_T


def _visible_scores(s_KGL, slot_L, pos, *, soft_cap, sliding_window):
    """Soft-capped scores with the keys a token at `pos` may not see set to -inf."""
    if soft_cap is not None:
        s_KGL = soft_cap * jnp.tanh(s_KGL / soft_cap)
    vis_L = slot_L <= pos
    if sliding_window is not None:
        vis_L &= slot_L > pos - sliding_window
    return jnp.where(vis_L, s_KGL, -jnp.inf)


def ref_ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S,
                               block_tables_SB, *, sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> jax.Array:
    """Token-by-token reference in f32 over densely gathered contexts; padding tokens get 0."""
    t, n, e = q_TNE.shape
    _, p, kh, _ = k_cache_NPKE.shape
    g = n // kh
    s_count = seq_lens_S.shape[0]
    seq_T, pos_T, real_T = _token_positions(query_start_loc_S1, seq_lens_S, t)
    ctx = block_tables_SB.shape[1] * p
    k_SLKE = k_cache_NPKE[block_tables_SB].reshape(s_count, ctx, kh, e).astype(jnp.float32)
    v_SLKE = v_cache_NPKE[block_tables_SB].reshape(s_count, ctx, kh, e).astype(jnp.float32)
    slot_L = jnp.arange(ctx)

    def one(q_NE, seq, pos, real):
        s_KGL = jnp.einsum("kge,lke->kgl", q_NE.reshape(kh, g, e).astype(jnp.float32), k_SLKE[seq])
        s_KGL = _visible_scores(s_KGL * sm_scale, slot_L, pos, soft_cap=soft_cap,
                                sliding_window=sliding_window)
        w_KGL = jax.nn.softmax(s_KGL, axis=-1)
        o_NE = jnp.einsum("kgl,lke->kge", w_KGL, v_SLKE[seq]).reshape(n, e)
        return jnp.where(real & (pos >= 0), o_NE, 0.0).astype(q_TNE.dtype)

    return jax.vmap(one)(q_TNE, seq_T, pos_T, real_T)


# ---------------------------------------------------------------------------------------------
# Validation and tiling
# ---------------------------------------------------------------------------------------------


def _validate(q_TNE, k_cache, v_cache, qsl, seq_lens, block_tables):
    if q_TNE.ndim != 3:
        raise ValueError(f"q_TNE must be [T, N, E]; got shape {q_TNE.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [NB, P, K, E] with equal shapes; got "
                         f"{k_cache.shape} and {v_cache.shape}")
    t, n, e = q_TNE.shape
    kh, ce = k_cache.shape[2], k_cache.shape[3]
    if ce != e:
        raise ValueError(f"head dim of q ({e}) and of the cache ({ce}) must match")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={kh} (GQA)")
    s = seq_lens.shape[0]
    if qsl.shape != (s + 1,) or block_tables.ndim != 2 or block_tables.shape[0] != s:
        raise ValueError(f"query_start_loc must be i32[S+1] and block_tables i32[S, B] with "
                         f"S = len(seq_lens) = {s}; got {qsl.shape} and {block_tables.shape}")


LOG2E = math.log2(math.e)


def _num_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Grid size along query tiles; the padding tokens past query_start_loc[S] form a last
    pseudo-sequence S. Up to VECTOR_SEARCH_MAX_SEQS sequences, sequence s owns exactly
    ceil(qlen_s / BQ) tiles from the sum of the earlier ones' (all computed in each program):
    at most (T + (S + 1)(BQ - 1)) / BQ in all, i.e. no program left idle by a batch of
    decodes. Past it (binary search), start(s) = query_start_loc[s] // BQ + s: a closed form
    that never gives fewer than ceil(qlen_s / BQ) tiles, at the cost of up to S + 1 idle ones."""
    if num_seqs <= VECTOR_SEARCH_MAX_SEQS:
        return (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q
    return num_tokens // block_q + num_seqs + 1


def _tile_rows(block_q: int, gp: int) -> int:
    """Rows of a query tile: BQ tokens x Gp heads, padded to 16 (the smallest tensor-core
    tile; the padding rows are masked off)."""
    return max(block_q * gp, 16)


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


# Up to this many sequences a program finds its own by comparing j with every start(s) at once
# (three loads and a prefix sum in registers); past it, a binary search (log2 S dependent loads).
VECTOR_SEARCH_MAX_SEQS = 2048


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _rpa_kernel(
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
            j = _num_tiles(num_tokens, num_seqs, block_q) - 1 - j
    rows = _tile_rows(block_q, gp)
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


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


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
    rows = _tile_rows(block_q, pl.next_power_of_2(group))
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
                                 _tile_rows(block_q, pl.next_power_of_2(group))) != (128, 2, 16):
        return None
    busy = min(num_seqs if busy_seqs is None else busy_seqs, num_seqs, num_tokens)
    return _num_tiles(num_tokens, num_seqs, block_q) * kv_heads, busy * kv_heads


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
    runner.ModelRunner.attention_hint)."""
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


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "impl", "block_q", "block_k", "num_splits",
    "num_warps", "num_stages", "interpret", "mask_all_steps", "heavy_first", "prefetch_slots",
    "busy_seqs", "heads_inner", "fill_splits", "fill_programs", "skewed"))
def ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S,
                           block_tables_SB, *, sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto",
                           block_q: int | None = None, block_k: int | None = None,
                           num_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, interpret: bool | None = None,
                           mask_all_steps: bool | None = None, heavy_first: bool | None = None,
                           prefetch_slots: bool | None = None,
                           busy_seqs: int | None = None,
                           heads_inner: bool | None = None,
                           fill_splits: bool | None = None,
                           fill_programs: int | None = None,
                           skewed: bool = False) -> jax.Array:
    """Attention of a mixed prefill/decode batch over a paged KV cache -> o f[T, N, E].

    impl: "pallas" (our kernels: on a GPU, prefill-heavy batches (T > 2 S) that the Mosaic GPU
    kernel supports go to it (ragged_paged_attention_mgpu.py: ~1.45x the Triton kernel's speed
    on prefill), everything else to the Triton kernel; on CPU the Triton kernel,
    interpreted), "triton" or "mgpu" (that kernel only), "xla" (plain XLA, memory-bounded) or
    "auto" (pallas on GPU, xla elsewhere). The tuning options below are the Triton kernel's
    and are picked from the shapes if None.
    mask_all_steps: one key loop that applies the causal/window mask on every step, instead of
    three (window edge, unmasked middle, causal edge; same result). Default True in interpret
    mode (3x faster to compile) and for decode buckets (T <= S) of 16-row tiles, where the
    mask is cheap and Triton then pipelines one loop rather than draining between three
    (0.5-5 % faster on 21 of 24 decode cases, H200, E = 128 in bf16; other head dims and dtypes
    not timed). Other batches keep three loops: larger tiles' masked steps cost more.
    heavy_first: launch the query tiles in reverse, the longest causal ranges first;
    prefetch_slots: look up the next key step's cache slots one step early. Both default to on
    for prefill-heavy batches (a few % off a 2K-token prefill, H200).
    busy_seqs: at least this many of the S sequence slots have query tokens (None: all of
    them). A caller that pads its batch to fixed sizes says how full it is, so that a decode
    grid of up to two programs per SM is pipelined only when most SMs get work
    (pipelined_decode), one of several waves takes 64-key 3-stage steps only where its busy
    programs fill their waves (many_wave_decode), and one of fewer programs than SMs splits
    by its own size only when it is full (split_decode_tiling); 0: not said (none of these;
    fill_splits for grids of up to two programs an SM).
    fill_splits: split each busy (query tile, kv head) item of the step into parts (at most
    num_splits) that fill a grid of fill_programs programs (default_fill_programs), in
    proportion to each item's key steps, the counts found in the kernel from query_start_loc
    and seq_lens (fill_split_counts); the default for decode buckets of up to two programs an
    SM whose busy count is not said (split_decode_tiling), which is how the engine runs padded
    buckets, and skewed steps of such buckets (skewed_contexts; larger ones: `skewed`).
    skewed: the caller says this step's contexts are skewed (skewed_contexts): decode grids of
    up to SKEWED_FILL_MAX_WAVES x num_sms() programs take fill_splits whatever busy_seqs says.
    heads_inner: launch a query tile's kv heads side by side (grid (K, J, X)) rather than a kv
    head's tiles (J, K, X). Default on for unsplit decode grids (T <= S, one split): the busy
    programs of a padded bucket, the first in launch order, then go to separate SMs (half-busy
    32-slot buckets 16-27 % faster on an H200, full ones level or up to 2 % faster). Split
    grids keep (J, K, X): with kv heads inner a padded bucket's busy programs bunched. It
    applies to tuned calls too.
    Any tuning option (block_q ... prefetch_slots, fill_splits, fill_programs) turns off the
    shape rules above: the rest of the tiling is then the plain default.
    """
    _validate(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB)
    impl, on_gpu = resolve_impl(impl, ("pallas", "triton", "mgpu", "xla"))
    if impl == "pallas":
        impl = _pallas_kernel_for(q_TNE, k_cache_NPKE, seq_lens_S, on_gpu=on_gpu,
                                  interpret=interpret, sliding_window=sliding_window,
                                  soft_cap=soft_cap)
    if impl == "mgpu":
        from jaxserve.pallas_kernels import ragged_paged_attention_mgpu as mgpu
        return mgpu.ragged_paged_attention_mgpu(
            q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            interpret=interpret)
    if impl == "xla":
        return xla_ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1,
                                          seq_lens_S, block_tables_SB, sm_scale=sm_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    t, n, e = q_TNE.shape
    nb, p, kh, _ = k_cache_NPKE.shape
    s, b = block_tables_SB.shape
    g = n // kh
    gp = pl.next_power_of_2(g)
    if e != pl.next_power_of_2(e) or e < 16:
        raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 16; got E={e}; "
                         f"use impl='xla'")
    tuned = (block_q, num_splits, block_k, num_warps, num_stages, prefetch_slots, fill_splits,
             fill_programs) != (None,) * 8
    special = None if tuned else special_decode_tiling(
        t, s, n, kh, busy_seqs, context=b * p, head_dim=e, itemsize=k_cache_NPKE.dtype.itemsize,
        skewed=skewed)
    fill = special.fill_splits if special else bool(fill_splits)
    if special:
        num_splits, step, num_stages, _ = special
        prefetch_slots = False
        block_k = max(16, min(step, pl.next_power_of_2(b * p)))   # <= the context
    block_q = block_q or default_block_q(t, s, g)
    num_stages = num_stages or 2
    num_splits = num_splits or default_num_splits(t, s, kh, block_q, b * p)
    fill = fill and num_splits > 1
    if fill and s > VECTOR_SEARCH_MAX_SEQS:
        raise ValueError(f"fill_splits needs at most {VECTOR_SEARCH_MAX_SEQS} sequence slots "
                         f"(it counts the busy ones in one vector load); got S={s}")
    rows = _tile_rows(block_q, gp)
    tiles = _num_tiles(t, s, block_q)
    num_warps = num_warps or (4 if rows <= 64 else 8)
    # the grid's size only for decode buckets (no more tokens than sequence slots): the rule
    # was measured on those, not on buckets of prompt chunks and decodes (T > S)
    programs = tiles * kh * num_splits if t <= s else None
    block_k = block_k or default_block_k(block_q, g, b * p, num_splits, programs=programs,
                                         head_dim=e, itemsize=k_cache_NPKE.dtype.itemsize,
                                         num_warps=num_warps, num_stages=num_stages)
    interpret = (not on_gpu) if interpret is None else interpret
    heavy_first = prefill_heavy(t, s) if heavy_first is None else heavy_first
    prefetch_slots = prefill_heavy(t, s) if prefetch_slots is None else prefetch_slots
    heads_inner = (t <= s and num_splits == 1) if heads_inner is None else heads_inner

    kernel = functools.partial(
        _rpa_kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=block_q, g=g, gp=gp, kv_heads=kh, head_dim=e, block_size=p, blocks_per_seq=b,
        block_k=block_k, num_splits=num_splits, num_tokens=t, num_seqs=s,
        fast_exp2=not interpret,
        mask_all_steps=(interpret or (t <= s and rows <= 16)) if mask_all_steps is None
        else mask_all_steps,
        heavy_first=heavy_first, prefetch_slots=prefetch_slots, heads_inner=bool(heads_inner),
        fill_splits=num_splits if fill else 0)
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
        grid = (fill_programs or default_fill_programs(tiles * kh),)
        if grid[0] < tiles * kh:
            raise ValueError(f"fill_programs={grid[0]} must be at least the grid's "
                             f"{tiles * kh} (query tile, kv head) items")
    else:
        grid = ((kh, tiles) if heads_inner else (tiles, kh)) + (num_splits,)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(s + 1), whole(s), whole(s * b), whole(t, n, e), whole(nb * p, kh * e),
                  whole(nb * p, kh * e)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{block_q}_bk{block_k}_x{num_splits}"
             + ("_fill" if fill else ""),
    )(query_start_loc_S1.astype(jnp.int32), seq_lens_S.astype(jnp.int32),
      block_tables_SB.astype(jnp.int32).reshape(s * b), q_TNE,
      k_cache_NPKE.reshape(nb * p, kh * e), v_cache_NPKE.reshape(nb * p, kh * e))
    if not split_out:
        return outs[0]
    return merge_splits(*outs, out_dtype=q_TNE.dtype, impl="pallas", interpret=interpret)


def _pallas_kernel_for(q_TNE, k_cache_NPKE, seq_lens_S, *, on_gpu: bool, interpret: bool | None,
                       sliding_window, soft_cap) -> str:
    """"mgpu" for prefill-heavy batches (T > 2 S, a static test on the step's bucket) on a GPU
    when the Mosaic GPU kernel supports them; "triton" otherwise (decode-heavy batches need the
    Triton kernel's key-range splits; CPU runs it interpreted)."""
    if not on_gpu or interpret or not prefill_heavy(q_TNE.shape[0], seq_lens_S.shape[0]):
        return "triton"
    from jaxserve.pallas_kernels import ragged_paged_attention_mgpu as mgpu
    supported = mgpu.supports(q_TNE, k_cache_NPKE, sliding_window=sliding_window,
                              soft_cap=soft_cap)
    return "mgpu" if supported else "triton"


# ---------------------------------------------------------------------------------------------
# XLA fallback (no Pallas): per-token gather of the sequence's context, chunked for memory
# ---------------------------------------------------------------------------------------------


def xla_ragged_paged_attention(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S,
                               block_tables_SB, *, sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, token_chunk: int = 64) -> jax.Array:
    """Token-at-a-time XLA attention (each token gathers its sequence's context), in chunks of
    `token_chunk` tokens to bound memory; cache-dtype operands with f32 accumulation."""
    t, n, e = q_TNE.shape
    _, p, kh, _ = k_cache_NPKE.shape
    g = n // kh
    ctx = block_tables_SB.shape[1] * p
    seq_T, pos_T, _ = _token_positions(query_start_loc_S1, seq_lens_S, t)
    slot_L = jnp.arange(ctx, dtype=jnp.int32)

    def one_token(args):
        q_NE, seq, pos = args
        table_B = block_tables_SB[seq]
        k_LKE = k_cache_NPKE[table_B].reshape(ctx, kh, e)
        v_LKE = v_cache_NPKE[table_B].reshape(ctx, kh, e)
        s_KGL = jnp.einsum("kge,lke->kgl", q_NE.reshape(kh, g, e), k_LKE,
                           preferred_element_type=jnp.float32) * sm_scale
        s_KGL = _visible_scores(s_KGL, slot_L, pos, soft_cap=soft_cap,
                                sliding_window=sliding_window)
        m = jnp.max(s_KGL, axis=-1, keepdims=True)
        w = jnp.exp(s_KGL - jnp.where(m == -jnp.inf, 0.0, m))   # padding rows: all zero
        den = jnp.maximum(w.sum(axis=-1, keepdims=True), 1e-30)
        o = jnp.einsum("kgl,lke->kge", (w / den).astype(v_LKE.dtype), v_LKE,
                       preferred_element_type=jnp.float32)
        return o.reshape(n, e).astype(q_TNE.dtype)

    return jax.lax.map(one_token, (q_TNE, seq_T, pos_T), batch_size=min(t, token_chunk))
