"""Fused QK-norm + RoPE + paged KV write: Pallas kernel (interpret mode) against the model's
own XLA blocks (models/layers.py), with and without Qwen3's q/k norms and llama3 scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def make(rng, *, t=7, n=6, kh=2, e=32, nb=6, p=4, dtype=jnp.float32):
    r = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    slots = rng.permutation(np.arange(p, nb * p))[:t].astype(np.int32)
    slots[-2:] = 0                                   # two padding tokens -> null block slot 0
    pos = rng.integers(0, 500, t).astype(np.int32)
    # poisoned caches: every slot not written this step must come back bit-identical
    k_cache = jnp.full((nb, p, kh, e), jnp.nan, dtype).at[1].set(r(p, kh, e))
    v_cache = jnp.full((nb, p, kh, e), -7.0, dtype)
    return (r(t, n, e), r(t, kh, e), r(t, kh, e), jnp.asarray(pos), jnp.asarray(slots),
            k_cache, v_cache)


@pytest.mark.parametrize("qk_norm,scaling,n,kh", [(False, None, 6, 2), (True, LLAMA3, 9, 3)])
def test_matches_model_blocks(qk_norm, scaling, n, kh):
    rng = np.random.default_rng(n)
    q, k, v, pos, slots, kc, vc = make(rng, n=n, kh=kh)
    inv = layers.rope_inv_freq(32, 10000.0, scaling)
    norms = (jnp.asarray(rng.standard_normal(32), jnp.float32),
             jnp.asarray(rng.standard_normal(32), jnp.float32)) if qk_norm else (None, None)
    got = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, eps=1e-6,
                                    impl="pallas")
    want = qrk.ref_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, eps=1e-6)
    real = np.asarray(slots) != 0
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        g = np.asarray(g).reshape(-1, kh, 32)
        w = np.asarray(w).reshape(-1, kh, 32)
        written = np.asarray(slots)[real]
        np.testing.assert_allclose(g[written], w[written], rtol=1e-5, atol=1e-5)
        untouched = np.setdiff1d(np.arange(4, g.shape[0]), written)   # blocks 1.. not written
        np.testing.assert_array_equal(g[untouched], w[untouched])     # NaN == NaN here


def test_bf16_and_xla_impl():
    rng = np.random.default_rng(3)
    args = make(rng, dtype=jnp.bfloat16)
    inv = layers.rope_inv_freq(32, 500000.0, None)
    got = qrk.qk_norm_rope_kv_write(*args, inv, impl="pallas")
    want = qrk.qk_norm_rope_kv_write(*args, inv, impl="xla")
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="inv_freq"):
        qrk.qk_norm_rope_kv_write(*args, inv[:3], impl="pallas")


def test_lowers_for_cuda_with_aliased_caches():
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((64, 32, 128), bf), sds((64, 8, 128), bf), sds((64, 8, 128), bf),
            sds((64,), jnp.int32), sds((64,), jnp.int32), sds((512, 16, 8, 128), bf),
            sds((512, 16, 8, 128), bf), sds((64,), jnp.float32), sds((128,), bf), sds((128,), bf))
    exported = export_for_cuda(lambda *a: qrk.qk_norm_rope_kv_write(
        *a, impl="pallas", interpret=False), *args)
    assert triton_kernel_names(exported) == ["qk_norm_rope_kv_write"]
