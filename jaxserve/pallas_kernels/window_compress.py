"""DeepSeek V4's compressor: the entries of the windows a step completes, in one kernel:

    entries_KE = window_compress(kv_LC, gate_LC, slots_KM, first_K, valid_K, norm_E, inv_freq,
                                 overlap=..., eps=...)

For entry k (window of m rows starting at position first_K[k]; slots_KM[k] the cache rows of
the window's tokens, with `overlap` the previous window's m rows before them):
    w = softmax over the rows, per channel, of the gates (the previous window's rows of a
        first window, first_K == 0, weigh nothing)
    y = RMSNorm(sum_rows w * kv) * norm_E, then interleaved rotary on its trailing 2 x
        len(inv_freq) channels at position first_K[k]
Without overlap (HCA) the rows are the window's kv | gate (C = E); with it (CSA) C = 2E: the
previous window's Ca (columns :E) and this window's Cb (columns E:). Entries with valid_K
false come out 0 (the caller writes them to the null row).

Program k: the window's rows gathered from the flattened per-token arrays, the softmax, the
sum and the norm in f32 in registers; the rotary pairs read each column's partner column
(c xor 1) as a second gather, so no lane shuffle. Why: in XLA this is a gather of a [K, 2m, C]
copy, a softmax, a reduction, a norm and a rotary, a few kernels per compressed layer a step.

Layouts: kv_LC / gate_LC f[L, C] (the cache arrays flattened: L = blocks x P); slots_KM
i32[K, M] with M = m (HCA) or 2m (CSA: previous window's rows first); first_K, valid_K i32 /
bool[K]; norm_E f[E]; inv_freq f32[R/2] -> f32[K, E]. Ep = E rounded up to a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import resolve_impl, whole


def ref_window_compress(kv_LC, gate_LC, slots_KM, first_K, valid_K, norm_E, inv_freq, *,
                        overlap: bool, eps: float):
    """Plain jnp (the model's path, models/deepseek_v4_attention.py compress)."""
    e = norm_E.shape[0]
    kv = kv_LC[slots_KM].astype(jnp.float32)
    g = gate_LC[slots_KM].astype(jnp.float32)
    if overlap:
        m = slots_KM.shape[1] // 2
        kv = jnp.concatenate([kv[:, :m, :e], kv[:, m:, e:]], axis=1)
        g = jnp.concatenate([g[:, :m, :e], g[:, m:, e:]], axis=1)
        g = g.at[:, :m].set(jnp.where((first_K > 0)[:, None, None], g[:, :m], -jnp.inf))
    y = jnp.sum(kv * jax.nn.softmax(g, axis=1), axis=1)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + eps) * norm_E.astype(jnp.float32)
    r = 2 * inv_freq.shape[0]
    ang = first_K.astype(jnp.float32)[:, None] * inv_freq[None, :]
    rope = y[:, e - r:].reshape(-1, r // 2, 2)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    rot = jnp.stack([rope[..., 0] * cos - rope[..., 1] * sin, rope[..., 1] * cos + rope[..., 0] * sin], -1)
    y = jnp.concatenate([y[:, :e - r], rot.reshape(-1, r)], axis=-1)
    return jnp.where(valid_K[:, None], y, 0.0)


def _kernel(kv_ref, g_ref, slots_ref, first_ref, valid_ref, norm_ref, freq_ref, o_ref, *, m_rows,
            m_p, e, e_p, r, overlap, eps):
    k = pl.program_id(0)
    rows = jnp.arange(m_p, dtype=jnp.int32)
    row_ok = rows < m_rows
    slots = plgpu.load(slots_ref.at[k, jnp.minimum(rows, m_rows - 1)])
    first = plgpu.load(first_ref.at[k])
    d = jnp.arange(e_p, dtype=jnp.int32)
    d_ok = d < e
    half = m_rows // 2
    # CSA: the previous window's rows read the Ca columns (:E), this window's the Cb (E:)
    off = jnp.where(rows >= half, e, 0) if overlap else jnp.zeros_like(rows)
    usable = row_ok & ((rows >= half) | (first > 0)) if overlap else row_ok

    def pooled(col):
        col = jnp.minimum(col, e - 1)
        idx = (slots[:, None], off[:, None] + col[None, :])
        kv = plgpu.load(kv_ref.at[idx]).astype(jnp.float32)
        g = plgpu.load(g_ref.at[idx]).astype(jnp.float32)
        g = jnp.where(usable[:, None], g, -jnp.inf)
        w = jnp.exp(g - jnp.max(g, axis=0)[None, :])
        return jnp.sum(jnp.where(usable[:, None], kv * w, 0.0), axis=0) / jnp.sum(w, axis=0)

    partner = d ^ 1
    y, y_partner = pooled(d), pooled(partner)
    y = jnp.where(d_ok, y, 0.0)
    scale = jax.lax.rsqrt(jnp.sum(y * y) / e + eps)
    norm = plgpu.load(norm_ref.at[jnp.minimum(d, e - 1)]).astype(jnp.float32)
    norm_p = plgpu.load(norm_ref.at[jnp.minimum(partner, e - 1)]).astype(jnp.float32)
    y, y_partner = y * scale * norm, y_partner * scale * norm_p
    in_rope = d >= e - r
    pair = jnp.clip((d - (e - r)) // 2, 0, r // 2 - 1)
    ang = first.astype(jnp.float32) * plgpu.load(freq_ref.at[pair])
    sign = jnp.where(d % 2 == 0, -1.0, 1.0)
    y = jnp.where(in_rope, y * jnp.cos(ang) + sign * y_partner * jnp.sin(ang), y)
    y = jnp.where(plgpu.load(valid_ref.at[k]) != 0, y, 0.0)
    plgpu.store(o_ref.at[k, d], y, mask=d_ok)


@functools.partial(jax.jit, static_argnames=("overlap", "eps", "impl", "num_warps", "interpret"))
def window_compress(kv_LC, gate_LC, slots_KM, first_K, valid_K, norm_E, inv_freq, *, overlap: bool,
                    eps: float, impl: str = "auto", num_warps: int = 4, interpret: bool | None = None):
    """f32[K, E]: see the module docstring. impl "pallas" (this kernel; interpreted on a CPU),
    "xla" (the reference) or "auto"."""
    k, m_rows = slots_KM.shape
    e = norm_E.shape[0]
    c = kv_LC.shape[1]
    if gate_LC.shape != kv_LC.shape or c != (2 * e if overlap else e):
        raise ValueError(f"kv_LC / gate_LC must be f[L, {2 * e if overlap else e}] alike (C = "
                         f"{'2E' if overlap else 'E'}); got {kv_LC.shape} and {gate_LC.shape}")
    if first_K.shape != (k,) or valid_K.shape != (k,):
        raise ValueError(f"first_K / valid_K must be [K={k}]; got {first_K.shape}, {valid_K.shape}")
    if overlap and m_rows % 2:
        raise ValueError(f"slots_KM must hold 2m rows with overlap; got {m_rows}")
    r = 2 * inv_freq.shape[0]
    if r > e or r % 2:
        raise ValueError(f"inv_freq must give an even rotary width <= E={e}; got {r}")
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_window_compress(kv_LC, gate_LC, slots_KM, first_K, valid_K, norm_E, inv_freq,
                                   overlap=overlap, eps=eps)
    kernel = functools.partial(_kernel, m_rows=m_rows, m_p=max(16, pl.next_power_of_2(m_rows)), e=e,
                               e_p=max(16, pl.next_power_of_2(e)), r=r, overlap=overlap, eps=float(eps))
    return pl.pallas_call(
        kernel,
        grid=(k,),
        in_specs=[whole(*kv_LC.shape), whole(*gate_LC.shape), whole(k, m_rows), whole(k), whole(k),
                  whole(e), whole(r // 2)],
        out_specs=whole(k, e),
        out_shape=jax.ShapeDtypeStruct((k, e), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=(not on_gpu) if interpret is None else interpret,
        name="window_compress",
    )(kv_LC, gate_LC, slots_KM.astype(jnp.int32), first_K.astype(jnp.int32), valid_K.astype(jnp.int32),
      norm_E, inv_freq.astype(jnp.float32))
