"""Ragged paged attention: Pallas kernel (interpret mode) and XLA fallback against the reference."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pallas_kernels.ragged_paged_attention import reference, triton_kernel, wrapper
from jaxserve.pallas_kernels.ragged_paged_attention import tiling as rt
from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling, gather_tiling
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names

from kernel_batches import cuda_attention_shapes, paged_batch

SCALE = 0.17


def bucket_shapes(s, t=None, kh=8, n=32, e=128, dtype=jnp.bfloat16):
    """Abstract inputs of an engine-like bucket: s sequence slots, t tokens (default s), 64
    cache blocks a sequence."""
    return cuda_attention_shapes(t=t or s, n=n, kh=kh, e=e, nb=s * 64 + 1, s=s, b=64,
                                 dtype=dtype)


def export_triton(args, triton_ir=None, **kw):
    """The Triton kernel's CUDA lowering at `args` (abstract), with wrapper options `kw`."""
    return export_for_cuda(lambda *a: wrapper.ragged_paged_attention(
        *a, sm_scale=SCALE, impl="triton", interpret=False, **gather_tiling(kw)), *args,
        triton_ir=triton_ir)


def kernel_name(args, **kw):
    """The Triton kernel's name (it carries the tiling the wrapper chose), traced only."""
    jaxpr = jax.make_jaxpr(lambda *a: wrapper.ragged_paged_attention(
        *a, sm_scale=SCALE, impl="triton", interpret=True, **gather_tiling(kw)))(*args)
    return re.search(r"ragged_paged_attention_\w+", str(jaxpr)).group()


def check(args, *, impl="pallas", atol=2e-5, **kw):
    opts = {k: kw.pop(k) for k in ("sliding_window", "soft_cap") if k in kw}
    ref = np.asarray(reference.ref_ragged_paged_attention(*args, sm_scale=SCALE, **opts))
    out = np.asarray(wrapper.ragged_paged_attention(*args, sm_scale=SCALE, impl=impl, **opts,
                                                    **gather_tiling(kw)))
    real = int(args[3][-1])
    # interpret mode starts every output buffer as NaN: finite means every element was written
    assert np.isfinite(out).all(), "some output element was never written"
    np.testing.assert_allclose(out[:real], ref[:real], atol=atol, rtol=1e-4)
    np.testing.assert_array_equal(out[real:], 0.0)   # padding tokens: zeros, never NaN
    return out


# The CPU suite runs one or two cases of each sweep below (each case compiles its own
# interpreted kernel, seconds on 2 cores); the *_GPU cases run in
# tests/gpu/test_gpu_interpret_sweeps.py under `-m gpu`.
DECODE_GQA, DECODE_GQA_GPU = [(8, 2)], [(4, 4), (16, 2)]           # GQA ratios 4; 1 and 8
ONE_TOKEN_GQA, ONE_TOKEN_GQA_GPU = [(4, 4)], [(8, 2), (16, 2)]     # GQA ratios 1; 4 and 8
TILE_ORDER, TILE_ORDER_GPU = [(True, True)], [(True, False), (False, True)]   # both; each alone
HEADS_INNER_SPLITS, HEADS_INNER_SPLITS_GPU = [3], [1]


@pytest.mark.parametrize("n,kh", DECODE_GQA)
def test_decode_only_gqa(n, kh):
    check(paged_batch([1] * 5, [1, 9, 16, 23, 40], n=n, kh=kh, seed=n))


def test_prefill_only_odd_lengths():
    check(paged_batch([7, 13, 1, 30], [7, 13, 1, 30], seed=1), block_k=8, mask_all_steps=False)


def test_mixed_chunked_prefill_decode_and_padding_sequences():
    # chunk of a longer prompt, decodes, a padding sequence (qlen 0, seq_len 0) in between
    args = paged_batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], seed=2)
    check(args)
    check(args, num_splits=3, block_k=8, mask_all_steps=False)   # split + merge; edge masks
    check(args, block_q=16, block_k=32)          # larger tiles than the sequences


@pytest.mark.parametrize("heavy_first,prefetch_slots", TILE_ORDER)
def test_tile_order_and_prefetched_slots(heavy_first, prefetch_slots):
    # the launch order of query tiles and looking up the next step's slots one step early
    # (the last step looks one step past the context) change no output
    args = paged_batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], seed=5)
    kw = dict(heavy_first=heavy_first, prefetch_slots=prefetch_slots, mask_all_steps=False)
    check(args, block_k=8, **kw)
    check(args, num_splits=3, block_k=8, **kw)


def test_pallas_picks_mosaic_for_prefill_heavy_batches_on_a_gpu():
    sds = jax.ShapeDtypeStruct
    q, cache = sds((2048, 32, 128), jnp.bfloat16), sds((64, 16, 8, 128), jnp.bfloat16)
    one_seq, many_seqs = sds((1,), jnp.int32), sds((1024,), jnp.int32)

    def pick(q=q, cache=cache, seq_lens=one_seq, on_gpu=True, interpret=None, **kw):
        kw = {"sliding_window": None, "soft_cap": None, **kw}
        return wrapper._pallas_kernel_for(q, cache, seq_lens, on_gpu=on_gpu, interpret=interpret, **kw)

    assert pick() == "mgpu"
    assert pick(seq_lens=many_seqs) == "triton"                  # T <= 2 S: decode-heavy
    assert pick(on_gpu=False) == pick(interpret=True) == "triton"
    assert pick(sliding_window=128) == pick(soft_cap=30.0) == "triton"
    assert pick(q=sds((2048, 24, 128), jnp.bfloat16)) == "triton"   # G = 3
    assert pick(q=sds((2048, 32, 96), jnp.bfloat16), cache=sds((64, 16, 8, 96), jnp.bfloat16)) \
        == "triton"                                                # E not a multiple of 64


def test_sliding_window_and_soft_cap():
    args = paged_batch([6, 1, 11], [40, 37, 30], seed=3)
    check(args, sliding_window=10)
    check(args, sliding_window=10, num_splits=2, block_k=8, mask_all_steps=False)
    check(args, soft_cap=5.0)


def test_group_not_power_of_two():
    # SmolLM2: 9 query heads over 3 kv heads (G = 3 is padded to 4 rows per token)
    check(paged_batch([3, 1, 5], [3, 20, 12], n=9, kh=3, e=16, seed=4))


def test_xla_fallback_matches_reference():
    args = paged_batch([9, 1, 0, 1], [25, 33, 0, 8], seed=5)
    check(args, impl="xla")
    check(args, impl="xla", sliding_window=6)


def test_matches_model_reference_paged_attention_xla():
    """Same numbers as models/layers.py's per-token reference (token_seq_ids/positions API)."""
    q, k, v, qsl, seq_lens, bt = args = paged_batch([4, 1, 6], [10, 21, 6], pad_tokens=0, seed=6)
    qlens = np.diff(np.asarray(qsl))
    seq_T = np.repeat(np.arange(len(qlens)), qlens)
    pos_T = np.concatenate([np.arange(c - ql, c) for ql, c in zip(qlens, np.asarray(seq_lens))])
    want = layers.paged_attention_xla(q, k, v, bt, jnp.asarray(seq_T), jnp.asarray(pos_T),
                                      sm_scale=SCALE)
    got = wrapper.ragged_paged_attention(*args, sm_scale=SCALE, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)


def test_bf16_inputs():
    args = paged_batch([5, 1], [12, 30], dtype=jnp.bfloat16, seed=7)
    ref = reference.ref_ragged_paged_attention(*args, sm_scale=SCALE).astype(jnp.float32)
    out = wrapper.ragged_paged_attention(*args, sm_scale=SCALE, impl="pallas").astype(jnp.float32)
    real = int(args[3][-1])
    err = jnp.linalg.norm(out[:real] - ref[:real]) / jnp.linalg.norm(ref[:real])
    assert float(err) < 1e-2


def test_validation_errors_name_the_field():
    q, k, v, qsl, seq_lens, bt = paged_batch([1], [4], n=6, kh=4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        wrapper.ragged_paged_attention(q, k, v, qsl, seq_lens, bt, sm_scale=1.0, impl="pallas")
    q, k, v, qsl, seq_lens, bt = paged_batch([1], [4])
    with pytest.raises(ValueError, match="impl"):
        wrapper.ragged_paged_attention(q, k, v, qsl, seq_lens, bt, sm_scale=1.0, impl="cuda")
    with pytest.raises(ValueError, match="query_start_loc"):
        wrapper.ragged_paged_attention(q, k, v, qsl[:1], seq_lens, bt, sm_scale=1.0)


@pytest.mark.parametrize("num_splits,block_q", [(1, None), (4, None), (4, 1)])
def test_lowers_for_cuda(num_splits, block_q):
    args = cuda_attention_shapes()
    exported = export_for_cuda(lambda *a: wrapper.ragged_paged_attention(
        *a, sm_scale=0.1, impl="pallas", interpret=False, sliding_window=128,
        tiling=Tiling(num_splits=num_splits, heavy_first=True, prefetch_slots=num_splits > 1,
                      block_q=block_q)), *args)
    names = triton_kernel_names(exported)
    assert len(names) == 1 + (num_splits > 1) and names[0].startswith("ragged_paged_attention")
    if num_splits > 1:   # the splits are merged by a second kernel
        assert names[1].startswith(f"merge_splits_x{num_splits}")
    assert exported.out_avals[0].shape == args[0].shape


@pytest.mark.parametrize("n,kh", ONE_TOKEN_GQA)
def test_one_token_tiles(n, kh):
    # BQ = 1: one tile per token, rows padded up to 16 and masked; decode rows, a chunk and
    # padding sequences, with and without key splits
    args = paged_batch([1, 3, 0, 1, 1], [9, 20, 0, 1, 33], n=n, kh=kh, seed=7)
    check(args, block_q=1)
    check(args, block_q=1, num_splits=3, block_k=8, mask_all_steps=False, heavy_first=True)


@pytest.fixture
def binary_search(monkeypatch):
    """Past VECTOR_SEARCH_MAX_SEQS (patched to 2) a program finds its sequence by binary
    search; jit caches are cleared on both sides, so no trace crosses the patch."""
    for module in (rt, triton_kernel):      # the grid's size and the kernel's search
        monkeypatch.setattr(module, "VECTOR_SEARCH_MAX_SEQS", 2)
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_binary_search_past_the_vector_search(binary_search):
    args = paged_batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], pad_tokens=5, seed=8)
    check(args, num_splits=2, block_k=8)
    check(args, block_q=1)


def test_wrapper_passes_the_grid_to_the_step_size_rule():
    # the kernel name carries the tiling the wrapper chose (traced only, nothing runs)
    def name(s, kh=8, n=32, e=128, dtype=jnp.bfloat16, t=None, **kw):
        return kernel_name(bucket_shapes(s, t, kh=kh, n=n, e=e, dtype=dtype), **kw)
    assert name(64) == "ragged_paged_attention_bq4_bk64_x1"
    assert name(128, kh=4) == "ragged_paged_attention_bq2_bk64_x1"    # Qwen3-30B-A3B's heads
    assert name(48) == "ragged_paged_attention_bq4_bk128_x1"          # 384 programs
    assert name(128) == "ragged_paged_attention_bq4_bk64_x1"          # 1,024: many_wave_decode
    assert name(64, dtype=jnp.float32) == name(64, e=64) == name(64, num_warps=8) == \
        "ragged_paged_attention_bq4_bk128_x1"
    # 128 tokens in 64 slots (chunks and decodes): 640 programs, but not a decode bucket
    assert name(64, t=128) == "ragged_paged_attention_bq4_bk128_x1"


def test_wrapper_pipelines_nearly_full_decode_grids():
    # the tiling and stage count the wrapper picks, read off the CUDA lowering
    def tiling(s, kh=8, dtype=jnp.bfloat16, **kw):
        exported = export_triton(bucket_shapes(s, kh=kh, dtype=dtype), **kw)
        return re.findall(r'name = "(ragged_paged_attention_[^"]+)", num_stages = (\d+)',
                          exported.mlir_module())[0]
    assert tiling(16) == ("ragged_paged_attention_bq4_bk128_x1", "5")
    assert tiling(32, kh=4) == ("ragged_paged_attention_bq2_bk128_x1", "5")
    # a padded bucket below its floor: fill_splits (at most 16 splits of the 1K-key context)
    assert tiling(16, busy_seqs=12) == ("ragged_paged_attention_bq4_bk64_x16_fill", "5")
    assert tiling(32) == ("ragged_paged_attention_bq4_bk64_x1", "5")             # two an SM
    assert tiling(32, busy_seqs=13) == ("ragged_paged_attention_bq4_bk64_x1", "5")
    assert tiling(32, busy_seqs=0) == ("ragged_paged_attention_bq4_bk64_x16_fill", "5")
    assert tiling(16, dtype=jnp.float32)[1] == "2"                # not measured
    assert tiling(16, num_splits=4) == ("ragged_paged_attention_bq4_bk64_x4", "2")   # as asked
    assert tiling(16, num_warps=4)[1] == "2"                      # any tuning option: as asked
    assert tiling(128) == ("ragged_paged_attention_bq4_bk64_x1", "3")    # many_wave_decode
    assert tiling(128, busy_seqs=100) == ("ragged_paged_attention_bq4_bk64_x1", "3")
    assert tiling(128, busy_seqs=0) == ("ragged_paged_attention_bq4_bk128_x1", "2")
    assert tiling(96) == ("ragged_paged_attention_bq4_bk128_x1", "2")


def test_fill_splits_over_padded_buckets_chunks_and_padding_tokens():
    # the kernel counts the busy (tile, kv head) items and splits each to fill its programs;
    # unwritten splits and rows stay NaN in interpret mode, so the merge must skip them
    qlens = [1, 0, 5, 1, 0, 1, 0, 0, 0, 0, 0, 1]
    ctxs = [9, 0, 40, 17, 0, 70, 0, 0, 0, 0, 0, 23]
    args = paged_batch(qlens, ctxs, pad_tokens=len(qlens) - sum(qlens), seed=13)
    # 6 busy tiles x 2 kv heads = 12 items, splits by key steps: per sequence 2, 5, 3, 9, 3 of
    # at most 16 (54 of 264 programs), 1, 2, 2, 4, 2 (26 of 30, spread), 1, 3, 2, 3, 2 (28 of
    # 37)
    for splits, programs in ((16, None), (4, 30), (3, 37)):
        check(args, num_splits=splits, block_k=8, num_stages=5, fill_splits=True,
              fill_programs=programs)
    check(args, num_splits=8, block_k=8, fill_splits=True, sliding_window=11, soft_cap=5.0)
    # an idle first slot and a 9-token chunk over three of 5 busy tiles: 10 items, split 1,
    # 3 and 2 ways by sequence in a grid of 30 (24 busy)
    idle_first = paged_batch([0, 1, 9, 0, 1, 0], [0, 12, 50, 0, 33, 0], pad_tokens=0, seed=14)
    check(idle_first, num_splits=4, block_k=8, fill_splits=True)
    check(idle_first, num_splits=4, block_k=8, fill_splits=True, fill_programs=30)
    with pytest.raises(ValueError, match="fill_programs"):
        wrapper.ragged_paged_attention(*args, sm_scale=SCALE, impl="triton", tiling=Tiling(
            num_splits=4, fill_splits=True, fill_programs=23))   # 12 tiles x 2 heads
    many = paged_batch([1] * 2049, [3] * 2049, n=2, kh=1, e=16, pad_tokens=0)
    with pytest.raises(ValueError, match="fill_splits needs at most 2048"):
        jax.eval_shape(lambda *a: wrapper.ragged_paged_attention(
            *a, sm_scale=SCALE, impl="triton", tiling=Tiling(num_splits=2, fill_splits=True)),
            *many)


def test_fill_split_counts_share_spare_programs_by_key_steps():
    counts = lambda steps, items, programs=264, most=32: np.asarray(triton_kernel.fill_split_counts(
        jnp.asarray(steps), jnp.asarray(items), programs, most)).tolist()
    # equal contexts: programs // items each (what a padded bucket of equal decodes gets)
    assert counts([16, 16, 0], [8, 8, 0]) == [16, 16, 1]
    assert counts([128] * 12, [8] * 12) == [2] * 12
    # a 32K-key decode beside a 1K one (64-key steps): the long one takes the spare programs
    assert counts([16, 512], [8, 8]) == [1, 31]
    assert counts([16, 512], [8, 8], most=8) == [1, 8]
    assert counts([3, 40], [8, 8], programs=1000) == [3, 32]   # at most its steps, and most
    # never more programs than the grid's, whatever the mix
    rng = np.random.default_rng(0)
    for _ in range(50):
        steps = rng.integers(0, 600, 20)
        items = rng.integers(0, 3, 20) * 4
        programs = int(items.sum()) + int(rng.integers(0, 300))
        got = np.asarray(counts(steps, items, programs))
        assert (got * items).sum() <= programs
        assert (got >= 1).all() and (got <= np.minimum(32, np.maximum(steps, 1))).all()


def test_fill_splits_follow_each_context_and_match_the_reference():
    # one long context among short ones: its items take most of the programs (here 14 splits
    # each, 28 of the 40 programs, against 1 for each short one), and the result matches the
    # reference
    qlens = [1, 1, 0, 1, 1, 0, 0]
    ctxs = [9, 300, 0, 12, 9, 0, 0]
    args = paged_batch(qlens, ctxs, pad_tokens=3, seed=21)
    steps = triton_kernel._item_steps(jnp.asarray(ctxs), jnp.asarray(qlens), block_k=8,
                            sliding_window=None)
    tiles = jnp.asarray([1, 1, 0, 1, 1, 0, 0]) * 2
    assert np.asarray(triton_kernel.fill_split_counts(steps, tiles, 40, 16)).tolist() == \
        [1, 14, 1, 1, 1, 1, 1]
    for programs in (14, 40, None):   # 14: the fewest the grid allows (padding tiles too)
        check(args, num_splits=16, block_k=8, num_stages=5, fill_splits=True,
              fill_programs=programs)
    check(args, num_splits=16, block_k=8, fill_splits=True, fill_programs=40,
          sliding_window=20)


def test_fill_splits_kernel_writes_the_counts_by_key_steps(monkeypatch):
    # the counts the kernel hands the merge (live: each token's splits, then the tokens) are
    # fill_split_counts' for each token's sequence
    qlens, ctxs = [1, 1, 0, 1, 1, 0, 0], [9, 300, 0, 12, 9, 0, 0]
    args = paged_batch(qlens, ctxs, pad_tokens=3, seed=22)
    seen = []
    merge = triton_kernel.merge_splits

    def spy(o, lse, live=None, **kw):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), live)
        return merge(o, lse, live, **kw)

    monkeypatch.setattr(triton_kernel, "merge_splits", spy)
    wrapper.ragged_paged_attention(*args, sm_scale=0.1234, impl="triton", tiling=Tiling(
        num_splits=16, block_k=8, fill_splits=True, fill_programs=40))
    jax.effects_barrier()
    assert seen[0][:4].tolist() == [1, 14, 1, 1] and seen[0][-1] == 4   # 4 real tokens


def test_fill_splits_over_a_grid_of_two_programs_an_sm():
    # 140 (tile, kv head) items: the default fill grid is 396 programs; a 9-token chunk, empty
    # slots in the middle and at the end, one 700-key context among short ones
    qlens = [1] * 30 + [0] * 5 + [9] + [1] * 25 + [0] * 9
    rng = np.random.default_rng(3)
    ctxs = [int(c) if q else 0 for q, c in zip(qlens, rng.integers(9, 60, len(qlens)))]
    ctxs[40] = 700
    args = paged_batch(qlens, ctxs, n=4, kh=2, e=16, pad_tokens=6, seed=23)
    assert rt.num_tiles(70, 70, rt.default_block_q(70, 70, 2)) * 2 == 140
    check(args, num_splits=16, block_k=8, fill_splits=True)
    check(args, num_splits=16, block_k=8, fill_splits=True, sliding_window=30)


def test_fill_splits_engine_bucket_picked_and_correct():
    # an engine-like 16-slot bucket at Llama-3.1-8B's heads with 3 busy: the wrapper picks
    # fill_splits by itself (busy_seqs=0), and it matches the reference
    qlens = [1, 1, 1] + [0] * 13
    args = paged_batch(qlens, [300, 33, 129] + [0] * 13, n=32, kh=8, e=128, p=16,
                       pad_tokens=13, seed=5, dtype=jnp.bfloat16)
    assert rt.special_decode_tiling(16, 16, 32, 8, 0, context=args[5].shape[1] * 16) == \
        rt.DecodeTiling(4, 64, 5, fill_splits=True)
    check(args, busy_seqs=0, atol=2e-2)
    # any tuning option turns the shape rules off: fill_splits=False gives the plain default
    assert kernel_name(args, busy_seqs=0, fill_splits=False) == \
        "ragged_paged_attention_bq4_bk64_x4"


def test_skewed_steps_take_fill_splits_up_to_four_programs_an_sm():
    T = rt.DecodeTiling

    def tiling(s, kh=8, busy=None, **kw):
        return rt.special_decode_tiling(s, s, 32, kh, busy, context=8192, **kw)
    # whatever the busy count, full buckets too, up to 4 x num_sms() programs
    assert tiling(16, skewed=True) == tiling(16, busy=0) == T(32, 64, 5, fill_splits=True)
    assert tiling(16) == T(1, 128, 5)                           # not skewed: pipelined
    assert tiling(64, skewed=True) == tiling(64, busy=40, skewed=True) == T(32, 64, 5, True)
    assert tiling(64) is None and tiling(64, busy=0) is None    # not skewed: the default
    assert tiling(128, kh=4, skewed=True) == T(32, 64, 5, True)
    assert tiling(128, skewed=True) == tiling(128) == T(1, 64, 3)   # 1,024 programs: not
    assert tiling(64, skewed=True, head_dim=64) is None         # not the measured case
    assert tiling(1, skewed=True) == tiling(1) == T(16, 128, 5)  # one slot: never skewed
    assert tiling(66, skewed=True) == T(32, 64, 5, True)        # 528 programs: the most
    assert tiling(67, skewed=True) is None
    assert rt.default_fill_programs(512) == 792 and rt.default_fill_programs(265) == 660
    # a full 16-slot bucket at Llama-3.1-8B's heads, one long context: correct when skewed
    qlens = [1] * 16
    args = paged_batch(qlens, [300] + [20] * 15, n=32, kh=8, e=128, p=16, pad_tokens=0,
                       seed=6, dtype=jnp.bfloat16)
    assert kernel_name(args, skewed=True).endswith("_fill")
    assert not kernel_name(args).endswith("_fill")
    check(args, skewed=True, atol=2e-2)


def test_unsplit_decode_grids_launch_kv_heads_side_by_side():
    # grid (K, J, X) for unsplit decode grids, (J, K, X) for split ones and prefill buckets
    def grid(s, t=None, **kw):
        mlir = export_triton(bucket_shapes(s, t), **kw).mlir_module()
        return tuple(int(g) for g in re.findall(r"grid_[xyz] = (\d+)", mlir)[:3])
    assert grid(32) == (8, 32, 1)                      # kv heads first
    assert grid(32, heads_inner=False) == (32, 8, 1)
    assert grid(4) == (4, 8, 4)                        # split: 4 tiles x 8 kv heads x 4 splits
    assert grid(16, busy_seqs=0) == (264, 1, 1)        # fill_splits: 2 programs an SM
    assert grid(32, busy_seqs=0) == (396, 1, 1)        # 256 items: 3
    assert grid(64, skewed=True) == (792, 1, 1)        # a skewed step of 512 items: 6
    assert grid(32, t=40) == (34, 8, 1)                # more tokens than slots: 34 tiles


@pytest.mark.parametrize("num_splits", HEADS_INNER_SPLITS)
def test_kv_heads_inner_launch_order_changes_no_output(num_splits):
    args = paged_batch([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], seed=7)
    for heads_inner in (True, False):
        check(args, num_splits=num_splits, block_k=8, heads_inner=heads_inner)


def test_decode_buckets_walk_their_keys_in_one_masked_loop():
    # T <= S: one key loop masking every step (what Triton pipelines without a drain between
    # loops); other batches: window edge, unmasked middle, causal edge, as three loops
    def key_loops(t, s, **kw):
        modules: list[str] = []
        export_triton(bucket_shapes(s, t), triton_ir=modules, **kw)
        return modules[0].count("scf.for")
    assert key_loops(16, 16) == 1                  # pipelined tiling
    assert key_loops(4, 4) == 1                    # split tiling (attention kernel, then merge)
    assert key_loops(24, 16) == 3                  # more tokens than slots
    assert key_loops(16, 16, mask_all_steps=False) == 3
    assert key_loops(16, 16, block_q=8) == 3        # 32-row tiles: not timed one-loop


def test_pipelined_decode_tiling_matches_reference():
    # the pipelined tiling (unsplit, 128-key steps, slots in their step, 5 stages) on 16 decodes of
    # 8 kv heads x 128 dims in bf16 (what picks it), contexts from one key to past a step
    ctxs = [1, 7, 16, 17, 100, 127, 128, 129, 200, 255, 256, 300, 5, 64, 2, 140]
    args = paged_batch([1] * 16, ctxs, n=32, kh=8, e=128, pad_tokens=0, seed=21,
                       dtype=jnp.bfloat16)
    assert rt.pipelined_decode(16, 16, 32, 8, None)
    check(args, atol=2e-2)


def test_two_programs_per_sm_pipelined_tiling_matches_reference():
    # 64-key pipelined steps in the engine's 32-slot bucket (256 programs): decodes, a 6-token
    # prompt chunk, padding slots and padding tokens
    qlens = [1] * 24 + [6] + [0] * 7
    ctxs = [1, 7, 16, 17, 63, 64, 65, 100, 127, 128, 129, 200, 5, 2, 40, 90, 33, 31, 70, 150,
            9, 12, 48, 80, 70] + [0] * 7
    args = paged_batch(qlens, ctxs, n=32, kh=8, e=128, pad_tokens=2, seed=22,
                       dtype=jnp.bfloat16)
    assert args[0].shape[0] == 32 and rt.pipelined_decode(32, 32, 32, 8, None) == 64
    check(args, atol=2e-2)


def test_engine_bucket_shape_decodes_chunk_and_padding_sequences():
    # the engine's small buckets: as many sequence slots as tokens (S = T), the tail slots
    # padding sequences; default tiles (multi-token, exact starts) with and without splits
    qlens = [1, 1, 5, 1, 0, 0, 0, 0, 0, 0, 0]
    ctxs = [9, 30, 12, 17, 0, 0, 0, 0, 0, 0, 0]
    args = paged_batch(qlens, ctxs, pad_tokens=len(qlens) - sum(qlens), seed=11)
    assert args[0].shape[0] == len(qlens)
    check(args)
    check(args, num_splits=2, block_k=8, mask_all_steps=False)


def test_binary_search_path_lowers_for_cuda(binary_search):
    exported = export_for_cuda(lambda *a: wrapper.ragged_paged_attention(
        *a, sm_scale=0.1, impl="triton", interpret=False), *cuda_attention_shapes())
    assert triton_kernel_names(exported)[0].startswith("ragged_paged_attention")


def test_triton_ir_dump_for_reading_off_the_gpu(tmp_path):
    # benchmarks/triton_ir.py writes each kernel's Triton IR (Triton's own pipeline then runs on
    # it in an environment with the triton wheel): the decode kernel's key loop is an scf.for
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "triton_ir.py")
    spec = importlib.util.spec_from_file_location("triton_ir", path)
    triton_ir = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(triton_ir)
    triton_ir.dump(str(tmp_path), 16, 256, ["busy_seqs=0"])
    names = sorted(os.listdir(tmp_path))
    assert names == ["k0.ttir", "k1.ttir"]          # split: attention, then the merge
    text = (tmp_path / "k0.ttir").read_text()
    assert "tt.func" in text and "scf.for" in text and "tt.dot" in text
