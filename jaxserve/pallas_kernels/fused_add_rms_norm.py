"""Fused residual add + RMSNorm: one pass over the rows instead of three.

    residual' = x + residual                  (in the residual's dtype, as the model does)
    normed    = residual' * rsqrt(mean(residual'^2) + eps) * w      (f32 math, input dtype out)

Layouts: x_TD f[T, D], residual_TD f[T, D], w_D f[D] -> (residual'_TD f[T, D], normed_TD f[T, D]).
With residual=None it is a plain RMSNorm and returns normed_TD only.

Legend: T rows (tokens), D model dim, Dp = D rounded up to a power of two (Triton tiles are
powers of two; the tail is masked), BR rows per program.

GPU kernel (Triton lowering of pallas_call): grid over blocks of BR rows; a program holds its
rows in registers, so each element is read once and each output written once: the traffic
floor is 2 reads + 2 writes of T x D (1 + 1 without the residual).

NOTE (measured, H200, 2026-11-29): faster than XLA standalone, but slower inside the whole
8B decode step, where XLA fuses these ops into neighbouring kernels; the engine therefore
keeps XLA for them and uses this kernel only when asked (`fused={"norm"}` or
JAXSERVE_FUSED_KERNELS=norm; models/llama.py make_kernels; BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import resolve_impl, whole

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def ref_fused_add_rms_norm(x_TD, residual_TD, w_D, *, eps: float):
    """(new residual, normed) in plain jnp; normed only when residual_TD is None."""
    h_TD = x_TD if residual_TD is None else (x_TD + residual_TD).astype(residual_TD.dtype)
    h = h_TD.astype(jnp.float32)
    normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    normed = (normed * w_D.astype(jnp.float32)).astype(x_TD.dtype)
    return normed if residual_TD is None else (h_TD, normed)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _validate(x_TD, residual_TD, w_D):
    if x_TD.ndim != 2:
        raise ValueError(f"x_TD must be [T, D]; got shape {x_TD.shape}")
    if residual_TD is not None and residual_TD.shape != x_TD.shape:
        raise ValueError(f"residual_TD must have x_TD's shape {x_TD.shape}; got {residual_TD.shape}")
    if w_D.shape != x_TD.shape[-1:]:
        raise ValueError(f"w_D must be [D] = [{x_TD.shape[-1]}]; got {w_D.shape}")


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _kernel(
    # inputs
    x_ref, res_ref, w_ref,
    # outputs
    res_out_ref, normed_ref,
    *, eps, rows_per_program, num_rows, dim, dim_pow2):
    rows_R = pl.program_id(0) * rows_per_program + jnp.arange(rows_per_program, dtype=jnp.int32)
    cols_D = jnp.arange(dim_pow2, dtype=jnp.int32)
    mask = (rows_R < num_rows)[:, None] & (cols_D < dim)[None, :]
    # NOTE: integer-array indices everywhere: interpret mode only discharges all-array (or
    # all-slice) indexers, and out-of-range rows/cols are masked (stores) or clamped (loads).
    at = (rows_R[:, None], cols_D[None, :])
    h = plgpu.load(x_ref.at[at], mask=mask, other=0.0)
    if res_ref is not None:
        h = (h + plgpu.load(res_ref.at[at], mask=mask, other=0.0)).astype(res_out_ref.dtype)
        plgpu.store(res_out_ref.at[at], h, mask=mask)
    hf = h.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(hf * hf, axis=1) / dim + eps)
    w = plgpu.load(w_ref.at[cols_D], mask=cols_D < dim, other=0.0).astype(jnp.float32)
    plgpu.store(normed_ref.at[at], (hf * inv_rms[:, None] * w[None, :]).astype(normed_ref.dtype),
                mask=mask)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("eps", "impl", "rows_per_program", "num_warps",
                                             "interpret"))
def fused_add_rms_norm(x_TD, residual_TD, w_D, *, eps: float, impl: str = "auto",
                       rows_per_program: int | None = None, num_warps: int | None = None,
                       interpret: bool | None = None):
    """(x + residual, RMSNorm(x + residual) * w); RMSNorm(x) * w alone if residual is None.

    impl: "pallas" (Triton kernel; interpreted on CPU), "xla", or "auto" (pallas on GPU).
    """
    _validate(x_TD, residual_TD, w_D)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_fused_add_rms_norm(x_TD, residual_TD, w_D, eps=eps)
    t, d = x_TD.shape
    dp = pl.next_power_of_2(d)
    # about 4K elements per program keeps a row block in registers without spilling
    br = rows_per_program or max(1, min(16, 4096 // dp))
    # 16 warps for wide rows: H200, D=4096, T=2048: 19.0 us (8 warps) -> 18.2 us, 87 % of HBM
    num_warps = num_warps or (16 if dp >= 4096 else 4)
    interpret = (not on_gpu) if interpret is None else interpret
    kernel = functools.partial(_kernel, eps=float(eps), rows_per_program=br, num_rows=t, dim=d,
                               dim_pow2=dp)
    has_res = residual_TD is not None
    if not has_res:
        kernel = _no_residual(kernel)
    out_shape = [jax.ShapeDtypeStruct((t, d), x_TD.dtype)]
    if has_res:
        out_shape.insert(0, jax.ShapeDtypeStruct((t, d), residual_TD.dtype))
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, br),),
        in_specs=[whole(t, d)] * (2 if has_res else 1) + [whole(d)],
        out_specs=[whole(t, d)] * len(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"fused_add_rms_norm_br{br}",
    )(*([x_TD, residual_TD, w_D] if has_res else [x_TD, w_D]))
    return tuple(outs) if has_res else outs[0]


def _no_residual(kernel):
    def k(x_ref, w_ref, normed_ref):
        return kernel(x_ref, None, w_ref, None, normed_ref)
    return k
