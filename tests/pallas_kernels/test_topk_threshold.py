"""Top-k and top-p thresholds (radix select): Pallas kernels (interpret mode) against a full
sort."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import topk_threshold as tk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def hard_rows(v=3000, seed=0):
    """Rows with ties at the threshold, all-negative values and banned (-inf) tokens; V not a
    multiple of the block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, v)).astype(np.float32) * 4
    x[1, :100] = 2.5                                     # many ties at the threshold
    x[2] = -np.abs(x[2]) - 1                             # all negative
    x[3, ::7] = -np.inf                                  # banned tokens
    return jnp.asarray(x)


# programs: one chunk per row walking every block, or a row spread over several programs
@pytest.mark.parametrize("programs", [1, 64])
def test_topk_matches_sort_with_ties_negatives_and_per_row_k(programs):
    x = hard_rows()
    v = x.shape[1]
    k = jnp.asarray([1, 50, 2047, 300, 0, v], jnp.int32)   # 0 and V: keep everything (-inf)
    want = tk.ref_topk_threshold(x, k)
    got = tk.topk_threshold(x, k, impl="pallas", block_v=512, programs=programs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(tk.topk_threshold(x, k, impl="xla")), np.asarray(want))
    assert np.isneginf(np.asarray(got)[4:]).all()


@pytest.mark.parametrize("programs", [1, 64])
def test_topp_matches_sort_over_the_whole_row_and_over_the_top_k(programs):
    x = hard_rows(seed=1)
    p = jnp.asarray([0.5, 0.9, 0.99, 0.3, 1.0, 0.05], jnp.float32)
    kth = tk.ref_topk_threshold(x, jnp.asarray([3000, 150, 40, 300, 7, 2], jnp.int32))
    for floor in (jnp.full((6,), -jnp.inf), kth):
        want = tk.ref_topp_threshold(x, p, floor)
        got = tk.topp_threshold(x, p, floor, impl="pallas", block_v=512, programs=programs)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.isneginf(np.asarray(got)[4])               # p = 1 keeps everything
    # the cut moves with p: a smaller nucleus never has a lower cut
    cuts = [float(tk.topp_threshold(x[:1], jnp.asarray([q]), jnp.asarray([-jnp.inf]),
                                    impl="pallas", block_v=512)[0]) for q in (0.2, 0.5, 0.8)]
    assert cuts[0] >= cuts[1] >= cuts[2] > -np.inf


def test_topp_just_below_one_keeps_what_the_sort_keeps():
    # the kernel's mass sums (in another order than the target's) can all fall short of
    # p * mass when p is the float just below 1: the cut must then keep everything, not NaN
    rng = np.random.default_rng(0)            # a row where they do (seeds 0 and 11 of 12)
    x = jnp.asarray((rng.standard_normal((1, 5000)) * 0.3).astype(np.float32))
    p = jnp.asarray([np.nextafter(np.float32(1), np.float32(0))])
    for floor in (jnp.asarray([-jnp.inf]), jnp.asarray([0.2])):
        got = tk.topp_threshold(x, p, floor, impl="pallas")
        want = tk.ref_topp_threshold(x, p, floor)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_array_equal(np.asarray(x >= got[:, None]), np.asarray(x >= want[:, None]))


def test_topp_of_a_peaked_row_keeps_the_peak_only():
    x = jnp.asarray(np.r_[[30.0], np.zeros(999)].astype(np.float32))[None]
    got = tk.topp_threshold(x, jnp.asarray([0.9]), jnp.asarray([-jnp.inf]), impl="pallas",
                            block_v=256)
    assert float(got[0]) == 30.0


def test_bf16_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 700)), jnp.bfloat16)
    k = jnp.asarray([5, 64, 699], jnp.int32)
    np.testing.assert_array_equal(np.asarray(tk.topk_threshold(x, k, impl="pallas", block_v=256)),
                                  np.asarray(tk.ref_topk_threshold(x, k)))
    p = jnp.asarray([0.3, 0.9, 0.6], jnp.float32)
    floor = jnp.full((3,), -jnp.inf)
    np.testing.assert_array_equal(
        np.asarray(tk.topp_threshold(x, p, floor, impl="pallas", block_v=256)),
        np.asarray(tk.ref_topp_threshold(x, p, floor)))


def test_auto_is_the_sort_off_gpu_and_shapes_are_checked():
    x = hard_rows()
    k = jnp.asarray([1, 2, 3, 4, 5, 6], jnp.int32)
    np.testing.assert_array_equal(np.asarray(tk.topk_threshold(x, k)),
                                  np.asarray(tk.ref_topk_threshold(x, k)))
    with pytest.raises(ValueError, match="p_S"):
        tk.topp_threshold(x, jnp.ones((5,)), jnp.zeros((6,)))


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(lambda x, k, p: tk.topp_threshold(
        x, p, tk.topk_threshold(x, k, impl="pallas", interpret=False), impl="pallas",
        interpret=False), sds((8, 128256), jnp.float32), sds((8,), jnp.int32),
        sds((8,), jnp.float32))
    assert triton_kernel_names(exported) == (["topk_threshold_pass"] * tk.PASSES
                                             + ["topp_threshold_pass"] * tk.PASSES)
