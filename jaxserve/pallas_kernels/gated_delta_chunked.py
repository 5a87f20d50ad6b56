"""Chunked gated delta rule (prefill, any ragged batch), WY form, states in place.

Each sequence's tokens are cut into chunks of L (64) tokens, from its query_start_loc[s] (its
last chunk partial); per chunk and value head, with the chunk's initial state S0 f[V, K]
(per-row: the rows of S update independently):

    gam = cumsum(g);  A = strict_lower(beta_i (k_i . k_j) exp(gam_i - gam_j));  T = (I + A)^-1
    U = T (beta v);   W = T (beta exp(gam) k);   P = causal(q_i . k_j exp(gam_i - gam_j))
    v' = U - W S0^T;  o = exp(gam) q S0^T + P v'
    S1 = exp(gam_L) S0 + v'^T (exp(gam_L - gam) k)

which is the token recurrence of models/gated_deltanet.py (chunked_gated_delta there is the
jnp reference, in the same form).

Two kernels, as flash-linear-attention splits the work:
1. gated_delta_chunked_prep (grid (N, H): every chunk of every sequence at once): gam, T, W, U
   and P of one chunk and value head, to f32 scratch gam f32[N, H, L], W f32[N, H, L, K],
   U f32[N, H, L, V], P f32[N, H, L, L]; nothing here depends on the state. N = T // L + S
   bounds the chunk count (a sequence adds at most one partial chunk); the wrapper computes
   each chunk's first token and length (0: a padding chunk, all zeros, read by nobody).
   T is stable in f32: the diagonal blocks of I + A (16 x 16, or L if smaller) are inverted
   by forward substitution, all blocks at once, 16 serial steps; the off-diagonal blocks
   follow by block forward substitution, L/16 - 1 steps of two [L, L] matmuls:
   T_i,: = T_ii (E_i,: - sum_{m<i} A_im T_m,:). (A Neumann series by repeated squaring would
   need only matmuls, but the powers of A cancel catastrophically in f32 when keys are
   correlated.)
2. gated_delta_chunked_state (grid (S, H, V/BV)): a program walks its sequence's chunks in
   order (a loop with a dynamic trip count), only matmuls per chunk, the [BV, K] state tile
   staying in registers between chunks; it is read from the sequence's slot once (zero for a
   fresh sequence) and written back once, in place (input_output_aliases).

Layouts: q_TGK, k_TGK f32[T, G, K] (L2-normalised; q scaled by K^-1/2), v_THV f[T, H, V],
g_TH, beta_TH f32[T, H], query_start_loc i32[S+1], seq_lens i32[S] (seq_lens == token count:
the sequence starts here, from a zero state), state_slots i32[S], state_NHVK f32[N, H, V, K]
-> (o f32[T, H, V] (zeros on padding tokens), state_NHVK updated in place; the slots of
padding sequences untouched).

Legend: T tokens, S sequences, H value heads, G key heads (value head h reads key head
h // (H/G)), K key head dim, V value head dim, BV value rows per program, L chunk length,
N chunks (in the scratch shapes; state slots in state_NHVK's).

Speed (H100, `benchmarks/kernels.py --only deltanet`, Qwen3.5-397B's heads, one sequence):
0.98 ms for 2,048 tokens against the jnp form's 2.95, 4.06 against 11.30 for 8,192; the engine
takes it for prompt chunks (models/qwen3_next.py CHUNKED_IMPL). Its dots are TF32 for a bf16
model, full f32 for a float32 one (dot_precision below: 63 ms there). The previous one-kernel version
(grid (S, H, V/BV), each program running every chunk's row-by-row forward substitution in
series) took 79.9 ms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models.layers import deltanet as gdn
from jaxserve.pallas_kernels.dispatch import resolve_impl, whole

# The dots' precision follows the model's dtype (v's: post-conv keeps conv's dtype). bf16: TF32
# tensor-core dots (Triton's "tf32"); XLA runs the jnp form's f32 matmuls in TF32 too at default
# precision, and bf16 activations carry more rounding than TF32 adds. f32: full-precision dots
# (Triton's "ieee", on the CUDA cores): a float32 engine must compute what the reference
# computes, and TF32 here gave Qwen3.5's tiny checkpoints 0.1-nat first-token logprob errors
# and made a batch differ from each request alone (a decode row goes through this kernel in a
# batch with a prefill, through the exact decode kernel alone; issue 70). The cost: both
# kernels took 63 ms for a 2,048-token sequence at Qwen3.5-397B's heads in f32 against 0.88 ms
# in TF32 (H200, per kernel: 48.5 / 14.9 ms against 0.47 / 0.41).
TF32 = jax.lax.Precision.DEFAULT
IEEE = jax.lax.Precision.HIGHEST


def dot_precision(dtype) -> jax.lax.Precision:
    """The dots' precision for a model computing in `dtype`: full f32 for float32, else TF32."""
    return IEEE if jnp.dtype(dtype) == jnp.float32 else TF32


DIAG_BLOCK = 16                       # rows of the diagonal blocks of (I + A) inverted row by row

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
    if s < 1 or query_start_loc.shape != (s + 1,) or state_slots.shape != (s,):
        raise ValueError("query_start_loc must be [S+1] and state_slots [S], S >= 1")
    for name, n in (("K", k), ("V", v), ("BV", bv), ("chunk", chunk)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"Triton's dot needs {name} a power of two >= 16; got {n}")
    if v % bv:
        raise ValueError(f"V ({v}) must be a multiple of block_v ({bv})")


# ---------------------------------------------------------------------------------------------
# Kernel bodies
# ---------------------------------------------------------------------------------------------


def unit_lower_inverse(a_LL, precision=IEEE):
    """(I + a)^-1 for a strictly lower f32[L, L] a (L a power of two >= 16), stable in f32.

    The diagonal blocks (DIAG_BLOCK rows, or L if smaller) by forward substitution, all blocks
    at once: at step i the i-th row of every block is e - a[row, :] X, X holding the block's
    rows before it (a row's other entries of a are in other blocks: masked out). Then block
    forward substitution, block row by block row: T_i,: = T_ii (E_i,: - sum_{m<i} a_im T_m,:),
    where the rows of blocks >= i of T are not read (a's block-lower part has no entry there).
    Only matmuls and masks of [L, L] tiles (no slicing of register tiles); also plain jnp."""
    l = a_LL.shape[0]
    b = min(DIAG_BLOCK, l)
    r_L = jnp.arange(l, dtype=jnp.int32)
    blk_L, pos_L = r_L // b, r_L % b
    eye = (r_L[:, None] == r_L[None, :]).astype(jnp.float32)
    same = blk_L[:, None] == blk_L[None, :]
    diag = jnp.where(same, a_LL, 0.0)
    below = jnp.where(same, 0.0, a_LL)

    def diag_row(i, x_LL):
        at_i = pos_L[:, None] == i
        return jnp.where(at_i, eye - plgpu.dot(jnp.where(at_i, diag, 0.0), x_LL, precision=precision), x_LL)

    # NOTE: both loop bounds int32 (a Python 0 gave an scf.for with mixed bound types)
    t_diag = jax.lax.fori_loop(jnp.int32(1), jnp.int32(b), diag_row, eye)
    if l == b:
        return t_diag

    def block_row(i, t_LL):
        rest = eye - plgpu.dot(below, t_LL, precision=precision)
        return jnp.where(blk_L[:, None] == i, plgpu.dot(t_diag, rest, precision=precision), t_LL)

    return jax.lax.fori_loop(jnp.int32(1), jnp.int32(l // b), block_row, t_diag)


def _prep_kernel(
    # inputs
    first_ref, len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    # outputs (scratch)
    gam_ref, w_ref, u_ref, p_ref,
    *, ratio: int, kd: int, vd: int, chunk: int, num_tokens: int, precision):
    """Program (chunk c, value head h): the chunk's gam, W, U, P (nothing of the state)."""
    c, h = pl.program_id(0), pl.program_id(1)
    n = len_ref[c]
    j = h // ratio
    l_L = jnp.arange(chunk, dtype=jnp.int32)
    k_K = jnp.arange(kd, dtype=jnp.int32)
    v_V = jnp.arange(vd, dtype=jnp.int32)
    valid = l_L < n
    t_L = jnp.minimum(first_ref[c] + l_L, num_tokens - 1)
    zlk = jnp.zeros((chunk, kd), jnp.int32)
    zlv = jnp.zeros((chunk, vd), jnp.int32)
    zll = jnp.zeros((chunk, chunk), jnp.int32)
    tri = l_L[:, None] >= l_L[None, :]
    strict = l_L[:, None] > l_L[None, :]
    # rows past the chunk (and every row of a padding chunk): zero q, k, v, g and beta give
    # zero rows of W, U, P and a flat gam, which leave the state and outputs alone
    q = jnp.where(valid[:, None], plgpu.load(q_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
    k = jnp.where(valid[:, None], plgpu.load(k_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
    v = jnp.where(valid[:, None], plgpu.load(v_ref.at[zlv + t_L[:, None], zlv + h, zlv + v_V[None, :]]), 0.0)
    g = jnp.where(valid, plgpu.load(g_ref.at[t_L, t_L * 0 + h]), 0.0)
    beta = jnp.where(valid, plgpu.load(beta_ref.at[t_L, t_L * 0 + h]), 0.0)
    q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    gam = jnp.sum(jnp.where(tri, g[None, :], 0.0), axis=1)                          # cumsum
    # decays masked before exp: above the diagonal gam_i - gam_j > 0 could overflow
    dec = jnp.exp(jnp.where(tri, gam[:, None] - gam[None, :], -jnp.inf))
    a = jnp.where(strict, beta[:, None] * plgpu.dot(k, k, trans_b=True, precision=precision) * dec, 0.0)
    t_inv = unit_lower_inverse(a, precision)
    w = plgpu.dot(t_inv, k * (beta * jnp.exp(gam))[:, None], precision=precision)        # [L, K]
    u = plgpu.dot(t_inv, v * beta[:, None], precision=precision)                          # [L, V]
    p = jnp.where(tri, plgpu.dot(q, k, trans_b=True, precision=precision) * dec, 0.0)    # [L, L]
    plgpu.store(gam_ref.at[l_L * 0 + c, l_L * 0 + h, l_L], gam)
    plgpu.store(w_ref.at[zlk + c, zlk + h, zlk + l_L[:, None], zlk + k_K[None, :]], w)
    plgpu.store(u_ref.at[zlv + c, zlv + h, zlv + l_L[:, None], zlv + v_V[None, :]], u)
    plgpu.store(p_ref.at[zll + c, zll + h, zll + l_L[:, None], zll + l_L[None, :]], p)


def _state_kernel(
    # inputs
    qsl_ref, seq_lens_ref, slots_ref, chunk0_ref, q_ref, k_ref, gam_ref, w_ref, u_ref, p_ref,
    state_in_ref,
    # outputs
    o_ref, state_ref,
    *, ratio: int, bv: int, kd: int, chunk: int, num_tokens: int, precision):
    """Program (sequence s, value head h, row block): the state pass over s's chunks."""
    s, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    begin = qsl_ref[s]
    n = qsl_ref[s + 1] - begin
    fresh = seq_lens_ref[s] == n
    slot = slots_ref[s]
    chunk0 = chunk0_ref[s]
    j = h // ratio
    l_L = jnp.arange(chunk, dtype=jnp.int32)
    k_K = jnp.arange(kd, dtype=jnp.int32)
    v_B = vb * bv + jnp.arange(bv, dtype=jnp.int32)
    zbk = jnp.zeros((bv, kd), jnp.int32)
    st_at = (zbk + slot, zbk + h, zbk + v_B[:, None], zbk + k_K[None, :])
    state0 = jnp.where(fresh, 0.0, plgpu.load(state_in_ref.at[st_at]).astype(jnp.float32))
    zlk = jnp.zeros((chunk, kd), jnp.int32)
    zlb = jnp.zeros((chunk, bv), jnp.int32)
    zll = jnp.zeros((chunk, chunk), jnp.int32)

    def one_chunk(c, st):
        ci = chunk0 + c
        tok_L = begin + c * chunk + l_L
        valid = tok_L < begin + n
        t_L = jnp.minimum(tok_L, num_tokens - 1)
        q = jnp.where(valid[:, None], plgpu.load(q_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
        k = jnp.where(valid[:, None], plgpu.load(k_ref.at[zlk + t_L[:, None], zlk + j, zlk + k_K[None, :]]), 0.0)
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        gam = plgpu.load(gam_ref.at[l_L * 0 + ci, l_L * 0 + h, l_L])
        w = plgpu.load(w_ref.at[zlk + ci, zlk + h, zlk + l_L[:, None], zlk + k_K[None, :]])
        u = plgpu.load(u_ref.at[zlb + ci, zlb + h, zlb + l_L[:, None], zlb + v_B[None, :]])
        p = plgpu.load(p_ref.at[zll + ci, zll + h, zll + l_L[:, None], zll + l_L[None, :]])
        v_new = u - plgpu.dot(w, st, trans_b=True, precision=precision)                     # [L, BV]
        o = (plgpu.dot(q * jnp.exp(gam)[:, None], st, trans_b=True, precision=precision)
             + plgpu.dot(p, v_new, precision=precision))
        plgpu.store(o_ref.at[zlb + tok_L[:, None], zlb + h, zlb + v_B[None, :]], o.astype(o_ref.dtype),
                    mask=valid[:, None] & (zlb == 0))
        last = jnp.sum(jnp.where(l_L == chunk - 1, gam, 0.0))     # gam is flat past the sequence
        k_dec = k * jnp.exp(last - gam)[:, None]
        return st * jnp.exp(last) + plgpu.dot(v_new, k_dec, trans_a=True, precision=precision)

    # NOTE: both loop bounds int32 (a Python 0 gave an scf.for with mixed bound types)
    st = jax.lax.fori_loop(jnp.int32(0), (n + chunk - 1) // chunk, one_chunk, state0)
    plgpu.store(state_ref.at[st_at], st.astype(state_ref.dtype), mask=(zbk == 0) & (n > 0))


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


def chunk_table(query_start_loc, num_tokens: int, chunk: int):
    """Each sequence's tokens cut into chunks of `chunk` from its start (its last one partial):
    (first chunk of each sequence i32[S], first token of each chunk i32[N], its length i32[N]
    (0: a padding chunk)) with N = T // L + S, a bound on the chunk count."""
    s = query_start_loc.shape[0] - 1
    qsl = query_start_loc.astype(jnp.int32)
    qlen_S = jnp.maximum(jnp.diff(qsl), 0)
    nch_S = (qlen_S + chunk - 1) // chunk
    end_S = jnp.cumsum(nch_S).astype(jnp.int32)
    first_S = end_S - nch_S
    c_N = jnp.arange(num_tokens // chunk + s, dtype=jnp.int32)
    seq_N = jnp.clip(jnp.searchsorted(end_S, c_N, side="right"), 0, s - 1).astype(jnp.int32)
    i_N = c_N - first_S[seq_N]
    real_N = c_N < end_S[-1]
    tok0_N = jnp.where(real_N, qsl[seq_N] + i_N * chunk, 0)
    len_N = jnp.where(real_N, jnp.clip(qlen_S[seq_N] - i_N * chunk, 0, chunk), 0)
    return first_S, tok0_N.astype(jnp.int32), len_N.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("impl", "chunk", "block_v", "num_warps", "interpret"),
                   donate_argnames=("state_NHVK",))
def gated_delta_chunked(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots,
                        state_NHVK, *, impl: str = "auto", chunk: int = gdn.CHUNK,
                        block_v: int | None = None, num_warps: int = 4, interpret: bool | None = None):
    """(o f32[T, H, V], state_NHVK updated in place): see the module docstring.
    impl: "pallas" (Triton; interpreted on a CPU), "xla" (the reference), "auto".
    num_warps: both kernels'."""
    t, g, kd = q_TGK.shape
    _, h, vd = v_THV.shape
    s = seq_lens.shape[0]
    bv = block_v or min(vd, 32)
    _validate(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens, state_slots, state_NHVK,
              chunk, bv)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_gated_delta_chunked(q_TGK, k_TGK, v_THV, g_TH, beta_TH, query_start_loc, seq_lens,
                                       state_slots, state_NHVK, chunk=chunk)
    interpret = (not on_gpu) if interpret is None else interpret
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    precision = dot_precision(v_THV.dtype)
    qsl = query_start_loc.astype(jnp.int32)
    chunk0_S, tok0_N, len_N = chunk_table(qsl, t, chunk)
    n = tok0_N.shape[0]

    ins = [tok0_N, len_N, q_TGK, k_TGK, v_THV, g_TH, beta_TH]
    scratch = [(n, h, chunk), (n, h, chunk, kd), (n, h, chunk, vd), (n, h, chunk, chunk)]
    gam, w, u, p = pl.pallas_call(
        functools.partial(_prep_kernel, ratio=h // g, kd=kd, vd=vd, chunk=chunk, num_tokens=t,
                          precision=precision),
        grid=(n, h),
        in_specs=[whole(*a.shape) for a in ins],
        out_specs=[whole(*shape) for shape in scratch],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape in scratch],
        compiler_params=params,
        interpret=interpret,
        name=f"gated_delta_chunked_prep_l{chunk}",
    )(*ins)

    ins = [qsl, seq_lens.astype(jnp.int32), state_slots.astype(jnp.int32), chunk0_S, q_TGK, k_TGK,
           gam, w, u, p, state_NHVK]
    o, state = pl.pallas_call(
        functools.partial(_state_kernel, ratio=h // g, bv=bv, kd=kd, chunk=chunk, num_tokens=t,
                          precision=precision),
        grid=(s, h, vd // bv),
        in_specs=[whole(*a.shape) for a in ins],
        out_specs=[whole(t, h, vd), whole(*state_NHVK.shape)],
        out_shape=[jax.ShapeDtypeStruct((t, h, vd), jnp.float32),
                   jax.ShapeDtypeStruct(state_NHVK.shape, state_NHVK.dtype)],
        input_output_aliases={len(ins) - 1: 1},
        compiler_params=params,
        interpret=interpret,
        name=f"gated_delta_chunked_state_l{chunk}_bv{bv}",
    )(*ins)
    # padding tokens are written by no program: zero them so nothing downstream sees garbage
    real_T = jnp.arange(t) < query_start_loc[-1]
    return jnp.where(real_T[:, None, None], o, 0.0), state
