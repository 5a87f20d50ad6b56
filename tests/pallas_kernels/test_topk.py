"""TopK with indices (radix select + compaction): the Pallas kernels in interpret mode against
lax.top_k, on ties, -inf entries, rows shorter than k, k up to 2048; and lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import topk as tk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.topk_threshold import PASSES


def hard_rows(l=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, l)).astype(np.float32) * 3
    x[1] = rng.integers(0, 4, l)                  # few distinct values: k cuts through ties
    x[2, 5:] = -np.inf                            # 5 finite entries: shorter than k
    x[3] = -np.inf                                # nothing to choose
    x[4, ::3] = -np.inf                           # masked positions among finite ones
    x[5] = -np.abs(x[5]) - 1                      # all negative
    return jnp.asarray(x)


def _check(x, k, got, sorted_out):
    want_v, want_i = tk.ref_topk(x, k)
    got_v, got_i = (np.asarray(a) for a in got)
    if not sorted_out:                            # same set: compare in the reference order
        got_v, got_i = (np.asarray(a) for a in tk._sort_desc(*got))
    np.testing.assert_array_equal(got_v, np.asarray(want_v))
    np.testing.assert_array_equal(got_i, np.asarray(want_i))
    # each chosen index points at its value
    ok = got_i >= 0
    np.testing.assert_array_equal(np.asarray(x)[np.nonzero(ok)[0], got_i[ok]], got_v[ok])


# programs: one chunk per row, or each row spread over several programs (several chunks)
@pytest.mark.parametrize("programs, k", [(1, 37), (24, 1), (24, 256)])
def test_matches_lax_top_k(programs, k):
    x = hard_rows()
    got = tk.topk(x, k, impl="pallas", block_l=64, programs=programs)
    _check(x, k, got, sorted_out=False)
    assert np.asarray(got[1])[3].tolist() == [-1] * k            # a row of -inf: nothing
    assert (np.asarray(got[1])[2] >= 0).sum() == min(5, k)       # 5 finite entries


def test_sorted_output_is_lax_top_k_order():
    x = hard_rows(seed=1)
    _check(x, 50, tk.topk(x, 50, impl="pallas", sorted=True, block_l=128, programs=12), True)


def test_ties_go_to_the_lowest_indices():
    x = jnp.asarray([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.0, 3.0]])
    vals, idx = tk.topk(x, 3, impl="pallas", sorted=True, block_l=16, programs=1)
    assert np.asarray(idx).tolist() == [[1, 2, 4]] and np.asarray(vals).tolist() == [[3.0] * 3]


def test_k_longer_than_the_row_pads():
    x = hard_rows(l=40)
    vals, idx = tk.topk(x, 64, impl="pallas", block_l=16, programs=8)
    assert vals.shape == (6, 64) and idx.shape == (6, 64)
    _check(x, 64, (vals, idx), sorted_out=False)
    assert (np.asarray(idx)[:, 40:] == -1).all()


def test_k_2048_over_a_long_row():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6000)).astype(np.float32)
    x[1, 3000:] = -np.inf                                        # a context of 3,000 keys
    x[0, 100:2200] = 0.5                                         # ties around the 2048th
    x = jnp.asarray(x)
    _check(x, 2048, tk.topk(x, 2048, impl="pallas", block_l=1024, programs=6), False)


def test_xla_impl_is_the_reference():
    x = hard_rows()
    _check(x, 9, tk.topk(x, 9, impl="xla"), True)
    with pytest.raises(ValueError, match="k must be"):
        tk.topk(x, 0)


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(lambda x: tk.topk(x, 2048, impl="pallas", interpret=False),
                               sds((4, 32768), jnp.float32))
    assert sorted(triton_kernel_names(exported)) == ["topk_count"] + ["topk_threshold_pass"] * PASSES + ["topk_write"]
