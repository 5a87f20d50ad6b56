"""Fused full-width QK-norm + partial rotary + paged KV-cache write (MiniMax-M2), in place.

MiniMax-M2 normalises each token's whole q row (all N heads x E) and whole k row (K x E),
then rotates only the first R dims of each head. The XLA path (models/layers/full_qk_norm.py
rope_write_xla) is: sums of squares, scale, rotate, scatter K and V into the cache. Here one
program per token does all of it, reading q, k, v once:

    q' = partial_rope(rmsnorm_row(q) * q_norm)      -> returned
    k' = partial_rope(rmsnorm_row(k) * k_norm)      -> written to k_cache at slot_mapping[t]
    v                                               -> written to v_cache at slot_mapping[t]

Rotate-half within the first R dims: column c < R/2 pairs with c + R/2; columns >= R pass.
Rounding follows the XLA path: the norm returns the input dtype, the rotation is in f32.
Under tensor parallelism a row is split over devices: each rank then passes `sumsq_T2`, the
whole rows' sums of squares (its own heads' partial sums, psum'd over `model`:
sharding/kernels.full_qk_norm_rope_kv_write), and `widths`, the whole rows' N*E and K*E.

Layouts: q_TNE f[T, N, E], k_TKE / v_TKE f[T, K, E], positions_T / slot_mapping_T i32[T]
(slot = block * P + offset; padding tokens write slot 0 of the null block), caches
f[NB, P, K, E], inv_freq f32[R/2], q_norm f[N*E], k_norm f[K*E].
-> (q'_TNE, k_cache, v_cache), caches updated in place (input_output_aliases) when donated.

Legend: T tokens, N query heads, K kv heads, E head dim, R rotary dims, NB cache blocks, P
block size; Np / Kp: N / K rounded up to powers of two (Triton tiles; extra rows masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models.layers.full_qk_norm import rope_write_xla
from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
from jaxserve.pallas_kernels.dispatch import absent_refs, resolve_impl, whole


def ref_full_qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                                   v_cache_NPKE, inv_freq_R, q_norm, k_norm, *, eps: float = 1e-6):
    """The model's own XLA blocks, in the model's order."""
    return rope_write_xla(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                                     v_cache_NPKE, inv_freq_R, q_norm, k_norm, eps=eps)


def _validate(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache, inv_freq_R,
              q_norm, k_norm):
    qrk.validate_tokens_and_caches(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache)
    _, n, e = q_TNE.shape
    kh = k_TKE.shape[1]
    r = 2 * inv_freq_R.shape[0]
    if inv_freq_R.ndim != 1 or not 0 < r <= e:
        raise ValueError(f"inv_freq must be f32[R/2] with 0 < R <= E={e}; got {inv_freq_R.shape}")
    if q_norm.shape != (n * e,) or k_norm.shape != (kh * e,):
        raise ValueError(f"q_norm must be f[N*E] = [{n * e}] and k_norm f[K*E] = [{kh * e}]; got "
                         f"{q_norm.shape} and {k_norm.shape}")


def _kernel(q_ref, k_ref, v_ref, pos_ref, slot_ref, inv_freq_ref, qn_ref, kn_ref, ss_ref, k_cache_in,
            v_cache_in, q_out_ref, k_cache_ref, v_cache_ref, *, n, kh, e, r, n_pow2, k_pow2, eps, widths):
    del k_cache_in, v_cache_in   # aliased to k_cache_ref / v_cache_ref
    t = pl.program_id(0)
    half = r // 2
    c_1E = jnp.arange(e, dtype=jnp.int32)[None, :]
    rotated = c_1E < r
    first = c_1E < half
    # the rotate-half partner of each rotated column, and its frequency (columns >= R: unused)
    partner_1E = jnp.where(rotated, jnp.where(first, c_1E + half, c_1E - half), c_1E)
    freq_1E = plgpu.load(inv_freq_ref.at[jnp.where(rotated, c_1E % half, 0)[0]])[None, :]
    angle_1E = pos_ref[t].astype(jnp.float32) * freq_1E
    cos = jnp.where(rotated, jnp.cos(angle_1E), 1.0)
    sin = jnp.where(rotated, jnp.where(first, -1.0, 1.0) * jnp.sin(angle_1E), 0.0)

    def norm_rope(x_ref, w_ref, heads, heads_pow2, which):
        """Rows = heads: the row-normed, rotated tile f32[Hp, E] and its row mask; `which`: 0
        for q, 1 for k (the column of ss_ref holding the whole row's sum of squares)."""
        h_R1 = jnp.arange(heads_pow2, dtype=jnp.int32)[:, None]
        ok = h_R1 < heads
        h_c = jnp.minimum(h_R1, heads - 1)
        x = jnp.where(ok, plgpu.load(x_ref.at[t, h_c, c_1E]).astype(jnp.float32), 0.0)
        xp = jnp.where(ok, plgpu.load(x_ref.at[t, h_c, partner_1E]).astype(jnp.float32), 0.0)
        if ss_ref is None:      # one sum of squares over every head of the row (masked rows add zeros)
            inv = jax.lax.rsqrt(jnp.sum(jnp.sum(x * x, axis=1)) / (heads * e) + eps)   # rows, then heads
        else:                   # the whole row's, across ranks
            inv = jax.lax.rsqrt(ss_ref[t, which] / widths[which] + eps)
        w = plgpu.load(w_ref.at[h_c * e + c_1E]).astype(jnp.float32)
        wp = plgpu.load(w_ref.at[h_c * e + partner_1E]).astype(jnp.float32)
        x = (x * inv * w).astype(x_ref.dtype).astype(jnp.float32)       # the norm's rounding
        xp = (xp * inv * wp).astype(x_ref.dtype).astype(jnp.float32)
        return x * cos + xp * sin, h_R1, ok

    q, hq, okq = norm_rope(q_ref, qn_ref, n, n_pow2, 0)
    plgpu.store(q_out_ref.at[t, hq, c_1E], q.astype(q_out_ref.dtype), mask=okq)
    k, hk, okk = norm_rope(k_ref, kn_ref, kh, k_pow2, 1)
    slot = slot_ref[t]
    col = hk * e + c_1E            # column in the [NB*P, K*E] view of the cache
    dt = k_cache_ref.dtype
    plgpu.store(k_cache_ref.at[slot, col], k.astype(k_ref.dtype).astype(dt), mask=okk)
    v = plgpu.load(v_ref.at[t, jnp.minimum(hk, kh - 1), c_1E])
    plgpu.store(v_cache_ref.at[slot, col], v.astype(dt), mask=okk)


@functools.partial(jax.jit, static_argnames=("eps", "impl", "num_warps", "interpret", "widths"))
def full_qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                               v_cache_NPKE, inv_freq_R, q_norm, k_norm, sumsq_T2=None, *,
                               eps: float = 1e-6, impl: str = "auto", num_warps: int | None = None,
                               interpret: bool | None = None, widths: tuple[int, int] | None = None):
    """(q' f[T, N, E], k_cache, v_cache): see the module docstring. Donate the caches.
    sumsq_T2 f32[T, 2] (q's, k's) with `widths` (N*E, K*E) of the whole rows: the rows are
    split over ranks and these are their whole sums of squares (pallas impl only)."""
    _validate(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE, v_cache_NPKE,
              inv_freq_R, q_norm, k_norm)
    impl, on_gpu = resolve_impl(impl)
    if (sumsq_T2 is None) != (widths is None):
        raise ValueError("sumsq_T2 and widths go together: both or neither")
    if sumsq_T2 is not None and (impl != "pallas" or sumsq_T2.shape != (q_TNE.shape[0], 2)):
        raise ValueError(f"sumsq_T2 must be f32[T, 2] = [{q_TNE.shape[0]}, 2], with impl 'pallas'; "
                         f"got {sumsq_T2.shape} with impl {impl!r}")
    if impl == "xla":
        return ref_full_qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T,
                                              k_cache_NPKE, v_cache_NPKE, inv_freq_R, q_norm, k_norm, eps=eps)
    t, n, e = q_TNE.shape
    nb, p, kh, _ = k_cache_NPKE.shape
    if e != pl.next_power_of_2(e) or e < 32:
        raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 32; got E={e}; use impl='xla'")
    interpret = (not on_gpu) if interpret is None else interpret
    kernel = functools.partial(_kernel, n=n, kh=kh, e=e, r=2 * inv_freq_R.shape[0],
                               n_pow2=pl.next_power_of_2(n), k_pow2=pl.next_power_of_2(kh), eps=float(eps),
                               widths=widths)
    cache_2d = (nb * p, kh * e)
    ins = [q_TNE, k_TKE, v_TKE, positions_T.astype(jnp.int32), slot_mapping_T.astype(jnp.int32),
           inv_freq_R.astype(jnp.float32), q_norm, k_norm]
    specs = [whole(t, n, e), whole(t, kh, e), whole(t, kh, e), whole(t), whole(t),
             whole(inv_freq_R.shape[0]), whole(n * e), whole(kh * e)]
    if sumsq_T2 is None:
        kernel = absent_refs(kernel, 8)
    else:
        ins.append(sumsq_T2.astype(jnp.float32))
        specs.append(whole(t, 2))
    ins += [k_cache_NPKE.reshape(cache_2d), v_cache_NPKE.reshape(cache_2d)]
    specs += [whole(*cache_2d), whole(*cache_2d)]
    q_out, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=specs,
        out_specs=[whole(t, n, e), whole(*cache_2d), whole(*cache_2d)],
        out_shape=[jax.ShapeDtypeStruct((t, n, e), q_TNE.dtype),
                   jax.ShapeDtypeStruct(cache_2d, k_cache_NPKE.dtype),
                   jax.ShapeDtypeStruct(cache_2d, v_cache_NPKE.dtype)],
        input_output_aliases={len(ins) - 2: 1, len(ins) - 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        interpret=interpret,
        name="full_qk_norm_rope_kv_write",
    )(*ins)
    return q_out, k_cache.reshape(k_cache_NPKE.shape), v_cache.reshape(v_cache_NPKE.shape)
