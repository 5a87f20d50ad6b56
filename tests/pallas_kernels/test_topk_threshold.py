"""Top-k threshold (radix select): Pallas kernel (interpret mode) against a full sort."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels import topk_threshold as tk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def test_matches_sort_with_ties_negatives_and_per_row_k():
    rng = np.random.default_rng(0)
    v = 3000                                            # not a multiple of the block
    x = rng.standard_normal((6, v)).astype(np.float32) * 4
    x[1, :100] = 2.5                                     # many ties at the threshold
    x[2] = -np.abs(x[2]) - 1                             # all negative
    x[3, ::7] = -np.inf                                  # banned tokens
    k = np.array([1, 50, 2047, 300, 0, v], np.int32)     # 0 and V: keep everything (-inf)
    x, k = jnp.asarray(x), jnp.asarray(k)
    want = tk.ref_topk_threshold(x, k)
    got = tk.topk_threshold(x, k, impl="pallas", block_v=512)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(tk.topk_threshold(x, k, impl="xla")), np.asarray(want))
    assert np.isneginf(np.asarray(got)[4:]).all()


def test_bf16_rows():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 700)), jnp.bfloat16)
    k = jnp.asarray([5, 64, 699], jnp.int32)
    np.testing.assert_array_equal(np.asarray(tk.topk_threshold(x, k, impl="pallas", block_v=256)),
                                  np.asarray(tk.ref_topk_threshold(x, k)))


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(lambda x, k: tk.topk_threshold(x, k, impl="pallas",
                                                              interpret=False),
                               sds((8, 128256), jnp.float32), sds((8,), jnp.int32))
    assert triton_kernel_names(exported) == ["topk_threshold"]
