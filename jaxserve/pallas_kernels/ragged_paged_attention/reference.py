"""Ragged paged attention's reference (plain jnp, dense per sequence), its input validation and
the plain-XLA implementation (impl="xla"). Problem and layouts: the package's docstring
(__init__.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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


def validate(q_TNE, k_cache, v_cache, qsl, seq_lens, block_tables):
    """The shapes every implementation needs (ValueError otherwise)."""
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


# the kernels keep scores in log2 units, so that their softmax runs on exp2
LOG2E = math.log2(math.e)


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