"""Grouped (ragged) matmul for MoE experts: rows sorted by expert times that expert's weights.

    out_MN[rows of group g] = x_MK[rows of group g] @ w_GKN[g]

Layouts: x_MK f[M, K] (rows sorted by group; group g owns group_sizes[g] consecutive rows),
w_GKN f[G, K, N], group_sizes_G i32[G] -> f[M, N]. Rows past sum(group_sizes) come out as 0.
Legend: M rows (tokens x experts per token), K contraction dim, N output dim, G groups (experts),
S row-tile slots of the "pallas" kernel, BM rows of a tile, BK / BN its K and N block sizes.

Implementations:
- "pallas": our Triton kernel (pallas_call) for few rows (decode). It reads only the weights of
  the groups that have rows: a few XLA ops first list the row tiles (each non-empty group's rows
  cut into tiles of BM = 16, the smallest tensor-core M; the rows past the groups form one more
  pseudo-group whose tiles only write zeros), then program (s, j) computes tile s times columns
  j*BN.. of its group's matrix, streaming w[g, :, those columns] BK rows at a time, and stores
  only its group's rows. At one token (8 of 128 experts) that is 1/16 of the weights the two
  below read. Unused tile slots (the list is sized for the worst case) exit at once. It beats
  both below up to 512 rows, while some experts are still empty (H200, Qwen3-30B-A3B gate+up
  at one token: 22.6 against 191 us; BENCHMARKS.md, "Kernels").
- "mosaic": JAX's Mosaic GPU ragged dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu:
  warpgroup MMA, TMA pipeline, persistent grid; Hopper only), 64 x 256 tiles: the fastest with
  many rows, where every expert has some and skipping pays nothing.
- "xla": jax.lax.ragged_dot; runs everywhere. Like "mosaic" it streams every expert's weights,
  used or not.
"auto": on a GPU, "pallas" up to SPARSE_MAX_ROWS rows (when the shapes suit it; the largest
size where it was measured to win), "mosaic" above on Hopper when the shapes suit its tiles,
else "xla"; on CPU "xla".

Block-scaled FP8 weights (DeepSeek's checkpoints kept as they are: e4m3 values and one f32
scale per 128 x 128 block, `scales_GBC` [G, ceil(K/128), ceil(N/128)] in w_GKN's [in, out]
layout): the "pallas" kernel reads the FP8 bytes, widens each tile to x's dtype and scales
each tile's product by its block's scale (its BK and BN divide 128, so a tile lies in one
block); half the bytes of bf16 weights. "auto" takes it on a GPU at any M (Mosaic has no
scaled FP8 path here); "xla" dequantizes every expert first (correct, not fast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import checked_block, resolve_impl, whole

MOSAIC_TILES = dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1)
SPARSE_MAX_ROWS = 512   # "auto" takes the "pallas" kernel up to this M (measured: module doc)
# The kernel addresses w as [G*K, N] with int32 offsets, the last one G*K*N - 1. A larger
# weight falls back to lax.ragged_dot, which reads every expert: DeepSeek-V3's 256 x 7168 x
# 2048 experts took 5.29 ms a layer at batch 1 that way, 5 % of its roofline (H200, session 20).
MAX_WEIGHT_ELEMENTS = 2 ** 31
FP8_BLOCK = 128         # DeepSeek's weight_block_size: one scale per 128 x 128 weights
BLOCK_M = 16            # rows of a tile: Triton's smallest dot M

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def dequantize(w_GKN, scales_GBC, dtype=jnp.float32):
    """Block-scaled FP8 weights as `dtype`: w[g, i, o] * scales[g, i // 128, o // 128]."""
    _, k, n = w_GKN.shape
    s = jnp.repeat(jnp.repeat(scales_GBC.astype(jnp.float32), FP8_BLOCK, 1), FP8_BLOCK, 2)
    return (w_GKN.astype(jnp.float32) * s[:, :k, :n]).astype(dtype)


def ref_grouped_matmul(x_MK, w_GKN, group_sizes_G, scales_GBC=None):
    """Dense reference: every row times its own group's matrix, in f32."""
    if scales_GBC is not None:
        w_GKN = dequantize(w_GKN, scales_GBC)
    m = x_MK.shape[0]
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(m), side="right")
    w_MKN = w_GKN[jnp.minimum(group_M, w_GKN.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mkn->mn", x_MK.astype(jnp.float32), w_MKN)
    return jnp.where((group_M < w_GKN.shape[0])[:, None], out, 0.0).astype(x_MK.dtype)


# ---------------------------------------------------------------------------------------------
# Validation and tiling
# ---------------------------------------------------------------------------------------------


def _validate(x_MK, w_GKN, group_sizes_G, scales_GBC=None):
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or w_GKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"x_MK must be [M, K] and w_GKN [G, K, N] with the same K; got "
                         f"{x_MK.shape} and {w_GKN.shape}")
    if group_sizes_G.shape != w_GKN.shape[:1]:
        raise ValueError(f"group_sizes_G must be i32[G = {w_GKN.shape[0]}]; got "
                         f"{group_sizes_G.shape}")
    if (scales_GBC is None) != (w_GKN.dtype != jnp.float8_e4m3fn):
        raise ValueError(f"scales_GBC must be given exactly when w_GKN is float8_e4m3fn; got "
                         f"w_GKN {w_GKN.dtype} and scales {'none' if scales_GBC is None else 'given'}")
    if scales_GBC is not None:
        g, k, n = w_GKN.shape
        want = (g, -(-k // FP8_BLOCK), -(-n // FP8_BLOCK))
        if scales_GBC.shape != want:
            raise ValueError(f"scales_GBC must be f32{list(want)} (a scale per {FP8_BLOCK} x "
                             f"{FP8_BLOCK} block of w_GKN {w_GKN.shape}); got {scales_GBC.shape}")


def split_experts(w_GKN, limit: int | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """w_GKN as the fewest equal chunks of experts within the kernel's reach (itself if it
    fits): separate arrays, so that each chunk's offsets start from its own base."""
    limit = MAX_WEIGHT_ELEMENTS if limit is None else limit
    g = w_GKN.shape[0]
    if w_GKN.size <= limit:
        return w_GKN
    parts = next((c for c in range(2, g + 1) if g % c == 0 and w_GKN.size // c <= limit), None)
    if parts is None:
        raise ValueError(f"one expert of shape {w_GKN.shape[1:]} is past the kernel's reach "
                         f"({limit} elements)")
    return tuple(jnp.split(w_GKN, parts))


def _over_chunks(x_MK, chunks, group_sizes_G, tuning, scale_chunks=None):
    """grouped_matmul over expert chunks: each chunk's rows (consecutive: rows are sorted by
    expert) are rotated to the front for its call, whose other rows come out as 0, and rotated
    back; the chunks' results add up. The rotations move M rows, not weights."""
    m = x_MK.shape[0]
    rows_M = jnp.arange(m, dtype=jnp.int32)
    ends_G = _inclusive_sums(group_sizes_G.astype(jnp.int32))   # (not jnp.cumsum: see there)
    out, g0 = None, 0
    for c, w in enumerate(chunks):
        g1 = g0 + w.shape[0]
        first = ends_G[g0 - 1] if g0 else jnp.int32(0)
        scales = None if scale_chunks is None else scale_chunks[c]
        y = grouped_matmul(x_MK[(rows_M + first) % m], w, group_sizes_G[g0:g1], scales=scales, **tuning)
        own_M = (rows_M - first) % m                   # each row's place in the rotated call
        # (rows past a call's groups are 0 from "pallas" and "xla"; masked for any kernel)
        y = jnp.where((own_M < ends_G[g1 - 1] - first)[:, None], y[own_M], 0)
        out = y if out is None else out + y
        g0 = g1
    if g0 != group_sizes_G.shape[0]:
        raise ValueError(f"group_sizes_G must be i32[G = {g0}] (the chunks' experts); got "
                         f"{group_sizes_G.shape}")
    return out


def _mosaic_fits(x_MK, w_GKN) -> bool:
    m, k = x_MK.shape
    n = w_GKN.shape[2]
    on_hopper = any("H100" in d.device_kind or "H200" in d.device_kind for d in jax.devices())
    return (on_hopper and m >= 64 and k % MOSAIC_TILES["block_k"] == 0
            and n % MOSAIC_TILES["block_n"] == 0 and x_MK.dtype == w_GKN.dtype
            and x_MK.dtype in (jnp.bfloat16, jnp.float16))


def _sparse_problem(x_MK, w_GKN) -> str | None:
    """Why the "pallas" kernel cannot take these operands (None if it can)."""
    g, k, n = w_GKN.shape
    if x_MK.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"x_MK must be bf16, f16 or f32; got {x_MK.dtype}"
    if x_MK.dtype != w_GKN.dtype and w_GKN.dtype != jnp.float8_e4m3fn:
        return (f"w_GKN must have x_MK's dtype or be float8_e4m3fn (with scales); got "
                f"{x_MK.dtype} and {w_GKN.dtype}")
    if k % 16 or n % 16:
        return f"K and N must be multiples of 16; got K={k}, N={n}"
    if g * k * n > MAX_WEIGHT_ELEMENTS:
        return (f"w_GKN has {g * k * n} elements; the kernel's int32 offsets reach at most "
                f"{MAX_WEIGHT_ELEMENTS}")
    return None


def _block(dim: int, requested: int | None, preferred: int, name: str, dim_name: str) -> int:
    """A requested block size must divide its dim; by default the largest power of two
    <= `preferred` that does (>= 16, as Triton's dot needs), so no load needs a mask."""
    if requested is not None:
        return checked_block(requested, name, dim, dim_name)
    b = preferred
    while dim % b:
        b //= 2
    return b


def _num_slots(m: int, g: int) -> int:
    """Most row tiles the groups can need: c non-empty groups (the trailing pseudo-group
    included, so c <= min(M, G + 1)) need sum ceil(size/BM) = c + sum (size - 1) // BM
    <= c + (M - c) // BM tiles, which grows with c."""
    c = min(m, g + 1)
    return c + (m - c) // BLOCK_M


def _inclusive_sums(x_G):
    """cumsum as a [G, G] masked sum. NOTE: XLA's GPU cumsum is a reduce-window kernel of its
    own (1-5 us each on the H200 at G = 128, twice per MoE layer); this fuses with its
    neighbours."""
    g = x_G.shape[0]
    upto_GG = jnp.arange(g)[None, :] <= jnp.arange(g)[:, None]
    return jnp.sum(jnp.where(upto_GG, x_G[None, :], 0), axis=1, dtype=x_G.dtype)


def _tile_list(group_sizes_G, m: int):
    """(group i32[S], first row i32[S], end row i32[S]) of every tile slot, in plain XLA.
    Group G is the pseudo-group of the rows past the real ones (its tiles store zeros);
    unused slots have first row == end row (they store nothing)."""
    g = group_sizes_G.shape[0]
    ends = jnp.minimum(_inclusive_sums(group_sizes_G.astype(jnp.int32)), m)
    ends_X = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])        # X = G + 1 groups
    starts_X = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_X[:-1]])
    tiles_X = pl.cdiv(ends_X - starts_X, BLOCK_M)
    tile_ends_X = _inclusive_sums(tiles_X)
    slot_S = jnp.arange(_num_slots(m, g), dtype=jnp.int32)
    # NOTE: a compare-and-count, not jnp.searchsorted's default loop: one small fusion.
    grp_S = jnp.sum(tile_ends_X[None, :] <= slot_S[:, None], axis=1, dtype=jnp.int32)
    used_S = grp_S <= g
    grp_S = jnp.minimum(grp_S, g)
    first_S = starts_X[grp_S] + (slot_S - (tile_ends_X - tiles_X)[grp_S]) * BLOCK_M
    end_S = jnp.minimum(first_S + BLOCK_M, ends_X[grp_S])
    first_S = jnp.where(used_S, first_S, 0)
    return grp_S, first_S, jnp.where(used_S, end_S, 0)


# ---------------------------------------------------------------------------------------------
# Kernel body: program (s, j) = row tile s x output columns j*BN .. (j+1)*BN
# ---------------------------------------------------------------------------------------------


def _sparse_kernel(
    # inputs
    grp_ref, first_ref, end_ref, x_ref, w_ref,
    # then FP8 weights' scales (if any), then the output
    *refs,
    m, k, groups, block_k, block_n):
    *scale_ref, o_ref = refs
    s, j = pl.program_id(0), pl.program_id(1)
    grp, first, end = grp_ref[s], first_ref[s], end_ref[s]
    rows_R = first + jnp.arange(BLOCK_M, dtype=jnp.int32)
    # x rows past the tile belong to other groups (or past M): any value will do for rows
    # whose results are never stored, so clamp the load instead of masking it.
    xrows_R1 = jnp.minimum(rows_R, m - 1)[:, None]
    cols_1N = j * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    kk_K = jnp.arange(block_k, dtype=jnp.int32)
    w_base = jnp.minimum(grp, groups - 1) * k   # w viewed as [G*K, N]

    def body(step, acc):
        kk = step * block_k + kk_K
        x = plgpu.load(x_ref.at[xrows_R1, kk[None, :]])                        # [BM, BK]
        w = plgpu.load(w_ref.at[(w_base + kk)[:, None], cols_1N])              # [BK, BN]
        if not scale_ref:
            return acc + plgpu.dot(x, w, precision=jax.lax.Precision.HIGHEST)
        # FP8: the tile lies in one 128 x 128 block (BK, BN divide 128): one scale for its product
        part = plgpu.dot(x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
        blocks_k = scale_ref[0].shape[0] // groups
        scale = scale_ref[0][jnp.minimum(grp, groups - 1) * blocks_k + step * block_k // FP8_BLOCK,
                             j * block_n // FP8_BLOCK]
        return acc + part * scale

    # The pseudo-group G (rows past the groups) and unused slots read no weights at all.
    # NOTE: both bounds explicitly int32: with a Python 0 the Triton lowering built an scf.for
    # whose bounds had different integer types, which the GPU's verifier rejected.
    steps = jnp.where(grp < groups, jnp.int32(k // block_k), jnp.int32(0))
    acc = jax.lax.fori_loop(jnp.int32(0), steps, body, jnp.zeros((BLOCK_M, block_n), jnp.float32))
    # NOTE: the store uses the unclamped rows with a mask: rows of the neighbouring groups'
    # tiles are never written (on the GPU nor in interpret mode's read-modify-write).
    plgpu.store(o_ref.at[rows_R[:, None], cols_1N], acc.astype(o_ref.dtype),
                mask=(rows_R < end)[:, None])


def _sparse_grouped_matmul(x_MK, w_GKN, group_sizes_G, *, block_k, block_n, num_warps,
                           num_stages, interpret, scales_GBC=None):
    problem = _sparse_problem(x_MK, w_GKN)
    if problem:
        raise ValueError(f"impl='pallas': {problem}; use impl='xla'")
    m, k = x_MK.shape
    g, _, n = w_GKN.shape
    # BN = BK = 128, 4 warps, 4 stages: within 1-6 % of the best tiling of an H200 sweep at 8
    # and 128 rows (benchmarks/kernels.py --only moe --sweep); each weight row read is then 256
    # contiguous bytes (128 in FP8).
    block_k = _block(k, block_k, 128, "block_k", "K")
    block_n = _block(n, block_n, 128, "block_n", "N")
    if scales_GBC is not None and (FP8_BLOCK % block_k or FP8_BLOCK % block_n):
        raise ValueError(f"impl='pallas' with FP8 weights: block_k and block_n must divide "
                         f"{FP8_BLOCK} (a tile in one scale block); got {block_k}, {block_n}")
    grp_S, first_S, end_S = _tile_list(group_sizes_G, m)
    s = grp_S.shape[0]
    operands = [grp_S, first_S, end_S, x_MK, w_GKN.reshape(g * k, n)]
    specs = [whole(s), whole(s), whole(s), whole(m, k), whole(g * k, n)]
    if scales_GBC is not None:       # addressed as [G * blocks of K, blocks of N]
        _, bk, bn = scales_GBC.shape
        operands.append(scales_GBC.astype(jnp.float32).reshape(g * bk, bn))
        specs.append(whole(g * bk, bn))
    return pl.pallas_call(
        functools.partial(_sparse_kernel, m=m, k=k, groups=g, block_k=block_k,
                          block_n=block_n),
        grid=(s, n // block_n),
        in_specs=specs,
        out_specs=whole(m, n),
        out_shape=jax.ShapeDtypeStruct((m, n), x_MK.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_sparse{'_fp8' if scales_GBC is not None else ''}_bk{block_k}_bn{block_n}",
    )(*operands)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "block_k", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, scales=None, impl: str = "auto",
                   block_k: int | None = None, block_n: int | None = None, num_warps: int = 4,
                   num_stages: int = 4, interpret: bool | None = None):
    """x_MK @ w_GKN[group of each row] -> f[M, N]; impl "auto" | "pallas" | "mosaic" | "xla".

    w_GKN may also be a tuple of consecutive expert chunks (split_experts: arrays past the
    "pallas" kernel's int32 reach, each chunk within it). scales: with float8_e4m3fn w_GKN,
    its block scales f32[G, ceil(K/128), ceil(N/128)] (a tuple of chunks with chunked w).
    Tuning options of the "pallas" kernel: block_k / block_n (powers of two >= 16 dividing K /
    N; default the largest dividing one up to 128), num_warps, num_stages, interpret
    (default: on CPU only).
    """
    tuning = dict(impl=impl, block_k=block_k, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret)
    if isinstance(w_GKN, (tuple, list)):
        return _over_chunks(x_MK, tuple(w_GKN), group_sizes_G, tuning,
                            None if scales is None else tuple(scales))
    _validate(x_MK, w_GKN, group_sizes_G, scales)
    auto = impl == "auto"
    impl, on_gpu = resolve_impl(impl, ("pallas", "mosaic", "xla"))
    if auto and on_gpu:
        sparse_ok = _sparse_problem(x_MK, w_GKN) is None
        if sparse_ok and (x_MK.shape[0] <= SPARSE_MAX_ROWS or scales is not None):
            impl = "pallas"
        else:
            impl = "mosaic" if scales is None and _mosaic_fits(x_MK, w_GKN) else "xla"
    if impl == "mosaic" and scales is not None:
        raise ValueError("impl='mosaic' has no FP8 weights; use impl='pallas' or 'xla'")
    if impl == "xla":
        if scales is not None:
            w_GKN = dequantize(w_GKN, scales, x_MK.dtype)
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32))
    if impl == "pallas":
        return _sparse_grouped_matmul(
            x_MK, w_GKN, group_sizes_G, block_k=block_k, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, interpret=(not on_gpu) if interpret is None else interpret,
            scales_GBC=scales)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(x_MK, w_GKN, group_sizes=group_sizes_G.astype(jnp.int32),
                                      **MOSAIC_TILES)
