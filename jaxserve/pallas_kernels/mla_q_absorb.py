"""MLA's absorbed query from the q projection, in one kernel (DeepSeek V3 / V3.2, the fused
"mla" path): each head's q_nope times its W_UK, its q_rope roped, side by side as the
attention kernel reads them, and (V3.2) the indexer's queries roped on their first R dims.

    q_TNW, q_idx_TIJ = mla_q_absorb(b_TM, w_uk_NEC, positions_T, inv_freq_H, *, num_heads,
                                    index_heads=0, factor=...)

b_TM is the q projection's output as it comes (models/deepseek.py q_latent_projections, w_q_lat,
or with q_lora_rank null the input projection w_in, whose q comes first), read in place:
    [head 0: q_nope (E) | q_rope (R) | head 1 ... | head N-1 | indexer heads: I x J | (unread)]
per token t and head n:
    q[t, n] = [q_nope[t, n] @ W_UK[n] (C) | rope(q_rope[t, n]) (R)]
    q_idx[t, i] = [rope(q_i[t, :R]) | q_i[t, R:]]                      (index_heads > 0)
rope: half-split at positions[t] * inv_freq, times YaRN's factor, rounded as models/mla.py
rounds it; the product in f32, rounded to b's dtype (as the model's einsum).

Why: the XLA path is a reshape copy and a split, a batched matmul with its operand and result
transposes, the rotary fusion, a concatenation, and the indexer's own rotary and concatenation:
five to seven launches a layer (issue 71) where this is one.

GPU kernel (Triton lowering of pallas_call): program (token tile, head, column tile): for a
query head, its [BT, E] q_nope rows times W_UK[n][:, BC columns] on the tensor cores (a decode
step's one row as row 0 of the 16-row tile the dot needs, as moe_decode does); the programs of
column tile 0 also rope the head's q_rope. Programs of heads N.. rope the indexer's heads (column
tile 0 only; the others return). Each W_UK tile is read once per token tile: a decode step
reads W_UK once, which is the matmul's traffic floor.

Layouts: b_TM f[T, M] (M >= N (E + R) + I J), w_uk_NEC f[N, E, C], positions_T i32[T],
inv_freq_H f32[R/2] -> q_TNW f[T, N, C + R], q_idx_TIJ f[T, I, J] or None.
Legend: T tokens, N heads, E nope dims, R rope dims, H = R / 2, C kv latent, W = C + R, I
indexer heads, J indexer head dim; BT tokens, BC latent columns a program; Ep, Hp, Jp powers
of two at least E, H, J (masked tails).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models.layers import mla
from jaxserve.pallas_kernels.dispatch import absent_refs, checked_block, resolve_impl, whole
from jaxserve.pallas_kernels.mla_latent_write import rope_pair

HIGHEST = jax.lax.Precision.HIGHEST


def ref_mla_q_absorb(b_TM, w_uk_NEC, positions_T, inv_freq_H, *, num_heads: int,
                     index_heads: int = 0, factor: float = 1.0):
    """The model's own ops (models/deepseek.py attention_block and indexer)."""
    t = b_TM.shape[0]
    n, e, _ = w_uk_NEC.shape
    r = 2 * inv_freq_H.shape[0]
    q = b_TM[:, :n * (e + r)].reshape(t, n, e + r)
    q_nope, q_rope = jnp.split(q, [e], axis=-1)
    q_rope = mla.rope(q_rope, positions_T, inv_freq_H, factor)
    q_lat = jnp.einsum("tne,nec->tnc", q_nope, w_uk_NEC.astype(q_nope.dtype))
    q_TNW = jnp.concatenate([q_lat, q_rope], axis=-1)
    if not index_heads:
        return q_TNW, None
    qi = b_TM[:, n * (e + r):].reshape(t, index_heads, -1)
    roped = mla.rope(qi[..., :r], positions_T, inv_freq_H, factor)
    return q_TNW, jnp.concatenate([roped, qi[..., r:]], axis=-1)


def _validate(b_TM, w_uk_NEC, positions_T, inv_freq_H, num_heads, index_heads):
    t, m = b_TM.shape
    if w_uk_NEC.ndim != 3 or w_uk_NEC.shape[0] != num_heads:
        raise ValueError(f"w_uk_NEC must be [N={num_heads}, E, C]; got {w_uk_NEC.shape}")
    e, r = w_uk_NEC.shape[1], 2 * inv_freq_H.shape[0]
    q_cols = num_heads * (e + r)
    if m < q_cols or (index_heads and ((m - q_cols) % index_heads or (m - q_cols) // index_heads < r)):
        raise ValueError(f"b_TM must be [T, N (E + R) (+ I J)] with N={num_heads}, E={e}, R={r}, "
                         f"I={index_heads} (J >= R); got {b_TM.shape}")
    if positions_T.shape != (t,):
        raise ValueError(f"positions_T must be i32[T={t}]; got {positions_T.shape}")


def _kernel(b_ref, wuk_ref, pos_ref, inv_ref, q_ref, qi_ref, *, t, n, e, e_p, c, half, half_p,
            j, j_p, block_t, block_c, factor):
    tb, h, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dtype = b_ref.dtype
    w = c + 2 * half
    rows = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    ok_r = rows < t
    rows_c = jnp.minimum(rows, t - 1)[:, None]
    i_h = jnp.arange(half_p, dtype=jnp.int32)
    ok_h = i_h < half
    i_h_c = jnp.minimum(i_h, half - 1)[None, :]
    angle = plgpu.load(pos_ref.at[rows_c[:, 0]]).astype(jnp.float32)[:, None] * \
        plgpu.load(inv_ref.at[i_h_c[0]])[None, :]

    def rope_into(out_ref, out_base, in_base):
        """Columns in_base.. (R of them) of b, roped, into columns out_base.. of out_ref."""
        x1 = plgpu.load(b_ref.at[rows_c, in_base + i_h_c])
        x2 = plgpu.load(b_ref.at[rows_c, in_base + half + i_h_c])
        r1, r2 = rope_pair(x1, x2, jnp.cos(angle), jnp.sin(angle), factor, dtype)
        mask = ok_r[:, None] & ok_h[None, :]
        plgpu.store(out_ref.at[rows[:, None], out_base + i_h[None, :]], r1.astype(out_ref.dtype), mask=mask)
        plgpu.store(out_ref.at[rows[:, None], out_base + half + i_h[None, :]], r2.astype(out_ref.dtype),
                    mask=mask)

    @pl.when(h < n)
    def _query_head():
        base = h * (e + 2 * half)
        i_e = jnp.arange(e_p, dtype=jnp.int32)
        ok_e = i_e < e
        i_e_c = jnp.minimum(i_e, e - 1)
        q_nope = plgpu.load(b_ref.at[rows_c, base + i_e_c[None, :]])
        q_nope = jnp.where(ok_e[None, :], q_nope, 0).astype(dtype)                     # [BT, Ep]
        cols = cb * block_c + jnp.arange(block_c, dtype=jnp.int32)
        ok_c = cols < c
        w_uk = plgpu.load(wuk_ref.at[h * e + i_e_c[:, None], jnp.minimum(cols, c - 1)[None, :]])
        w_uk = jnp.where(ok_e[:, None], w_uk, 0).astype(dtype)                         # [Ep, BC]
        lat = plgpu.dot(q_nope, w_uk, precision=HIGHEST)
        plgpu.store(q_ref.at[rows[:, None], h * w + cols[None, :]], lat.astype(q_ref.dtype),
                    mask=ok_r[:, None] & ok_c[None, :])

        @pl.when(cb == 0)
        def _rope():
            rope_into(q_ref, h * w + c, base + e)

    if qi_ref is None:
        return

    @pl.when((h >= n) & (cb == 0))
    def _index_head():
        i = h - n
        base = n * (e + 2 * half) + i * j
        rope_into(qi_ref, i * j, base)
        i_j = jnp.arange(j_p, dtype=jnp.int32)
        rest = plgpu.load(b_ref.at[rows_c, base + jnp.minimum(i_j, j - 1)[None, :]])
        plgpu.store(qi_ref.at[rows[:, None], i * j + i_j[None, :]], rest.astype(qi_ref.dtype),
                    mask=ok_r[:, None] & ((i_j >= 2 * half) & (i_j < j))[None, :])


@functools.partial(jax.jit, static_argnames=("num_heads", "index_heads", "factor", "impl",
                                             "block_t", "block_c", "num_warps", "interpret"))
def mla_q_absorb(b_TM, w_uk_NEC, positions_T, inv_freq_H, *, num_heads: int, index_heads: int = 0,
                 factor: float = 1.0, impl: str = "auto", block_t: int = 16, block_c: int = 128,
                 num_warps: int = 4, interpret: bool | None = None):
    """(q_TNW f[T, N, C + R], q_idx_TIJ f[T, I, J] or None): see the module docstring.
    impl: "pallas" (this kernel; interpreted on a CPU), "xla" (the reference) or "auto".
    block_t: tokens a program (a power of two >= 16); block_c: latent columns a program (a
    power of two >= 16; at most C rounded up to one)."""
    _validate(b_TM, w_uk_NEC, positions_T, inv_freq_H, num_heads, index_heads)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_mla_q_absorb(b_TM, w_uk_NEC, positions_T, inv_freq_H, num_heads=num_heads,
                                index_heads=index_heads, factor=factor)
    t, m = b_TM.shape
    n, e, c = w_uk_NEC.shape
    half = inv_freq_H.shape[0]
    r = 2 * half
    j = (m - n * (e + r)) // index_heads if index_heads else 1
    block_t = checked_block(block_t, "block_t")
    block_c = min(checked_block(block_c, "block_c"), max(16, pl.next_power_of_2(c)))
    p2 = pl.next_power_of_2
    kernel = functools.partial(_kernel, t=t, n=n, e=e, e_p=max(16, p2(e)), c=c, half=half,
                               half_p=p2(half), j=j, j_p=p2(j),
                               block_t=block_t, block_c=block_c, factor=float(factor))
    outs = [jax.ShapeDtypeStruct((t, n * (c + r)), b_TM.dtype)]
    out_specs = [whole(t, n * (c + r))]
    if index_heads:
        outs.append(jax.ShapeDtypeStruct((t, index_heads * j), b_TM.dtype))
        out_specs.append(whole(t, index_heads * j))
    else:
        kernel = absent_refs(kernel, 5)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_t), n + index_heads, pl.cdiv(c, block_c)),
        in_specs=[whole(t, m), whole(n * e, c), whole(t), whole(half)],
        out_specs=out_specs,
        out_shape=outs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=(not on_gpu) if interpret is None else interpret,
        name="mla_q_absorb" + ("_index" if index_heads else ""),
    )(b_TM, w_uk_NEC.reshape(n * e, c), positions_T.astype(jnp.int32), inv_freq_H.astype(jnp.float32))
    q_TNW = out[0].reshape(t, n, c + r)
    return q_TNW, (out[1].reshape(t, index_heads, j) if index_heads else None)
