"""Mosaic GPU ragged paged attention: runs in Mosaic GPU interpret mode on CPU, vs the reference.

Interpret mode simulates the kernel's three warpgroups as threads, with TMA copies, barriers
and wgmma (from shared memory) done by host callbacks. It has no rule for `run_state` or for a
wgmma operand held in registers, so under interpret=True the kernel stages P through shared
memory for the P V product (the only difference from the GPU path; see the kernel's NOTE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.ragged_paged_attention import mgpu as mg
from jaxserve.pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention

from kernel_batches import cuda_attention_shapes, paged_batch

SCALE = 0.17


def check(args, **kw):
    ref = np.asarray(ref_ragged_paged_attention(*args, sm_scale=SCALE), np.float32)
    kw.setdefault("interpret", True)
    out = np.asarray(mg.ragged_paged_attention_mgpu(*args, sm_scale=SCALE, **kw), np.float32)
    real = int(args[3][-1])
    assert np.isfinite(out).all(), "some output element is not finite"
    err = np.linalg.norm(out[:real] - ref[:real]) / np.linalg.norm(ref[:real])
    assert err < 1e-2, err
    np.testing.assert_allclose(out[:real], ref[:real], atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(out[real:], 0.0)   # padding tokens: zeros
    return out


def batch(qlens, ctxs, *, n=8, kh=2, e=64, p=8, seed=0, pad_tokens=3):
    return paged_batch(qlens, ctxs, n=n, kh=kh, e=e, p=p, seed=seed, pad_tokens=pad_tokens,
                       dtype=jnp.bfloat16)


TILINGS = ["sequence", "flat"]
# The CPU suite runs each test below at one or two of its cases (every branch, tiling and edge
# case at least once); interpret mode compiles each shape in seconds. The other cases of each
# sweep (the *_GPU lists) run in tests/gpu/test_gpu_mgpu_interpret_sweep.py under `-m gpu`.
PREFILL_GQA = [(8, 2, "sequence"), (16, 2, "flat")]
PREFILL_GQA_GPU = [(4, 4, "sequence"), (4, 4, "flat"), (8, 2, "flat"), (16, 2, "sequence")]


@pytest.mark.parametrize("n,kh,tiling", PREFILL_GQA)   # GQA ratios 1, 4, 8 over the sweep
def test_prefill_gqa(n, kh, tiling):
    # a long prompt (several tiles, the last past T) then a short one starting mid-tile at an
    # odd token (not 8-aligned)
    check(batch([70, 5], [70, 90], n=n, kh=kh, seed=n), block_kv=64, tiling=tiling)


@pytest.mark.parametrize("tiling", ["flat"])            # "sequence": the GPU sweep
def test_chunked_prefill_odd_lengths_three_stages(tiling):
    # prompts with earlier context; tiles straddle sequence ends; 3-deep K/V ring
    check(batch([13, 29, 7], [77, 29, 40], seed=1), block_kv=64, num_stages=3, tiling=tiling)


@pytest.mark.parametrize("tiling", ["sequence"])        # "flat": the GPU sweep
def test_mixed_with_decode_rows_and_padding_sequences(tiling):
    # chunk of a longer prompt, decodes, padding sequences (qlen 0, seq_len 0) in between
    args = batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], seed=2)
    check(args, block_kv=64, tiling=tiling)
    check(args, block_kv=128, schedule_barrier=False, heavy_first=False, tiling=tiling)


def test_float16_and_block_size_16():
    args = paged_batch([20, 5], [50, 5], n=8, kh=2, e=64, p=16, seed=3, dtype=jnp.float16)
    check(args, block_kv=64)


def test_unsupported_options_raise():
    args = batch([4], [4])
    with pytest.raises(ValueError, match="sliding_window"):
        mg.ragged_paged_attention_mgpu(*args, sm_scale=1.0, sliding_window=4, interpret=True)
    with pytest.raises(ValueError, match="G = N // K"):
        mg.ragged_paged_attention_mgpu(*paged_batch([4], [4], n=6, kh=2, e=64,
                                                    dtype=jnp.bfloat16),
                                       sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        mg.ragged_paged_attention_mgpu(*paged_batch([4], [4], e=64), sm_scale=1.0,
                                       interpret=True)


def test_shapes_over_shared_memory_are_not_supported():
    # E=256 at the default tiles needs ~386 KB of shared memory (the H200 has 227 KiB): the
    # dispatcher must keep such models on the Triton kernel instead of failing to compile
    sds = jax.ShapeDtypeStruct
    q, cache = sds((2048, 16, 256), jnp.bfloat16), sds((64, 16, 4, 256), jnp.bfloat16)
    assert not mg.supports(q, cache)
    with pytest.raises(ValueError, match="shared memory"):
        mg._check_supported(q, cache, 128, 2, None, None)
    assert mg.supports(sds((2048, 32, 128), jnp.bfloat16), sds((64, 16, 8, 128), jnp.bfloat16))


@pytest.mark.parametrize("tiling", TILINGS)
def test_lowers_for_cuda(tiling):
    """The GPU path (interpret=False: wgmma with P in registers) lowers to one Mosaic GPU call
    (Pallas -> Mosaic GPU MLIR, layout inference included; PTX is made only on a GPU)."""
    from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda
    args = cuda_attention_shapes(t=256, s=4)
    exported = export_for_cuda(lambda *a: mg.ragged_paged_attention_mgpu(
        *a, sm_scale=0.1, interpret=False, num_stages=3, block_kv=64, tiling=tiling), *args)
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == args[0].shape


@pytest.mark.parametrize("n", [1, 63, 64, 257])
def test_small_inputs_get_a_buffer_of_their_own(n):
    """Mosaic GPU needs 256-byte aligned operands; in the engine's step query_start_loc,
    seq_lens and the block tables are slices of one packed input (views at any offset), so the
    wrapper pads each (never by zero entries: a zero pad is a no-op and keeps the view)."""
    x = jnp.arange(n, dtype=jnp.int32)
    y = mg._own_buffer(x)
    assert y.dtype == jnp.int32 and y.shape[0] % 64 == 0 and y.shape[0] > n
    np.testing.assert_array_equal(np.asarray(y[:n]), np.arange(n))


# --- the decode configuration: one compute warpgroup, key-range splits merged by log-sum-exp


@pytest.mark.parametrize("splits", [3])                 # 1: the GPU sweep
def test_decode_rows_one_warpgroup_and_splits(splits):
    # decodes with contexts of 1 to 200 keys (some splits see no key at all), a padding
    # sequence, padding tokens after the last sequence
    args = batch([1, 1, 1, 0, 1], [200, 37, 1, 0, 130], seed=5)
    check(args, **{**mg.DECODE_CONFIG, "num_splits": splits})


@pytest.mark.parametrize("n,kh", [(16, 2)])   # GQA 8; GQA 1 (4, 4): the GPU sweep
def test_splits_with_prefill_chunks_and_two_warpgroups(n, kh):
    # split key ranges under causal masks that start mid-split, with the prefill tiles
    check(batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], n=n, kh=kh, seed=2), block_kv=64,
          num_splits=2)


def test_one_warpgroup_on_prefill_chunks():
    # the decode configuration handles any batch: chunks longer than one tile (BQ = 16 tokens
    # at G = 4) straddling sequence ends
    check(batch([13, 29, 7], [77, 29, 40], seed=1), block_kv=64, num_stages=4, compute_wgs=1,
          num_splits=3)


def test_supports_takes_either_configuration():
    sds = jax.ShapeDtypeStruct
    q, cache = sds((64, 32, 128), jnp.bfloat16), sds((64, 16, 8, 128), jnp.bfloat16)
    assert mg.supports(q, cache, **mg.DECODE_CONFIG) and mg.supports(q, cache, **mg.PREFILL_CONFIG)
    assert not mg.supports(q, cache, **{**mg.DECODE_CONFIG, "num_stages": 9})   # shared memory
    assert not mg.supports(q, cache, **{**mg.DECODE_CONFIG, "bt_ahead": -1})


def test_default_splits_fill_the_gpu_only_for_decode():
    assert mg.default_num_splits(2048, 1, 8, 2048, 128) == 1                  # prefill-heavy
    # work items within one round of 132 CTAs, >= 2 key steps a split
    assert mg.default_num_splits(1, 1, 8, 8192, 64) == 16                     # one long decode
    assert mg.default_num_splits(1, 1, 8, 1024, 64) == 8                      # 2 steps a split
    assert mg.default_num_splits(4, 4, 8, 4096, 64) == 4
    assert mg.default_num_splits(4, 4, 8, 4096, 64, num_ctas=66) == 2
    assert mg.default_num_splits(128, 128, 8, 1024, 64) == 1                  # 1024 items already
    with pytest.raises(ValueError, match="num_splits"):
        mg.ragged_paged_attention_mgpu(*batch([4], [4]), sm_scale=1.0, tiling="flat",
                                       num_splits=2, interpret=True)


def test_decode_configuration_lowers_for_cuda():
    from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda
    args = cuda_attention_shapes(t=64, s=64)
    exported = export_for_cuda(lambda *a: mg.ragged_paged_attention_mgpu(
        *a, sm_scale=0.1, interpret=False, **{**mg.DECODE_CONFIG, "num_splits": 4}), *args)
    assert "mosaic_gpu" in exported.mlir_module()
    assert exported.out_avals[0].shape == args[0].shape
    from jaxserve.pallas_kernels.cuda_lowering import triton_kernel_names
    assert len(triton_kernel_names(exported)) == 1   # the splits are merged by the Triton kernel


def expected_tiles(qsl, num_tokens, ct):
    """Brute force: every sequence's tiles (and the padding tokens'), ct tokens each from its
    first token rounded down to 8."""
    bounds = list(zip(qsl, list(qsl[1:]) + [num_tokens]))
    return [(s, (b & -8) + k * ct) for s, (b, e) in enumerate(bounds) if e > b
            for k in range(-(-(e - (b & -8)) // ct))]


TILE_MAP_SEEDS, TILE_MAP_SEEDS_GPU = [1, 4], [0, 2, 3, 5]   # tiles of 16 and 32; 64 and 32


@pytest.mark.parametrize("seed", TILE_MAP_SEEDS)
def test_tile_map_lists_every_tile_in_order_within_the_grid_bound(seed):
    rng = np.random.default_rng(seed)
    ct = 8 * int(rng.choice([1, 2, 4, 8]))
    for _ in range(8):
        s = int(rng.integers(1, 40))
        # lengths around multiples of the tile and of 8 (the alignment edge cases), and zeros
        qlens = rng.choice([0, 1, 7, ct - 1, ct, ct + 1, 2 * ct + 7, 3], size=s)
        t = int(qlens.sum()) + int(rng.integers(0, 2 * ct))
        qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        num_tiles = t // ct + s + 1                      # the kernel's grid bound
        want = expected_tiles([int(x) for x in qsl], t, ct)
        assert len(want) <= num_tiles
        seq_lens = qlens + rng.integers(0, 50, size=s)
        args = (jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), t, num_tiles, ct)
        def fields(got):
            seq, t0, *rest = got[:-1].reshape(len(mg.TILE_FIELDS), num_tiles)
            count = got[-1]
            # each tile carries its sequence's token bounds and position offset (padding: 0)
            ends = list(qsl[1:]) + [t]
            for j in range(count):
                sj = seq[j]
                offset = seq_lens[sj] - ends[sj] if sj < s else 0
                assert [x[j] for x in rest] == [qsl[sj], ends[sj], offset], (j, sj)
            return seq, t0, count

        seq, t0, count = fields(np.asarray(mg.sequence_tile_map(*args)))
        assert count == len(want)
        assert list(zip(seq[:count].tolist(), t0[:count].tolist())) == want
        np.testing.assert_array_equal(seq[count:], -1)
        # longest first: the same tiles, by key steps of their causal range, most first
        seq, t0, count = fields(np.asarray(mg.sequence_tile_map(*args, longest_first_block_kv=16)))
        pairs = list(zip(seq[:count].tolist(), t0[:count].tolist()))
        assert sorted(pairs) == sorted(want)
        np.testing.assert_array_equal(seq[count:], -1)

        def steps(s_t0):
            s_, t0_ = s_t0
            if s_ == len(qlens):
                return 0                      # the padding tokens' tiles: no keys
            end = qsl[s_ + 1]
            return -(-(min(t0_ + ct, end) + seq_lens[s_] - end) // 16)
        assert [steps(x) for x in pairs] == sorted(map(steps, pairs), reverse=True)


def test_engine_bucket_with_mostly_empty_sequence_slots():
    # the engine's prefill buckets: a few real sequences, then many padding slots
    args = batch([21, 1, 6] + [0] * 13, [40, 9, 6] + [0] * 13, seed=3, pad_tokens=11)
    check(args, block_kv=64)


def check_race_free(args, **kw):
    """check() in interpret mode with shared-memory race detection (a TMA store still reading a
    buffer that the next work item writes, ...; the interpreter otherwise does TMA at once),
    then that no race was found."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plgpu
    check(args, **kw, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("tiling,q_buffers", [("flat", 1), ("sequence", 2)])   # the other two: GPU sweep
def test_few_ctas_each_loop_over_several_work_items(tiling, q_buffers):
    # 3 CTAs for 2 kv heads x ~10 tiles: several rounds, alternate rounds taken in reverse
    # order, the K/V ring, the barriers, the staging buffers and (with 2 q buffers) the next
    # item's q copy in flight during this one
    args = batch([21, 1, 6, 0, 30], [40, 9, 6, 0, 30], seed=4, pad_tokens=5)
    check_race_free(args, block_kv=64, num_ctas=3, tiling=tiling, q_buffers=q_buffers)


@pytest.mark.parametrize("tiling", ["sequence"])        # "flat": the GPU sweep
def test_ctas_without_a_work_item_store_nothing(tiling):
    # 2 tiles x 2 kv heads = 4 items for 5 CTAs: the last one's item index is past the end (it
    # reads a clamped, real item's tile and must not write it: on the GPU that write races)
    check(batch([40], [40], pad_tokens=0), block_kv=64, num_ctas=5, tiling=tiling)


def test_few_ctas_with_key_range_splits():
    # the decode configuration looping: each item's q copy in flight during the previous item
    args = batch([1, 1, 12, 1], [70, 33, 40, 9], seed=5)
    check_race_free(args, **{**mg.DECODE_CONFIG, "num_splits": 3}, num_ctas=5)


BT_AHEAD = [(0, 8, 2), (3, 8, 2)]                        # none ahead; 3 ahead at GQA 4
BT_AHEAD_GPU = [(1, 8, 2), (2, 4, 4), (2, 16, 2)]        # 1 ahead; two q buffers at GQA 1 and 8


@pytest.mark.parametrize("bt_ahead,n,kh", BT_AHEAD)
def test_block_table_entries_loaded_ahead_over_many_key_steps(bt_ahead, n, kh):
    # items of 2-5 key steps of 64 keys (8 cache blocks of 8 each), several items per CTA:
    # the FIFO carries entries from step to step; two q buffers at GQA 4, 1 and 8
    args = batch([1, 1, 1], [300, 200, 130], n=n, kh=kh, seed=6)
    check_race_free(args, **{**mg.DECODE_CONFIG, "num_splits": 2, "bt_ahead": bt_ahead},
                    num_ctas=2)
