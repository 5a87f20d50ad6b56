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
"auto": on a GPU, "pallas" up to sparse_max_rows(G) rows (when the shapes suit it): 512, the
largest size where it was measured to win at 128 experts, or 4 rows an expert where there are
more (Qwen3.5's 512 experts: 2,048; at 640 rows, batch 64 x top-10, some 28 % of them are still
empty, which "mosaic" would read anyway), "mosaic" above on Hopper when the shapes suit its
tiles, else "xla"; on CPU "xla".

Block-scaled FP8 weights (`BlockScaledFp8`: DeepSeek's checkpoints kept as they are, e4m3
values and one f32 scale per B x B block, B = 128 in the real models): the "pallas" kernel
reads the FP8 bytes, widens each tile to x's dtype and scales each tile's product by its
block's scale (its BK and BN divide B, so a tile lies in one block); half the bytes of bf16
weights. "auto" takes it on a GPU at any M (Mosaic has no scaled FP8 path here); "xla"
dequantizes every expert first (correct, not fast).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import checked_block, resolve_impl, whole

MOSAIC_TILES = dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1)
SPARSE_MAX_ROWS = 512   # "auto" takes the "pallas" kernel up to this M (measured: module doc)
SPARSE_MAX_ROWS_PER_GROUP = 4   # ... or up to this many rows an expert, if more (module doc)
# The kernel addresses w as [G*K, N] with int32 offsets, the last one G*K*N - 1. A larger
# weight falls back to lax.ragged_dot, which reads every expert: DeepSeek-V3's 256 x 7168 x
# 2048 experts took 5.29 ms a layer at batch 1 that way, 5 % of its roofline (H200, session 20).
MAX_WEIGHT_ELEMENTS = 2 ** 31


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaledFp8:
    """Expert weights as e4m3 values [G, K, N] ([in, out], as the bf16 ones) and f32 scales
    [G, ceil(K/B), ceil(N/B)], one per B x B block (DeepSeek's `weight_scale_inv`, transposed):
    w[g, i, o] = values[g, i, o] * scales[g, i // B, o // B]."""
    values: jax.Array
    scales: jax.Array
    block: int = dataclasses.field(default=128, metadata=dict(static=True))

    shape = property(lambda self: self.values.shape)
    ndim = property(lambda self: self.values.ndim)
    size = property(lambda self: self.values.size)
    dtype = property(lambda self: self.values.dtype)

    def problem(self) -> str | None:
        """Why these values and scales are not one e4m3 array and its block scales (None if
        they are)."""
        g, k, n = self.shape
        b = self.block
        want = (g, -(-k // b), -(-n // b))
        if self.values.dtype != jnp.float8_e4m3fn or self.scales.shape != want:
            return (f"BlockScaledFp8 needs float8_e4m3fn values and f32{list(want)} scales (one "
                    f"per {b} x {b} block of {self.shape}); got {self.values.dtype} and "
                    f"{self.scales.shape}")
        return None

    def split(self, parts: int) -> tuple["BlockScaledFp8", ...]:
        return tuple(BlockScaledFp8(v, s, self.block) for v, s in
                     zip(jnp.split(self.values, parts), jnp.split(self.scales, parts)))
BLOCK_M = 16            # rows of a tile: Triton's smallest dot M

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def dequantize(w: BlockScaledFp8, dtype=jnp.float32):
    """Block-scaled FP8 weights as `dtype`: values[g, i, o] * scales[g, i // B, o // B]."""
    _, k, n = w.shape
    b = w.block
    s = jnp.repeat(jnp.repeat(w.scales.astype(jnp.float32), b, 1), b, 2)
    return (w.values.astype(jnp.float32) * s[:, :k, :n]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def quantize(w_GKN, block: int = 128) -> BlockScaledFp8:
    """w_GKN as block-scaled FP8, each block's largest magnitude at e4m3's 448 (DeepSeek's
    recipe; for dummy weights of an FP8 model: real checkpoints come quantized). Jitted, with
    the scales broadcast over [G, K/B, B, N/B, B] blocks, so no f32 copy of the array is ever
    whole (eagerly, DeepSeek-V3's 256 x 7168 x 2048 experts made three 15 GB f32 arrays, and
    the 3-layer benchmark's quantization did not finish in 70 s on an H100)."""
    g, k, n = w_GKN.shape
    kb, nb = -(-k // block), -(-n // block)
    blocks = jnp.pad(w_GKN, ((0, 0), (0, kb * block - k), (0, nb * block - n))).reshape(
        g, kb, block, nb, block).astype(jnp.float32)
    amax = jnp.abs(blocks).max(axis=(2, 4))
    scales = jnp.where(amax > 0, amax / 448.0, 1.0)
    values = (blocks / scales[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
    return BlockScaledFp8(values.reshape(g, kb * block, nb * block)[:, :k, :n], scales, block)


def ref_grouped_matmul(x_MK, w_GKN, group_sizes_G):
    """Dense reference: every row times its own group's matrix, in f32."""
    if isinstance(w_GKN, BlockScaledFp8):
        w_GKN = dequantize(w_GKN)
    m = x_MK.shape[0]
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(m), side="right")
    w_MKN = w_GKN[jnp.minimum(group_M, w_GKN.shape[0] - 1)].astype(jnp.float32)
    out = jnp.einsum("mk,mkn->mn", x_MK.astype(jnp.float32), w_MKN)
    return jnp.where((group_M < w_GKN.shape[0])[:, None], out, 0.0).astype(x_MK.dtype)


# ---------------------------------------------------------------------------------------------
# Validation and tiling
# ---------------------------------------------------------------------------------------------


def _validate(x_MK, w_GKN, group_sizes_G):
    if x_MK.ndim != 2 or w_GKN.ndim != 3 or w_GKN.shape[1] != x_MK.shape[1]:
        raise ValueError(f"x_MK must be [M, K] and w_GKN [G, K, N] with the same K; got "
                         f"{x_MK.shape} and {w_GKN.shape}")
    if group_sizes_G.shape != w_GKN.shape[:1]:
        raise ValueError(f"group_sizes_G must be i32[G = {w_GKN.shape[0]}]; got "
                         f"{group_sizes_G.shape}")
    if w_GKN.dtype == jnp.float8_e4m3fn and not isinstance(w_GKN, BlockScaledFp8):
        raise ValueError("float8_e4m3fn w_GKN needs its block scales: pass a BlockScaledFp8")
    if isinstance(w_GKN, BlockScaledFp8) and w_GKN.problem():
        raise ValueError(w_GKN.problem())


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
    if isinstance(w_GKN, BlockScaledFp8):
        return w_GKN.split(parts)
    return tuple(jnp.split(w_GKN, parts))


def _over_chunks(x_MK, chunks, group_sizes_G, tuning):
    """grouped_matmul over expert chunks: each chunk's rows (consecutive: rows are sorted by
    expert) are rotated to the front for its call, whose other rows come out as 0, and rotated
    back; the chunks' results add up. The rotations move M rows, not weights."""
    m = x_MK.shape[0]
    rows_M = jnp.arange(m, dtype=jnp.int32)
    ends_G = _inclusive_sums(group_sizes_G.astype(jnp.int32))   # (not jnp.cumsum: see there)
    out, g0 = None, 0
    for w in chunks:
        g1 = g0 + w.shape[0]
        first = ends_G[g0 - 1] if g0 else jnp.int32(0)
        y = grouped_matmul(x_MK[(rows_M + first) % m], w, group_sizes_G[g0:g1], **tuning)
        own_M = (rows_M - first) % m                   # each row's place in the rotated call
        # (rows past a call's groups are 0 from "pallas" and "xla"; masked for any kernel)
        y = jnp.where((own_M < ends_G[g1 - 1] - first)[:, None], y[own_M], 0)
        out = y if out is None else out + y
        g0 = g1
    if g0 != group_sizes_G.shape[0]:
        raise ValueError(f"group_sizes_G must be i32[G = {g0}] (the chunks' experts); got "
                         f"{group_sizes_G.shape}")
    return out


def sparse_max_rows(num_groups: int) -> int:
    """The most rows "auto" gives the "pallas" kernel over num_groups experts."""
    return max(SPARSE_MAX_ROWS, SPARSE_MAX_ROWS_PER_GROUP * num_groups)


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
    if x_MK.dtype != w_GKN.dtype and not isinstance(w_GKN, BlockScaledFp8):
        return (f"w_GKN must have x_MK's dtype or be BlockScaledFp8; got {x_MK.dtype} and "
                f"{w_GKN.dtype}")
    if isinstance(w_GKN, BlockScaledFp8) and (k % 16 or n % 16 or w_GKN.block % 16):
        return f"FP8 K, N and block must be multiples of 16; got K={k}, N={n}, block={w_GKN.block}"
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
    m, k, groups, block_k, block_n, fp8_block):
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
        # FP8: the tile lies in one scale block (BK, BN divide it): one scale for its product
        part = plgpu.dot(x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
        blocks_k = scale_ref[0].shape[0] // groups
        scale = scale_ref[0][jnp.minimum(grp, groups - 1) * blocks_k + step * block_k // fp8_block,
                             j * block_n // fp8_block]
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
                           num_stages, interpret):
    problem = _sparse_problem(x_MK, w_GKN)
    if problem:
        raise ValueError(f"impl='pallas': {problem}; use impl='xla'")
    fp8_block = w_GKN.block if isinstance(w_GKN, BlockScaledFp8) else 0
    scales_GBC = w_GKN.scales if fp8_block else None
    w_GKN = w_GKN.values if fp8_block else w_GKN
    m, k = x_MK.shape
    g, _, n = w_GKN.shape
    # BN = BK = 128, 4 warps, 4 stages: within 1-6 % of the best tiling of an H200 sweep at 8
    # and 128 rows (benchmarks/kernels.py --only moe --sweep); each weight row read is then 256
    # contiguous bytes (128 in FP8).
    preferred = min(128, fp8_block) if fp8_block else 128
    block_k = _block(k, block_k, preferred, "block_k", "K")
    block_n = _block(n, block_n, preferred, "block_n", "N")
    if fp8_block and (fp8_block % block_k or fp8_block % block_n):
        raise ValueError(f"impl='pallas' with FP8 weights: block_k and block_n must divide the "
                         f"scale block {fp8_block} (a tile in one block); got {block_k}, {block_n}")
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
                          block_n=block_n, fp8_block=fp8_block),
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
def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, impl: str = "auto",
                   block_k: int | None = None, block_n: int | None = None, num_warps: int = 4,
                   num_stages: int = 4, interpret: bool | None = None):
    """x_MK @ w_GKN[group of each row] -> f[M, N]; impl "auto" | "pallas" | "mosaic" | "xla".

    w_GKN may also be a tuple of consecutive expert chunks (split_experts: arrays past the
    "pallas" kernel's int32 reach, each chunk within it), and a BlockScaledFp8 (or chunks).
    Tuning options of the "pallas" kernel: block_k / block_n (powers of two >= 16 dividing K /
    N; default the largest dividing one up to 128), num_warps, num_stages, interpret
    (default: on CPU only).
    """
    tuning = dict(impl=impl, block_k=block_k, block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret)
    if isinstance(w_GKN, (tuple, list)):
        return _over_chunks(x_MK, tuple(w_GKN), group_sizes_G, tuning)
    _validate(x_MK, w_GKN, group_sizes_G)
    fp8 = isinstance(w_GKN, BlockScaledFp8)
    auto = impl == "auto"
    impl, on_gpu = resolve_impl(impl, ("pallas", "mosaic", "xla"))
    if auto and on_gpu:
        sparse_ok = _sparse_problem(x_MK, w_GKN) is None
        if sparse_ok and (x_MK.shape[0] <= sparse_max_rows(w_GKN.shape[0]) or fp8):
            impl = "pallas"
        else:
            impl = "mosaic" if not fp8 and _mosaic_fits(x_MK, w_GKN) else "xla"
    if impl == "mosaic" and fp8:
        raise ValueError("impl='mosaic' has no FP8 weights; use impl='pallas' or 'xla'")
    if impl == "xla":
        if fp8:
            w_GKN = dequantize(w_GKN, x_MK.dtype)
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32))
    if impl == "pallas":
        return _sparse_grouped_matmul(
            x_MK, w_GKN, group_sizes_G, block_k=block_k, block_n=block_n, num_warps=num_warps,
            num_stages=num_stages, interpret=(not on_gpu) if interpret is None else interpret)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot(x_MK, w_GKN, group_sizes=group_sizes_G.astype(jnp.int32),
                                      **MOSAIC_TILES)
