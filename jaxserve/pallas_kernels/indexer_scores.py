"""DeepSeek V3.2's lightning-indexer scores over each token's paged context, in one kernel:

    scores_TL = indexer_scores(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T,
                               positions_T, scale=...)
    scores[t, l] = sum_i w[t, i] * relu(scale * q[t, i] . k[l])   for l <= positions[t], else -inf

where k[l] is the indexer key of context slot l of token t's sequence (block l // P of its
block table, row l % P). The top index_topk of each row are the positions its sparse MLA reads
(models/mla.py select_topk).

Program (t, c): token t against context slots c*BL .. (c+1)*BL - 1 (each slot's key row
gathered through the block table), one [Ip, J] x [J, BL] product on the tensor cores, relu,
then the weighted sum over the I heads; chunks wholly past the token's position store -inf
without reading keys.

Why: in XLA this is a loop over tokens that gathers each token's whole context into a
[L, J] copy, two products and a mask (several kernels a layer at decode, and at prefill each
chunk of 64 tokens a gathered copy per token).

Layouts: q_TIJ f[T, I, J], w_TI f32[T, I] (the head weights, already scaled), index_k_NPJ
f[NB, P, J], block_tables_SB i32[S, B], token_seq_ids_T / positions_T i32[T] -> f32[T, B * P].
Legend: T tokens, I indexer heads (Ip: a power of two >= 16), J head dim, NB cache blocks,
P block size, S sequences, B blocks per sequence, L = B * P context slots, BL slots per
program; Jp a power of two >= 16 (masked tail).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models.layers import mla
from jaxserve.pallas_kernels.dispatch import checked_block, resolve_impl, whole


def ref_indexer_scores(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T, positions_T,
                       *, scale: float):
    """The model's own XLA path (models/mla.py index_scores_xla)."""
    return mla.index_scores_xla(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T,
                                positions_T, scale=scale)


def _validate(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T, positions_T):
    t, i, j = q_TIJ.shape
    if w_TI.shape != (t, i):
        raise ValueError(f"w_TI must be f32[T, I] = [{t}, {i}]; got {w_TI.shape}")
    if index_k_NPJ.ndim != 3 or index_k_NPJ.shape[2] != j:
        raise ValueError(f"index_k_NPJ must be [NB, P, J={j}]; got {index_k_NPJ.shape}")
    if block_tables_SB.ndim != 2:
        raise ValueError(f"block_tables_SB must be i32[S, B]; got {block_tables_SB.shape}")
    if token_seq_ids_T.shape != (t,) or positions_T.shape != (t,):
        raise ValueError(f"token_seq_ids_T and positions_T must be i32[T={t}]; got "
                         f"{token_seq_ids_T.shape} and {positions_T.shape}")


def _kernel(q_ref, w_ref, k_ref, bt_ref, seq_ref, pos_ref, o_ref, *, heads, heads_p, j, j_p, p,
            slots_per_prog, num_slots, num_blocks_per_seq, scale):
    t, c = pl.program_id(0), pl.program_id(1)
    bl = slots_per_prog
    slots = c * bl + jnp.arange(bl, dtype=jnp.int32)                    # context slots l
    real = slots < num_slots
    pos = pos_ref[t]

    @pl.when(c * bl > pos)
    def _():                                                             # all in the future
        plgpu.store(o_ref.at[t, slots], jnp.full((bl,), -jnp.inf, jnp.float32), mask=real)

    @pl.when(c * bl <= pos)
    def _():
        seq = seq_ref[t]
        blk = jnp.minimum(slots // p, num_blocks_per_seq - 1)
        rows = plgpu.load(bt_ref.at[seq, blk]) * p + slots % p          # rows of [NB*P, J]
        d = jnp.arange(j_p, dtype=jnp.int32)
        d_safe = jnp.minimum(d, j - 1)
        keys = plgpu.load(k_ref.at[rows[None, :], d_safe[:, None]])      # [Jp, BL]
        h = jnp.arange(heads_p, dtype=jnp.int32)
        h_safe = jnp.minimum(h, heads - 1)
        q = plgpu.load(q_ref.at[t, h_safe[:, None], d_safe[None, :]])    # [Ip, Jp]
        q = jnp.where((h < heads)[:, None] & (d < j)[None, :], q, jnp.zeros_like(q))
        s = plgpu.dot(q, keys.astype(q.dtype), precision=jax.lax.Precision.HIGHEST)  # [Ip, BL]
        w = jnp.where(h < heads, plgpu.load(w_ref.at[t, h_safe]), 0.0)   # [Ip]
        total = jnp.sum(w[:, None] * jnp.maximum(s * scale, 0.0), axis=0)
        plgpu.store(o_ref.at[t, slots], jnp.where(slots <= pos, total, -jnp.inf), mask=real)


@functools.partial(jax.jit, static_argnames=("scale", "impl", "slots_per_program", "num_warps",
                                             "interpret"))
def indexer_scores(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T, positions_T, *,
                   scale: float, impl: str = "auto", slots_per_program: int = 64,
                   num_warps: int = 4, interpret: bool | None = None):
    """f32[T, B * P]: see the module docstring. impl: "pallas" (this kernel; interpreted on a
    CPU), "xla" (the model's path) or "auto". slots_per_program: BL, a power of two >= 16."""
    _validate(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T, positions_T)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_indexer_scores(q_TIJ, w_TI, index_k_NPJ, block_tables_SB, token_seq_ids_T,
                                  positions_T, scale=scale)
    checked_block(slots_per_program, "slots_per_program")
    t, heads, j = q_TIJ.shape
    nb, p, _ = index_k_NPJ.shape
    b = block_tables_SB.shape[1]
    num_slots = b * p
    kernel = functools.partial(_kernel, heads=heads, heads_p=max(16, pl.next_power_of_2(heads)),
                               j=j, j_p=max(16, pl.next_power_of_2(j)), p=p,
                               slots_per_prog=slots_per_program, num_slots=num_slots,
                               num_blocks_per_seq=b, scale=float(scale))
    return pl.pallas_call(
        kernel,
        grid=(t, pl.cdiv(num_slots, slots_per_program)),
        in_specs=[whole(t, heads, j), whole(t, heads), whole(nb * p, j), whole(*block_tables_SB.shape),
                  whole(t), whole(t)],
        out_specs=whole(t, num_slots),
        out_shape=jax.ShapeDtypeStruct((t, num_slots), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=(not on_gpu) if interpret is None else interpret,
        name="indexer_scores",
    )(q_TIJ, w_TI.astype(jnp.float32), index_k_NPJ.reshape(nb * p, j),
      block_tables_SB.astype(jnp.int32), token_seq_ids_T.astype(jnp.int32),
      positions_T.astype(jnp.int32))
