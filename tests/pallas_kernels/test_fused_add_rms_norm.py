"""Fused residual add + RMSNorm: Pallas kernel (interpret mode) against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pallas_kernels import fused_add_rms_norm as farn
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def rand(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("t,d,br", [(5, 576, None), (3, 64, 2), (17, 100, 4)])
def test_matches_reference_ragged_rows_and_odd_dims(t, d, br):
    rng = np.random.default_rng(t)
    x, res, w = rand(rng, (t, d)), rand(rng, (t, d)), rand(rng, (d,))
    new_res, normed = farn.fused_add_rms_norm(x, res, w, eps=1e-5, impl="pallas",
                                              rows_per_program=br)
    want_res, want_normed = farn.ref_fused_add_rms_norm(x, res, w, eps=1e-5)
    # interpret mode starts outputs as NaN: finite everywhere means every element was written
    assert np.isfinite(np.asarray(new_res)).all() and np.isfinite(np.asarray(normed)).all()
    np.testing.assert_allclose(new_res, want_res, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(normed, want_normed, rtol=1e-5, atol=1e-5)
    # and it is the model's own rms_norm of the model's residual add
    np.testing.assert_allclose(normed, layers.rms_norm(x + res, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_without_residual_is_plain_rms_norm():
    rng = np.random.default_rng(1)
    x, w = rand(rng, (6, 96), jnp.bfloat16), rand(rng, (96,), jnp.bfloat16)
    got = farn.fused_add_rms_norm(x, None, w, eps=1e-6, impl="pallas")
    want = layers.rms_norm(x, w, 1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_xla_impl_and_validation():
    rng = np.random.default_rng(2)
    x, res, w = rand(rng, (4, 32)), rand(rng, (4, 32)), rand(rng, (32,))
    a = farn.fused_add_rms_norm(x, res, w, eps=1e-5, impl="xla")
    b = farn.ref_fused_add_rms_norm(x, res, w, eps=1e-5)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="w_D"):
        farn.fused_add_rms_norm(x, res, w[:5], eps=1e-5)
    with pytest.raises(ValueError, match="impl"):
        farn.fused_add_rms_norm(x, res, w, eps=1e-5, impl="triton")


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    args = (sds((128, 4096), jnp.bfloat16), sds((128, 4096), jnp.bfloat16),
            sds((4096,), jnp.bfloat16))
    exported = export_for_cuda(lambda x, r, w: farn.fused_add_rms_norm(
        x, r, w, eps=1e-5, impl="pallas", interpret=False), *args)
    assert triton_kernel_names(exported) == ["fused_add_rms_norm_br1"]
