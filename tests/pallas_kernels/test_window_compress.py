"""V4's compressor kernel (interpret mode) against its jnp reference: CSA's overlapping windows
(a first window whose previous rows weigh nothing, scattered rows) and HCA's plain ones, odd
widths, invalid entries, bf16, bad arguments, and the CUDA lowering at V4-Flash's CSA shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import window_compress as wc
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def operands(rng, *, k=6, m=4, e=32, r=8, overlap=True, rows=64, dtype=jnp.float32):
    c = 2 * e if overlap else e
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    slots = jnp.asarray(rng.integers(0, rows, (k, 2 * m if overlap else m)), jnp.int32)
    first = jnp.asarray(rng.integers(0, 20, k) * m, jnp.int32).at[0].set(0)     # entry 0: a first window
    valid = jnp.asarray(rng.random(k) < 0.8).at[0].set(True)
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, r, 2) / r), jnp.float32)
    return f(rows, c), f(rows, c), slots, first, valid, 1.0 + 0.2 * f(e), inv_freq


@pytest.mark.parametrize("overlap,m,e,r", [(True, 4, 32, 8), (False, 8, 24, 8), (True, 4, 40, 16)])
def test_matches_the_reference(overlap, m, e, r):
    args = operands(np.random.default_rng(m + e), m=m, e=e, r=r, overlap=overlap)
    got = wc.window_compress(*args, overlap=overlap, eps=1e-6, impl="pallas")
    want = wc.ref_window_compress(*args, overlap=overlap, eps=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bf16():
    args = operands(np.random.default_rng(2), dtype=jnp.bfloat16)
    got = wc.window_compress(*args, overlap=True, eps=1e-6, impl="pallas")
    want = wc.ref_window_compress(*args, overlap=True, eps=1e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_the_field():
    kv, g, slots, first, valid, norm, freq = operands(np.random.default_rng(1))
    with pytest.raises(ValueError, match="kv_LC"):
        wc.window_compress(kv[:, :8], g, slots, first, valid, norm, freq, overlap=True, eps=1e-6)
    with pytest.raises(ValueError, match="first_K"):
        wc.window_compress(kv, g, slots, first[:2], valid, norm, freq, overlap=True, eps=1e-6)


def test_lowers_for_cuda_at_v4_flash_csa_shapes():
    sds, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    exported = export_for_cuda(
        lambda *a: wc.window_compress(*a, overlap=True, eps=1e-6, impl="pallas", interpret=False),
        sds((64 * 300, 1024), bf), sds((64 * 300, 1024), bf), sds((16, 8), i32), sds((16,), i32),
        sds((16,), jnp.bool_), sds((512,), bf), sds((32,), jnp.float32))
    assert triton_kernel_names(exported) == ["window_compress"]
