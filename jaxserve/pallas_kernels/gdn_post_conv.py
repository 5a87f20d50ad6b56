"""Fused gated-DeltaNet post-conv step: split the conv output into q / k / v, L2-normalise q and
k (q also scaled by K^-1/2), and compute the decay g and write strength beta, in one pass.

    q = l2norm(conv[:, q_j]) * K^-1/2,   k = l2norm(conv[:, k_j]),   v = conv[:, v_h]
    g = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)

Layouts: conv_TC f[T, C] with C = 2*G*K + H*V (channels q | k | v, each head-major), a_TH,
b_TH f[T, H], a_log_H, dt_bias_H f[H] -> (q_TGK f32[T, G, K], k_TGK f32[T, G, K],
v_THV f[T, H, V] (conv's dtype), g_TH f32[T, H], beta_TH f32[T, H]).

Legend: T tokens, G key heads, H value heads (r = H / G per key head), K key head dim,
V value head dim, C conv channels, BT tokens per program.

Why this design: each of these is a few flops per element, so unfused they cost one HBM round
trip each (XLA fuses some, not the split + two reductions + the [T, H] gates together). A
program takes BT tokens of one key head j: its q and k rows, the r value heads it serves and
their a / b, so every input element is read once and every output written once.
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


def ref_gdn_post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, *, num_k_heads: int, k_dim: int,
                      v_dim: int):
    """Plain jnp (models/gated_deltanet.py post_conv), v in conv's dtype."""
    q, k, v, g, beta = gdn.post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, num_k_heads=num_k_heads,
                                     k_dim=k_dim, v_dim=v_dim)
    return q, k, v.astype(conv_TC.dtype), g, beta


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _validate(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, g, k, v):
    t, c = conv_TC.shape
    h = a_TH.shape[1]
    if c != 2 * g * k + h * v:
        raise ValueError(f"conv_TC must have 2*G*K + H*V = {2 * g * k + h * v} channels; got {c}")
    if a_TH.shape != (t, h) or b_TH.shape != (t, h) or a_log_H.shape != (h,) or dt_bias_H.shape != (h,):
        raise ValueError("a, b must be [T, H] and A_log, dt_bias [H]")
    if h % g or not (_pow2(k) and _pow2(h // g * v) and _pow2(h // g)):
        raise ValueError(f"the Triton kernel needs H % G == 0 and powers of two K, H/G, H/G*V; got "
                         f"G={g}, H={h}, K={k}, V={v}")


# ---------------------------------------------------------------------------------------------
# Kernel body
# ---------------------------------------------------------------------------------------------


def _kernel(
    # inputs
    conv_ref, a_ref, b_ref, a_log_ref, dt_bias_ref,
    # outputs
    q_ref, k_ref, v_ref, g_ref, beta_ref,
    *, bt: int, num_tokens: int, g: int, kd: int, vd: int, ratio: int, eps: float):
    j = pl.program_id(1)
    # stores use the unclamped rows (out-of-range ones masked), loads the clamped ones: a
    # masked store to a duplicate index would race with the real row's (interpret mode too)
    out_R = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    live_R = out_R < num_tokens
    t_R = jnp.minimum(out_R, num_tokens - 1)
    k_K = jnp.arange(kd, dtype=jnp.int32)
    zrk = jnp.zeros((bt, kd), jnp.int32)
    rows = zrk + t_R[:, None]
    q = plgpu.load(conv_ref.at[rows, zrk + j * kd + k_K[None, :]]).astype(jnp.float32)
    k = plgpu.load(conv_ref.at[rows, zrk + (g + j) * kd + k_K[None, :]]).astype(jnp.float32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + eps) * (kd ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + eps)
    mask_rk = live_R[:, None] & (zrk == 0)
    out = zrk + out_R[:, None]
    plgpu.store(q_ref.at[out, zrk + j, zrk + k_K[None, :]], q, mask=mask_rk)
    plgpu.store(k_ref.at[out, zrk + j, zrk + k_K[None, :]], k, mask=mask_rk)
    # the r value heads of key head j: contiguous columns of v, then of a / b
    w = ratio * vd
    c_W = jnp.arange(w, dtype=jnp.int32)
    zrw = jnp.zeros((bt, w), jnp.int32)
    v = plgpu.load(conv_ref.at[zrw + t_R[:, None], zrw + 2 * g * kd + j * w + c_W[None, :]])
    plgpu.store(v_ref.at[zrw + out_R[:, None], zrw + j * ratio + c_W[None, :] // vd, zrw + c_W[None, :] % vd],
                v.astype(v_ref.dtype), mask=live_R[:, None] & (zrw == 0))
    h_H = j * ratio + jnp.arange(ratio, dtype=jnp.int32)
    zrh = jnp.zeros((bt, ratio), jnp.int32)
    at = (zrh + t_R[:, None], zrh + h_H[None, :])
    a = plgpu.load(a_ref.at[at]).astype(jnp.float32)
    b = plgpu.load(b_ref.at[at]).astype(jnp.float32)
    a_log = plgpu.load(a_log_ref.at[h_H]).astype(jnp.float32)
    dt_bias = plgpu.load(dt_bias_ref.at[h_H]).astype(jnp.float32)
    x = a + dt_bias[None, :]
    # softplus in its overflow-free form (exp of -|x| only)
    softplus = jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))
    mask_rh = live_R[:, None] & (zrh == 0)
    at = (zrh + out_R[:, None], zrh + h_H[None, :])
    plgpu.store(g_ref.at[at], -jnp.exp(a_log)[None, :] * softplus, mask=mask_rh)
    plgpu.store(beta_ref.at[at], 1.0 / (1.0 + jnp.exp(-b)), mask=mask_rh)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("num_k_heads", "k_dim", "v_dim", "impl", "block_t",
                                             "num_warps", "interpret"))
def gdn_post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, *, num_k_heads: int, k_dim: int,
                  v_dim: int, impl: str = "auto", block_t: int | None = None, num_warps: int = 4,
                  interpret: bool | None = None):
    """(q, k, v, g, beta): see the module docstring. impl "pallas" (Triton; interpreted on a
    CPU), "xla" (the reference) or "auto"."""
    g, kd, vd = num_k_heads, k_dim, v_dim
    _validate(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, g, kd, vd)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_gdn_post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, num_k_heads=g, k_dim=kd, v_dim=vd)
    t, _ = conv_TC.shape
    h = a_TH.shape[1]
    # 16 tokens x (2 x 128 + 4 x 128) elements per program on Qwen3.5-397B: registers
    bt = block_t or min(16, pl.next_power_of_2(t))
    interpret = (not on_gpu) if interpret is None else interpret
    kernel = functools.partial(_kernel, bt=bt, num_tokens=t, g=g, kd=kd, vd=vd, ratio=h // g, eps=1e-6)
    ins = [conv_TC, a_TH, b_TH, a_log_H, dt_bias_H]
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((t, g, kd), f32), jax.ShapeDtypeStruct((t, g, kd), f32),
                 jax.ShapeDtypeStruct((t, h, vd), conv_TC.dtype), jax.ShapeDtypeStruct((t, h), f32),
                 jax.ShapeDtypeStruct((t, h), f32)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, bt), g),
        in_specs=[whole(*a.shape) for a in ins],
        out_specs=[whole(*o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gdn_post_conv_bt{bt}",
    )(*ins))
