"""MLA's split merge folded into W_UV: the Pallas kernel (interpret mode) against its
reference on random partials (empty splits holding NaN, padded heads), and end to end after
the attention kernel's unmerged splits against the model's path (mla_attention, then the
einsum) on decode, prefill and mixed batches, dense and sparse; bf16; CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import mla_attention as mk
from jaxserve.pallas_kernels import mla_output as mo
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from test_mla_attention import BATCHES, C, mla_batch
from test_split_merge import partials


@pytest.mark.parametrize("x,t,np_,n,c,o,blocks", [
    (1, 1, 4, 4, 32, 16, {}), (4, 3, 16, 4, 32, 16, {}),
    (3, 37, 8, 5, 48, 24, dict(block_c=16, block_o=16)),    # 3 latent steps, a masked O tail
    (16, 2, 16, 16, 72, 32, dict(block_c=32))])             # a masked latent tail
def test_matches_reference(x, t, np_, n, c, o, blocks):
    o_part, lse = partials(x, t, np_, c, seed=x + t)
    w_uv = jnp.asarray(np.random.default_rng(t).standard_normal((n, c, o)), jnp.float32) * 0.2
    got = mo.mla_merge_uv(o_part, lse, w_uv, out_dtype=jnp.float32, impl="pallas", **blocks)
    want = mo.ref_mla_merge_uv(o_part, lse, w_uv, out_dtype=jnp.float32)
    assert got.shape == (t, n * o)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[-1], 0.0)     # every split empty: 0


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_after_the_attention_kernel_equals_the_model_path(kind, sparse, splits):
    q, lat, bt, seq, pos, sel, real = mla_batch(*BATCHES[kind], seed=len(kind))
    sel = sel if sparse else None
    w_uv = jnp.asarray(np.random.default_rng(1).standard_normal((q.shape[1], C, 16)), jnp.float32)
    kw = dict(sm_scale=0.3, value_dim=C, block_k=8, splits=splits)
    o_TNC = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", **kw)
    want = jnp.einsum("tnc,nco->tno", o_TNC, w_uv).reshape(q.shape[0], -1)
    o_part, lse = mk.mla_attention_partials(q, lat, bt, seq, pos, sel, **kw)
    assert o_part.shape[0] == splits
    got = mo.mla_merge_uv(o_part, lse, w_uv, out_dtype=q.dtype, impl="pallas")
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], rtol=1e-4, atol=1e-4)


def test_bf16_rounds_as_the_model_path():
    """bf16: the merged latent rounded to bf16 before W_UV, the product accumulated in f32 (as
    the GPU's einsum; XLA:CPU's bf16 dot accumulates in bf16, so the xla impl is not the bar)."""
    from jaxserve.pallas_kernels.split_merge import ref_merge_splits
    o_part, lse = partials(4, 5, 16, 64, seed=3)
    w_uv = jnp.asarray(np.random.default_rng(2).standard_normal((12, 64, 32)), jnp.bfloat16)
    got = mo.mla_merge_uv(o_part, lse, w_uv, impl="pallas")
    merged = ref_merge_splits(o_part, lse).astype(jnp.bfloat16)[:, :12].astype(jnp.float32)
    want = jnp.einsum("tnc,nco->tno", merged, w_uv.astype(jnp.float32)).reshape(5, -1)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)


def test_bad_arguments_name_the_field():
    o_part, lse = partials(2, 3, 4, 32)
    w_uv = jnp.zeros((4, 32, 16))
    with pytest.raises(ValueError, match="lse_XTN"):
        mo.mla_merge_uv(o_part, lse[:, :2], w_uv)
    with pytest.raises(ValueError, match="w_uv_NCO"):
        mo.mla_merge_uv(o_part, lse, jnp.zeros((8, 32, 16)))
    with pytest.raises(ValueError, match="block_o"):
        mo.mla_merge_uv(o_part, lse, w_uv, impl="pallas", block_o=12)


def test_lowers_for_cuda_at_deepseek_shapes():
    """16 splits of one token, 128 heads, C 512, O 128, bf16 out."""
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(
        lambda o, l, w: mo.mla_merge_uv(o, l, w, impl="pallas", interpret=False),
        sds((16, 1, 128, 512), jnp.float32), sds((16, 1, 128), jnp.float32),
        sds((128, 512, 128), jnp.bfloat16))
    assert triton_kernel_names(exported) == ["mla_merge_uv_x16"]
