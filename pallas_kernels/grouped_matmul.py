"""Grouped (ragged) matmul for MoE experts: rows sorted by expert times that expert's weights.

    out_MN[rows of group g] = x_MK[rows of group g] @ w_GKN[g]

Layouts: x_MK f[M, K] (rows sorted by group; group g owns group_sizes[g] consecutive rows),
w_GKN f[G, K, N], group_sizes_G i32[G] summing to M -> f[M, N].
Legend: M rows (tokens x experts per token), K contraction dim, N output dim, G groups (experts).

Implementations, chosen by measurement on an H200 (BENCHMARKS.md, "Kernels"; Qwen3-30B-A3B
gate/up shapes, D=2048 -> 2 x 768, 128 experts, top-8):
- "mosaic": JAX's Mosaic GPU ragged dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu:
  warpgroup MMA, TMA pipeline, persistent grid; Hopper only), 64 x 256 tiles. It was the fastest
  at every size from 128 rows up: 4.4x lax.ragged_dot at 1024 rows and ~37x at 16K rows.
- "xla": jax.lax.ragged_dot; 10 % faster than the Mosaic kernel at 8 rows (one decode token),
  and it runs everywhere.
Both take ~190 us for a single token: they stream all 128 experts' weights although only 8 are
used; a kernel that skips empty groups would be ~15x faster there (not written yet).
"auto" takes "mosaic" on a Hopper GPU for M >= 64 when the shapes suit its tiles, else "xla".
No Pallas Triton kernel of our own: the Mosaic one is already at the HBM ceiling's order for
large M and our Triton attempt would not use wgmma/TMA as it does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.dispatch import resolve_impl

MOSAIC_TILES = dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1)


def ref_grouped_matmul(x_MK, w_GKN, group_sizes_G):
    """Dense reference: every row times its own group's matrix, in f32."""
    m = x_MK.shape[0]
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(m), side="right")
    w_MKN = w_GKN[jnp.minimum(group_M, w_GKN.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mkn->mn", x_MK.astype(jnp.float32), w_MKN)
    return jnp.where((group_M < w_GKN.shape[0])[:, None], out, 0.0).astype(x_MK.dtype)


def _mosaic_fits(x_MK, w_GKN) -> bool:
    m, k = x_MK.shape
    n = w_GKN.shape[2]
    on_hopper = any("H100" in d.device_kind or "H200" in d.device_kind for d in jax.devices())
    return (on_hopper and m >= 64 and k % MOSAIC_TILES["block_k"] == 0
            and n % MOSAIC_TILES["block_n"] == 0 and x_MK.dtype == w_GKN.dtype
            and x_MK.dtype in (jnp.bfloat16, jnp.float16))


@functools.partial(jax.jit, static_argnames=("impl",))
def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, impl: str = "auto"):
    """x_MK @ w_GKN[group of each row] -> f[M, N]; impl "auto" | "mosaic" | "xla"."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or w_GKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"x_MK must be [M, K] and w_GKN [G, K, N] with the same K; got "
                         f"{x_MK.shape} and {w_GKN.shape}")
    if group_sizes_G.shape != w_GKN.shape[:1]:
        raise ValueError(f"group_sizes_G must be i32[G = {w_GKN.shape[0]}]; got "
                         f"{group_sizes_G.shape}")
    impl, on_gpu = resolve_impl(impl, ("mosaic", "xla"))
    if impl == "pallas":   # "auto" on a GPU
        impl = "mosaic" if on_gpu and _mosaic_fits(x_MK, w_GKN) else "xla"
    if impl == "xla":
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32))
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(x_MK, w_GKN, group_sizes=group_sizes_G.astype(jnp.int32),
                                      **MOSAIC_TILES)
