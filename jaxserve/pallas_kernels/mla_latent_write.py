"""MLA's cache writes in one kernel: the kv latent's RMSNorm, the shared key's rotary and the
paged latent write, and (V3.2) the indexer key's LayerNorm, rotary and paged write.

    latent', index_k' = mla_latent_write(kv_TW, kv_norm_C, positions_T, slot_mapping_T,
                                         latent_NPW, inv_freq_H, factor=...,
                                         index_TJ=None, index_norm_J=None, index_bias_J=None,
                                         index_cache_NPJ=None)

per token t (slot s = slot_mapping[t]):
    latent[s] = [rmsnorm(kv[t, :C]) * kv_norm | rope(kv[t, C:])]           (W = C + R wide)
    index_k[s] = rope_first_R(layernorm(index[t]) * index_norm + index_bias)   (J wide)

rope: half-split rotary at positions[t] * inv_freq, times YaRN's attention factor, rounded as
models/mla.py rounds it (to the input dtype after the rotation, again after the factor).

Why a kernel: in XLA the latent path is a norm fusion, a rotary fusion, a concatenation and a
scatter, and the indexer key adds a LayerNorm, a rotary and a second scatter: six or more
small kernels a layer that a batch-1 decode step launches 61 times (DeepSeek-V3), for a few
kilobytes of data. One program per token here.

Layouts: kv_TW f[T, C + R] (the wkv_a projection's output as it comes), kv_norm_C f[C],
positions_T / slot_mapping_T i32[T], latent_NPW f[NB, P, C + R], inv_freq_H f32[R/2];
index_TJ f[T, J], index_norm_J / index_bias_J f[J], index_cache_NPJ f[NB, P, J].
The caches are updated in place (input_output_aliases) when the caller donates them.

Legend: T tokens, C kv latent, R rope dims, H = R / 2, W = C + R, J indexer head dim, NB cache
blocks, P block size; Cp, Hp, Jp: powers of two at least C, H, J (masked tails).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models import layers
from jaxserve.models.layers import mla
from jaxserve.pallas_kernels.dispatch import absent_refs, per_token_call, resolve_impl, whole

# ---------------------------------------------------------------------------------------------
# Reference: the model's own XLA building blocks, in the model's order
# ---------------------------------------------------------------------------------------------


def ref_mla_latent_write(kv_TW, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H,
                         *, factor: float = 1.0, eps: float = 1e-6, index_TJ=None,
                         index_norm_J=None, index_bias_J=None, index_cache_NPJ=None,
                         index_eps: float = 1e-6):
    c = kv_norm_C.shape[0]
    r = 2 * inv_freq_H.shape[0]
    c_TC = layers.rms_norm(kv_TW[:, :c], kv_norm_C, eps)
    k_rope_TR = mla.rope(kv_TW[:, None, c:], positions_T, inv_freq_H, factor)[:, 0]
    latent = mla.write_paged(latent_NPW, jnp.concatenate([c_TC, k_rope_TR], -1), slot_mapping_T)
    if index_TJ is None:
        return latent, None
    k_TJ = mla.layer_norm(index_TJ, index_norm_J, index_bias_J, index_eps)
    roped_TR = mla.rope(k_TJ[:, None, :r], positions_T, inv_freq_H, factor)[:, 0]
    index_cache = mla.write_paged(index_cache_NPJ, jnp.concatenate([roped_TR, k_TJ[:, r:]], -1),
                                  slot_mapping_T)
    return latent, index_cache


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _validate(kv_TW, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H, index_TJ,
              index_norm_J, index_bias_J, index_cache_NPJ):
    t, w = kv_TW.shape
    c, r = kv_norm_C.shape[0], 2 * inv_freq_H.shape[0]
    if w != c + r:
        raise ValueError(f"kv_TW must be [T, C + R] = [T, {c} + {r}] (kv_norm_C is f[C], inv_freq_H "
                         f"f32[R/2]); got {kv_TW.shape}")
    if positions_T.shape != (t,) or slot_mapping_T.shape != (t,):
        raise ValueError(f"positions_T and slot_mapping_T must be i32[T={t}]; got "
                         f"{positions_T.shape} and {slot_mapping_T.shape}")
    if latent_NPW.ndim != 3 or latent_NPW.shape[2] != w:
        raise ValueError(f"latent_NPW must be [NB, P, W={w}]; got {latent_NPW.shape}")
    parts = (index_TJ, index_norm_J, index_bias_J, index_cache_NPJ)
    if any(p is None for p in parts) != all(p is None for p in parts):
        raise ValueError("index_TJ, index_norm_J, index_bias_J and index_cache_NPJ go together "
                         "(V3.2's indexer) or are all None")
    if index_TJ is not None:
        j = index_TJ.shape[1]
        if index_TJ.shape[0] != t or j < r:
            raise ValueError(f"index_TJ must be [T={t}, J] with J >= R={r}; got {index_TJ.shape}")
        if index_norm_J.shape != (j,) or index_bias_J.shape != (j,):
            raise ValueError(f"index_norm_J and index_bias_J must be f[J={j}]")
        if index_cache_NPJ.shape != latent_NPW.shape[:2] + (j,):
            raise ValueError(f"index_cache_NPJ must be [NB, P, J] = {latent_NPW.shape[:2] + (j,)}; "
                             f"got {index_cache_NPJ.shape}")


# ---------------------------------------------------------------------------------------------
# Kernel body: one program per token
# ---------------------------------------------------------------------------------------------


def rope_pair(x1, x2, cos, sin, factor, dtype):
    """The two rotated halves, rounded as mla.rope rounds them."""
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = [(x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)]
    if factor != 1.0:
        out = [(o.astype(jnp.float32) * factor).astype(dtype) for o in out]
    return out


def rotary(pos_ref, inv_ref, t, half, half_p):
    """(cos, sin, columns, their mask, clamped columns) of token t's rotary angles."""
    i_h = jnp.arange(half_p, dtype=jnp.int32)
    in_h = i_h < half
    i_h_safe = jnp.minimum(i_h, half - 1)
    angle = pos_ref[t].astype(jnp.float32) * plgpu.load(inv_ref.at[i_h_safe])
    return jnp.cos(angle), jnp.sin(angle), i_h, in_h, i_h_safe


def rms_normed(x_ref, t, off, width, width_p, w_ref, eps, dtype):
    """(RMSNorm(x[t, off:off + width]) * w rounded to dtype, its columns, their mask)."""
    i = jnp.arange(width_p, dtype=jnp.int32)
    ok = i < width
    safe = jnp.minimum(i, width - 1)
    x = jnp.where(ok, plgpu.load(x_ref.at[t, off + safe]).astype(jnp.float32), 0.0)
    inv_rms = jax.lax.rsqrt(jnp.sum(x * x) / width + eps)
    return (x * inv_rms * plgpu.load(w_ref.at[safe]).astype(jnp.float32)).astype(dtype), i, ok


def write_latent(kv_ref, kv_off, kvn_ref, t, slot, rot, latent_ref, *, c, c_p, half, factor, eps):
    """latent[slot] = [RMSNorm(kv[t, :C]) * kv_norm | rope(kv[t, C:])], kv read from column
    kv_off of kv_ref."""
    # loads clamp their indices into range; stores keep them and mask (a clamped masked store
    # would aim several lanes at one element, and interpret mode writes their old values back)
    dtype = kv_ref.dtype
    normed, i_c, in_c = rms_normed(kv_ref, t, kv_off, c, c_p, kvn_ref, eps, dtype)
    plgpu.store(latent_ref.at[slot, i_c], normed.astype(latent_ref.dtype), mask=in_c)
    cos, sin, i_h, in_h, i_h_safe = rot
    k1, k2 = rope_pair(plgpu.load(kv_ref.at[t, kv_off + c + i_h_safe]),
                        plgpu.load(kv_ref.at[t, kv_off + c + half + i_h_safe]), cos, sin, factor, dtype)
    plgpu.store(latent_ref.at[slot, c + i_h], k1.astype(latent_ref.dtype), mask=in_h)
    plgpu.store(latent_ref.at[slot, c + half + i_h], k2.astype(latent_ref.dtype), mask=in_h)


def write_index_key(idx_ref, idx_off, idxn_ref, idxb_ref, t, slot, rot, index_ref, *, j, j_p,
                     half, factor, index_eps):
    """index_k[slot] = rope_first_R(LayerNorm(idx[t]) * norm + bias), idx read from column
    idx_off: LayerNorm over J (f32, rounded to the input dtype), then rotary on its first R
    dims, which are re-read and normalised again by the same statistics."""
    dtype = idx_ref.dtype
    cos, sin, i_h, in_h, i_h_safe = rot
    i_j = jnp.arange(j_p, dtype=jnp.int32)
    in_j = i_j < j
    i_j_safe = jnp.minimum(i_j, j - 1)
    y = jnp.where(in_j, plgpu.load(idx_ref.at[t, idx_off + i_j_safe]).astype(jnp.float32), 0.0)
    mean = jnp.sum(y) / j
    centred = jnp.where(in_j, y - mean, 0.0)
    inv_std = jax.lax.rsqrt(jnp.sum(centred * centred) / j + index_eps)

    def layer_norm(cols, x_cols):
        w = plgpu.load(idxn_ref.at[cols]).astype(jnp.float32)
        b = plgpu.load(idxb_ref.at[cols]).astype(jnp.float32)
        return ((x_cols.astype(jnp.float32) - mean) * inv_std * w + b).astype(dtype)

    rest = layer_norm(i_j_safe, y)
    plgpu.store(index_ref.at[slot, i_j], rest.astype(index_ref.dtype), mask=in_j & (i_j >= 2 * half))
    q1 = layer_norm(i_h_safe, plgpu.load(idx_ref.at[t, idx_off + i_h_safe]))
    q2 = layer_norm(half + i_h_safe, plgpu.load(idx_ref.at[t, idx_off + half + i_h_safe]))
    r1, r2 = rope_pair(q1, q2, cos, sin, factor, dtype)
    plgpu.store(index_ref.at[slot, i_h], r1.astype(index_ref.dtype), mask=in_h)
    plgpu.store(index_ref.at[slot, half + i_h], r2.astype(index_ref.dtype), mask=in_h)


def _kernel(kv_ref, kvn_ref, pos_ref, slot_ref, inv_ref, idx_ref, idxn_ref, idxb_ref,
            latent_in, index_in, latent_ref, index_ref,
            *, c, c_p, half, half_p, j, j_p, factor, eps, index_eps):
    del latent_in, index_in   # aliased to latent_ref / index_ref
    t = pl.program_id(0)
    slot = slot_ref[t]
    rot = rotary(pos_ref, inv_ref, t, half, half_p)
    write_latent(kv_ref, 0, kvn_ref, t, slot, rot, latent_ref, c=c, c_p=c_p, half=half,
                  factor=factor, eps=eps)
    if idx_ref is not None:
        write_index_key(idx_ref, 0, idxn_ref, idxb_ref, t, slot, rot, index_ref, j=j, j_p=j_p,
                         half=half, factor=factor, index_eps=index_eps)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("factor", "eps", "index_eps", "impl", "num_warps",
                                             "interpret"))
def mla_latent_write(kv_TW, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H,
                     index_TJ=None, index_norm_J=None, index_bias_J=None, index_cache_NPJ=None, *,
                     factor: float = 1.0, eps: float = 1e-6, index_eps: float = 1e-6,
                     impl: str = "auto", num_warps: int = 4, interpret: bool | None = None):
    """(latent cache, index cache or None): see the module docstring. Donate the caches.
    impl: "pallas" (this kernel; interpreted on a CPU), "xla" (the reference) or "auto"."""
    _validate(kv_TW, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H, index_TJ,
              index_norm_J, index_bias_J, index_cache_NPJ)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_mla_latent_write(kv_TW, kv_norm_C, positions_T, slot_mapping_T, latent_NPW,
                                    inv_freq_H, factor=factor, eps=eps, index_TJ=index_TJ,
                                    index_norm_J=index_norm_J, index_bias_J=index_bias_J,
                                    index_cache_NPJ=index_cache_NPJ, index_eps=index_eps)
    t, w = kv_TW.shape
    c, half = kv_norm_C.shape[0], inv_freq_H.shape[0]
    nb, p, _ = latent_NPW.shape
    has_index = index_TJ is not None
    j = index_TJ.shape[1] if has_index else 1
    kernel = functools.partial(_kernel, c=c, c_p=pl.next_power_of_2(c), half=half,
                               half_p=pl.next_power_of_2(half), j=j, j_p=pl.next_power_of_2(j),
                               factor=float(factor), eps=float(eps), index_eps=float(index_eps))
    ins = [kv_TW, kv_norm_C, positions_T.astype(jnp.int32), slot_mapping_T.astype(jnp.int32),
           inv_freq_H.astype(jnp.float32)]
    specs = [whole(t, w), whole(c), whole(t), whole(t), whole(half)]
    outs, out_specs = [jax.ShapeDtypeStruct((nb * p, w), latent_NPW.dtype)], [whole(nb * p, w)]
    if has_index:
        ins += [index_TJ, index_norm_J, index_bias_J]
        specs += [whole(t, j), whole(j), whole(j)]
    ins.append(latent_NPW.reshape(nb * p, w))
    specs.append(whole(nb * p, w))
    aliases = {len(ins) - 1: 0}
    if has_index:
        ins.append(index_cache_NPJ.reshape(nb * p, j))
        specs.append(whole(nb * p, j))
        outs.append(jax.ShapeDtypeStruct((nb * p, j), index_cache_NPJ.dtype))
        out_specs.append(whole(nb * p, j))
        aliases[len(ins) - 1] = 1
    else:   # no indexer: its refs (three inputs, the cache in and out) are absent
        kernel = absent_refs(kernel, 5, 6, 7, 9, 11)
    out = per_token_call(kernel, t, ins, specs, outs, out_specs, aliases, num_warps=num_warps,
                         interpret=(not on_gpu) if interpret is None else interpret,
                         name="mla_latent_index_write" if has_index else "mla_latent_write")
    latent = out[0].reshape(latent_NPW.shape)
    return latent, (out[1].reshape(index_cache_NPJ.shape) if has_index else None)
