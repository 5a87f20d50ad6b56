"""DeepSeek V4's attention on the engine's paged caches, in plain jnp (the reference the
kernels are to be tested against): one shared K=V head, a sliding window, and per layer type
the compressed branches: CSA (an entry every m tokens from two overlapping windows, a
lightning indexer choosing index_topk of them per query) and HCA (an entry every m' tokens,
all of them visible).

Cache layout ([num_blocks, P, width]; why: ARCHITECTURE.md "DeepSeek V4's caches"). The
per-token rows ("kv", "ckv", "cgate", "ikv", "igate") are the sliding-window group's: on its
blocks and tables (StepInput.window_block_tables: `window_view` gives a step's slots there),
freed as they fall out of the window (deepseek_v4.tokens_back); the entries ("comp", "icomp")
stay on the full group's block table, as a sequence's every entry stays visible:
- "kv" f[E]: each token's roped, normed K=V row (the window reads the last W of them);
- "ckv" / "cgate" f[c*E]: each token's compressor projections (the gate with its in-window
  position bias added), c = 2 for CSA (the Ca | Cb series), 1 for HCA: the carry of a window
  not yet compressed is these rows, so no per-request state exists;
- "comp" f[E], one row per m tokens (PagedSpec.tokens_per_row: [num_blocks, max(1, P / m), E]):
  entry e (tokens e*m .. e*m + m - 1) in the block of the token that completes it,
  (e + 1) * m - 1, at row e mod (P / m) (row 0 when m >= P: an HCA entry in every (m / P)-th
  block); `entry_slots` is the one place that layout shows;
- CSA also "ikv" / "igate" f[2J] and "icomp" f[J]: the indexer's own compressor, alike.

Under impl "pallas" the attention's gathers and softmax are pallas_kernels/sparse_sink_attention,
CSA's indexer V3.2's indexer_scores and TopK kernels, CSA's compressors
pallas_kernels/window_compress (HCA's 128-row windows stay jnp).

Legend: T tokens, H heads, E head dim, R rope dims (the trailing R of a head, pairs
interleaved), W sliding window, m compression rate, N entries a sequence can hold, I / J the
indexer's heads and head dim, k index_topk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.core.step_input import StepInput
from jaxserve.pallas_kernels.indexer_scores import indexer_scores
from jaxserve.pallas_kernels.sparse_sink_attention import sparse_sink_attention
from jaxserve.pallas_kernels.topk import topk
from jaxserve.pallas_kernels.window_compress import window_compress
from jaxserve.sharding import kernels as sharded

NEG_INF = float("-inf")


def rope_interleaved(x: jax.Array, positions_T: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate the trailing 2 * len(inv_freq) channels of x [T, ..., E] at positions_T, V4's
    pairs (x0, x1), (x2, x3), ...; negative inv_freq undoes it (the output's de-rotation)."""
    r = 2 * inv_freq.shape[0]
    ang = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]            # [T, R/2]
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    rope = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    even, odd = rope[..., 0], rope[..., 1]
    rot = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], -1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], rot.astype(x.dtype)], axis=-1)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in f32 over the last axis, times w if given, back in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y if w is None else y * w.astype(jnp.float32)).astype(x.dtype)


def window_view(x: StepInput, block_size: int) -> StepInput:
    """x on the sliding-window group's tables: its block_tables those, its slot_mapping each
    token's slot there (none where x writes the null slot: padding, a multi-step or chained
    position past the table). x itself for a step built without the group (the model tests'
    own steps keep every array on one table)."""
    tables = x.window_block_tables
    if tables is None:
        return x
    blk = jnp.clip(x.positions // block_size, 0, tables.shape[1] - 1)
    slots = tables[x.token_seq_ids, blk] * block_size + x.positions % block_size
    return dataclasses.replace(x, block_tables=tables, window_block_tables=None,
                               slot_mapping=jnp.where(x.slot_mapping > 0, slots, 0))


def slots_of(x: StepInput, seq_T: jax.Array, pos: jax.Array, block_size: int) -> jax.Array:
    """Cache slot of position(s) `pos` [T, ...] of each token's sequence; positions outside
    0 .. B*P - 1 give the null block's slot (their rows are masked by the caller)."""
    b = x.block_tables.shape[1]
    inside = (pos >= 0) & (pos < b * block_size)
    p = jnp.clip(pos, 0, b * block_size - 1)
    seq = seq_T.reshape(seq_T.shape + (1,) * (pos.ndim - 1))
    slot = x.block_tables[seq, p // block_size] * block_size + p % block_size
    return jnp.where(inside, slot, 0)


def write_rows(cache_NPX: jax.Array, rows_TX: jax.Array, slots_T: jax.Array) -> jax.Array:
    n, p = cache_NPX.shape[:2]
    flat = cache_NPX.reshape(n * p, *cache_NPX.shape[2:])
    return flat.at[slots_T].set(rows_TX.astype(cache_NPX.dtype)).reshape(cache_NPX.shape)


def read_rows(cache_NPX: jax.Array, slots: jax.Array) -> jax.Array:
    n, p = cache_NPX.shape[:2]
    return cache_NPX.reshape(n * p, *cache_NPX.shape[2:])[slots]


def entry_rows(x: StepInput, seq, e, *, rate: int, block_size: int, rows: int):
    """Row of entry(ies) e of sequence(s) seq in an entry array flattened to [num_blocks * rows]
    (module doc), and whether the entry fits the block table (else the null block's row 0)."""
    b = x.block_tables.shape[1]
    last = (e + 1) * rate - 1
    inside = (e >= 0) & (last < b * block_size)
    blk = x.block_tables[seq, jnp.clip(last, 0, b * block_size - 1) // block_size]
    return jnp.where(inside, blk * rows + e % rows, 0), inside


def max_new_entries(num_tokens: int, num_seqs: int, rate: int) -> int:
    """A bound on the windows a step of T tokens over S sequences completes: a sequence's L
    tokens complete at most L // m + 1, and the floors' sum is at most T // m."""
    return min(num_tokens, num_tokens // rate + num_seqs)


def compress(cache: dict, names: tuple[str, str, str], kv_TC: jax.Array, gate_TC: jax.Array,
             ape_MC: jax.Array, norm_w: jax.Array, x: StepInput, xw: StepInput, *, rate: int,
             overlap: bool, inv_freq: jax.Array, eps: float, impl: str = "xla") -> dict:
    """Write each token's compressor rows (gate + its in-window bias), then, for each token that
    completes a window (position + 1 a multiple of m), the window's entry: a per-channel softmax
    over the window's gates weighting its kv rows (with `overlap`, CSA's: the previous window's
    Ca half beside this one's Cb half, 2m rows; the first window's Ca rows weigh 0), RMSNorm,
    rotary at the window's first position. Returns the updated arrays. Under "pallas" the
    entries of windows of up to 32 rows (CSA's 2m) come from the window_compress kernel
    (replicated under a mesh); HCA's 128-row windows stay in XLA. xw: x on the window group
    (window_view), where the per-token rows are; the entries go by x's block table."""
    kv_name, gate_name, comp_name = names
    p = cache[kv_name].shape[1]
    pos_T = x.positions
    gate_TC = gate_TC.astype(jnp.float32) + ape_MC[pos_T % rate].astype(jnp.float32)
    ckv = write_rows(cache[kv_name], kv_TC, xw.slot_mapping)
    cgate = write_rows(cache[gate_name], gate_TC, xw.slot_mapping)
    t, s = pos_T.shape[0], x.seq_lens.shape[0]
    real_T = jnp.arange(t) < x.query_start_loc[-1]
    done_T = real_T & ((pos_T + 1) % rate == 0)
    k = max_new_entries(t, s, rate)
    (rows_K,) = jnp.nonzero(done_T, size=k, fill_value=0)
    valid_K = jnp.arange(k) < jnp.sum(done_T)
    seq_K, end_K = x.token_seq_ids[rows_K], pos_T[rows_K]
    first_K = end_K + 1 - rate                                   # the window's first position
    win = jnp.arange(rate)
    cur_KM = first_K[:, None] + win[None, :]
    rows_KM = cur_KM if not overlap else jnp.concatenate([cur_KM - rate, cur_KM], axis=1)
    slots_KM = slots_of(xw, seq_K, rows_KM, p)
    if impl == "pallas" and rows_KM.shape[1] <= 32:
        n = ckv.shape[0] * p
        args = (ckv.reshape(n, -1), cgate.reshape(n, -1), slots_KM, first_K, valid_K, norm_w, inv_freq)
        run = functools.partial(window_compress, overlap=overlap, eps=eps, impl=impl)
        entry_KC = sharded.replicated(run, len(args))(*args)
    else:
        kv_KMC = read_rows(ckv, slots_KM).astype(jnp.float32)
        g_KMC = read_rows(cgate, slots_KM).astype(jnp.float32)
        if overlap:
            e = kv_KMC.shape[-1] // 2
            g_prev = jnp.where((first_K > 0)[:, None, None], g_KMC[:, :rate, :e], NEG_INF)
            kv_KMC = jnp.concatenate([kv_KMC[:, :rate, :e], kv_KMC[:, rate:, e:]], axis=1)
            g_KMC = jnp.concatenate([g_prev, g_KMC[:, rate:, e:]], axis=1)
        w_KMC = jax.nn.softmax(g_KMC, axis=1)
        entry_KC = rms_norm(jnp.sum(kv_KMC * w_KMC, axis=1), norm_w, eps)
        entry_KC = rope_interleaved(entry_KC, first_K, inv_freq)
    dest_K, _ = entry_rows(x, seq_K, (end_K + 1) // rate - 1, rate=rate, block_size=p,
                           rows=cache[comp_name].shape[1])
    dest_K = jnp.where(valid_K, dest_K, 0)
    return {kv_name: ckv, gate_name: cgate, comp_name: write_rows(cache[comp_name], entry_KC, dest_K)}


def entry_slots(x: StepInput, *, rate: int, block_size: int, rows: int, num_entries: int):
    """(row of each of the first num_entries entries of each token's sequence i32[T, N] in the
    flattened entry array, which of them the token sees bool[T, N]: e < (position + 1) // m,
    the windows complete at or before it)."""
    e_TN = jnp.broadcast_to(jnp.arange(num_entries)[None, :], (x.num_tokens, num_entries))
    slots, _ = entry_rows(x, x.token_seq_ids[:, None], e_TN, rate=rate, block_size=block_size, rows=rows)
    return slots, e_TN < ((x.positions + 1) // rate)[:, None]


def index_select(q_TIJ: jax.Array, w_TI: jax.Array, icomp, x: StepInput, *, rate: int,
                 block_size: int, num_entries: int, top_k: int, impl: str):
    """The lightning indexer's choice of entries per token: (entry i32[T, k], chosen and visible
    bool[T, k]). Under "pallas", where an entry block holds P / m >= 1 whole entries (m <= P:
    entry e at row e mod (P / m) of logical block e // (P / m), V3.2's paged key layout), V3.2's
    indexer_scores kernel scores them (a token's last visible entry as its "position") and the
    TopK kernel selects; otherwise the jnp path below (index_topk)."""
    if impl == "pallas" and rate <= block_size:
        last_T = (x.positions + 1) // rate - 1
        # replicated under a mesh, as V3.2's indexer: every rank scores and selects alike
        score = functools.partial(indexer_scores, scale=q_TIJ.shape[-1] ** -0.5, impl=impl)
        args = (q_TIJ, w_TI, icomp, x.block_tables, x.token_seq_ids, last_T)
        scores = sharded.replicated(score, len(args))(*args)
        select = functools.partial(topk, k=min(top_k, scores.shape[1]), impl=impl)
        vals, idx = sharded.replicated(select, 1, 2)(scores)
        return idx, vals > NEG_INF
    slots, visible = entry_slots(x, rate=rate, block_size=block_size, rows=icomp.shape[1],
                                 num_entries=num_entries)
    return index_topk(q_TIJ, w_TI, icomp, slots, visible, top_k)


def index_topk(q_TIJ: jax.Array, w_TI: jax.Array, icomp, slots_TN, visible_TN, top_k: int):
    """The lightning indexer's choice: score_t(e) = sum_i w_ti * ReLU(q_ti . k_e) / sqrt(J)
    (w already scaled by I^-1/2) over the visible entries, their top k: (entry i32[T, k],
    chosen and visible bool[T, k])."""
    k_TNJ = read_rows(icomp, slots_TN).astype(jnp.float32)
    s_TIN = jnp.einsum("tij,tnj->tin", q_TIJ.astype(jnp.float32), k_TNJ)
    scores = jnp.einsum("tin,ti->tn", jax.nn.relu(s_TIN) * q_TIJ.shape[-1] ** -0.5,
                        w_TI.astype(jnp.float32))
    scores = jnp.where(visible_TN, scores, NEG_INF)
    k = min(top_k, scores.shape[1])
    vals, idx = jax.lax.top_k(scores, k)
    return idx, vals > NEG_INF


def attend(q_THE: jax.Array, kv_cache, comp_cache, x: StepInput, xw: StepInput, sinks_H: jax.Array, *,
           window: int, rate: int, num_entries: int, selected=None, impl: str = "xla"):
    """Attention of each token over its window's K=V rows and (compressed layers) the visible
    compressed entries, or only the `selected` (entry indices, valid) ones under CSA; the per-
    head sink joins the softmax's denominator. f32[T, H, E]. The slots are built here (integer
    ops); the gathers and the softmax are pallas_kernels/sparse_sink_attention.py (impl
    "pallas") or its jnp reference ("xla"). xw: x on the window group (window_view)."""
    p = kv_cache.shape[1]
    win_TW = x.positions[:, None] - jnp.arange(window)[None, :]
    win_slots = slots_of(xw, x.token_seq_ids, win_TW, p)
    comp_slots = comp_ok = comp_len = None
    if comp_cache is not None:
        comp_slots, comp_ok = entry_slots(x, rate=rate, block_size=p, rows=comp_cache.shape[1],
                                          num_entries=num_entries)
        comp_len = (x.positions + 1) // rate         # HCA: the visible entries are a prefix
        if selected is not None:
            idx_Tk, comp_ok = selected
            comp_slots = jnp.take_along_axis(comp_slots, idx_Tk, axis=1)
            comp_len = None
    def kernel(q, sinks, *rest):
        return sparse_sink_attention(q, *rest[:6], sinks, rest[6], sm_scale=q_THE.shape[-1] ** -0.5,
                                     impl=impl)
    args = (kv_cache, comp_cache, win_slots, win_TW >= 0, comp_slots, comp_ok, comp_len)
    if impl == "xla" or sharded.model_axis_size() == 1:
        return kernel(q_THE, sinks_H, *args)
    # under tensor parallelism each rank attends with its own heads (and their sinks) over the
    # replicated rows: the kernel per model shard (a pallas_call is opaque to the partitioner)
    sharded.check_divides("the sparse sink attention kernel", heads=q_THE.shape[1])
    return sharded.per_model_shard(kernel, (sharded.HEADS_TNE, sharded.VECTOR_C) + (sharded.REPLICATED,) * 7,
                                   sharded.HEADS_TNE)(q_THE, sinks_H, *args)
