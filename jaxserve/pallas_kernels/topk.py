"""Top-k of each row returning values AND indices, for rows up to 128K keys and k up to 2048
(V3.2's indexer picks 2,048 positions per query token; the sampler's top-k can use it too).

    vals_Sk, idx_Sk = topk(x_SL, k)     # f32[S, k], i32[S, k]; -inf / -1 past a row's finite entries

Semantics: the k largest finite entries of each row; ties at the k-th value go to the lowest
indices (as lax.top_k); -inf entries are never chosen, so a row with fewer than k finite
entries (a short context, masked positions) fills its remaining slots with (-inf, -1). With
sorted=True the k are in descending value order (ties by index), exactly lax.top_k's output
where that has k finite values; else in an unspecified order (attention needs only the set).
NaNs are not supported.

Method: radix select, then compaction. pallas_kernels/topk_threshold.py finds the k-th
largest value of every row (8 passes of 4 bits, no sort). Then two kernels over a grid of
(row, chunk of the row) programs: the first counts per chunk the entries above the threshold
and those equal to it; a tiny XLA cumulative sum over the chunks gives each chunk its first
output slot; the second re-reads its chunk and writes each chosen entry (value and index)
to its slot (entries above first, then as many ties as fill k, each in index order; a
cumulative sum inside each block of the chunk ranks them). So the row is read 10 times and
only k entries are written, against lax.top_k's sort-based selection. At k = 2,048 over 16
rows it takes 0.79 x lax.top_k's time at 8K keys, 0.51 x at 32K and 0.21 x at 128K (H100,
BENCHMARKS.md "Kernels"); untuned.

Legend: S rows, L entries per row, k chosen per row, C chunks of a row, BL entries a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import num_sms, resolve_impl, whole
from jaxserve.pallas_kernels.topk_threshold import _chunking, topk_threshold


def ref_topk(x_SL: jax.Array, k: int):
    """lax.top_k over f32 rows, chosen -inf entries replaced by index -1 (the reference)."""
    vals_Sk, idx_Sk = jax.lax.top_k(x_SL.astype(jnp.float32), min(k, x_SL.shape[1]))
    vals_Sk, idx_Sk = _pad_k(vals_Sk, idx_Sk.astype(jnp.int32), k)
    return vals_Sk, jnp.where(vals_Sk > -jnp.inf, idx_Sk, -1)


def _pad_k(vals_Sk, idx_Sk, k):
    """Rows shorter than k: pad the output to k slots with (-inf, -1)."""
    short = k - vals_Sk.shape[1]
    if short <= 0:
        return vals_Sk, idx_Sk
    return (jnp.pad(vals_Sk, ((0, 0), (0, short)), constant_values=-jnp.inf),
            jnp.pad(idx_Sk, ((0, 0), (0, short)), constant_values=-1))


def _block(x_ref, row, lo, hi, i, block_l, kth):
    """Block i of the chunk [lo, hi) of a row: (columns, values, above the threshold i32,
    equal to it i32); -inf is never either."""
    col = lo + i * block_l + jnp.arange(block_l, dtype=jnp.int32)
    live = col < hi
    x = plgpu.load(x_ref.at[row, col], mask=live, other=-jnp.inf).astype(jnp.float32)
    above = live & (x > kth)
    tie = live & (x == kth) & (kth > -jnp.inf)
    return col, x, above.astype(jnp.int32), tie.astype(jnp.int32)


def _count_kernel(x_ref, kth_ref, counts_ref, *, l, chunk, block_l):
    """Entries above and at the threshold in this program's chunk -> counts[row, c, 0:2]."""
    row, c = pl.program_id(0), pl.program_id(1)
    kth = kth_ref[row]
    lo = c * chunk

    def step(i, acc):
        _, _, a, t = _block(x_ref, row, lo, jnp.minimum(lo + chunk, l), i, block_l, kth)
        return acc[0] + jnp.sum(a), acc[1] + jnp.sum(t)

    zero = jnp.zeros((), jnp.int32)
    n_above, n_tie = jax.lax.fori_loop(0, chunk // block_l, step, (zero, zero))
    counts_ref[row, c, 0] = n_above
    counts_ref[row, c, 1] = n_tie


def _write_kernel(x_ref, kth_ref, start_ref, above_ref, vals_in_ref, idx_in_ref, vals_ref, idx_ref,
                  *, l, k, chunk, block_l):
    """Write this chunk's chosen entries to their slots. start[row, c] = (first slot of its
    entries above, ties before it); above[row] = the row's entries above the threshold, so
    ties go to slots above[row] + their rank while that is < k."""
    del vals_in_ref, idx_in_ref        # aliased to the outputs: pre-filled with (-inf, -1)
    row, c = pl.program_id(0), pl.program_id(1)
    kth = kth_ref[row]
    n_above = above_ref[row]
    lo = c * chunk

    def step(i, carry):
        col, x, a, t = _block(x_ref, row, lo, jnp.minimum(lo + chunk, l), i, block_l, kth)
        above = a > 0
        rank_above = carry[0] + jnp.cumsum(a) - a
        rank_tie = carry[1] + jnp.cumsum(t) - t
        slot = jnp.where(above, rank_above, n_above + rank_tie)
        chosen = above | ((t > 0) & (n_above + rank_tie < k))
        # NOTE: lanes not chosen aim at the spare column k: the interpreter's masked store is
        # a read-modify-write scatter, where a masked lane sharing a chosen lane's slot could
        # write the old value back over it (a GPU's masked lanes write nothing)
        slot = jnp.where(chosen, slot, k)
        plgpu.store(vals_ref.at[row, slot], x, mask=chosen)
        plgpu.store(idx_ref.at[row, slot], col, mask=chosen)
        return carry[0] + jnp.sum(a), carry[1] + jnp.sum(t)

    jax.lax.fori_loop(0, chunk // block_l, step, (start_ref[row, c, 0], start_ref[row, c, 1]))


def _compact(x_SL, kth_S, k: int, *, block_l: int, num_warps: int, programs: int, interpret: bool):
    s, l = x_SL.shape
    num_chunks, chunk = _chunking(s, l, block_l, programs)
    rows = pl.BlockSpec((s,), lambda i, c: (0,))
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    counts_SC2 = pl.pallas_call(
        functools.partial(_count_kernel, l=l, chunk=chunk, block_l=block_l),
        grid=(s, num_chunks), in_specs=[whole(s, l), rows], out_specs=whole(s, num_chunks, 2),
        out_shape=jax.ShapeDtypeStruct((s, num_chunks, 2), jnp.int32), compiler_params=params,
        interpret=interpret, name="topk_count")(x_SL, kth_S)
    start_SC2 = jnp.cumsum(counts_SC2, axis=1) - counts_SC2       # exclusive, per row
    n_above_S = counts_SC2[:, :, 0].sum(axis=1)
    w = k + 1                                   # the k slots and a spare column (see the kernel)
    out_shape = [jax.ShapeDtypeStruct((s, w), jnp.float32), jax.ShapeDtypeStruct((s, w), jnp.int32)]
    vals_Sw, idx_Sw = pl.pallas_call(
        functools.partial(_write_kernel, l=l, k=k, chunk=chunk, block_l=block_l),
        grid=(s, num_chunks),
        in_specs=[whole(s, l), rows, whole(s, num_chunks, 2), rows, whole(s, w), whole(s, w)],
        out_specs=[whole(s, w), whole(s, w)], out_shape=out_shape,
        input_output_aliases={4: 0, 5: 1}, compiler_params=params, interpret=interpret,
        name="topk_write")(x_SL, kth_S, start_SC2, n_above_S,
                           jnp.full((s, w), -jnp.inf, jnp.float32), jnp.full((s, w), -1, jnp.int32))
    return vals_Sw[:, :k], idx_Sw[:, :k]


def _sort_desc(vals_Sk, idx_Sk):
    """Descending by value, ties (and the -1 padding, last) by index, as lax.top_k orders."""
    key = jnp.where(idx_Sk < 0, jnp.iinfo(jnp.int32).max, idx_Sk)
    neg, _, idx = jax.lax.sort((-vals_Sk, key, idx_Sk), dimension=1, num_keys=2)
    return -neg, idx


@functools.partial(jax.jit, static_argnames=("k", "impl", "sorted", "block_l", "num_warps",
                                             "programs", "interpret"))
def topk(x_SL, k: int, *, impl: str = "auto", sorted: bool = False, block_l: int = 1024,
         num_warps: int = 8, programs: int | None = None, interpret: bool | None = None):
    """(values f32[S, k], indices i32[S, k]) of each row's k largest finite entries.

    impl: "pallas" (radix select + compaction; interpreted on CPU), "xla" (ref_topk: lax.top_k)
    or "auto" ("pallas" on a GPU, "xla" elsewhere). programs: about how many programs each
    pass runs (default 4 per SM)."""
    if x_SL.ndim != 2:
        raise ValueError(f"x_SL must be [S, L]; got shape {x_SL.shape}")
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    impl, on_gpu = resolve_impl(impl, ("pallas", "xla"))
    if impl == "xla":
        return ref_topk(x_SL, k)
    interpret = (not on_gpu) if interpret is None else interpret
    x_SL = x_SL.astype(jnp.float32)
    s, l = x_SL.shape
    # k >= L: the threshold is -inf (keep every finite entry), the rest of the slots stay empty
    kth_S = topk_threshold(x_SL, jnp.full((s,), min(k, l), jnp.int32), impl="pallas",
                           interpret=interpret)
    vals_Sk, idx_Sk = _compact(x_SL, kth_S, k, block_l=block_l, num_warps=num_warps,
                               programs=programs or 4 * num_sms(), interpret=interpret)
    return _sort_desc(vals_Sk, idx_Sk) if sorted else (vals_Sk, idx_Sk)
