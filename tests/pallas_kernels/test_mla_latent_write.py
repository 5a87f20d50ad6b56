"""MLA's fused latent (+ indexer key) write: the Pallas kernel (interpret mode) against the
model's own XLA blocks (models/mla.py), decode-only, prefill and mixed token sets, with YaRN's
factor, odd widths, bf16, and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import mla
from jaxserve.pallas_kernels import mla_latent_write as mlw
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


def make(rng, *, t, c, r, j, nb=9, p=4, dtype=jnp.float32, index=True):
    """Arguments of one step: t tokens in scattered slots, the last two padding (slot 0 of the
    null block); caches poisoned where nothing is written (they must come back unchanged)."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    slots = rng.permutation(np.arange(p, nb * p))[:t].astype(np.int32)
    slots[-2:] = 0
    pos = jnp.asarray(rng.integers(0, 3000, t).astype(np.int32))
    latent = jnp.full((nb, p, c + r), jnp.nan, dtype).at[2].set(f(p, c + r))
    args = dict(kv_TW=f(t, c + r) * 3, kv_norm_C=f(c), positions_T=pos,
                slot_mapping_T=jnp.asarray(slots), latent_NPW=latent)
    if index:
        args.update(index_TJ=f(t, j) * 2 + 1, index_norm_J=f(j), index_bias_J=f(j),
                    index_cache_NPJ=jnp.full((nb, p, j), -5.0, dtype))
    return args, slots


def compare(got, want, slots, tol):
    written = slots[slots != 0]
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        g = np.asarray(g, np.float32).reshape(-1, w.shape[-1])
        w = np.asarray(w, np.float32).reshape(-1, w.shape[-1])
        np.testing.assert_allclose(g[written], w[written], rtol=tol, atol=tol)
        untouched = np.setdiff1d(np.arange(4, g.shape[0]), written)   # blocks 1..: not the null block
        np.testing.assert_array_equal(g[untouched], w[untouched])     # NaN == NaN here


@pytest.mark.parametrize("t,c,r,j,scaling,index", [
    (3, 64, 16, 32, None, True),        # decode: three sequences, one token each
    (21, 64, 16, 32, YARN, True),       # a prefill chunk, YaRN's factor on the rotary
    (13, 48, 8, 24, YARN, True),        # widths that are no powers of two (masked tails)
    (9, 64, 16, 32, YARN, False),       # V3: no indexer
])
def test_matches_model_blocks(t, c, r, j, scaling, index):
    rng = np.random.default_rng(t + c)
    args, slots = make(rng, t=t, c=c, r=r, j=j, index=index)
    inv, factor = mla.rope_tables(r, 10000.0, scaling, 4096)
    assert (factor != 1.0) == (scaling is not None)
    got = mlw.mla_latent_write(inv_freq_H=inv, factor=factor, impl="pallas", **args)
    want = mlw.ref_mla_latent_write(inv_freq_H=inv, factor=factor, **args)
    compare(got, want, slots, 1e-5)


def test_bf16_against_the_xla_impl():
    rng = np.random.default_rng(5)
    args, slots = make(rng, t=11, c=64, r=16, j=32, dtype=jnp.bfloat16)
    inv, factor = mla.rope_tables(16, 10000.0, YARN, 4096)
    got = mlw.mla_latent_write(inv_freq_H=inv, factor=factor, impl="pallas", **args)
    want = mlw.mla_latent_write(inv_freq_H=inv, factor=factor, impl="xla", **args)
    assert got[0].dtype == jnp.bfloat16
    compare(got, want, slots, 2e-2)


def test_the_reference_is_the_model_path():
    """The reference writes exactly what deepseek.attention_block's own XLA ops write."""
    rng = np.random.default_rng(7)
    args, slots = make(rng, t=5, c=32, r=8, j=16)
    inv, factor = mla.rope_tables(8, 10000.0, YARN, 4096)
    latent, index = mlw.ref_mla_latent_write(inv_freq_H=inv, factor=factor, **args)
    kv, pos = np.asarray(args["kv_TW"]), np.asarray(args["positions_T"])
    x = kv[:, :32]
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * np.asarray(args["kv_norm_C"])
    ang = pos[:, None] * np.asarray(inv)[None, :]
    k1, k2 = kv[:, 32:36], kv[:, 36:]
    roped = np.concatenate([k1 * np.cos(ang) - k2 * np.sin(ang), k2 * np.cos(ang) + k1 * np.sin(ang)], -1)
    rows = np.asarray(latent).reshape(-1, 40)[slots[:3]]
    np.testing.assert_allclose(rows, np.concatenate([normed, roped * factor], -1)[:3], rtol=1e-4, atol=1e-5)
    assert np.asarray(index).reshape(-1, 16)[slots[:3]].std() > 0.1


def test_bad_arguments_name_the_field():
    rng = np.random.default_rng(1)
    args, _ = make(rng, t=4, c=32, r=8, j=16)
    inv = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="kv_TW"):
        mlw.mla_latent_write(**dict(args, kv_TW=args["kv_TW"][:, :-1]), inv_freq_H=inv)
    with pytest.raises(ValueError, match="go together"):
        mlw.mla_latent_write(**dict(args, index_bias_J=None), inv_freq_H=inv)
    with pytest.raises(ValueError, match="index_TJ"):
        mlw.mla_latent_write(**dict(args, index_TJ=args["index_TJ"][:, :4]), inv_freq_H=inv)


@pytest.mark.parametrize("index", [True, False])
def test_lowers_for_cuda_at_deepseek_shapes(index):
    """DeepSeek-V3.2's widths: C 512, R 64, J 128; bf16 caches of 64-token blocks."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    shapes = [sds((16, 576), bf), sds((512,), bf), sds((16,), jnp.int32), sds((16,), jnp.int32),
              sds((100, 64, 576), bf), sds((32,), jnp.float32)]
    if index:
        shapes += [sds((16, 128), bf), sds((128,), bf), sds((128,), bf), sds((100, 64, 128), bf)]
    exported = export_for_cuda(
        lambda *a: mlw.mla_latent_write(*a, factor=1.3, impl="pallas", interpret=False), *shapes)
    name = "mla_latent_index_write" if index else "mla_latent_write"
    assert triton_kernel_names(exported) == [name]
