"""The plain-XLA paged attention (models/layers.py, the CPU path and the model's reference):
its online-softmax walk over key steps gives the dense softmax's numbers, for every token
shape the runner makes, with sliding window and soft cap, and whatever the step size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers

SCALE = 0.17


def dense_reference(q, k_cache, v_cache, tables, seq_T, pos_T, *, sliding_window=None,
                    soft_cap=None):
    """Each token's whole padded context gathered at once, one softmax over it (numpy, f64)."""
    q, k_cache, v_cache = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    t, n, e = q.shape
    _, p, kh, _ = k_cache.shape
    g = n // kh
    out = np.zeros_like(q)
    for i in range(t):
        table = np.asarray(tables)[seq_T[i]]
        k = k_cache[table].reshape(-1, kh, e)
        v = v_cache[table].reshape(-1, kh, e)
        s = np.einsum("kge,lke->kgl", q[i].reshape(kh, g, e), k) * SCALE
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        key = np.arange(k.shape[0])
        vis = key <= pos_T[i]
        if sliding_window is not None:
            vis &= key > pos_T[i] - sliding_window
        s = np.where(vis, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[i] = np.einsum("kgl,lke->kge", w, v).reshape(n, e)
    return out


def batch(qlens, ctxs, *, n=6, kh=2, e=16, p=4, b=12, pad_tokens=3, seed=0, nb=0):
    """A step of chunks (query length, context after the step) over a shuffled block pool with
    block tables `b` wide (wider than any context: as the runner's max_model_len / P), plus
    `pad_tokens` padding tokens (sequence 0, position 0, as the runner pads); `nb` blocks
    in the pool at least."""
    rng = np.random.default_rng(seed)
    nb = max(nb, sum(-(-c // p) for c in ctxs) + 3)
    q = rng.standard_normal((sum(qlens) + pad_tokens, n, e)).astype(np.float32)
    k = rng.standard_normal((nb, p, kh, e)).astype(np.float32)
    v = rng.standard_normal((nb, p, kh, e)).astype(np.float32)
    tables = np.zeros((len(qlens) + 1, b), np.int32)      # one padding sequence: all null
    perm, used = rng.permutation(np.arange(1, nb)), 0
    seq_T, pos_T = [], []
    for s, (ql, c) in enumerate(zip(qlens, ctxs)):
        nblk = -(-c // p)
        tables[s, :nblk] = perm[used:used + nblk]
        used += nblk
        seq_T += [s] * ql
        pos_T += range(c - ql, c)
    seq_T = np.array(seq_T + [0] * pad_tokens, np.int32)
    pos_T = np.array(pos_T + [0] * pad_tokens, np.int32)
    return q, k, v, tables, seq_T, pos_T


def check(args, atol=2e-5, **kw):
    opts = {k: kw[k] for k in ("sliding_window", "soft_cap") if k in kw}
    got = layers.paged_attention_xla(*(jnp.asarray(a) for a in args), sm_scale=SCALE, **kw)
    want = dense_reference(*args, **opts)
    np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("keys_per_step", [4, 8, 12, 1000])   # 1, 2, 3 blocks (not dividing B), all
def test_decode_prefill_and_mixed_steps_match_the_dense_softmax(keys_per_step):
    check(batch([1] * 4, [1, 5, 17, 44]), keys_per_step=keys_per_step)          # decode rows
    check(batch([13, 7], [13, 30], seed=1), keys_per_step=keys_per_step)        # prefill chunks
    check(batch([9, 1, 1, 6], [25, 33, 8, 6], seed=2), keys_per_step=keys_per_step)


def test_token_chunks_each_walk_their_own_keys():
    # 3 chunks of 8 tokens (the last one padded): a long prefill chunk beside short decodes
    check(batch([1, 17, 1], [3, 40, 48], seed=3), token_chunk=8, keys_per_step=8)


def test_sliding_window_skips_steps_and_soft_cap():
    args = batch([6, 1, 11], [40, 37, 30], pad_tokens=0, seed=4)
    check(args, sliding_window=10, keys_per_step=8)
    check(args, sliding_window=3, keys_per_step=4)     # windows inside one block
    check(args, soft_cap=5.0, keys_per_step=8)
    check(batch([2, 1], [20, 9], seed=5), sliding_window=5, soft_cap=2.0)   # with padding tokens


def test_bf16_cache():
    q, k, v, tables, seq_T, pos_T = batch([3, 1], [10, 21], seed=6)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    got = layers.paged_attention_xla(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                                     jnp.asarray(v, jnp.bfloat16), tables, seq_T, pos_T,
                                     sm_scale=SCALE, keys_per_step=8)
    want = dense_reference(bf(q), bf(k), bf(v), tables, seq_T, pos_T)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def test_the_walk_stops_at_the_steps_furthest_position():
    """Blocks past the step's furthest position are never gathered: tables pointing there at
    NaN blocks change nothing (masking alone would not hide them: 0 * NaN is NaN)."""
    q, k, v, tables, seq_T, pos_T = batch([1, 1], [5, 9], p=4, b=12, pad_tokens=0, seed=7)
    want = dense_reference(q, k, v, tables, seq_T, pos_T)
    nb = k.shape[0]
    nan_k = np.concatenate([k, np.full((9,) + k.shape[1:], np.nan, np.float32)])
    nan_v = np.concatenate([v, np.full((9,) + v.shape[1:], np.nan, np.float32)])
    tables[:2, 3:] = np.arange(nb, nb + 9)       # keys 12 and on: past position 8
    got = layers.paged_attention_xla(*map(jnp.asarray, (q, nan_k, nan_v, tables, seq_T, pos_T)),
                                     sm_scale=SCALE, keys_per_step=4)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)


def test_jits_once_for_every_context():
    """One compiled program serves every context length (the trip count is dynamic)."""
    f = jax.jit(lambda *a: layers.paged_attention_xla(*a, sm_scale=SCALE, keys_per_step=8))
    for ctxs in ([1, 2], [30, 44], [48, 3]):
        args = batch([1, 1], ctxs, b=12, seed=8, nb=40)
        np.testing.assert_allclose(np.asarray(f(*args)), dense_reference(*args), atol=2e-5,
                                   rtol=1e-4)
    assert f._cache_size() == 1
