"""Fused QK-norm (optional, Qwen3) + rotary embedding + paged KV-cache write, in place.

One pass over this step's q, k, v instead of four (norm q, norm k, rope q, rope k) plus the
scatter into the cache:

    q' = rope(rmsnorm(q) * q_norm)        -> returned
    k' = rope(rmsnorm(k) * k_norm)        -> written to k_cache at slot_mapping[t]
    v                                     -> written to v_cache at slot_mapping[t]

RoPE is HF's "rotate half" layout with angles positions[t] * inv_freq (so llama3 / linear
scaling arrive already folded into inv_freq: models/layers.py rope_inv_freq). Rounding follows
the model's XLA path: the norm returns the input dtype, the rotation is computed in f32.

Layouts: q_TNE f[T, N, E], k_TKE / v_TKE f[T, K, E], positions_T i32[T], slot_mapping_T i32[T]
(slot = block * P + offset; padding tokens use slot 0 of the null block), caches
f[NB, P, K, E], inv_freq f32[E/2], q_norm_E / k_norm_E f[E] or None.
-> (q'_TNE, k_cache, v_cache); the caches are updated in place (input_output_aliases) when the
caller donates them (the engine's step does).

Legend: T tokens, N query heads, K kv heads, E head dim, H = E / 2, NB cache blocks, P block
size; Np / Kp are N / K rounded up to powers of two (Triton tiles; extra rows are masked).

NOTE (measured, H200, 2026-11-29): faster than XLA standalone, but slower inside the whole
8B decode step, where XLA fuses these ops into neighbouring kernels; the engine therefore
keeps XLA for them and uses this kernel only when asked (`fused={"rope"}` or
JAXSERVE_FUSED_KERNELS=rope; models/llama.py make_kernels; BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models import layers
from jaxserve.pallas_kernels.dispatch import resolve_impl, whole

# ---------------------------------------------------------------------------------------------
# Reference: the model's own XLA building blocks, in the model's order
# ---------------------------------------------------------------------------------------------


def ref_qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                              v_cache_NPKE, inv_freq_H, q_norm_E=None, k_norm_E=None, *,
                              eps: float = 1e-6):
    return layers.qk_norm_rope_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                                     v_cache_NPKE, inv_freq_H, q_norm_E, k_norm_E, eps=eps)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate_tokens_and_caches(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache):
    """The shape checks every fused q/k + KV-write kernel shares (also full_qk_norm_rope_kv_write)."""
    t, n, e = q_TNE.shape
    if k_TKE.shape != v_TKE.shape or k_TKE.shape[0] != t or k_TKE.shape[2] != e:
        raise ValueError(f"k_TKE and v_TKE must both be [T={t}, K, E={e}]; got {k_TKE.shape} "
                         f"and {v_TKE.shape}")
    if positions_T.shape != (t,) or slot_mapping_T.shape != (t,):
        raise ValueError(f"positions_T and slot_mapping_T must be i32[T={t}]; got "
                         f"{positions_T.shape} and {slot_mapping_T.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k_TKE.shape[1:]:
        raise ValueError(f"caches must be [NB, P, K, E] with K, E = {k_TKE.shape[1:]}; got "
                         f"{k_cache.shape} and {v_cache.shape}")


def _validate(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache, inv_freq_H,
              q_norm_E, k_norm_E):
    validate_tokens_and_caches(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache, v_cache)
    e = q_TNE.shape[2]
    if inv_freq_H.shape != (e // 2,) or e % 2:
        raise ValueError(f"inv_freq must be f32[E/2] = [{e // 2}] (even E); got {inv_freq_H.shape}")
    if (q_norm_E is None) != (k_norm_E is None):
        raise ValueError("q_norm_E and k_norm_E must be given together (Qwen3) or both None")
    if q_norm_E is not None and (q_norm_E.shape != (e,) or k_norm_E.shape != (e,)):
        raise ValueError(f"q_norm_E and k_norm_E must be f[E] = [{e}]")


# ---------------------------------------------------------------------------------------------
# Kernel body: one program per token
# ---------------------------------------------------------------------------------------------


def _kernel(
    # inputs
    q_ref, k_ref, v_ref, pos_ref, slot_ref, inv_freq_ref, qn_ref, kn_ref, k_cache_in, v_cache_in,
    # outputs
    q_out_ref, k_cache_ref, v_cache_ref,
    *, n, kh, e, n_pow2, k_pow2, eps, k_off=0, v_off=0):
    # k_off / v_off: the first k / v head in k_ref / v_ref (all three are one packed
    # [T, N + 2K, E] array in qkv_norm_rope_kv_write)
    del k_cache_in, v_cache_in   # aliased to k_cache_ref / v_cache_ref
    t = pl.program_id(0)
    half = e // 2
    i_1H = jnp.arange(half, dtype=jnp.int32)[None, :]
    angle_1H = pos_ref[t].astype(jnp.float32) * plgpu.load(inv_freq_ref.at[i_1H[0]])[None, :]
    cos, sin = jnp.cos(angle_1H), jnp.sin(angle_1H)

    def norm_rope(x_ref, w_ref, heads, heads_pow2, off):
        """Rows = heads; returns the two rotated halves (f32) and the row mask."""
        h_R1 = jnp.arange(heads_pow2, dtype=jnp.int32)[:, None]
        ok = h_R1 < heads
        h_c = jnp.minimum(h_R1, heads - 1) + off
        x1 = plgpu.load(x_ref.at[t, h_c, i_1H])
        x2 = plgpu.load(x_ref.at[t, h_c, i_1H + half])
        if w_ref is not None:   # RMSNorm over the head dim, rounded to the input dtype
            f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
            inv = jax.lax.rsqrt((jnp.sum(f1 * f1, axis=1) + jnp.sum(f2 * f2, axis=1)) / e + eps)
            w1 = plgpu.load(w_ref.at[i_1H[0]]).astype(jnp.float32)[None, :]
            w2 = plgpu.load(w_ref.at[i_1H[0] + half]).astype(jnp.float32)[None, :]
            x1 = (f1 * inv[:, None] * w1).astype(x_ref.dtype)
            x2 = (f2 * inv[:, None] * w2).astype(x_ref.dtype)
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin, h_R1, ok

    q1, q2, hq, okq = norm_rope(q_ref, qn_ref, n, n_pow2, 0)
    plgpu.store(q_out_ref.at[t, hq, i_1H], q1.astype(q_out_ref.dtype), mask=okq)
    plgpu.store(q_out_ref.at[t, hq, i_1H + half], q2.astype(q_out_ref.dtype), mask=okq)

    k1, k2, hk, okk = norm_rope(k_ref, kn_ref, kh, k_pow2, k_off)
    slot = slot_ref[t]
    col = hk * e + i_1H            # column in the [NB*P, K*E] view of the cache
    dt = k_cache_ref.dtype
    # NOTE: k' is rounded to the input dtype first, as the XLA path's apply_rope does
    plgpu.store(k_cache_ref.at[slot, col], k1.astype(k_ref.dtype).astype(dt), mask=okk)
    plgpu.store(k_cache_ref.at[slot, col + half], k2.astype(k_ref.dtype).astype(dt), mask=okk)
    hk_c = jnp.minimum(hk, kh - 1) + v_off
    v_all = plgpu.load(v_ref.at[t, hk_c, jnp.arange(e, dtype=jnp.int32)[None, :]])
    plgpu.store(v_cache_ref.at[slot, hk * e + jnp.arange(e, dtype=jnp.int32)[None, :]],
                v_all.astype(dt), mask=okk)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("eps", "impl", "num_warps", "interpret"))
def qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE,
                          v_cache_NPKE, inv_freq_H, q_norm_E=None, k_norm_E=None, *,
                          eps: float = 1e-6, impl: str = "auto", num_warps: int | None = None,
                          interpret: bool | None = None):
    """(q' f[T, N, E], k_cache, v_cache): see the module docstring. Donate the caches."""
    _validate(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE, v_cache_NPKE,
              inv_freq_H, q_norm_E, k_norm_E)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_qk_norm_rope_kv_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T,
                                         k_cache_NPKE, v_cache_NPKE, inv_freq_H, q_norm_E,
                                         k_norm_E, eps=eps)
    t, kh, e = k_TKE.shape
    return _pallas(kernel_inputs=[q_TNE, k_TKE, v_TKE], specs=[whole(*q_TNE.shape), whole(t, kh, e),
                   whole(t, kh, e)], n=q_TNE.shape[1], dtype=q_TNE.dtype, positions_T=positions_T,
                   slot_mapping_T=slot_mapping_T, k_cache_NPKE=k_cache_NPKE,
                   v_cache_NPKE=v_cache_NPKE, inv_freq_H=inv_freq_H, q_norm_E=q_norm_E,
                   k_norm_E=k_norm_E, eps=eps, num_warps=num_warps, packed=False,
                   interpret=(not on_gpu) if interpret is None else interpret)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "impl", "num_warps", "interpret"))
def qkv_norm_rope_kv_write(qkv_THE, positions_T, slot_mapping_T, k_cache_NPKE, v_cache_NPKE,
                           inv_freq_H, q_norm_E=None, k_norm_E=None, *, num_heads: int,
                           eps: float = 1e-6, impl: str = "auto", num_warps: int | None = None,
                           interpret: bool | None = None):
    """qk_norm_rope_kv_write on one packed qkv_THE f[T, N + 2K, E] (q heads, then k, then v: a
    fused qkv projection's output as it comes, read in place rather than through three sliced
    copies). Returns (q' f[T, N, E], k_cache, v_cache)."""
    t, h, e = qkv_THE.shape
    kh = k_cache_NPKE.shape[2]
    if h != num_heads + 2 * kh:
        raise ValueError(f"qkv_THE must be [T, N + 2K = {num_heads + 2 * kh}, E]; got {qkv_THE.shape}")
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        q, k, v = jnp.split(qkv_THE, [num_heads, num_heads + kh], axis=1)
        return qk_norm_rope_kv_write(q, k, v, positions_T, slot_mapping_T, k_cache_NPKE,
                                     v_cache_NPKE, inv_freq_H, q_norm_E, k_norm_E, eps=eps,
                                     impl="xla")
    _validate(qkv_THE[:, :num_heads], qkv_THE[:, num_heads:num_heads + kh], qkv_THE[:, num_heads + kh:],
              positions_T, slot_mapping_T, k_cache_NPKE, v_cache_NPKE, inv_freq_H, q_norm_E, k_norm_E)
    return _pallas(kernel_inputs=[qkv_THE], specs=[whole(t, h, e)], n=num_heads,
                   dtype=qkv_THE.dtype, positions_T=positions_T, slot_mapping_T=slot_mapping_T,
                   k_cache_NPKE=k_cache_NPKE, v_cache_NPKE=v_cache_NPKE, inv_freq_H=inv_freq_H,
                   q_norm_E=q_norm_E, k_norm_E=k_norm_E, eps=eps, num_warps=num_warps,
                   packed=True, interpret=(not on_gpu) if interpret is None else interpret)


def _pallas(*, kernel_inputs, specs, n, dtype, positions_T, slot_mapping_T, k_cache_NPKE,
            v_cache_NPKE, inv_freq_H, q_norm_E, k_norm_E, eps, num_warps, packed, interpret):
    """The pallas_call of both wrappers: q, k, v as three arrays, or one packed (`packed`)."""
    t, e = positions_T.shape[0], inv_freq_H.shape[0] * 2
    nb, p, kh, _ = k_cache_NPKE.shape
    if e != pl.next_power_of_2(e) or e < 32:
        raise ValueError(f"the pallas kernel needs a power-of-two head dim >= 32; got E={e}; "
                         f"use impl='xla'")
    has_norm = q_norm_E is not None
    kernel = functools.partial(_kernel, n=n, kh=kh, e=e, n_pow2=pl.next_power_of_2(n),
                               k_pow2=pl.next_power_of_2(kh), eps=float(eps),
                               k_off=n if packed else 0, v_off=n + kh if packed else 0)
    if not has_norm:
        kernel = _without_norms(kernel)
    if packed:
        kernel = _packed(kernel)
    cache_2d = (nb * p, kh * e)
    ins = kernel_inputs + [positions_T.astype(jnp.int32), slot_mapping_T.astype(jnp.int32),
                           inv_freq_H.astype(jnp.float32)]
    specs = specs + [whole(t), whole(t), whole(e // 2)]
    if has_norm:
        ins += [q_norm_E, k_norm_E]
        specs += [whole(e), whole(e)]
    ins += [k_cache_NPKE.reshape(cache_2d), v_cache_NPKE.reshape(cache_2d)]
    specs += [whole(*cache_2d), whole(*cache_2d)]
    q_out, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=specs,
        out_specs=[whole(t, n, e), whole(*cache_2d), whole(*cache_2d)],
        out_shape=[jax.ShapeDtypeStruct((t, n, e), dtype),
                   jax.ShapeDtypeStruct(cache_2d, k_cache_NPKE.dtype),
                   jax.ShapeDtypeStruct(cache_2d, v_cache_NPKE.dtype)],
        input_output_aliases={len(ins) - 2: 1, len(ins) - 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=1),
        interpret=interpret,
        name="qkv_norm_rope_kv_write" if packed else "qk_norm_rope_kv_write",
    )(*ins)
    return q_out, k_cache.reshape(k_cache_NPKE.shape), v_cache.reshape(v_cache_NPKE.shape)


def _packed(kernel):
    """The kernel's q, k and v refs all read the one packed qkv ref."""
    def k(qkv, *rest):
        return kernel(qkv, qkv, qkv, *rest)
    return k


def _without_norms(kernel):
    def k(q, k_, v, pos, slot, inv, k_cache_in, v_cache_in, q_out, k_cache, v_cache):
        return kernel(q, k_, v, pos, slot, inv, None, None, k_cache_in, v_cache_in, q_out,
                      k_cache, v_cache)
    return k
