"""Gated DeltaNet linear attention on ragged batches, in plain jnp (Qwen3-Next, Qwen3.5).

Per value head, with a state S f[V, K] per sequence and the token's decay g (log space, <= 0)
and write strength beta in (0, 1):

    S_t = exp(g_t) * S_{t-1} @ (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      o_t = S_t q_t

q and k arrive L2-normalised and q scaled by K^-1/2 (post_conv). Three forms, all equal:
  - `naive_gated_delta`: the recurrence token by token, one sequence (the test reference);
  - `recurrent_gated_delta`: one step for every sequence at once (decode);
  - `chunked_gated_delta`: the WY (UT-transform) form over chunks of L tokens, each chunk
    belonging to one sequence: within a chunk the L updates collapse into a triangular solve
    and a few matmuls, and only the per-chunk state update is sequential.
`gated_delta_rule` picks recurrent when no sequence has more than one token, else chunked.

Ragged layout (jaxserve/step_input.py): a step's tokens are the sequences' chunks back to back;
sequence s has qlen_S[s] tokens from query_start_loc[s]; padding sequences have qlen 0.

Legend: T tokens, S sequences, H value heads, G key heads (H % G == 0), K key head dim,
V value head dim, C conv channels (2*G*K + H*V), W conv width, N chunks, L chunk length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64   # tokens per chunk of the chunked form (FLA's and vLLM's choice)


def ragged_index(query_start_loc, num_tokens: int):
    """(sequence of each token i32[T], its index within its chunk of the step i32[T],
    tokens of each sequence i32[S], token is real bool[T])."""
    t_T = jnp.arange(num_tokens, dtype=jnp.int32)
    qlen_S = jnp.diff(query_start_loc).astype(jnp.int32)
    seq_T = jnp.clip(jnp.searchsorted(query_start_loc, t_T, side="right") - 1, 0, qlen_S.shape[0] - 1)
    real_T = t_T < query_start_loc[-1]
    return seq_T.astype(jnp.int32), t_T - query_start_loc[seq_T], qlen_S, real_T


# ---------------------------------------------------------------------------------------------
# Causal depthwise conv1d with a carried state
# ---------------------------------------------------------------------------------------------


def causal_conv(x_TC, w_CW, state_SCw, query_start_loc):
    """SiLU(causal depthwise conv) of each sequence's tokens, continuing from its state.

    state_SCw f[S, C, W-1]: the W-1 inputs before each sequence's chunk, oldest first (zeros for
    a sequence that starts here). Returns (out f[T, C], new state f[S, C, W-1]: the last W-1
    inputs, a padding sequence's unchanged)."""
    t, _ = x_TC.shape
    w = w_CW.shape[1]
    seq_T, i_T, qlen_S, _ = ragged_index(query_start_loc, t)
    state_SwC = jnp.swapaxes(state_SCw, 1, 2).astype(x_TC.dtype)

    def window(seq_R, i_R, tok_R):
        """Inputs at in-chunk offsets i-(W-1) .. i for rows R: from this step's tokens when the
        offset is >= 0, else from the state (offset -1 is its last column)."""
        lag_W = jnp.arange(w - 1, -1, -1)
        src_RW = i_R[:, None] - lag_W[None, :]
        from_x = src_RW >= 0
        xs = x_TC[jnp.clip(tok_R[:, None] - lag_W[None, :], 0, t - 1)]
        st = state_SwC[seq_R[:, None], jnp.clip(src_RW + w - 1, 0, w - 2)]
        return jnp.where(from_x[..., None], xs, st)                         # [R, W, C]

    win_TWC = window(seq_T, i_T, jnp.arange(t))
    out_TC = jnp.einsum("twc,cw->tc", win_TWC.astype(jnp.float32), w_CW.astype(jnp.float32))
    out_TC = jax.nn.silu(out_TC).astype(x_TC.dtype)
    # the new state is the window of a virtual token just after each chunk, minus its own slot
    s = qlen_S.shape[0]
    new_SwC = window(jnp.arange(s), qlen_S, query_start_loc[:-1] + qlen_S)[:, :-1]
    return out_TC, jnp.swapaxes(new_SwC, 1, 2).astype(state_SCw.dtype)


# ---------------------------------------------------------------------------------------------
# Post-conv step: split, L2-normalise, decay and write strength
# ---------------------------------------------------------------------------------------------


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis, in f32 (HF's and FLA's formula)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, *, num_k_heads: int, k_dim: int, v_dim: int,
              grouped: bool = False):
    """(q f32[T, G, K] L2-normalised and scaled by K^-1/2, k f32[T, G, K] L2-normalised,
    v f32[T, H, V], g f32[T, H] = -exp(A_log) * softplus(a + dt_bias), beta f32[T, H] = sigmoid(b)).
    The conv channels are q | k | v, or with `grouped` one block per key head j: [q_j | k_j |
    v of its value heads] (the layout on a mesh: each rank's channel block is whole heads)."""
    t = conv_TC.shape[0]
    gk = num_k_heads * k_dim
    if grouped:
        x = conv_TC.astype(jnp.float32).reshape(t, num_k_heads, -1)
        q, k, v = (p.reshape(t, -1) for p in jnp.split(x, [k_dim, 2 * k_dim], axis=-1))
    else:
        q, k, v = jnp.split(conv_TC.astype(jnp.float32), [gk, 2 * gk], axis=-1)
    q_TGK = l2norm(q.reshape(t, num_k_heads, k_dim)) * (k_dim ** -0.5)
    k_TGK = l2norm(k.reshape(t, num_k_heads, k_dim))
    g_TH = -jnp.exp(a_log_H.astype(jnp.float32)) * jax.nn.softplus(
        a_TH.astype(jnp.float32) + dt_bias_H.astype(jnp.float32))
    return q_TGK, k_TGK, v.reshape(t, -1, v_dim), g_TH, jax.nn.sigmoid(b_TH.astype(jnp.float32))


def expand_heads(x_TGK, num_v_heads: int):
    """Key head j serves value heads j*r .. j*r+r-1 (r = H / G), as HF's repeat_interleave."""
    return jnp.repeat(x_TGK, num_v_heads // x_TGK.shape[1], axis=1)


# ---------------------------------------------------------------------------------------------
# The gated delta rule
# ---------------------------------------------------------------------------------------------


def naive_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, state_HVK):
    """Token-by-token recurrence of ONE sequence (f32): (o f32[T, H, V], final state)."""
    def step(s_HVK, inp):
        q, k, v, g, beta = inp
        s_HVK = s_HVK * jnp.exp(g)[:, None, None]
        delta_HV = (v - jnp.einsum("hvk,hk->hv", s_HVK, k)) * beta[:, None]
        s_HVK = s_HVK + delta_HV[:, :, None] * k[:, None, :]
        return s_HVK, jnp.einsum("hvk,hk->hv", s_HVK, q)
    state, o = jax.lax.scan(step, state_HVK.astype(jnp.float32),
                            tuple(a.astype(jnp.float32) for a in (q_THK, k_THK, v_THV, g_TH, beta_TH)))
    return o, state


def recurrent_gated_delta(q_SHK, k_SHK, v_SHV, g_SH, beta_SH, state_SHVK):
    """One token per sequence (decode): (o f32[S, H, V], new state f32[S, H, V, K]). A sequence
    with g = beta = 0 and k = 0 keeps its state."""
    s = state_SHVK.astype(jnp.float32) * jnp.exp(g_SH)[:, :, None, None]
    delta_SHV = (v_SHV - jnp.einsum("shvk,shk->shv", s, k_SHK)) * beta_SH[:, :, None]
    s = s + delta_SHV[..., None] * k_SHK[:, :, None, :]
    return jnp.einsum("shvk,shk->shv", s, q_SHK), s


def chunk_layout(query_start_loc, num_tokens: int, chunk: int):
    """Each sequence's tokens cut into chunks of `chunk` (its last one partial).

    Returns (flat slot of each token in the [N*L] chunked layout i32[T] (N*L for padding
    tokens: dropped), sequence of each chunk i32[N], chunk is its sequence's first bool[N],
    last bool[N], chunk is real bool[N]) with N = ceil(T/L) + S, a bound on the chunk count."""
    seq_T, i_T, qlen_S, real_T = ragged_index(query_start_loc, num_tokens)
    s = qlen_S.shape[0]
    n = -(-num_tokens // chunk) + s
    nch_S = (qlen_S + chunk - 1) // chunk
    end_S = jnp.cumsum(nch_S)
    first_S = end_S - nch_S
    dest_T = jnp.where(real_T, (first_S[seq_T] + i_T // chunk) * chunk + i_T % chunk, n * chunk)
    c_N = jnp.arange(n)
    seq_N = jnp.clip(jnp.searchsorted(end_S, c_N, side="right"), 0, s - 1).astype(jnp.int32)
    real_N = c_N < end_S[-1]
    return dest_T, seq_N, real_N & (c_N == first_S[seq_N]), real_N & (c_N == end_S[seq_N] - 1), real_N


def chunk_prepare(k_NLHK, v_NLHV, g_NLH, beta_NLH):
    """Per-chunk quantities that do not depend on the state (parallel over chunks):
    cumulative decay gam f32[N, H, L]; U = (I + A)^-1 beta v and W = (I + A)^-1 beta k exp(gam)
    with A the strictly lower beta_i (k_i . k_j) exp(gam_i - gam_j) (the UT transform)."""
    l = k_NLHK.shape[1]
    k = jnp.swapaxes(k_NLHK, 1, 2)                    # [N, H, L, K]
    v = jnp.swapaxes(v_NLHV, 1, 2)                    # [N, H, L, V]
    beta = jnp.swapaxes(beta_NLH, 1, 2)               # [N, H, L]
    gam = jnp.cumsum(jnp.swapaxes(g_NLH, 1, 2), axis=-1)
    lower = jnp.tril(jnp.ones((l, l), bool), -1)
    # decays masked before exp: above the diagonal gam_i - gam_j > 0 could overflow
    dec = jnp.exp(jnp.where(lower, gam[..., :, None] - gam[..., None, :], -jnp.inf))
    a = beta[..., :, None] * jnp.einsum("nhik,nhjk->nhij", k, k) * dec
    eye = jnp.eye(l, dtype=a.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * jnp.exp(gam))[..., None]], axis=-1)
    uw = jax.lax.linalg.triangular_solve(eye + a, rhs, left_side=True, lower=True, unit_diagonal=True)
    return gam, uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]


def chunk_step(state_HVK, q_HLK, k_HLK, gam_HL, u_HLV, w_HLK):
    """One chunk from its initial state: (o f32[H, L, V], state after the chunk)."""
    l = q_HLK.shape[1]
    v_new = u_HLV - jnp.einsum("hlk,hvk->hlv", w_HLK, state_HVK)
    causal = jnp.tril(jnp.ones((l, l), bool))
    dec = jnp.exp(jnp.where(causal, gam_HL[:, :, None] - gam_HL[:, None, :], -jnp.inf))
    attn = jnp.einsum("hik,hjk->hij", q_HLK, k_HLK) * dec
    o = jnp.einsum("hlk,hvk->hlv", q_HLK * jnp.exp(gam_HL)[..., None], state_HVK) + attn @ v_new
    last = gam_HL[:, -1:]
    k_dec = k_HLK * jnp.exp(last - gam_HL)[..., None]
    state = state_HVK * jnp.exp(last)[..., None] + jnp.einsum("hlv,hlk->hvk", v_new, k_dec)
    return o, state


def chunked_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHVK, query_start_loc,
                        chunk: int = CHUNK):
    """Any ragged batch: (o f32[T, H, V], final state f32[S, H, V, K]); padding sequences keep
    their state."""
    t, h, kd = q_THK.shape
    vd = v_THV.shape[-1]
    dest_T, seq_N, first_N, last_N, _ = chunk_layout(query_start_loc, t, chunk)
    n = seq_N.shape[0]

    def to_chunks(a_T):
        flat = jnp.zeros((n * chunk,) + a_T.shape[1:], jnp.float32)
        flat = flat.at[dest_T].set(a_T.astype(jnp.float32), mode="drop")
        return flat.reshape((n, chunk) + a_T.shape[1:])

    q, k, v, g, beta = map(to_chunks, (q_THK, k_THK, v_THV, g_TH, beta_TH))
    gam, u, w = chunk_prepare(k, v, g, beta)
    q, k = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
    init = state_SHVK.astype(jnp.float32)

    def body(carry, c):
        running, finals = carry
        s0 = jnp.where(first_N[c], init[seq_N[c]], running)
        o, s1 = chunk_step(s0, q[c], k[c], gam[c], u[c], w[c])
        finals = jnp.where(last_N[c], finals.at[seq_N[c]].set(s1), finals)
        return (s1, finals), o

    (_, finals), o_NHLV = jax.lax.scan(body, (jnp.zeros((h, vd, kd), jnp.float32), init), jnp.arange(n))
    o_flat = jnp.swapaxes(o_NHLV, 1, 2).reshape(n * chunk, h, vd)
    return o_flat[jnp.clip(dest_T, 0, n * chunk - 1)], finals


def gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHVK, query_start_loc,
                     chunk: int = CHUNK):
    """(o f32[T, H, V], final state f32[S, H, V, K]) of a ragged batch: the recurrent form when
    every sequence has at most one token (a decode step), else the chunked form; the choice is
    made on the device (lax.cond), so one compiled step serves both."""
    t = q_THK.shape[0]
    s = state_SHVK.shape[0]
    qlen_S = jnp.diff(query_start_loc)
    seq_T, _, _, real_T = ragged_index(query_start_loc, t)

    def decode(_):
        tok_S = jnp.clip(query_start_loc[:-1], 0, t - 1)
        has_S = (qlen_S > 0)[:, None]
        pick = lambda a_T: jnp.where(has_S.reshape((s,) + (1,) * (a_T.ndim - 1)),  # noqa: E731
                                     a_T[tok_S].astype(jnp.float32), 0.0)
        o_SHV, st = recurrent_gated_delta(*map(pick, (q_THK, k_THK, v_THV, g_TH, beta_TH)), state_SHVK)
        return jnp.where(real_T[:, None, None], o_SHV[seq_T], 0.0), st

    def chunked(_):
        return chunked_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, state_SHVK, query_start_loc, chunk)

    return jax.lax.cond(jnp.max(qlen_S) <= 1, decode, chunked, None)


def gated_rms_norm(o_THV, z_THV, w_V, eps: float):
    """RMSNorm(o) * w * silu(z) over each head (HF's RMSNormGated: the norm before the gate)."""
    o = o_THV.astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
    return o * w_V.astype(jnp.float32) * jax.nn.silu(z_THV.astype(jnp.float32))
