"""MLA paged attention: the Pallas kernel (interpret mode) against its jnp reference on
decode-only, prefill-only and mixed ragged batches, dense and sparse; lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import mla_attention as mk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names

C, R, P = 32, 16, 8


def mla_batch(qlens, ctxs, *, n=4, k=6, pad_tokens=2, seed=0):
    """(q_TNW, latent_NPW, block_tables, token_seq_ids, positions, selected_Tk, real tokens):
    sequence s computes its last qlens[s] of ctxs[s] positions; blocks scattered (0 = null);
    each token selects up to k random positions of its visible range (-1 padded)."""
    rng = np.random.default_rng(seed)
    b = max(-(-c // P) for c in ctxs)
    nb = sum(-(-c // P) for c in ctxs) + 3
    perm = rng.permutation(np.arange(1, nb))
    bt = np.zeros((len(ctxs), b), np.int32)
    seq_ids, pos, used = [], [], 0
    for s, (ql, c) in enumerate(zip(qlens, ctxs)):
        bt[s, :-(-c // P)] = perm[used:used + -(-c // P)]
        used += -(-c // P)
        seq_ids += [s] * ql
        pos += list(range(c - ql, c))
    real = len(pos)
    seq_ids += [0] * pad_tokens
    pos += [0] * pad_tokens
    sel = np.full((len(pos), k), -1, np.int32)
    for t, p in enumerate(pos):
        pick = rng.permutation(p + 1)[:k]
        sel[t, :len(pick)] = pick
    q = rng.standard_normal((len(pos), n, C + R)).astype(np.float32)
    lat = rng.standard_normal((nb, P, C + R)).astype(np.float32)
    arr = jnp.asarray
    return arr(q), arr(lat), arr(bt), arr(np.asarray(seq_ids, np.int32)), arr(np.asarray(pos, np.int32)), \
        arr(sel), real


BATCHES = {"decode": ([1, 1, 1], [5, 17, 30]), "prefill": ([7, 12], [7, 20]),
           "mixed": ([1, 9, 1, 4], [33, 9, 2, 13])}


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_kernel_matches_reference(kind, sparse):
    q, lat, bt, seq, pos, sel, real = mla_batch(*BATCHES[kind], seed=len(kind))
    sel = sel if sparse else None
    kw = dict(sm_scale=0.3, value_dim=C)
    want = mk.ref_mla_attention(q, lat, bt, seq, pos, sm_scale=0.3, value_dim=C, selected_Tk=sel)
    got = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", block_k=8, **kw)
    assert got.shape == (q.shape[0], q.shape[1], C)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_sparse_differs_from_dense_and_heads_span_tiles():
    """More heads than one tile (20 over tiles of 16), and sparse really restricts the keys."""
    q, lat, bt, seq, pos, sel, real = mla_batch([3, 1], [40, 25], n=20, k=4, seed=5)
    kw = dict(sm_scale=0.2, value_dim=C)
    dense = mk.mla_attention(q, lat, bt, seq, pos, impl="pallas", block_k=16, block_h=16, **kw)
    sparse = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", block_k=16, block_h=16, **kw)
    np.testing.assert_allclose(np.asarray(dense)[:real],
                               np.asarray(mk.ref_mla_attention(q, lat, bt, seq, pos, **kw))[:real],
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sparse)[:real], np.asarray(mk.ref_mla_attention(
        q, lat, bt, seq, pos, selected_Tk=sel, **kw))[:real], atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(dense)[:real] - np.asarray(sparse)[:real]).max() > 0.1


def test_selection_of_all_visible_positions_is_dense():
    q, lat, bt, seq, pos, _, real = mla_batch([2, 1], [10, 6], k=16, seed=2)
    every = jnp.where(jnp.arange(16)[None, :] <= pos[:, None], jnp.arange(16)[None, :], -1)
    kw = dict(sm_scale=0.3, value_dim=C, impl="pallas", block_k=8)
    np.testing.assert_allclose(np.asarray(mk.mla_attention(q, lat, bt, seq, pos, every, **kw))[:real],
                               np.asarray(mk.mla_attention(q, lat, bt, seq, pos, **kw))[:real],
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_key_range_splits_match_the_reference(splits, sparse):
    """Each token's keys split 1, 3 or 8 ways (more splits than some tokens have key steps:
    empty splits), merged: the same as the reference on a mixed batch."""
    q, lat, bt, seq, pos, sel, real = mla_batch(*BATCHES["mixed"], seed=9)
    sel = sel if sparse else None
    kw = dict(sm_scale=0.3, value_dim=C)
    want = mk.ref_mla_attention(q, lat, bt, seq, pos, selected_Tk=sel, **kw)
    got = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", block_k=8, splits=splits, **kw)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5, rtol=1e-5)


def test_few_tokens_take_splits_and_many_none():
    assert mk.key_splits(1, 128, 16) == mk.MAX_SPLITS        # 8 programs: split 16 ways
    assert mk.key_splits(16, 128, 16) == 2 * mk.num_sms() // 128
    assert mk.key_splits(64, 128, 16) == 1


def test_validation():
    q, lat, bt, seq, pos, sel, _ = mla_batch([1], [3])
    with pytest.raises(ValueError, match="value_dim"):
        mk.mla_attention(q, lat, bt, seq, pos, sm_scale=1.0, value_dim=C + R)
    with pytest.raises(ValueError, match="latent cache"):
        mk.mla_attention(q, lat[..., :C], bt, seq, pos, sm_scale=1.0, value_dim=C)


@pytest.mark.parametrize("k", [0, 2048])
@pytest.mark.parametrize("t", [1, 64])
def test_lowers_for_cuda_at_deepseek_shapes(k, t):
    """128 heads, a 512 + 64 latent, bf16: dense (k = 0) and sparse over 2,048 positions; one
    decode token (key splits and their merge) and 64 (no splits)."""
    sds = jax.ShapeDtypeStruct
    n, nb, p, s, b = 128, 512, 64, 8, 64
    args = [sds((t, n, 576), jnp.bfloat16), sds((nb, p, 576), jnp.bfloat16), sds((s, b), jnp.int32),
            sds((t,), jnp.int32), sds((t,), jnp.int32)]
    if k:
        args.append(sds((t, k), jnp.int32))
    exported = export_for_cuda(lambda *a: mk.mla_attention(*a, sm_scale=0.135, value_dim=512,
                                                           impl="pallas", interpret=False), *args)
    name = "mla_sparse_attention" if k else "mla_attention"
    names = triton_kernel_names(exported)
    if t == 64:
        assert names == [name]
    else:
        assert names[0] == f"{name}_x{mk.MAX_SPLITS}" and names[1].startswith("merge_splits_x16")
