"""Multi-head latent attention (DeepSeek V2/V3/V3.2): rotary (YaRN), the paged latent write,
V3.2's indexer scores and top-k choice, in plain jnp (the attention itself over the paged
latents: pallas_kernels/mla_attention.py, its kernel and its jnp reference).

The cache keeps per token ONE row of width W = C + R: the RMS-normed kv latent (C =
kv_lora_rank) and the shared roped key (R = qk_rope_head_dim), both single-head. Attention
is computed absorbed: W_UK is folded into the query (q_lat = q_nope @ W_UK, width C), scores
are q_lat . latent + q_rope . k_rope over the W-wide rows, the output is a weighted sum of
the latents (width C), and W_UV maps it to each head's value space afterwards. So the cache
read per token is W numbers whatever the number of heads (576 for DeepSeek-V3, against
128 heads x 2 x 192 for expanded keys and values), which is what makes MLA's decode cheap.

V3.2's lightning indexer keeps a second per-token array on the same block table (its key,
width J) and picks, for every query token, the `index_topk` positions it attends to.

Legend: T tokens, S sequences, N heads, C kv latent, R rope dims, W = C + R, P tokens per
block, B blocks per sequence, L = B * P context slots, I indexer heads, J indexer head dim,
k selected positions per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.models import layers


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(rope_dim: int, theta: float, scaling: dict | None, max_positions: int):
    """(inv_freq f32[R/2], attention factor) for DeepSeek's rotary: default, or YaRN with
    DeepSeek's mscale / mscale_all_dim (the factor multiplies cos and sin, i.e. the roped q
    and k, as HF does). Other kinds go to layers.rope_inv_freq (factor 1).

    YaRN here: frequencies below the correction range are interpolated (divided by `factor`),
    above it kept, with a linear ramp between (the range from beta_fast / beta_slow rotations
    over original_max_position_embeddings).
    NOTE: YaRN belongs in the shared layers package (layers.rope_inv_freq); it is here only
    because that file is not this branch's to edit."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "yarn":
        return layers.rope_inv_freq(rope_dim, theta, scaling), 1.0
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_len
    attn = scaling.get("attention_factor")
    if attn is None:
        ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = (yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all) if ms and ms_all
                else yarn_get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return rope_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001                     # avoid a zero-width ramp
    pos_freqs = theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim)
    ramp = jnp.clip((jnp.arange(rope_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp                       # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn)


def softmax_scale(qk_head_dim: int, scaling: dict | None, max_positions: int) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's
    correction of the attention temperature for the extended context)."""
    scale = qk_head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        ms_all = scaling.get("mscale_all_dim", 0)
        if ms_all:
            factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
            scale *= yarn_get_mscale(factor, ms_all) ** 2
    return scale


def rope(x_TNR: jax.Array, positions_T: jax.Array, inv_freq: jax.Array, factor: float) -> jax.Array:
    """Half-split rotary times the YaRN attention factor. Interleaved checkpoints
    (rope_interleave) are de-interleaved once at load (deepseek_loader), so this one layout
    serves both: q and k get the same permutation, so their dot products are unchanged."""
    out = layers.apply_rope(x_TNR, positions_T, inv_freq)
    return out if factor == 1.0 else (out.astype(jnp.float32) * factor).astype(x_TNR.dtype)


def write_paged(cache_NPX: jax.Array, rows_TX: jax.Array, slot_mapping_T: jax.Array) -> jax.Array:
    """Scatter one row per token into its cache slot (in place once the cache is donated)."""
    n, p = cache_NPX.shape[:2]
    flat = cache_NPX.reshape(n * p, *cache_NPX.shape[2:])
    return flat.at[slot_mapping_T].set(rows_TX.astype(cache_NPX.dtype)).reshape(cache_NPX.shape)


def layer_norm(x_TJ: jax.Array, w_J: jax.Array, b_J: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm (mean and variance over the last axis) in f32, back in the input dtype.
    NOTE: belongs in the shared layers package next to rms_norm."""
    x = x_TJ.astype(jnp.float32)
    mu = x.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(var + eps) * w_J.astype(jnp.float32) + b_J.astype(jnp.float32)
    return y.astype(x_TJ.dtype)


def index_scores_xla(q_TIJ: jax.Array, w_TI: jax.Array, index_k_NPJ: jax.Array,
                     block_tables_SB: jax.Array, token_seq_ids_T: jax.Array,
                     positions_T: jax.Array, *, scale: float, token_chunk: int = 64) -> jax.Array:
    """The lightning indexer's scores f32[T, L] over each token's paged context:
    score(t, l) = sum_i w[t, i] * relu(scale * q[t, i] . k[l]); -inf where l > positions[t]
    (the future, and everything past the sequence's end)."""
    t = q_TIJ.shape[0]
    p, j = index_k_NPJ.shape[1:]
    ctx_len = block_tables_SB.shape[1] * p
    slot_pos_L = jnp.arange(ctx_len, dtype=jnp.int32)

    def one_token(args):
        q_IJ, w_I, seq, pos = args
        k_LJ = index_k_NPJ[block_tables_SB[seq]].reshape(ctx_len, j).astype(jnp.float32)
        s_IL = jax.nn.relu(jnp.einsum("ij,lj->il", q_IJ.astype(jnp.float32), k_LJ) * scale)
        s_L = jnp.einsum("i,il->l", w_I.astype(jnp.float32), s_IL)
        return jnp.where(slot_pos_L <= pos, s_L, -jnp.inf)

    return jax.lax.map(one_token, (q_TIJ, w_TI, token_seq_ids_T, positions_T),
                       batch_size=min(t, token_chunk))


def select_topk(scores_TL: jax.Array, k: int, topk_fn=None) -> jax.Array:
    """i32[T, min(k, L)]: the positions of each row's k best scores, -1 where fewer than k are
    finite (a row whose context is shorter than k attends to all of it). `topk_fn(x, k) ->
    (values, indices)` defaults to lax.top_k (pallas_kernels.topk is the kernel)."""
    k = min(k, scores_TL.shape[1])
    vals_Tk, idx_Tk = (topk_fn or jax.lax.top_k)(scores_TL, k)
    return jnp.where(vals_Tk > -jnp.inf, idx_Tk, -1).astype(jnp.int32)
