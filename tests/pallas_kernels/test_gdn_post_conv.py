"""The fused post-conv kernel (pallas_kernels/gdn_post_conv.py), interpreted on the CPU,
against its jnp reference (models/gated_deltanet.py post_conv), on token counts that do and do
not fill the last block, in f32 and bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.gdn_post_conv import gdn_post_conv, ref_gdn_post_conv

G, H, K, V = 2, 4, 16, 8


def _inputs(t, dtype, seed=0):
    rng = np.random.default_rng(seed)
    c = 2 * G * K + H * V
    arr = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), dtype)  # noqa: E731
    # a spans softplus's both regimes (large negative and large positive arguments too)
    return arr(t, c), arr(t, H, scale=8.0), arr(t, H, scale=3.0), arr(H, scale=0.5), arr(H)


@pytest.mark.parametrize("t", [1, 5, 16, 37])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_post_conv_kernel_matches_reference(t, dtype):
    ins = _inputs(t, dtype, seed=t)
    kw = dict(num_k_heads=G, k_dim=K, v_dim=V)
    want = ref_gdn_post_conv(*ins, **kw)
    got = gdn_post_conv(*ins, **kw, impl="pallas", interpret=True, block_t=8)
    for name, w, g in zip("q k v g beta".split(), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-6, rtol=1e-6,
                                   err_msg=name)


def test_post_conv_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    t, g, h, k, v = 64, 16, 64, 128, 128            # Qwen3.5-397B's linear-attention heads
    args = (sds((t, 2 * g * k + h * v), jnp.bfloat16), sds((t, h), jnp.bfloat16), sds((t, h), jnp.bfloat16),
            sds((h,), jnp.float32), sds((h,), jnp.float32))
    exported = export_for_cuda(lambda *a: gdn_post_conv(*a, num_k_heads=g, k_dim=k, v_dim=v, impl="pallas",
                                                        interpret=False), *args)
    assert triton_kernel_names(exported) == ["gdn_post_conv_bt16"]
