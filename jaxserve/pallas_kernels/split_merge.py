"""Merging key-range splits: the partial attention outputs of X splits combined into one.

An attention kernel that splits each row's key range X ways (flash-decoding: more programs for
a few long decodes) leaves, per split x and output row r, a normalised partial output o[x, r]
and its log2-sum-exp2 lse[x, r] (-inf for a split that saw no key). The merged row is

    o[r] = sum_x 2^(lse[x, r] - m[r]) o[x, r] / sum_x 2^(lse[x, r] - m[r]),   m[r] = max_x lse[x, r]

and 0 where every split is empty.

Layouts: o_XTNE f32[X, T, N, E], lse_XTN f32[X, T, N] -> o_TNE [T, N, E] (out_dtype).
Optionally live i32[T + 1]: an attention kernel that sets split counts at run time
(ragged_paged_attention's fill_splits) writes only the first live[t] splits of token t, and
only of the first live[T] tokens; the rest is never read, and those tokens merge to 0.

Legend: X splits (Xp rounded up to a power of two, the tail masked), T tokens, N heads, E head
dim, R = T * N output rows, BR rows and BE columns per program.

GPU kernel (Triton lowering of pallas_call): grid over (row blocks, column blocks); a program
loads the lse of its rows and the [Xp, BR, BE] partials once and writes BR x BE outputs. Why a
kernel: XLA made this merge 2 to 4 fusions, about half the attention kernel's own time at 32
splits (H200); one pass over the partials is the floor.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, num_sms, resolve_impl, whole

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def ref_merge_splits(o_XTNE, lse_XTN):
    """Combine normalised partial outputs by their log2-sum-exp2 weights (empty splits: -inf,
    their partial ignored); f32 out."""
    m_TN = lse_XTN.max(axis=0)
    w_XTN = jnp.exp2(lse_XTN - jnp.where(m_TN == -jnp.inf, 0.0, m_TN)[None])
    den_TN = w_XTN.sum(axis=0)
    # splits of weight 0 (empty) are dropped, not multiplied by 0: they may hold NaN
    o_TNE = jnp.where(w_XTN[..., None] > 0, o_XTNE * w_XTN[..., None], 0.0).sum(axis=0)
    return o_TNE / jnp.where(den_TN == 0, 1.0, den_TN)[..., None]


# ---------------------------------------------------------------------------------------------
# Validation and tiling
# ---------------------------------------------------------------------------------------------


def _validate(o_XTNE, lse_XTN):
    if o_XTNE.ndim != 4 or lse_XTN.shape != o_XTNE.shape[:3]:
        raise ValueError(f"o_XTNE must be [X, T, N, E] and lse_XTN [X, T, N]; got "
                         f"{o_XTNE.shape} and {lse_XTN.shape}")
    e = o_XTNE.shape[3]
    if e < 16 or e & (e - 1):
        raise ValueError(f"the head dim E of o_XTNE must be a power of two >= 16; got {e}")


def _tiles(rows: int, e: int, xp: int) -> tuple[int, int]:
    """(BR, BE): about one program per SM of an H200 (132) where there are enough outputs, and
    at most 8K partial elements per program (more spill registers: 64 splits x 8 rows x 128
    columns ran 30 x slower than 1 row x 64 columns on an H200)."""
    be = min(e, 64 if rows * e // 64 >= num_sms() else 32)
    while be > 16 and xp * be > 8192:
        be //= 2
    br = 1
    while br < 16 and pl.cdiv(rows, 2 * br) * (e // be) >= num_sms() and xp * 2 * br * be <= 8192:
        br *= 2
    return br, be


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def _merge_kernel(live_ref, lse_ref, o_ref, out_ref, *, splits, xp, rows, heads, block_r,
                  block_e):
    i, c = pl.program_id(0), pl.program_id(1)
    x = jnp.arange(xp, dtype=jnp.int32)
    r = i * block_r + jnp.arange(block_r, dtype=jnp.int32)
    col = c * block_e + jnp.arange(block_e, dtype=jnp.int32)
    # NOTE: columns are not clamped (BE divides E): Triton vectorises the loads only where it
    # sees contiguous addresses
    x_c, r_c = jnp.minimum(x, splits - 1), jnp.minimum(r, rows - 1)
    lse_at = lse_ref.at[x_c[:, None], r_c[None, :]]
    o_at = o_ref.at[x_c[:, None, None], r_c[None, :, None], col[None, None, :]]
    if live_ref is None:
        live = jnp.broadcast_to((x < splits)[:, None], (xp, block_r))
        lse, o = plgpu.load(lse_at), plgpu.load(o_at)
    else:   # only what the attention kernel wrote: the rest is never loaded
        tokens = rows // heads
        live = (x[:, None] < jnp.minimum(plgpu.load(live_ref.at[r_c // heads]), splits)) & \
            (r < live_ref[tokens] * heads)[None, :]
        lse = plgpu.load(lse_at, mask=live, other=-jnp.inf)
        o = plgpu.load(o_at, mask=live[:, :, None], other=0.0)
    lse = jnp.where(live, lse, -jnp.inf)                                          # [Xp, BR]
    m = lse.max(axis=0)
    w = jnp.exp2(lse - jnp.where(m == -jnp.inf, 0.0, m)[None, :])                 # 0 if empty
    den = w.sum(axis=0)
    # NOTE: splits of weight 0 are dropped, not multiplied by 0: their partial may be NaN
    merged = jnp.where(w[:, :, None] > 0, o * w[:, :, None], 0.0).sum(axis=0)
    merged = merged / jnp.where(den == 0, 1.0, den)[:, None]
    plgpu.store(out_ref.at[r[:, None], col[None, :]], merged.astype(out_ref.dtype),
                mask=(r < rows)[:, None])


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


def _live_only(lse_XTN, live):
    """lse with the splits and tokens outside live (each token's splits, then the tokens
    written) empty (-inf)."""
    x, t = lse_XTN.shape[:2]
    dead = (jnp.arange(x)[:, None] >= live[None, :t]) | (jnp.arange(t) >= live[t])[None, :]
    return jnp.where(dead[..., None], -jnp.inf, lse_XTN)


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "interpret"))
def merge_splits(o_XTNE, lse_XTN, live=None, *, out_dtype=jnp.float32, impl: str = "auto",
                 interpret: bool | None = None) -> jax.Array:
    """Merged o_TNE (out_dtype) of X key-range splits, of which only live i32[T + 1] (each
    token's splits, then the tokens) were written if given. impl: "pallas" (the kernel above;
    on CPU interpreted), "xla" (ref_merge_splits) or "auto" (pallas on GPU, xla elsewhere)."""
    _validate(o_XTNE, lse_XTN)
    if live is not None and live.shape != (o_XTNE.shape[1] + 1,):
        raise ValueError(f"live must be i32[T + 1] = [{o_XTNE.shape[1] + 1}] (each token's "
                         f"splits, then the tokens written); got {live.shape}")
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        if live is not None:
            lse_XTN = _live_only(lse_XTN, live)
        return ref_merge_splits(o_XTNE, lse_XTN).astype(out_dtype)
    x, t, n, e = o_XTNE.shape
    rows = t * n
    xp = pl.next_power_of_2(x)
    block_r, block_e = _tiles(rows, e, xp)
    kernel = functools.partial(_merge_kernel, splits=x, xp=xp, rows=rows, heads=n,
                               block_r=block_r, block_e=block_e)
    in_specs = [whole(x, rows), whole(x, rows, e)]
    if live is None:
        kernel = absent_refs(kernel, 0)
    else:
        in_specs.insert(0, whole(t + 1))
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block_r), e // block_e),
        in_specs=in_specs,
        out_specs=whole(rows, e),
        out_shape=jax.ShapeDtypeStruct((rows, e), out_dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=2 if xp * block_r * block_e <= 4096 else 4, num_stages=1),
        interpret=(not on_gpu) if interpret is None else interpret,
        name=f"merge_splits_x{x}_br{block_r}_be{block_e}",
    )(*([] if live is None else [live.astype(jnp.int32)]),
      lse_XTN.astype(jnp.float32).reshape(x, rows), o_XTNE.astype(jnp.float32).reshape(x, rows, e))
    return out.reshape(t, n, e)
