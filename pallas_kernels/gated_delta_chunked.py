"""Chunked gated delta rule (prefill, any ragged batch), WY form, states in place.

Each sequence's tokens are cut into chunks of L (64) tokens; per chunk and value head, with
the chunk's initial state S0 f[V, K] (per-row: the rows of S update independently):

    gam = cumsum(g);  A = strict_lower(beta_i (k_i . k_j) exp(gam_i - gam_j));  T = (I + A)^-1
    U = T (beta v);   W = T (beta exp(gam) k)                                  (the UT transform)
    v' = U - W S0^T;  o = exp(gam) q S0^T + (causal(q k^T exp(gam_i - gam_j))) v'
    S1 = exp(gam_L) S0 + v'^T (exp(gam_L - gam) k)

which is the token recurrence of models/gated_deltanet.py (chunked_gated_delta there is the
jnp reference, in the same form). T comes from forward substitution on the identity, row by
row in registers: exact and stable (a Neumann series by repeated squaring would need only
matmuls, but the powers of A cancel catastrophically in f32 when keys are correlated).

Layouts: q_TGK, k_TGK f32[T, G, K] (L2-normalised; q scaled by K^-1/2), v_THV f[T, H, V],
g_TH, beta_TH f32[T, H], query_start_loc i32[S+1], seq_lens i32[S] (seq_lens == token count:
the sequence starts here, from a zero state), state_slots i32[S], state_NHVK f32[N, H, V, K]
-> (o f32[T, H, V] (zeros on padding tokens), state_NHVK updated in place).

Legend: T tokens, S sequences, H value heads, G key heads (value head h reads key head
h // (H/G)), K key head dim, V value head dim, BV value rows per program, L chunk length,
N state slots.

Grid (S, H, V/BV): a program walks its sequence's chunks in order (a loop with a dynamic
trip count), the [BV, K] state tile staying in registers between chunks; it is read from the
sequence's slot once and written back once.
Measured too slow to use: one 2,048-token sequence at Qwen3.5-397B's heads took 79.9 ms
against its jnp form's 2.96 (H100, BENCHMARKS.md), since one sequence is only H * V/BV
programs and each runs every chunk's forward substitution in series; the engine takes the jnp
form (models/qwen3_next.py CHUNKED_IMPL). A fast version would compute every chunk's WY
factors in parallel first and leave only the state pass sequential (flash-linear-attention's
split), not built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models import gated_deltanet as gdn
from jaxserve.pallas_kernels.dispatch import resolve_impl
from jaxserve.pallas_kernels.gated_delta_decode import call_state_kernel

HIGHEST = jax.lax.Precision.HIGHEST   # f32 matmuls, no TF32: the state accumulates over 10K tokens

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def ref_gated_delta_chunked(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                            state_slots, state_NHVK, *, chunk: int = gdn.CHUNK):
    """Plain jnp (gated_deltanet.chunked_gated_delta at the sequences' slots)."""
    t, h = g_TH.shape
    qlen_S = jnp.diff(query_start_loc)
    fresh_S = seq_lens == qlen_S
    old = state_NHVK[state_slots].astype(jnp.float32)
    init = jnp.where(fresh_S[:, None, None, None], 0.0, old)
    o, new = gdn.chunked_gated_delta(gdn.expand_heads(q_TGK, h), gdn.expand_heads(k_TGK, h), v_THV,
                                     g_TH, beta_TH, init, query_start_loc, chunk)
    real_T = jnp.arange(t) < query_start_loc[-1]
    new = jnp.where((qlen_S > 0)[:, None, None, None], new, old)   # padding: slot left as is
    return (jnp.where(real_T[:, None, None], o, 0.0),
            state_NHVK.at[state_slots].set(new.astype(state_NHVK.dtype)))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _validate(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK,
              chunk, bv):
    t, g, k = q_TGK.shape
    _, h, v = v_THV.shape
    if k_TGK.shape != q_TGK.shape or v_THV.shape[0] != t or g_TH.shape != (t, h) or beta_TH.shape != (t, h):
        raise ValueError("q, k must be [T, G, K], v [T, H, V], g and beta [T, H]")
    if h % g or state_NHVK.shape[1:] != (h, v, k):
        raise ValueError(f"need H % G == 0 and state [N, H, V, K]; got H={h}, G={g}, {state_NHVK.shape}")
    s = seq_lens.shape[0]
    if query_start_loc.shape != (s + 1,) or state_slots.shape != (s,):
        raise ValueError("query_start_loc must be [S+1] and state_slots [S]")
    for name, n in (("K", k), ("BV", bv), ("chunk", chunk)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"Triton's dot needs {name} a power of two >= 16; got {n}")
    if v % bv:
        raise ValueError(f"V ({v}) must be a multiple of block_v ({bv})")


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _unit_lower_inverse(a_LL, rows_L, l: int):
    """(I + a)^-1 for a strictly lower a, by forward substitution: row i of the inverse is
    e_i - a[i, :] @ X, where X holds rows < i (the rest still zero)."""
    def row(i, x_LL):
        a_i = jnp.sum(jnp.where(rows_L[:, None] == i, a_LL, 0.0), axis=0)          # [L]
        e_i = (rows_L == i).astype(jnp.float32)
        x_i = e_i - jnp.sum(a_i[:, None] * x_LL, axis=0)
        return jnp.where(rows_L[:, None] == i, x_i[None, :], x_LL)

    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(l), row, jnp.zeros((l, l), jnp.float32))


def _kernel(
    # inputs
    qsl_ref, seq_lens_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref,
    # outputs
    o_ref, state_ref,
    *, ratio: int, bv: int, kd: int, chunk: int, num_tokens: int):
    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    begin = qsl_ref[s]
    n = qsl_ref[s + 1] - begin
    fresh = seq_lens_ref[s] == n
    slot = slots_ref[s]
    j = h // ratio
    l_L = jnp.arange(chunk, dtype=jnp.int32)
    k_K = jnp.arange(kd, dtype=jnp.int32)
    v_B = vb * bv + jnp.arange(bv, dtype=jnp.int32)
    zbk = jnp.zeros((bv, kd), jnp.int32)
    st_at = (zbk + slot, zbk + h, zbk + v_B[:, None], zbk + k_K[None, :])
    state0 = jnp.where(fresh, 0.0, plgpu.load(state_in_ref.at[st_at]).astype(jnp.float32))
    tri = l_L[:, None] >= l_L[None, :]
    strict = l_L[:, None] > l_L[None, :]
    zlk = jnp.zeros((chunk, kd), jnp.int32)
    zlb = jnp.zeros((chunk, bv), jnp.int32)

    def one_chunk(c, st):
        tok_L = begin + c * chunk + l_L
        valid = tok_L < begin + n
        t_L = jnp.minimum(tok_L, num_tokens - 1)
        # rows past the sequence: zero q, k, v, g and beta leave the state and outputs alone
        q = jnp.where(valid[:, None], plgpu.load(q_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
        k = jnp.where(valid[:, None], plgpu.load(k_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
        v = jnp.where(valid[:, None], plgpu.load(v_ref.at[zlb + t_L[:, None], zlb + h, zlb + v_B[None, :]]), 0.0)
        g = jnp.where(valid, plgpu.load(g_ref.at[t_L, t_L * 0 + h]), 0.0)
        beta = jnp.where(valid, plgpu.load(beta_ref.at[t_L, t_L * 0 + h]), 0.0)
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        gam = jnp.sum(jnp.where(tri, g[None, :], 0.0), axis=1)                       # cumsum
        dec = jnp.exp(jnp.where(tri, gam[:, None] - gam[None, :], -jnp.inf))
        a = jnp.where(strict, beta[:, None] * plgpu.dot(k, k, trans_b=True, precision=HIGHEST) * dec, 0.0)
        t_inv = _unit_lower_inverse(a, l_L, chunk)
        u = plgpu.dot(t_inv, v * beta[:, None], precision=HIGHEST)                     # [L, BV]
        w = plgpu.dot(t_inv, k * (beta * jnp.exp(gam))[:, None], precision=HIGHEST)    # [L, K]
        v_new = u - plgpu.dot(w, st, trans_b=True, precision=HIGHEST)
        attn = jnp.where(tri, plgpu.dot(q, k, trans_b=True, precision=HIGHEST) * dec, 0.0)
        o = (plgpu.dot(q * jnp.exp(gam)[:, None], st, trans_b=True, precision=HIGHEST)
             + plgpu.dot(attn, v_new, precision=HIGHEST))
        plgpu.store(o_ref.at[zlb + tok_L[:, None], zlb + h, zlb + v_B[None, :]], o.astype(o_ref.dtype),
                    mask=valid[:, None] & (zlb == 0))
        last = jnp.sum(g)
        k_dec = k * jnp.exp(last - gam)[:, None]
        return st * jnp.exp(last) + plgpu.dot(v_new, k_dec, trans_a=True, precision=HIGHEST)

    # NOTE: both loop bounds int32 (a Python 0 gave an scf.for with mixed bound types)
    st = jax.lax.fori_loop(jnp.int32(0), (n + chunk - 1) // chunk, one_chunk, state0)
    plgpu.store(state_ref.at[st_at], st.astype(state_ref.dtype), mask=(zbk == 0) & (n > 0))


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "chunk", "block_v", "num_warps", "interpret"),
                   donate_argnames=("state_NHVK",))
def gated_delta_chunked(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots,
                        state_NHVK, *, impl: str = "auto", chunk: int = gdn.CHUNK,
                        block_v: int | None = None, num_warps: int = 4, interpret: bool | None = None):
    """(o f32[T, H, V], state_NHVK updated in place): see the module docstring.
    impl: "pallas" (Triton; interpreted on a CPU), "xla" (the reference), "auto"."""
    t = q_TGK.shape[0]
    bv = block_v or min(v_THV.shape[2], 32)
    _validate(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK,
              chunk, bv)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_gated_delta_chunked(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                                       state_slots, state_NHVK, chunk=chunk)
    o, state = call_state_kernel(_kernel, (q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                                           state_slots, state_NHVK), per_token=True, bv=bv,
                                 num_warps=num_warps, chunk=chunk,
                                 interpret=(not on_gpu) if interpret is None else interpret,
                                 name=f"gated_delta_chunked_l{chunk}_bv{bv}")
    # padding tokens are written by no program: zero them so nothing downstream sees garbage
    real_T = jnp.arange(t) < query_start_loc[-1]
    return jnp.where(real_T[:, None, None], o, 0.0), state
