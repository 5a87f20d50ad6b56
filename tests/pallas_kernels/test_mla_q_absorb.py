"""MLA's absorbed query (q_nope @ W_UK beside the roped q_rope, and V3.2's roped indexer
queries) from the packed q projection: the Pallas kernel (interpret mode) against its
reference, the model's own ops, on decode, prefill and mixed token counts (padding rows), odd
widths, no indexer, wider inputs (the input projection with q first), bf16; CUDA lowering at
DeepSeek-V3.2's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import mla
from jaxserve.pallas_kernels import mla_q_absorb as mqa
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from test_mla_latent_write import YARN


def make(rng, *, t, n, e, r, c, i, j, extra=0, dtype=jnp.float32):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    b = f(t, n * (e + r) + i * j + extra)
    pos = jnp.asarray(rng.integers(0, 3000, t).astype(np.int32))
    inv, factor = mla.rope_tables(r, 10000.0, YARN, 4096)
    return dict(b_TM=b, w_uk_NEC=f(n, e, c) * 0.3, positions_T=pos, inv_freq_H=inv), factor


CASES = {   # t, n, e, r, c, i, j, extra, block_c
    "decode": (1, 4, 16, 8, 32, 8, 16, 0, 128),
    "decode_batch": (3, 4, 16, 8, 32, 8, 16, 0, 16),
    "prefill": (37, 4, 16, 8, 32, 8, 16, 0, 16),
    "mixed_odd_widths": (19, 3, 24, 12, 40, 5, 20, 0, 16),
    "v3_no_index_wider_input": (6, 4, 16, 8, 32, 0, 0, 40, 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    t, n, e, r, c, i, j, extra, block_c = CASES[case]
    args, factor = make(np.random.default_rng(t + n), t=t, n=n, e=e, r=r, c=c, i=i, j=j, extra=extra)
    kw = dict(num_heads=n, index_heads=i, factor=factor)
    got = mqa.mla_q_absorb(**args, **kw, impl="pallas", block_c=block_c)
    want = mqa.ref_mla_q_absorb(**args, **kw)
    assert got[0].shape == (t, n, c + r)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    if i:
        assert got[1].shape == (t, i, j)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    else:
        assert got[1] is None


def test_reference_is_the_model_ops():
    """Numpy's absorbed query and rotary agree with the reference (the model's ops)."""
    args, factor = make(np.random.default_rng(2), t=3, n=2, e=16, r=8, c=16, i=2, j=16)
    q, qi = mqa.ref_mla_q_absorb(**args, num_heads=2, index_heads=2, factor=factor)
    b, w = np.asarray(args["b_TM"]), np.asarray(args["w_uk_NEC"])
    heads = b[:, :48].reshape(3, 2, 24)
    np.testing.assert_allclose(np.asarray(q)[..., :16], np.einsum("tne,nec->tnc", heads[..., :16], w),
                               rtol=1e-4, atol=1e-5)
    ang = np.asarray(args["positions_T"])[:, None, None] * np.asarray(args["inv_freq_H"])[None, None, :]
    x1, x2 = heads[..., 16:20], heads[..., 20:]
    roped = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(np.asarray(q)[..., 16:], roped * factor, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(qi)[..., 8:], b[:, 48:].reshape(3, 2, 16)[..., 8:])


def test_bf16_against_the_xla_impl():
    args, factor = make(np.random.default_rng(4), t=5, n=4, e=16, r=8, c=32, i=4, j=16,
                        dtype=jnp.bfloat16)
    kw = dict(num_heads=4, index_heads=4, factor=factor)
    got = mqa.mla_q_absorb(**args, **kw, impl="pallas")
    want = mqa.mla_q_absorb(**args, **kw, impl="xla")
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_the_field():
    args, _ = make(np.random.default_rng(1), t=2, n=4, e=16, r=8, c=32, i=2, j=16)
    with pytest.raises(ValueError, match="w_uk_NEC"):
        mqa.mla_q_absorb(**args, num_heads=3, index_heads=2)
    with pytest.raises(ValueError, match="b_TM"):
        mqa.mla_q_absorb(**dict(args, b_TM=args["b_TM"][:, :-1]), num_heads=4, index_heads=2)
    with pytest.raises(ValueError, match="block_c"):
        mqa.mla_q_absorb(**args, num_heads=4, index_heads=2, impl="pallas", block_c=24)


@pytest.mark.parametrize("index", [True, False])
def test_lowers_for_cuda_at_deepseek_shapes(index):
    """128 heads, E 128, R 64, C 512; V3.2's indexer 64 x 128; bf16."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    m = 128 * 192 + (64 * 128 if index else 0)
    shapes = [sds((4, m), bf), sds((128, 128, 512), bf), sds((4,), jnp.int32), sds((32,), jnp.float32)]
    exported = export_for_cuda(lambda *a: mqa.mla_q_absorb(
        *a, num_heads=128, index_heads=64 if index else 0, factor=1.3, impl="pallas",
        interpret=False), *shapes)
    assert triton_kernel_names(exported) == ["mla_q_absorb" + ("_index" if index else "")]
