"""MLA's input prep (q latent norm, latent + indexer key writes, head weights) from the packed
input projection: the Pallas kernel (interpret mode) against its reference, which is the
model's own ops (decode tokens, a prefill chunk, a mixed step; V3 and V3.2; no q latent; bf16);
the CUDA lowering at DeepSeek-V3.2's widths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.models.layers import mla
from jaxserve.pallas_kernels import mla_input_prep as mip
from jaxserve.pallas_kernels import mla_latent_write as mlw
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from test_mla_latent_write import YARN, compare, make


def packed(rng, *, t, q, c, r, j, heads, index=True, q_norm=True, dtype=jnp.float32, nb=9):
    """(kwargs of mla_input_prep, slots, the parts): a_TM = [q | kv | index key | head weights]."""
    args, slots = make(rng, t=t, c=c, r=r, j=j, nb=nb, dtype=dtype, index=index)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    q_part, head_w = f(t, q) * 2, f(t, heads)
    parts = [q_part, args.pop("kv_TW")] + ([args.pop("index_TJ"), head_w] if index else [])
    args["a_TM"] = jnp.concatenate(parts, axis=1)
    args["q_norm_Q"] = f(q) if q_norm else None
    return args, slots, q_part, head_w


CASES = {   # t, q, c, r, j, heads, index, q_norm
    "decode": (3, 32, 64, 16, 32, 8, True, True),
    "prefill": (21, 48, 64, 16, 32, 8, True, True),
    "mixed_odd_widths": (13, 40, 48, 8, 24, 6, True, True),
    "v3": (9, 32, 64, 16, 32, 8, False, True),
    "v3_no_q_lora": (5, 96, 64, 16, 32, 8, False, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    t, q, c, r, j, heads, index, q_norm = CASES[case]
    rng = np.random.default_rng(t + q)
    args, slots, q_part, head_w = packed(rng, t=t, q=q, c=c, r=r, j=j, heads=heads, index=index,
                                         q_norm=q_norm)
    inv, factor = mla.rope_tables(r, 10000.0, YARN, 4096)
    got = mip.mla_input_prep(inv_freq_H=inv, factor=factor, q_width=q, impl="pallas", **args)
    want = mip.ref_mla_input_prep(inv_freq_H=inv, factor=factor, q_width=q, **args)
    compare(got[1:3], want[1:3], slots, 1e-5)
    for g, w in (got[0], want[0]), (got[3], want[3]):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert (got[0] is None) == (not q_norm) and (got[3] is None) == (not index)


def test_reference_is_the_model_ops():
    """The reference's q latent and head weights are the model's rms_norm and scale, and its
    caches mla_latent_write's reference on the sliced parts."""
    rng = np.random.default_rng(3)
    args, _, q_part, head_w = packed(rng, t=4, q=32, c=32, r=8, j=16, heads=8)
    inv, factor = mla.rope_tables(8, 10000.0, YARN, 4096)
    q, latent, index, w = mip.ref_mla_input_prep(inv_freq_H=inv, factor=factor, q_width=32, **args)
    np.testing.assert_array_equal(q, layers.rms_norm(q_part, args["q_norm_Q"], 1e-6))
    np.testing.assert_allclose(w, np.asarray(head_w) / np.sqrt(8), rtol=1e-6)
    a = args["a_TM"]
    want = mlw.ref_mla_latent_write(a[:, 32:72], args["kv_norm_C"], args["positions_T"],
                                    args["slot_mapping_T"], args["latent_NPW"], inv, factor=factor,
                                    index_TJ=a[:, 72:88], index_norm_J=args["index_norm_J"],
                                    index_bias_J=args["index_bias_J"],
                                    index_cache_NPJ=args["index_cache_NPJ"])
    np.testing.assert_array_equal(latent, want[0])
    np.testing.assert_array_equal(index, want[1])


def test_bf16_against_the_xla_impl():
    rng = np.random.default_rng(5)
    args, slots, _, _ = packed(rng, t=11, q=32, c=64, r=16, j=32, heads=8, dtype=jnp.bfloat16)
    inv, factor = mla.rope_tables(16, 10000.0, YARN, 4096)
    kw = dict(inv_freq_H=inv, factor=factor, q_width=32, **args)
    got = mip.mla_input_prep(impl="pallas", **kw)
    want = mip.mla_input_prep(impl="xla", **kw)
    assert got[0].dtype == jnp.bfloat16 and got[3].dtype == jnp.float32
    compare(got[1:3], want[1:3], slots, 2e-2)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)


def test_bad_arguments_name_the_field():
    rng = np.random.default_rng(1)
    args, _, _, _ = packed(rng, t=4, q=32, c=32, r=8, j=16, heads=4)
    inv = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="a_TM"):
        mip.mla_input_prep(**dict(args, a_TM=args["a_TM"][:, :60]), inv_freq_H=inv, q_width=32)
    with pytest.raises(ValueError, match="q_norm_Q"):
        mip.mla_input_prep(**args, inv_freq_H=inv, q_width=30)
    with pytest.raises(ValueError, match="go together"):
        mip.mla_input_prep(**dict(args, index_bias_J=None), inv_freq_H=inv, q_width=32)


@pytest.mark.parametrize("index", [True, False])
def test_lowers_for_cuda_at_deepseek_shapes(index):
    """DeepSeek-V3.2's widths: Q 1536, C 512, R 64, J 128, I 64; bf16, 64-token blocks."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    m = 1536 + 576 + (128 + 64 if index else 0)
    shapes = [sds((16, m), bf), sds((512,), bf), sds((16,), jnp.int32), sds((16,), jnp.int32),
              sds((100, 64, 576), bf), sds((32,), jnp.float32), sds((1536,), bf)]
    if index:
        shapes += [sds((128,), bf), sds((128,), bf), sds((100, 64, 128), bf)]
    exported = export_for_cuda(
        lambda *a: mip.mla_input_prep(*a, q_width=1536, factor=1.3, impl="pallas", interpret=False),
        *shapes)
    assert triton_kernel_names(exported) == ["mla_input_prep" + ("_index" if index else "")]
