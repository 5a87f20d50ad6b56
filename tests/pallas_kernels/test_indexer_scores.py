"""V3.2's indexer scores kernel (interpret mode) against the model's XLA path (models/mla.py
index_scores_xla) on decode-only, prefill and mixed ragged batches over scattered paged keys,
odd head counts and widths, bf16, and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import indexer_scores as isc
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def batch(rng, qlens, ctxs, *, heads=4, j=32, p=4, b=None, dtype=jnp.float32):
    """Tokens of len(qlens) sequences, each sequence's last qlens[s] positions of ctxs[s], over
    blocks scattered through a shuffled pool; two padding tokens at the end (sequence 0,
    position 0); tables padded with the null block 0."""
    b = b or max(-(-c // p) for c in ctxs)
    nb = sum(-(-c // p) for c in ctxs) + 2
    perm = rng.permutation(np.arange(1, nb))
    tables = np.zeros((len(ctxs), b), np.int32)
    used = 0
    for s, c in enumerate(ctxs):
        n = -(-c // p)
        tables[s, :n] = perm[used:used + n]
        used += n
    seq = np.concatenate([np.full(q, s) for s, q in enumerate(qlens)] + [[0, 0]]).astype(np.int32)
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(qlens, ctxs)] + [[0, 0]]).astype(np.int32)
    t = len(seq)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return (f(t, heads, j), jnp.asarray(rng.random((t, heads)), jnp.float32), f(nb, p, j),
            jnp.asarray(tables), jnp.asarray(seq), jnp.asarray(pos))


CASES = {
    "decode": ([1, 1, 1, 1], [37, 5, 64, 1]),
    "prefill": ([19, 8], [19, 8]),
    "mixed": ([1, 13, 1], [70, 40, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,j,p,bl", [(4, 32, 4, 16), (5, 24, 8, 32), (16, 64, 16, 64)])
def test_matches_the_model_path(case, heads, j, p, bl):
    rng = np.random.default_rng(len(case) + heads)
    args = batch(rng, *CASES[case], heads=heads, j=j, p=p)
    got = isc.indexer_scores(*args, scale=j ** -0.5, impl="pallas", slots_per_program=bl)
    want = isc.ref_indexer_scores(*args, scale=j ** -0.5)
    assert got.shape == want.shape
    g, w = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isinf(g), np.isinf(w))       # the causal mask
    np.testing.assert_allclose(g[np.isfinite(w)], w[np.isfinite(w)], rtol=1e-5, atol=1e-5)


def test_bf16_and_the_top_k_it_feeds():
    rng = np.random.default_rng(9)
    args = batch(rng, [1, 6], [300, 150], heads=8, j=64, p=16, dtype=jnp.bfloat16)
    got = isc.indexer_scores(*args, scale=0.125, impl="pallas")
    want = isc.ref_indexer_scores(*args, scale=0.125)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=2e-3, atol=2e-3)
    # the positions the sparse attention reads are (nearly) the same
    top_g = np.asarray(jax.lax.top_k(got, 32)[1])
    top_w = np.asarray(jax.lax.top_k(want, 32)[1])
    overlap = np.mean([len(set(a) & set(b)) / 32 for a, b in zip(top_g, top_w)])
    assert overlap > 0.95


def test_bad_arguments_name_the_field():
    rng = np.random.default_rng(1)
    q, w, k, bt, seq, pos = batch(rng, [1], [5])
    with pytest.raises(ValueError, match="w_TI"):
        isc.indexer_scores(q, w[:, :2], k, bt, seq, pos, scale=1.0)
    with pytest.raises(ValueError, match="index_k_NPJ"):
        isc.indexer_scores(q, w, k[..., :8], bt, seq, pos, scale=1.0)
    with pytest.raises(ValueError, match="slots_per_program"):
        isc.indexer_scores(q, w, k, bt, seq, pos, scale=1.0, impl="pallas", slots_per_program=24)


def test_lowers_for_cuda_at_v32_shapes():
    """DeepSeek-V3.2: 64 indexer heads of 128, 64-token blocks, a 128K-token table, bf16."""
    sds, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    exported = export_for_cuda(
        lambda *a: isc.indexer_scores(*a, scale=128 ** -0.5, impl="pallas", interpret=False),
        sds((4, 64, 128), bf), sds((4, 64), jnp.float32), sds((2100, 64, 128), bf),
        sds((2, 2048), i32), sds((4,), i32), sds((4,), i32))
    assert triton_kernel_names(exported) == ["indexer_scores"]
