"""Grouped matmul for MoE on CPU: the XLA path and our expert-skipping Pallas kernel
(interpret mode) against the dense reference (the Mosaic GPU kernel "auto" picks on Hopper for
many rows is JAX's own and is checked on the GPU by benchmarks/kernels.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import grouped_matmul as gm
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def operands(sizes, m=None, k=64, n=64, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    m = int(sizes.sum()) if m is None else m
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(sizes)


def check_pallas(x, w, sizes, tol=1e-5, **tuning):
    got = gm.grouped_matmul(x, w, sizes, impl="pallas", **tuning)
    want = gm.ref_grouped_matmul(x, w, sizes)
    assert got.dtype == x.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    return np.asarray(got, np.float32)


def test_xla_and_auto_match_reference_with_empty_groups():
    x, w, sizes = operands([3, 0, 5, 1, 0, 7], k=16, n=8)   # empty experts included
    want = gm.ref_grouped_matmul(x, w, sizes)
    for impl in ("xla", "auto"):
        got = gm.grouped_matmul(x, w, sizes, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_pallas_one_token_top8_of_128_experts():
    sizes = np.zeros(128, np.int32)
    sizes[np.random.default_rng(1).choice(128, 8, replace=False)] = 1
    check_pallas(*operands(sizes))


def test_pallas_groups_spanning_several_row_tiles_and_all_rows_in_one_group():
    # groups of 20 and 37 rows take 2 and 3 tiles of BM = 16; several K and N steps
    check_pallas(*operands([3, 0, 20, 1, 0, 37, 0, 2], k=64, n=64), block_k=16, block_n=32)
    check_pallas(*operands([0, 0, 40, 0], k=32, n=48))      # N=48: block_n falls back to 16


def test_pallas_rows_past_the_groups_are_zero():
    x, w, sizes = operands([3, 0, 20, 1, 0, 7, 0, 2], m=50)    # 33 rows in groups, 17 beyond
    got = check_pallas(x, w, sizes)
    assert (got[33:] == 0).all()
    got = check_pallas(x, w, jnp.zeros_like(sizes))             # no rows in any group
    assert (got == 0).all()


def test_pallas_bf16():
    check_pallas(*operands([2, 0, 0, 17, 1, 0, 5, 0], dtype=jnp.bfloat16), tol=2e-2)


def test_pallas_reads_no_weights_of_empty_groups():
    # the point of the kernel: empty experts' weights are never read, so NaN there is harmless
    sizes = np.zeros(32, np.int32)
    sizes[[3, 4, 17, 30]] = [1, 18, 2, 3]
    x, w, sizes = operands(sizes, m=28)                         # 4 rows past the groups
    empty = np.asarray(sizes) == 0
    w = jnp.where(jnp.asarray(empty)[:, None, None], jnp.nan, w)
    got = check_pallas(x, w, sizes)
    assert np.isfinite(got).all()


def test_pallas_validation():
    x, w, sizes = operands([4, 4], k=64, n=64)
    with pytest.raises(ValueError, match="block_k"):
        gm.grouped_matmul(x, w, sizes, impl="pallas", block_k=48)
    with pytest.raises(ValueError, match="block_n"):
        gm.grouped_matmul(x, w, sizes, impl="pallas", block_n=128)
    with pytest.raises(ValueError, match="multiples of 16"):
        gm.grouped_matmul(x[:, :40], w[:, :40], sizes, impl="pallas")
    with pytest.raises(ValueError, match="dtype"):
        gm.grouped_matmul(x.astype(jnp.bfloat16), w, sizes, impl="pallas")


def test_tile_list_bound_is_tight():
    # worst case for M rows: as many one-row groups as there are groups (up to M - 1), the
    # rest past the groups; every slot is then used and every row covered by exactly one tile
    for m, g in ((8, 128), (63, 8), (64, 128), (100, 3), (1, 4)):
        sizes = np.zeros(g, np.int32)
        sizes[:min(m - 1, g)] = 1
        grp, first, end = (np.asarray(a) for a in gm._tile_list(jnp.asarray(sizes), m))
        assert len(grp) == gm._num_slots(m, g) == (end > first).sum()
        covered = np.zeros(m, int)
        for f, e in zip(first, end):
            covered[f:e] += 1
        assert (covered == 1).all()


def test_auto_keeps_the_sparse_kernel_while_experts_can_be_empty():
    # 512 rows at 128 experts (measured); 4 rows an expert beyond: Qwen3.5's batch 64 x top-10
    # over 512 experts (640 rows) stays sparse, as do DeepSeek's 64 x 8 over 256
    assert gm.sparse_max_rows(128) == 512 and gm.sparse_max_rows(8) == 512
    assert gm.sparse_max_rows(512) == 2048 >= 64 * 10
    assert gm.sparse_max_rows(256) >= 64 * 8


def test_validation():
    x = jnp.zeros((4, 16))
    with pytest.raises(ValueError, match="same K"):
        gm.grouped_matmul(x, jnp.zeros((2, 8, 4)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="group_sizes_G"):
        gm.grouped_matmul(x, jnp.zeros((2, 16, 4)), jnp.array([4]))
    with pytest.raises(ValueError, match="impl"):
        gm.grouped_matmul(x, jnp.zeros((2, 16, 4)), jnp.array([2, 2]), impl="triton")


@pytest.mark.parametrize("k,n", [(2048, 768), (768, 2048)])   # Qwen3-30B-A3B gate/up, down
def test_pallas_lowers_for_cuda(k, n):
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(
        lambda x, w, s: gm.grouped_matmul(x, w, s, impl="pallas", interpret=False),
        sds((8, k), jnp.bfloat16), sds((128, k, n), jnp.bfloat16), sds((128,), jnp.int32))
    assert triton_kernel_names(exported) == ["grouped_matmul_sparse_bk128_bn128"]


def test_pallas_takes_weights_up_to_its_int32_reach(monkeypatch):
    """The kernel's last weight offset is G*K*N - 1: a weight of exactly the limit is taken,
    one element a row more is refused (then "auto" falls back to lax.ragged_dot)."""
    monkeypatch.setattr(gm, "MAX_WEIGHT_ELEMENTS", 4 * 16 * 32)
    x = jnp.ones((8, 16), jnp.float32)
    assert gm._sparse_problem(x, jnp.ones((4, 16, 32), jnp.float32)) is None
    assert "int32 offsets" in gm._sparse_problem(x, jnp.ones((4, 16, 48), jnp.float32))


def test_fuse_projections_keeps_experts_past_the_kernels_reach_apart(monkeypatch):
    """Fused gate|up experts over the kernel's reach would send every decode step through
    lax.ragged_dot, reading all experts: those stay two arrays; dense MLPs still fuse."""
    from jaxserve.models import llama

    monkeypatch.setattr(llama, "MAX_WEIGHT_ELEMENTS", 2 * 4 * 8 * 16 - 1)
    experts = {"w_gate": jnp.ones((4, 8, 16)), "w_up": jnp.ones((4, 8, 16))}
    small = {"w_gate": jnp.ones((2, 8, 16)), "w_up": jnp.ones((2, 8, 16))}
    dense = {"w_gate": jnp.ones((8, 16)), "w_up": jnp.ones((8, 16))}
    fused = llama.fuse_projections(None, {"layers": [experts, small, dense]})["layers"]
    assert set(fused[0]) == {"w_gate", "w_up"}
    assert fused[1]["w_gate_up"].shape == (2, 8, 32) and fused[2]["w_gate_up"].shape == (8, 32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_expert_chunks_give_the_whole_weights_result(impl):
    """Weights past the kernel's reach run as chunks of experts (split_experts): the same
    result as the whole array, empty groups, rows past the groups and one-chunk rows too."""
    x, w, sizes = operands([3, 0, 5, 1, 0, 0, 7, 2], m=20, k=32, n=48)
    chunks = gm.split_experts(w, limit=w.size // 4)
    assert len(chunks) == 4 and all(c.shape == (2, 32, 48) for c in chunks)
    want = gm.ref_grouped_matmul(x, w, sizes)
    got = gm.grouped_matmul(x, chunks, sizes, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    one = jnp.asarray([0, 0, 0, 0, 0, 0, 9, 2], jnp.int32)      # every row in the last chunk
    np.testing.assert_allclose(np.asarray(gm.grouped_matmul(x, chunks, one, impl=impl)),
                               np.asarray(gm.ref_grouped_matmul(x, w, one)), rtol=1e-5, atol=1e-5)
    assert gm.split_experts(w, limit=w.size) is w
    with pytest.raises(ValueError, match="one expert"):
        gm.split_experts(w, limit=w.size // 16)


# -- block-scaled FP8 weights (DeepSeek's checkpoints kept in FP8) ------------------------------


def fp8_operands(sizes, m=None, k=256, n=256, dtype=jnp.float32, seed=0, block=128):
    """(x, BlockScaledFp8 weights, sizes): scales differ per block, so a scale applied to the
    wrong tile shows."""
    x, w, sizes = operands(sizes, m, k, n, dtype, seed)
    rng = np.random.default_rng(seed + 1)
    w8 = (w.astype(jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (w.shape[0], -(-k // block), -(-n // block))) / 64, jnp.float32)
    return x, gm.BlockScaledFp8(w8, scales, block), sizes


def check_fp8(x, w, sizes, tol=1e-5, impls=("pallas", "xla"), **tuning):
    want = np.asarray(gm.ref_grouped_matmul(x, w, sizes), np.float32)
    for impl in impls:
        got = gm.grouped_matmul(x, w, sizes, impl=impl, **(tuning if impl == "pallas" else {}))
        assert got.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    return want


def test_fp8_dequantize_is_the_loaders():
    from jaxserve.models.loaders.deepseek import dequantize_blocks

    _, w, _ = fp8_operands([1, 1], k=200, n=136)      # partial last blocks
    ours = np.asarray(gm.dequantize(w))
    # the loader's is per [out, in] matrix with scale_inv [out blocks, in blocks]
    for g in range(2):
        theirs = dequantize_blocks(np.asarray(w.values[g]).T, np.asarray(w.scales[g]).T, (128, 128)).T
        np.testing.assert_array_equal(ours[g], theirs)


def test_fp8_one_token_top8_of_128_experts_and_row_tiles():
    sizes = np.zeros(128, np.int32)
    sizes[np.random.default_rng(1).choice(128, 8, replace=False)] = 1
    check_fp8(*fp8_operands(sizes, k=256, n=128))
    # several row tiles, rows past the groups, K and N over several scale blocks and tiles
    want = check_fp8(*fp8_operands([3, 0, 20, 1, 0, 37], m=70, k=384, n=256), block_k=64, block_n=32)
    assert (want[61:] == 0).all()
    check_fp8(*fp8_operands([3, 0, 5, 9], k=64, n=48, block=16))    # small blocks: 16 x 16 tiles


def test_fp8_with_bf16_activations():
    check_fp8(*fp8_operands([2, 0, 17, 5], dtype=jnp.bfloat16), tol=3e-2)


def test_fp8_expert_chunks():
    x, w, sizes = fp8_operands([3, 0, 5, 1, 0, 0, 7, 2], m=20, k=128, n=128)
    want = gm.ref_grouped_matmul(x, w, sizes)
    chunks = gm.split_experts(w, limit=w.size // 4)
    assert len(chunks) == 4 and all(isinstance(c, gm.BlockScaledFp8) for c in chunks)
    for impl in ("pallas", "xla"):
        got = gm.grouped_matmul(x, chunks, sizes, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fp8_validation():
    x, w, sizes = fp8_operands([4, 4], k=256, n=256)
    with pytest.raises(ValueError, match="needs its block scales"):
        gm.grouped_matmul(x, w.values, sizes)
    with pytest.raises(ValueError, match=r"f32\[2, 2, 2\] scales"):
        gm.grouped_matmul(x, gm.BlockScaledFp8(w.values, w.scales[:, :1]), sizes)
    with pytest.raises(ValueError, match="must divide the scale block"):
        gm.grouped_matmul(x, w, sizes, impl="pallas", block_k=256)
    with pytest.raises(ValueError, match="no FP8"):
        gm.grouped_matmul(x, w, sizes, impl="mosaic")


def test_fp8_pallas_lowers_for_cuda():
    """DeepSeek-V3's expert shapes (gate 7168 x 2048, down 2048 x 7168) at one token."""
    sds = jax.ShapeDtypeStruct
    for k, n in ((7168, 2048), (2048, 7168)):
        exported = export_for_cuda(
            lambda x, w, sc, s: gm.grouped_matmul(x, gm.BlockScaledFp8(w, sc), s, impl="pallas",
                                                  interpret=False),
            sds((8, k), jnp.bfloat16), sds((16, k, n), jnp.float8_e4m3fn),
            sds((16, k // 128, n // 128), jnp.float32), sds((16,), jnp.int32))
        assert triton_kernel_names(exported) == ["grouped_matmul_sparse_fp8_bk128_bn128"]
