"""MLA's attention output: the key-range splits merged and each head's W_UV applied, in one
kernel (DeepSeek V3 / V3.2, the fused "mla" path: MLA's split merge folded into the value
projection).

    o_TM = mla_merge_uv(o_XTNC, lse_XTN, w_uv_NCO, *, out_dtype)          f[T, N * O]
    o[t, n * O:(n + 1) * O] = round(merge_x(o[x, t, n], lse[x, t, n])) @ W_UV[n]

The merge is split_merge.py's (each split's normalised partial weighted by 2^(lse - max), a
split that saw no key dropped, a row with none 0), rounded to out_dtype as mla_attention's
merged output is; the product in f32, rounded to out_dtype (the model's einsum). The output is
the heads side by side, as the o projection (wo) reads them.

Why: the XLA path after the attention kernel is the merge kernel, then a batched matmul with
its operand and result transposes: three to four launches a layer where this is one (issue 71).
mla_attention_partials gives the partials (any number of splits, one included).

GPU kernel (Triton lowering of pallas_call): program (token tile, head, column tile of O): the
merge weights of its BT rows from the X splits' lse, then over the C latent columns BC at a
time: those columns of every split's partial, merged, times W_UV[n][BC rows, BO columns] on
the tensor cores (a decode step's one row as row 0 of the 16-row tile). Each W_UV tile is read
once per token tile.

Layouts: o_XTNC f32[X, T, Np, C] and lse_XTN f32[X, T, Np] (Np >= N: mla_attention pads the
heads to whole tiles), w_uv_NCO f[N, C, O].
Legend: X splits, T tokens, N heads, C kv latent, O value head dim; BT, BC, BO a program's
tokens, latent columns and output columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import checked_block, resolve_impl, whole
from jaxserve.pallas_kernels.split_merge import ref_merge_splits

HIGHEST = jax.lax.Precision.HIGHEST


def ref_mla_merge_uv(o_XTNC, lse_XTN, w_uv_NCO, *, out_dtype=jnp.bfloat16):
    """The model's path: the merge (split_merge's reference) rounded to out_dtype, the padded
    heads dropped, the einsum with W_UV, the heads side by side."""
    n = w_uv_NCO.shape[0]
    o_TNC = ref_merge_splits(o_XTNC, lse_XTN).astype(out_dtype)[:, :n]
    o_TNO = jnp.einsum("tnc,nco->tno", o_TNC, w_uv_NCO.astype(out_dtype))
    return o_TNO.reshape(o_TNO.shape[0], -1)


def _validate(o_XTNC, lse_XTN, w_uv_NCO):
    if o_XTNC.ndim != 4 or lse_XTN.shape != o_XTNC.shape[:3]:
        raise ValueError(f"o_XTNC must be f32[X, T, Np, C] and lse_XTN f32[X, T, Np]; got "
                         f"{o_XTNC.shape} and {lse_XTN.shape}")
    if w_uv_NCO.ndim != 3 or w_uv_NCO.shape[1] != o_XTNC.shape[3] or w_uv_NCO.shape[0] > o_XTNC.shape[2]:
        raise ValueError(f"w_uv_NCO must be [N, C={o_XTNC.shape[3]}, O] with N <= Np="
                         f"{o_XTNC.shape[2]}; got {w_uv_NCO.shape}")


def _kernel(lse_ref, o_ref, wuv_ref, out_ref, *, splits, t, np_, c, o, block_t, block_c,
            block_o, dtype):
    tb, h, ob = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    rows_c = jnp.minimum(rows, t - 1)
    # the merge weights of each split (2^(lse - max); 0 for a split that saw no key)
    lse = [plgpu.load(lse_ref.at[x * t + rows_c, h]) for x in range(splits)]       # X x [BT]
    m = functools.reduce(jnp.maximum, lse)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [jnp.exp2(v - m) for v in lse]
    den = functools.reduce(jnp.add, weights)
    den = jnp.where(den == 0, 1.0, den)
    cols_o = ob * block_o + jnp.arange(block_o, dtype=jnp.int32)
    ok_o = cols_o < o
    cols_o_c = jnp.minimum(cols_o, o - 1)
    acc = jnp.zeros((block_t, block_o), jnp.float32)
    for c0 in range(0, c, block_c):                       # C / BC steps (DeepSeek: 4)
        cols = c0 + jnp.arange(block_c, dtype=jnp.int32)
        ok_c = cols < c
        cols_c = jnp.minimum(cols, c - 1)
        merged = jnp.zeros((block_t, block_c), jnp.float32)
        for x in range(splits):
            part = plgpu.load(o_ref.at[(x * t + rows_c)[:, None], h * c + cols_c[None, :]])
            # NOTE: weight-0 splits are dropped, not multiplied by 0: their partial may be NaN
            merged += jnp.where(weights[x][:, None] > 0, part * weights[x][:, None], 0.0)
        merged = jnp.where(ok_c[None, :], merged / den[:, None], 0.0).astype(dtype)
        w_uv = plgpu.load(wuv_ref.at[h * c + cols_c[:, None], cols_o_c[None, :]])
        w_uv = jnp.where(ok_c[:, None], w_uv, 0).astype(dtype)
        acc += plgpu.dot(merged, w_uv, precision=HIGHEST)
    plgpu.store(out_ref.at[rows[:, None], h * o + cols_o[None, :]], acc.astype(out_ref.dtype),
                mask=(rows < t)[:, None] & ok_o[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "impl", "block_t", "block_c", "block_o",
                                             "num_warps", "interpret"))
def mla_merge_uv(o_XTNC, lse_XTN, w_uv_NCO, *, out_dtype=jnp.bfloat16, impl: str = "auto",
                 block_t: int = 16, block_c: int = 128, block_o: int = 128, num_warps: int = 4,
                 interpret: bool | None = None):
    """f[T, N * O] (out_dtype): see the module docstring. impl: "pallas" (this kernel;
    interpreted on a CPU), "xla" (the reference) or "auto". block_t / block_c / block_o: a
    program's tokens, latent columns a step, output columns (powers of two >= 16). The
    defaults give a decode token one program a head at DeepSeek's O = 128, so no two programs
    merge the same partials (untuned)."""
    _validate(o_XTNC, lse_XTN, w_uv_NCO)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_mla_merge_uv(o_XTNC, lse_XTN, w_uv_NCO, out_dtype=out_dtype)
    x, t, np_, c = o_XTNC.shape
    n, _, o = w_uv_NCO.shape
    p2 = pl.next_power_of_2
    block_t = checked_block(block_t, "block_t")
    block_c = min(checked_block(block_c, "block_c"), max(16, p2(c)))
    block_o = min(checked_block(block_o, "block_o"), max(16, p2(o)))
    kernel = functools.partial(_kernel, splits=x, t=t, np_=np_, c=c, o=o, block_t=block_t,
                               block_c=block_c, block_o=block_o, dtype=jnp.dtype(out_dtype))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_t), n, pl.cdiv(o, block_o)),
        in_specs=[whole(x * t, np_), whole(x * t, np_ * c), whole(n * c, o)],
        out_specs=whole(t, n * o),
        out_shape=jax.ShapeDtypeStruct((t, n * o), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=(not on_gpu) if interpret is None else interpret,
        name=f"mla_merge_uv_x{x}",
    )(lse_XTN.astype(jnp.float32).reshape(x * t, np_), o_XTNC.astype(jnp.float32).reshape(x * t, np_ * c),
      w_uv_NCO.reshape(n * c, o))
