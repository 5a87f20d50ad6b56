"""Merging key-range splits: the Pallas kernel (interpret mode) against the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import split_merge as sm
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def partials(x, t, n, e, *, seed=0):
    """Random partial outputs and lse; split 0 of token 0 and every split of the last token
    are empty (lse -inf), the empty ones holding NaN (a kernel may leave them unwritten)."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((x, t, n, e)).astype(np.float32)
    lse = (4 * rng.standard_normal((x, t, n))).astype(np.float32)
    lse[0, 0] = -np.inf
    lse[:, -1] = -np.inf
    o[lse == -np.inf] = np.nan
    return jnp.asarray(o), jnp.asarray(lse)


@pytest.mark.parametrize("x,t,n,e", [(1, 3, 4, 32), (3, 5, 8, 16), (8, 2, 32, 128),
                                     (33, 4, 4, 64), (3, 37, 9, 128)])   # last: rows % BR != 0
def test_matches_reference(x, t, n, e):
    o, lse = partials(x, t, n, e, seed=x)
    out = np.asarray(sm.merge_splits(o, lse, impl="pallas"))
    want = np.asarray(sm.ref_merge_splits(jnp.where(jnp.isnan(o), 0.0, o), lse))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[-1], 0.0)         # every split empty: zeros, not NaN
    if x == 1:                                           # one split: its own partial
        np.testing.assert_allclose(out[1:-1], np.asarray(o[0, 1:-1]), rtol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("splits,tokens", [([2, 5, 1, 3, 4], 3), ([5] * 5, 5), ([1] * 5, 5),
                                           ([9, 2, 0, 4, 1], 5), ([3, 1, 2, 2, 5], 0)])
def test_only_live_splits_and_tokens_are_read(impl, splits, tokens):
    # an attention kernel that sets split counts at run time writes only the first live[t]
    # splits of token t, of the first live[T] tokens: the rest (NaN here, garbage on a GPU)
    # never counts; a token with no split written merges to 0
    x, t, n, e = 5, 5, 4, 32
    o, lse = partials(x, t, n, e, seed=7)
    written = (np.arange(x)[:, None] < np.minimum(splits, x)[None, :]) & \
        (np.arange(t) < tokens)[None, :]
    o_dead = jnp.where(written[..., None, None], o, jnp.nan)
    lse_dead = jnp.where(written[..., None], lse, jnp.nan)
    live = jnp.asarray(splits + [tokens], jnp.int32)
    out = np.asarray(sm.merge_splits(o_dead, lse_dead, live, impl=impl))
    want = np.asarray(sm.ref_merge_splits(jnp.nan_to_num(o), jnp.where(
        written[..., None], lse, -jnp.inf)))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[tokens:], 0.0)
    np.testing.assert_array_equal(out[np.asarray(splits) == 0], 0.0)


def test_out_dtype_and_xla_impl():
    o, lse = partials(4, 3, 8, 32)
    out = sm.merge_splits(o, lse, out_dtype=jnp.bfloat16, impl="pallas")
    assert out.dtype == jnp.bfloat16
    want = sm.merge_splits(jnp.nan_to_num(o), lse, out_dtype=jnp.bfloat16, impl="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_validation_errors_name_the_field():
    o, lse = partials(2, 3, 4, 16)
    with pytest.raises(ValueError, match="lse_XTN"):
        sm.merge_splits(o, lse[:, :2])
    with pytest.raises(ValueError, match="head dim E"):
        sm.merge_splits(jnp.zeros((2, 3, 4, 24)), lse)
    with pytest.raises(ValueError, match="impl"):
        sm.merge_splits(o, lse, impl="cuda")


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(lambda o, lse: sm.merge_splits(
        o, lse, out_dtype=jnp.bfloat16, impl="pallas", interpret=False),
        sds((32, 1, 32, 128), jnp.float32), sds((32, 1, 32), jnp.float32))
    assert triton_kernel_names(exported) == ["merge_splits_x32_br1_be32"]


@pytest.mark.parametrize("x,rows,e", [(2, 32, 128), (64, 32, 128), (64, 512, 128), (4, 4096, 128),
                                      (256, 4096, 64), (1024, 8, 16)])
def test_tiles_bound_the_registers(x, rows, e):
    xp = 1 << (x - 1).bit_length()
    br, be = sm._tiles(rows, e, xp)
    assert e % be == 0 and br >= 1
    assert xp * br * be <= max(8192, xp * 16)   # 8K partials a program (16 columns at least)
