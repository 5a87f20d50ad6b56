"""The fused linear layer (pallas_kernels/fused_linear.py) compiled for the GPU against its
reference at the default model's shapes (SmolLM2-135M: D 576, F 1536, q|k|v 960, vocabulary
49152 tied), a wide one and Qwen3-30B-A3B's attention and router (the fused stack's MoE layers),
on decode, small-batch and prefill row counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import fused_linear as fl

pytestmark = pytest.mark.gpu

SHAPES = {   # name: (K, N, operands)
    "qkv": (576, 960, dict(norm=True)),
    "o": (576, 576, dict(residual=True)),
    "gate_up": (576, 3072, dict(norm=True, gated=True)),
    "down": (1536, 576, dict(residual=True)),
    "wide_gate_up": (4096, 28672, dict(norm=True, gated=True)),
    "moe_qkv": (2048, 5120, dict(norm=True)),            # Qwen3-30B-A3B: one-row up to 16M
    "moe_o": (4096, 2048, dict(residual=True)),
}


def operands(rng, t, k, n, dtype, norm=False, residual=False, gated=False):
    r = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.5, dtype)  # noqa: E731
    kw = dict(gated=gated)
    if norm:
        kw["norm_K"] = r(k) + 1
    if residual:
        kw["residual_TN"] = r(t, n)
    return r(t, k) , jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype), kw


CASES = ([("NK", name, t, dtype) for name in SHAPES for t in (1, 16, 64, 512)    # the engine's
          for dtype in (jnp.float32, jnp.bfloat16)]                              # layers' layout
         + [("KN", name, t, jnp.bfloat16) for name in ("qkv", "down") for t in (1, 64)])


@pytest.mark.parametrize("w_layout,name,t,dtype", CASES)
def test_fused_linear_on_the_gpu(name, t, dtype, w_layout):
    k, n, variant = SHAPES[name]
    x, w, kw = operands(np.random.default_rng(t), t, k, n, dtype, **variant)
    got = np.asarray(fl.fused_linear(x, w.T if w_layout == "NK" else w, w_layout=w_layout,
                                     impl="pallas", **kw), np.float32)
    with jax.default_matmul_precision("highest"):     # not TF32: the kernel's f32 is exact
        want = np.asarray(fl.ref_fused_linear(x, w, **kw), np.float32)
    # bf16: sums in another order, then the gate's three roundings; at K = 4096 one output
    # of 7.3M was 0.035 off (H100), so the bound grows with sqrt(K)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2 * max(1.0, (k / 1024) ** 0.5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("t", [1, 64])
def test_lm_head_over_the_tied_embedding_on_the_gpu(t):
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, 576)), jnp.bfloat16)
    embed = jnp.asarray(rng.standard_normal((49152, 576)) * 0.05, jnp.bfloat16)
    got = fl.fused_linear(x, embed, w_layout="NK", out_dtype=jnp.float32, impl="pallas")
    want = jnp.dot(x, embed.T, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_router_with_normed_rows_on_the_gpu(t, dtype):
    """Qwen3-30B-A3B's router (2048 -> 128) with normed_out: the product, and the normalised
    rows as models/layers.py rms_norm gives them (moe_decode's input in the fused stack)."""
    from jaxserve.models import layers
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, 2048)) * 4 + 1, dtype)
    w = jnp.asarray(rng.standard_normal((128, 2048)) / np.sqrt(2048), dtype)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, 2048), dtype)
    y, h = fl.fused_linear(x, w, norm_K=norm, w_layout="NK", normed_out=True, impl="pallas")
    with jax.default_matmul_precision("highest"):
        want_y = fl.ref_fused_linear(x, w, norm_K=norm, w_layout="NK")
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), rtol=tol, atol=tol)
    # the rows as rms_norm rounds them: an ulp apart at most (the mean square summed in
    # another order), 2**-7 relative in bf16
    want_h = np.asarray(layers.rms_norm(x, norm, 1e-6), np.float32)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 4 * 2.0 ** -23
    np.testing.assert_allclose(np.asarray(h, np.float32), want_h, rtol=ulp, atol=1e-6)
