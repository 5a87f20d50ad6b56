"""MiniMax-M2's attention input in plain XLA: RMSNorm over each token's whole q row (all heads)
and whole k row, a rotary embedding on the first dims of each head only, and the K/V cache
write (models/minimax_m2.py; pallas_kernels/full_qk_norm_rope_kv_write.py fuses the three and
is checked against rope_write_xla).

Legend: T tokens, N query heads, K kv heads, E head dim, F = N*E or K*E (a whole row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models import layers


def qk_norm(q_TF: jax.Array, k_TF: jax.Array, q_w: jax.Array, k_w: jax.Array, num_kv_heads: int,
            eps: float):
    """RMSNorm of each token's whole q row (N*E) and whole k row (K*E), in f32, times the
    weights; returned in the input dtype.

    Why the shape of the sums: per kv-head group first ([T, K] each: under tensor
    parallelism, heads are split by whole kv groups, so that is local), then q's and k's
    stacked on a last axis of 2 and summed over K together: the one cross-device reduction,
    f32[T, 2] (an all-reduce per layer instead of two)."""
    t = q_TF.shape[0]
    q = q_TF.astype(jnp.float32).reshape(t, num_kv_heads, -1)
    k = k_TF.astype(jnp.float32).reshape(t, num_kv_heads, -1)
    ss_TK2 = jnp.stack([jnp.sum(q * q, axis=-1), jnp.sum(k * k, axis=-1)], axis=-1)
    ss_T2 = jnp.sum(ss_TK2, axis=1)
    inv_T2 = jax.lax.rsqrt(ss_T2 / jnp.array([q_TF.shape[1], k_TF.shape[1]], jnp.float32) + eps)
    q = q.reshape(t, -1) * inv_T2[:, :1] * q_w.astype(jnp.float32)
    k = k.reshape(t, -1) * inv_T2[:, 1:] * k_w.astype(jnp.float32)
    return q.astype(q_TF.dtype), k.astype(k_TF.dtype)


def partial_rope(x_TNE: jax.Array, positions_T: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """RoPE (rotate-half) on the first 2 * len(inv_freq) dims of each head; the rest pass."""
    r = 2 * inv_freq.shape[0]
    if r == x_TNE.shape[-1]:
        return layers.apply_rope(x_TNE, positions_T, inv_freq)
    return jnp.concatenate([layers.apply_rope(x_TNE[..., :r], positions_T, inv_freq), x_TNE[..., r:]], -1)


def rope_write_xla(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache, inv_freq_R,
                   q_norm, k_norm, *, eps: float):
    """The full-width q/k norm, partial rotary and the cache write in plain XLA: (q', k_cache,
    v_cache). The fused kernel (pallas_kernels/full_qk_norm_rope_kv_write.py) matches it."""
    t, n, e = q_TNE.shape
    kh = k_TKE.shape[1]
    q, k = qk_norm(q_TNE.reshape(t, n * e), k_TKE.reshape(t, kh * e), q_norm, k_norm, kh, eps)
    q_TNE = partial_rope(q.reshape(t, n, e), positions_T, inv_freq_R)
    k_TKE = partial_rope(k.reshape(t, kh, e), positions_T, inv_freq_R)
    k_cache, v_cache = layers.write_kv(k_cache, v_cache, k_TKE, v_TKE, slot_mapping_T)
    return q_TNE, k_cache, v_cache
