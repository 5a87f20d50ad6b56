"""Grouped matmul for MoE: the XLA path against the dense reference on CPU (the Mosaic GPU
kernel it picks on Hopper is JAX's own and is checked on the GPU by benchmarks/kernels.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import grouped_matmul as gm


def test_xla_and_auto_match_reference_with_empty_groups():
    rng = np.random.default_rng(0)
    sizes = np.array([3, 0, 5, 1, 0, 7], np.int32)        # empty experts included
    x = jnp.asarray(rng.standard_normal((sizes.sum(), 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 16, 8)), jnp.float32)
    want = gm.ref_grouped_matmul(x, w, jnp.asarray(sizes))
    for impl in ("xla", "auto"):
        got = gm.grouped_matmul(x, w, jnp.asarray(sizes), impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_validation():
    x = jnp.zeros((4, 16))
    with pytest.raises(ValueError, match="same K"):
        gm.grouped_matmul(x, jnp.zeros((2, 8, 4)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="group_sizes_G"):
        gm.grouped_matmul(x, jnp.zeros((2, 16, 4)), jnp.array([4]))
    with pytest.raises(ValueError, match="impl"):
        gm.grouped_matmul(x, jnp.zeros((2, 16, 4)), jnp.array([2, 2]), impl="triton")
