"""Ragged paged attention for prefill-heavy batches, as a Hopper kernel in Mosaic GPU.

Same problem, layouts and semantics as the Triton kernel (see the package's docstring;
`reference.ref_ragged_paged_attention` is the reference): causal attention of a ragged batch of
query tokens over a paged KV cache, GQA, decode rows (qlen 1) and padding sequences allowed,
padding tokens after query_start_loc[-1] get zeros. Not supported (ValueError): sliding_window,
soft_cap, dtypes other than f16/bf16 (q and cache alike), head dims not a multiple of 64,
G = N // K not in {1, 2, 4, 8}, cache block sizes P not a multiple of 8 or not dividing block_kv.
T not a multiple of 8 works but costs a padded copy of q (engine token buckets avoid it).

Layouts (per layer):
    q_TNE           f16/bf16[T, N, E]     this step's queries
    k_cache_NPKE    f16/bf16[NB, P, K, E] paged keys (viewed as [NB*P, K*E] by the kernel)
    v_cache_NPKE    f16/bf16[NB, P, K, E] paged values
    query_start_loc i32[S+1], seq_lens i32[S], block_tables i32[S, B]
    -> o_TNE        [T, N, E] in q's dtype

Legend: T tokens, S sequences, N query heads, K kv heads, G = N // K, E head dim, NB cache
blocks, P slots per block, B blocks per sequence, BQ = 64 // G tokens per warpgroup tile,
CT = compute_wgs * BQ tokens per CTA, BKV keys per pipeline step (block_kv), W ring stages
(num_stages), X key-range splits (num_splits).

Design:
  * A persistent grid: one CTA per SM (num_ctas), each looping over work items (query tile,
    kv head h, split) handed out in rounds (CTA c takes the c-th item of even rounds and the
    c-th from the end of odd ones), with three warpgroups (the prefill configuration; the
    decode one has one compute warpgroup). The K/V ring and its barriers carry from one item
    to the next, so the memory warpgroup fetches the next item's keys while the compute
    warpgroups finish the last one. Two compute warpgroups own 64 rows each = BQ tokens x the
    G query heads of kv head h (GQA: K/V read once per group), ordered (head, token) so that
    each head's BQ tokens are one strided [BQ, E] TMA copy of q. One memory warpgroup walks the
    same key steps and fills a W-deep ring of [BKV, E] K
    and V tiles in shared memory page by page: BKV // P TMA copies of [P, E] from the cache
    viewed as [NB*P, K*E], through the block table, all arriving on one barrier per stage;
    the compute warpgroups hand a stage back through "consumed" barriers.
  * Small loads are kept off the warpgroups' paths where that is cheap: in the "sequence"
    tiling every field of a tile is in the tile map (passed with the block table as one
    buffer; query_start_loc and seq_lens are not read), and each warpgroup loads an item's
    fields ahead and carries them, computing nothing from them until they are used (the
    memory warpgroup one item ahead, the compute warpgroups two: they start the next item's q
    copy during the current one when q_buffers = 2); the memory warpgroup loads block-table
    entries bt_ahead key steps before their copies; a stored output is waited for only until
    its buffer has been read. Still on the path: the chain at the kernel's start (tile count,
    the first item's fields, its first block-table entries), each sequence's first bt_ahead
    lookups, and the "flat" tiling's per-tile search.
  * Per key step: wgmma S = Q K^T into registers, online softmax in exp2 units (the causal
    mask only on steps that need it), wgmma O += P V with P from registers. A two-party
    "schedule" barrier makes the two compute warpgroups alternate, so one's softmax overlaps
    the other's matmuls (FA3's ping-pong). Tiles are handed out longest-context first.
  * Two ways of tiling the tokens (`tiling=`):
    "sequence" (default): each tile serves one sequence, so decode rows get tiles of their own
      and run in parallel. The tiles come from a small map computed by XLA before the launch
      (sequence_tile_map: each tile's sequence, first token, its sequence's token bounds and
      position offset, longest causal range first, and their count), so the persistent grid
      never visits the idle tiles of the engine's mostly empty sequence slots. A tile starts
      at its sequence's first token rounded down to 8 (TMA copies into the 8-row-tiled q
      buffer must start on a row that is a multiple of 8; an unaligned start came out wrong on
      the H200), and only the rows of the sequence are stored: from an untiled staging buffer,
      as a ladder of BQ, BQ/2, ..., 1
      row TMA stores (TMA boxes are static). That buffer needs Mosaic GPU's Lane lowering
      semantics (Warpgroup semantics' layout inference tiles it and rejects the row slices).
    "flat": tile j is tokens [j*CT, (j+1)*CT) whatever sequences they belong to, with one key
      loop per sequence present (rows of other sequences masked out); no other tile writes
      those rows, so whole tiles are stored. Lowered with Warpgroup semantics, ~5% faster than
      "sequence" on prefill-only batches, but the loops of a tile run one after the other, so
      a tile full of decode rows is very slow (8x "sequence" on 32 decodes beside a 1K chunk):
      only for batches without decode rows.

Why Mosaic GPU: our Triton kernel (triton_kernel.py) gathers K/V with per-row pointer
loads and stays at ~34 % of the 794 TFLOP/s bf16 rate on a 2,048-token prefill; Hopper's rate
needs wgmma + TMA + warp specialisation, which Pallas' Triton lowering does not expose and
Mosaic GPU does. On that prefill this kernel runs at 0.91-0.94x cuDNN's speed while reading K/V
through the block table (cuDNN gets them dense) and ~1.45x the Triton kernel's (H200;
BENCHMARKS.md, "Kernels"). The XLA ops before the kernel (the tile map with its sort, padded
copies of the small inputs) depend only on the step's query_start_loc and seq_lens, so the
engine's step computes them once for all layers (CSE).
Decode configuration (DECODE_CONFIG: one compute warpgroup, a 4-deep ring of 64-key steps,
key-range splits merged by log-sum-exp, a second q buffer, bt_ahead = 2): correct, but slower
than the Triton kernel on most decode cases, so ragged_paged_attention never dispatches it.
Each CTA needs ~180 KB of shared memory, so one runs per SM, and with static rounds a CTA's
fixed start (the first copies go out ~3 us after launch) and uneven ends are not hidden;
balancing them needs items handed out dynamically (a fetch-and-add, which Mosaic GPU's Pallas
API lacks in jax 0.11.2).
Tried and slower: 64-key steps with 3 or 4 stages for prefill (3 stages of 128 keys do not fit
in shared memory beside "sequence"'s staging buffer), no schedule barrier, other launch orders.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.pallas_kernels.dispatch import DEFAULT_NUM_SMS, absent_refs, num_sms
from jaxserve.pallas_kernels.ragged_paged_attention.mgpu_kernel import (
    LSE_COLS, ROWS_PER_WG, TILE_FIELDS, rpa_mgpu_kernel)
from jaxserve.pallas_kernels.ragged_paged_attention.reference import validate
from jaxserve.pallas_kernels.ragged_paged_attention.tiling import prefill_heavy
from jaxserve.pallas_kernels.split_merge import merge_splits

COMPUTE_WGS = 2           # prefill: two compute warpgroups (FA3 ping-pong); decode: one
# Tile configurations by measurement (module docstring): prefill-heavy batches fill the GPU
# with query tiles; decode batches have 1 token per sequence, so one compute warpgroup, a deeper
# ring of smaller key steps and key-range splits (num_splits: None = default_num_splits).
PREFILL_CONFIG = dict(block_kv=128, num_stages=2, compute_wgs=2, num_splits=1, q_buffers=1,
                      bt_ahead=0)
DECODE_CONFIG = dict(block_kv=64, num_stages=4, compute_wgs=1, num_splits=None, q_buffers=2,
                     bt_ahead=2)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


MAX_SMEM_BYTES = 232448   # shared memory per block on an H100/H200 (227 KiB)


def _smem_bytes(head_dim: int, block_kv: int, num_stages: int, tiling: str, itemsize: int,
                compute_wgs: int = COMPUTE_WGS, num_splits: int = 1, q_buffers: int = 1) -> int:
    """Shared memory of the GPU path: q tiles, the output staging ("sequence" tiling; f32 plus
    the log-sum-exp when the key range is split) and the K/V ring (barriers are a few hundred
    bytes; the margin covers them)."""
    rows = compute_wgs * ROWS_PER_WG
    staging = 0
    if tiling == "sequence":
        staging = (rows * head_dim * itemsize if num_splits == 1
                   else rows * (head_dim + LSE_COLS) * 4)
    q_and_ring = q_buffers * rows * head_dim + 2 * num_stages * block_kv * head_dim
    return itemsize * q_and_ring + staging


def _check_supported(q_TNE, k_cache, block_kv, num_stages, sliding_window, soft_cap,
                     tiling="sequence", compute_wgs=COMPUTE_WGS, num_splits=1, q_buffers=1,
                     bt_ahead=0):
    if sliding_window is not None or soft_cap is not None:
        raise ValueError("ragged_paged_attention_mgpu supports neither sliding_window nor "
                         "soft_cap; use ragged_paged_attention(impl='pallas') for those")
    _, n, e = q_TNE.shape
    _, p, kh, _ = k_cache.shape
    g = n // kh
    if q_TNE.dtype != k_cache.dtype or jnp.dtype(q_TNE.dtype) not in (
            jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q and the cache must share one dtype, float16 or bfloat16; got "
                         f"{q_TNE.dtype} and {k_cache.dtype}")
    if e % 64:
        raise ValueError(f"head dim E must be a multiple of 64 (wgmma/TMA tiles); got {e}")
    if g not in (1, 2, 4, 8):
        raise ValueError(f"query heads per kv head G = N // K must be 1, 2, 4 or 8; got {g}")
    if block_kv % 64 or block_kv % p:
        raise ValueError(f"block_kv must be a multiple of 64 and of the block size P={p}; "
                         f"got {block_kv}")
    if p % 8:
        raise ValueError(f"cache block size P must be a multiple of 8; got {p}")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2; got {num_stages}")
    if compute_wgs not in (1, 2):
        raise ValueError(f"compute_wgs must be 1 or 2; got {compute_wgs}")
    if num_splits < 1 or (num_splits > 1 and tiling != "sequence"):
        raise ValueError(f"num_splits must be >= 1, and 1 with tiling='flat'; got {num_splits}")
    if q_buffers not in (1, 2):
        raise ValueError(f"q_buffers must be 1 or 2; got {q_buffers}")
    if bt_ahead < 0:
        raise ValueError(f"bt_ahead must be >= 0; got {bt_ahead}")
    smem = _smem_bytes(e, block_kv, num_stages, tiling, jnp.dtype(q_TNE.dtype).itemsize,
                       compute_wgs, num_splits, q_buffers)
    if smem > MAX_SMEM_BYTES - 4096:
        raise ValueError(f"head dim E={e} with block_kv={block_kv} and num_stages={num_stages} "
                         f"needs {smem} bytes of shared memory; at most "
                         f"{MAX_SMEM_BYTES - 4096} fit (use a smaller block_kv or E <= 128)")


def _own_buffer(x_N):
    """x as int32 in a buffer of its own, padded by 1..64 entries (the kernel reads only the
    first N). NOTE: a Mosaic GPU call needs 256-byte aligned operands, and inside the engine's
    step these small arrays are slices of one packed input, which XLA passes as views at any
    offset ("Input buffer 1 is not 256-byte aligned" on the H200); a padded copy is a fresh,
    aligned allocation (a zero pad would be a no-op and keep the view)."""
    n = x_N.shape[0]
    return jnp.pad(x_N.astype(jnp.int32), (0, 64 - n % 64))


def sequence_tile_map(query_start_loc_S1, seq_lens_S, num_tokens: int, num_tiles: int,
                      tile_tokens: int, *, longest_first_block_kv: int | None = None) -> jax.Array:
    """The tiles of the "sequence" tiling -> i32[F * num_tiles + 1], F = len(TILE_FIELDS):
    entry f * num_tiles + j is field f of tile j: its sequence (S for the padding tokens past
    query_start_loc[S]), its first token, the first and end token of its sequence (the padding
    tokens: qsl[S] and num_tokens) and the offset from a token to its position (seq_len - end);
    the last entry is the number of tiles. Entries of the tiles past it are unused (-1, 0...).
    Sequence s needs ceil((end - start) / CT) tiles from its first token rounded down to 8 (TMA
    row alignment; see the kernel), in order. num_tiles = T // CT + S + 1 is enough whatever
    the batch: each sequence needs at most qsl[s+1] // CT - qsl[s] // CT + 1 tiles, CT being a
    multiple of 8 (see the tests). With longest_first_block_kv, the tiles are ordered by their
    number of key steps of that size, most first (stable): the persistent kernel hands them out
    in that order, so the longest start first and the rest even out the CTAs' loads (longest
    processing time first); the gain measured on multi-sequence prefill steps was small, and
    the sort costs ~5 us of XLA ops once per step."""
    qsl = query_start_loc_S1.astype(jnp.int32)
    begin_S1 = qsl                                              # S real + the padding one
    end_S1 = jnp.append(qsl[1:], jnp.int32(num_tokens))
    first_S1 = jnp.bitwise_and(begin_S1, -8)
    tiles_S1 = jnp.where(end_S1 > begin_S1, pl.cdiv(end_S1 - first_S1, tile_tokens), 0)
    ends_S1 = jnp.cumsum(tiles_S1)                              # one past each one's last tile
    j_J = jnp.arange(num_tiles, dtype=jnp.int32)
    # NOTE: a comparison matrix, not searchsorted's loop: one small fusion ((T/CT + S) x S)
    seq_J = jnp.minimum(jnp.sum(ends_S1[None, :] <= j_J[:, None], axis=1, dtype=jnp.int32),
                        qsl.shape[0] - 1)
    t0_J = first_S1[seq_J] + (j_J - (ends_S1[seq_J] - tiles_S1[seq_J])) * tile_tokens
    idle = j_J >= ends_S1[-1]
    if longest_first_block_kv:
        num_seqs = qsl.shape[0] - 1
        real = seq_J < num_seqs                                 # not the padding tokens' tiles
        s_c = jnp.minimum(seq_J, num_seqs - 1)
        kv_end = jnp.minimum(t0_J + tile_tokens, end_S1[seq_J]) + seq_lens_S[s_c] - end_S1[seq_J]
        steps = jnp.where(real, pl.cdiv(kv_end, longest_first_block_kv), 0)
        # a stable sort by comparison matrices (NOTE: jnp.argsort's sort op, interpreted next
        # to the Mosaic GPU interpreter, hung on 2 CPU cores; on the GPU these are two fusions)
        key = jnp.where(idle, 1, -steps)
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) &
                                                   (j_J[None, :] < j_J[:, None]))
        rank_J = jnp.sum(before, axis=1, dtype=jnp.int32)         # where tile j goes
        order = jnp.argmax(rank_J[None, :] == j_J[:, None], axis=1)
        seq_J, t0_J, idle = seq_J[order], t0_J[order], idle[order]
    seq_lens_S1 = jnp.append(seq_lens_S.astype(jnp.int32), end_S1[-1])   # padding: offset 0
    fields = (seq_J, t0_J, begin_S1[seq_J], end_S1[seq_J], seq_lens_S1[seq_J] - end_S1[seq_J])
    return jnp.concatenate([jnp.where(idle, -1 if f == 0 else 0, x) for f, x in enumerate(fields)]
                           + [ends_S1[-1:]])





def supports(q_TNE, k_cache, *, sliding_window=None, soft_cap=None,
             block_kv: int = PREFILL_CONFIG["block_kv"],
             num_stages: int = PREFILL_CONFIG["num_stages"],
             compute_wgs: int = PREFILL_CONFIG["compute_wgs"], num_splits: int | None = 1,
             q_buffers: int = PREFILL_CONFIG["q_buffers"], bt_ahead: int = 0) -> bool:
    """Whether this kernel handles these shapes and options (the prefill configuration by
    default; num_splits None counts as 1).
    ragged_paged_attention's impl="pallas" falls back to the Triton kernel otherwise."""
    try:
        _check_supported(q_TNE, k_cache, block_kv, num_stages, sliding_window, soft_cap,
                         compute_wgs=compute_wgs, num_splits=num_splits or 1,
                         q_buffers=q_buffers, bt_ahead=bt_ahead)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


def default_num_splits(num_tokens: int, num_seqs: int, kv_heads: int, context: int,
                       block_kv: int, num_ctas: int = DEFAULT_NUM_SMS) -> int:
    """Key-range splits for decode-heavy batches: as many as keep the work items (sequences x
    kv heads x splits) within one round of the persistent grid, with at least two key steps
    per split (at most 32); 1 for prefill-heavy batches. A second, partial round costs a whole
    item's time (H200: one 8K-token decode took 13.5 us in 16 splits, 128 items, and 22.0 in
    17). Approximate: it counts min(T, S) sequences, not the padding tokens' tile nor sequences
    that span several tiles."""
    if prefill_heavy(num_tokens, num_seqs):
        return 1
    work = max(min(num_tokens, num_seqs) * kv_heads, 1)
    return int(max(1, min(num_ctas // work, context // (2 * block_kv), 32)))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "tiling", "block_kv", "num_stages",
    "schedule_barrier", "heavy_first", "interpret", "compute_wgs", "num_splits", "num_ctas",
    "q_buffers", "bt_ahead"))
def ragged_paged_attention_mgpu(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1,
                                seq_lens_S, block_tables_SB, *, sm_scale: float,
                                sliding_window: int | None = None, soft_cap: float | None = None,
                                tiling: str = "sequence", block_kv: int = 128, num_stages: int = 2,
                                compute_wgs: int = COMPUTE_WGS, num_splits: int | None = 1,
                                schedule_barrier: bool = True, heavy_first: bool = True,
                                num_ctas: int | None = None, q_buffers: int = 1,
                                bt_ahead: int = 0,
                                interpret: bool | plgpu.InterpretGPUParams | None = None
                                ) -> jax.Array:
    """Causal attention of a ragged batch over a paged KV cache -> o f[T, N, E].

    The defaults are the prefill configuration (PREFILL_CONFIG); DECODE_CONFIG is the one for
    decode-heavy batches.
    tiling: "sequence" (each tile serves one sequence: any batch, decode rows included) or
    "flat" (tiles of the token axis whatever the sequences: faster on prefill-only batches, but
    a tile runs one key loop per sequence in it, so decode rows serialise: never use it for
    batches with decode rows).
    block_kv: keys per pipeline step (multiple of 64 and of P); num_stages: depth of the K/V
    ring in shared memory; compute_wgs: compute warpgroups per CTA (64 query rows each);
    num_splits: work items per query tile and kv head along the key range ("sequence" tiling;
    partial outputs merged by their log-sum-exp afterwards; None = default_num_splits);
    schedule_barrier: make two compute warpgroups alternate (FA3 ping-pong); heavy_first: hand
    out the tiles with the longest causal range first; num_ctas: CTAs of the persistent grid
    (default: one per SM of the GPU, fewer if there are fewer work items); q_buffers: 2 copies
    the next work item's q during the current one (shared memory for a second q tile);
    bt_ahead: key steps ahead of its copies that the memory warpgroup loads the block-table
    entries (registers: up to (bt_ahead + 1) x block_kv // P of them, in a warpgroup capped at
    40; a sequence's last bt_ahead steps load entries that go unused); interpret: run in
    Mosaic GPU interpret mode (default: when no GPU is present; an InterpretGPUParams sets its
    options, e.g. race detection in the tests).
    """
    validate(q_TNE, k_cache_NPKE, v_cache_NPKE, query_start_loc_S1, seq_lens_S, block_tables_SB)
    if tiling not in ("sequence", "flat"):
        raise ValueError(f"tiling must be 'sequence' or 'flat'; got {tiling!r}")
    t, n, e = q_TNE.shape
    nb, p, kh, _ = k_cache_NPKE.shape
    s, b = block_tables_SB.shape
    g = n // kh
    num_ctas = num_ctas or num_sms()
    if num_splits is None:
        num_splits = (default_num_splits(t, s, kh, b * p, block_kv, num_ctas)
                      if tiling == "sequence" else 1)
    _check_supported(q_TNE, k_cache_NPKE, block_kv, num_stages, sliding_window, soft_cap, tiling,
                     compute_wgs, num_splits, q_buffers, bt_ahead)
    schedule_barrier = schedule_barrier and compute_wgs == 2
    ct = compute_wgs * (ROWS_PER_WG // g)
    # NOTE: q is copied into 8-row tiled shared memory, and Mosaic GPU then wants T to be a
    # multiple of 8 (or below 8): pad odd token counts (a copy of q; engine buckets avoid it).
    t_pad = t if t % 8 == 0 or t < 8 else t + (-t) % 8
    # flat: tiles of the token axis; sequence: at most qsl[s+1] // CT - qsl[s] // CT + 1 tiles
    # per sequence (sequence_tile_map)
    num_tiles = pl.cdiv(t_pad, ct) if tiling == "flat" else t_pad // ct + s + 1
    if t_pad != t:
        q_TNE = jnp.pad(q_TNE, ((0, t_pad - t), (0, 0), (0, 0)))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    interpret_params = (interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                        else plgpu.InterpretGPUParams() if interpret else None)
    interpret = interpret_params is not None
    num_ctas = min(num_ctas, num_tiles * kh * num_splits)
    dtype = q_TNE.dtype
    split = num_splits > 1
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(
        rpa_mgpu_kernel, tiling=tiling, num_tokens=t_pad, num_seqs=s, blocks_per_seq=b,
        block_size=p, group=g, head_dim=e, block_kv=block_kv, num_stages=num_stages,
        num_tiles=num_tiles, sm_scale=float(sm_scale), schedule_barrier=schedule_barrier,
        heavy_first=heavy_first, interpret=interpret, compute_wgs=compute_wgs,
        num_splits=num_splits, kv_heads=kh, num_ctas=num_ctas, q_buffers=q_buffers,
        bt_ahead=bt_ahead,
        bt_offset=len(TILE_FIELDS) * num_tiles + 1 if tiling == "sequence" else 0)
    if split:
        out_type = (jax.ShapeDtypeStruct((num_splits, t_pad, n, e), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, t_pad, n, LSE_COLS), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct((t_pad, n, e), dtype)
        kernel = absent_refs(kernel, 8)   # seven inputs, then o: no lse
    rows = (compute_wgs, ROWS_PER_WG)
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=(
            plgpu.SMEM((compute_wgs, q_buffers, ROWS_PER_WG, e), dtype, transforms=tiled),
            # untiled output staging for row-granular stores ("sequence" tiling only)
            plgpu.SMEM((*rows, e), jnp.float32 if split else dtype)
            if tiling == "sequence" else None,
            plgpu.SMEM((*rows, LSE_COLS), jnp.float32) if split else None,
            plgpu.SMEM((num_stages, block_kv, e), dtype, transforms=tiled),
            plgpu.SMEM((num_stages, block_kv, e), dtype, transforms=tiled),
            plgpu.Barrier(num_arrivals=g, num_barriers=compute_wgs * q_buffers),
            plgpu.Barrier(num_arrivals=block_kv // p, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=block_kv // p, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=2),
            # P staging for interpret mode only (see the NOTE in the kernel)
            plgpu.SMEM((*rows, block_kv), dtype, transforms=tiled) if interpret else None,
        ),
        # persistent: each CTA loops over work items (see the kernel)
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        # NOTE: "sequence" needs Lane semantics: under Warpgroup semantics the layout inference
        # tiles the output buffer in 8 rows and rejects the row-granular store slices; "flat"
        # runs ~7% faster under Warpgroup semantics.
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Lane if tiling == "sequence"
            else plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params,
        kernel_name=f"ragged_paged_attention_mgpu_{tiling}_bkv{block_kv}_w{num_stages}"
                    f"_c{compute_wgs}_x{num_splits}_q{q_buffers}_a{bt_ahead}",
    )
    bt_flat = block_tables_SB.reshape(s * b).astype(jnp.int32)
    if tiling == "sequence":
        # The kernel reads the map (which holds every tile's bounds) and the block table only:
        # one buffer, bt_offset entries in, computed in the map's fusion; a fresh allocation,
        # so aligned (see _own_buffer). query_start_loc and seq_lens are not read.
        meta = jnp.concatenate([
            sequence_tile_map(query_start_loc_S1, seq_lens_S, t_pad, num_tiles, ct,
                              longest_first_block_kv=block_kv if heavy_first else None),
            bt_flat])
        small = (meta, meta, meta, meta)
    else:   # the map is not read
        small = (_own_buffer(query_start_loc_S1), _own_buffer(seq_lens_S), _own_buffer(bt_flat),
                 jnp.zeros(64, jnp.int32))
    outs = call(*small, q_TNE, k_cache_NPKE.reshape(nb * p, kh * e),
                v_cache_NPKE.reshape(nb * p, kh * e))
    if split:
        # NOTE: interpreted, the merge is plain XLA: the Triton merge kernel's interpreter
        # after Mosaic GPU's interpreted kernel in one program deadlocked on 2 CPU cores
        o_TNE = merge_splits(outs[0], outs[1][..., 0], out_dtype=dtype,
                             impl="xla" if interpret else "pallas", interpret=False)
    else:
        o_TNE = outs
    return o_TNE[:t] if t_pad != t else o_TNE


