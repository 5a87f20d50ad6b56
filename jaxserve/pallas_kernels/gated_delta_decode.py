"""Recurrent gated-delta-rule update for decode: one token per sequence, state in place.

For sequence s with one token t (query_start_loc[s] .. +1) and value head h (key head
j = h // (H/G)), with its state S f[V, K] at state_NHVK[state_slots[s], h]:

    S <- exp(g) S;   S <- S + beta (v - S k) k^T;   o = S q

Layouts: q_TGK, k_TGK f32[T, G, K] (L2-normalised; q scaled by K^-1/2: models/gated_deltanet.py
post_conv), v_THV f[T, H, V], g_TH, beta_TH f32[T, H], query_start_loc i32[S+1], seq_lens
i32[S] (a sequence with seq_lens == its token count starts here: zero state), state_slots
i32[S], state_NHVK f32[num_slots, H, V, K] -> (o f32[S, H, V], state_NHVK updated in place
(input_output_aliases)). Sequences with no token (padding) output zeros and write nothing.
Contract: no sequence has more than one token (models/gated_deltanet.py gated_delta_rule
takes the chunked form otherwise).

Legend: T tokens, S sequences, H value heads, G key heads, K key head dim, V value head dim,
N state slots, BV value rows per program.

Why this design: rows of S update independently (row v only needs v[v] and its own row), so
the grid is (S, H, V/BV) and a program holds a [BV, K] tile of the state in registers: the
state is read and written once, which is the whole cost of a decode step (the state is
64 heads x 128 x 128 x 4 B = 4 MiB per sequence and layer on Qwen3.5-397B).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models.layers import deltanet as gdn
from jaxserve.pallas_kernels.dispatch import resolve_impl, whole

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def ref_gated_delta_decode(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                           state_slots, state_NHVK):
    """Plain jnp: (o f32[S, H, V], updated state_NHVK)."""
    t, h = g_TH.shape
    tok_S = jnp.clip(query_start_loc[:-1], 0, t - 1)
    qlen_S = jnp.diff(query_start_loc)
    live_S = qlen_S > 0
    fresh_S = seq_lens == qlen_S
    state = jnp.where(fresh_S[:, None, None, None], 0.0, state_NHVK[state_slots].astype(jnp.float32))
    o, new = gdn.recurrent_gated_delta(gdn.expand_heads(q_TGK[tok_S], h), gdn.expand_heads(k_TGK[tok_S], h),
                                       v_THV[tok_S].astype(jnp.float32), g_TH[tok_S], beta_TH[tok_S], state)
    o = jnp.where(live_S[:, None, None], o, 0.0)
    # padding sequences write their slot's old value back (they point at the null slot 0)
    new = jnp.where(live_S[:, None, None, None], new, state_NHVK[state_slots].astype(jnp.float32))
    return o, state_NHVK.at[state_slots].set(new.astype(state_NHVK.dtype))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _validate(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK):
    t, g, k = q_TGK.shape
    _, h, v = v_THV.shape
    if k_TGK.shape != q_TGK.shape or v_THV.shape[0] != t:
        raise ValueError(f"q, k must be [T, G, K] and v [T, H, V]; got {q_TGK.shape}, {k_TGK.shape}, {v_THV.shape}")
    if g_TH.shape != (t, h) or beta_TH.shape != (t, h):
        raise ValueError(f"g and beta must be [T, H] = {(t, h)}; got {g_TH.shape}, {beta_TH.shape}")
    if h % g:
        raise ValueError(f"value heads ({h}) must be a multiple of key heads ({g})")
    if state_NHVK.shape[1:] != (h, v, k):
        raise ValueError(f"state must be [num_slots, H, V, K] = [N, {h}, {v}, {k}]; got {state_NHVK.shape}")
    s = seq_lens.shape[0]
    if query_start_loc.shape != (s + 1,) or state_slots.shape != (s,):
        raise ValueError("query_start_loc must be [S+1] and state_slots [S]")
    if not (_pow2(k) and _pow2(v)):
        raise ValueError(f"the Triton kernel needs power-of-two head dims; got K={k}, V={v}")


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _kernel(
    # inputs
    qsl_ref, seq_lens_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref,
    # outputs
    o_ref, state_ref,
    *, ratio: int, bv: int, kd: int, num_tokens: int):
    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    begin = qsl_ref[s]
    n = qsl_ref[s + 1] - begin
    live = n > 0
    fresh = seq_lens_ref[s] == n
    slot = slots_ref[s]
    t = jnp.minimum(begin, num_tokens - 1)
    k_K = jnp.arange(kd, dtype=jnp.int32)
    v_B = vb * bv + jnp.arange(bv, dtype=jnp.int32)
    zk = jnp.zeros((kd,), jnp.int32)
    zb = jnp.zeros((bv,), jnp.int32)
    q = plgpu.load(q_ref.at[zk + t, zk + h // ratio, k_K]).astype(jnp.float32)
    k = plgpu.load(k_ref.at[zk + t, zk + h // ratio, k_K]).astype(jnp.float32)
    v = plgpu.load(v_ref.at[zb + t, zb + h, v_B]).astype(jnp.float32)
    g = g_ref[t, h].astype(jnp.float32)
    beta = beta_ref[t, h].astype(jnp.float32)
    zbk = jnp.zeros((bv, kd), jnp.int32)
    at = (zbk + slot, zbk + h, zbk + v_B[:, None], zbk + k_K[None, :])
    st = plgpu.load(state_in_ref.at[at]).astype(jnp.float32)
    st = jnp.where(fresh, 0.0, st) * jnp.exp(g)
    delta_B = (v - jnp.sum(st * k[None, :], axis=1)) * beta
    st = st + delta_B[:, None] * k[None, :]
    o_B = jnp.sum(st * q[None, :], axis=1)
    plgpu.store(o_ref.at[zb + s, zb + h, v_B], jnp.where(live, o_B, 0.0).astype(o_ref.dtype))
    plgpu.store(state_ref.at[at], st.astype(state_ref.dtype), mask=(zbk == 0) & live)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "block_v", "num_warps", "interpret"),
                   donate_argnames=("state_NHVK",))
def gated_delta_decode(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots,
                       state_NHVK, *, impl: str = "auto", block_v: int | None = None,
                       num_warps: int = 4, interpret: bool | None = None):
    """(o f32[S, H, V], state_NHVK updated in place): see the module docstring.
    impl: "pallas" (Triton; interpreted on a CPU), "xla" (the reference), "auto"."""
    _validate(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_gated_delta_decode(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                                      state_slots, state_NHVK)
    # 32 x 128 f32 = 16 KiB of state per program: registers, no spills at 4 warps
    bv = block_v or min(v_THV.shape[2], 32)
    return call_state_kernel(_kernel, (q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                                       state_slots, state_NHVK), per_token=False, bv=bv,
                             num_warps=num_warps, interpret=(not on_gpu) if interpret is None else interpret,
                             name=f"gated_delta_decode_bv{bv}")


def call_state_kernel(kernel, args, *, per_token: bool, bv: int, num_warps: int, interpret: bool,
                      name: str, **static):
    """The pallas_call both gated-delta kernels share: grid (S, H, V/BV), every operand whole,
    outputs o (f32[T, H, V] per token, or f32[S, H, V] per sequence) and the state, aliased to
    the state input (updated in place). `kernel` takes ratio, bv, kd, num_tokens and `static`."""
    q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK = args
    t, g, kd = q_TGK.shape
    _, h, vd = v_THV.shape
    s = seq_lens.shape[0]
    ins = [query_start_loc.astype(jnp.int32), seq_lens.astype(jnp.int32), state_slots.astype(jnp.int32),
           q_TGK, k_TGK, v_THV, g_TH, beta_TH, state_NHVK]
    o_shape = ((t if per_token else s), h, vd)
    return tuple(pl.pallas_call(
        functools.partial(kernel, ratio=h // g, bv=bv, kd=kd, num_tokens=t, **static),
        grid=(s, h, vd // bv),
        in_specs=[whole(*a.shape) for a in ins],
        out_specs=[whole(*o_shape), whole(*state_NHVK.shape)],
        out_shape=[jax.ShapeDtypeStruct(o_shape, jnp.float32),
                   jax.ShapeDtypeStruct(state_NHVK.shape, state_NHVK.dtype)],
        input_output_aliases={len(ins) - 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*ins))
