"""The jnp gated-DeltaNet pieces (models/gated_deltanet.py) against per-sequence references on
ragged mixed batches: the chunked and recurrent delta rule against the token-by-token
recurrence, the carried-state causal conv against a direct numpy convolution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import deltanet as gdn

H, G, K, V = 4, 2, 8, 6


def _batch(qlens, pad_tokens=3, seed=0):
    rng = np.random.default_rng(seed)
    s = len(qlens)
    t = sum(qlens) + pad_tokens
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32))
    k = gdn.l2norm(jnp.asarray(rng.standard_normal((t, H, K)), jnp.float32))
    q = gdn.l2norm(jnp.asarray(rng.standard_normal((t, H, K)), jnp.float32)) * K ** -0.5
    v = jnp.asarray(rng.standard_normal((t, H, V)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.5, (t, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 0.95, (t, H)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((s, H, V, K)), jnp.float32)
    return q, k, v, g, beta, state, qsl


def _naive(q, k, v, g, beta, state, qsl):
    outs, finals = [], []
    for s in range(state.shape[0]):
        a, b = int(qsl[s]), int(qsl[s + 1])
        o, st = gdn.naive_gated_delta(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state[s])
        outs.append(o)
        finals.append(st)
    return jnp.concatenate(outs), jnp.stack(finals)


# ragged mixed batches: decode rows, prefill chunks crossing chunk boundaries, padding seqs
CASES = [[1, 1, 1], [5, 1, 13, 0, 0], [9], [3, 20, 1, 7, 0]]


@pytest.mark.parametrize("qlens", CASES)
@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_matches_recurrence(qlens, chunk):
    q, k, v, g, beta, state, qsl = _batch(qlens, seed=len(qlens) + chunk)
    want_o, want_s = _naive(q, k, v, g, beta, state, qsl)
    o, st = gdn.chunked_gated_delta(q, k, v, g, beta, state, qsl, chunk=chunk)
    n = int(qsl[-1])
    np.testing.assert_allclose(o[:n], want_o, atol=2e-5, rtol=0)
    np.testing.assert_allclose(st, want_s, atol=2e-5, rtol=0)
    o2, st2 = jax.jit(gdn.gated_delta_rule, static_argnames="chunk")(q, k, v, g, beta, state, qsl,
                                                                      chunk=chunk)
    np.testing.assert_allclose(o2[:n], want_o, atol=2e-5, rtol=0)
    np.testing.assert_allclose(st2, want_s, atol=2e-5, rtol=0)


def test_padding_sequences_keep_their_state():
    q, k, v, g, beta, state, qsl = _batch([4, 0, 0])
    for fn in (gdn.chunked_gated_delta, gdn.gated_delta_rule):
        _, st = fn(q, k, v, g, beta, state, qsl)
        np.testing.assert_array_equal(st[1:], state[1:])
        assert not np.allclose(st[0], state[0])


def test_recurrent_step_is_one_token_of_the_recurrence():
    q, k, v, g, beta, state, qsl = _batch([1, 1, 1, 1], pad_tokens=0)
    o, st = gdn.recurrent_gated_delta(q, k, v, g, beta, state)
    want_o, want_s = _naive(q, k, v, g, beta, state, qsl)
    np.testing.assert_allclose(o, want_o, atol=1e-5, rtol=0)
    np.testing.assert_allclose(st, want_s, atol=1e-5, rtol=0)


@pytest.mark.parametrize("qlens", [[1, 2, 5, 0], [7, 1], [1, 1, 1]])
def test_causal_conv_continues_from_state(qlens):
    rng = np.random.default_rng(1)
    c, w = 5, 4
    s, t = len(qlens), sum(qlens) + 2
    x = rng.standard_normal((t, c)).astype(np.float32)
    wt = rng.standard_normal((c, w)).astype(np.float32)
    state = rng.standard_normal((s, c, w - 1)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    out, new = gdn.causal_conv(jnp.asarray(x), jnp.asarray(wt), jnp.asarray(state), jnp.asarray(qsl))
    for i in range(s):
        a, b = qsl[i], qsl[i + 1]
        ext = np.concatenate([state[i].T, x[a:b]])                   # [W-1 + n, C]
        want = np.stack([(ext[j:j + w] * wt.T).sum(0) for j in range(b - a)]) if b > a else np.zeros((0, c))
        want = want / (1 + np.exp(-want))
        np.testing.assert_allclose(np.asarray(out[a:b]), want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(new[i]), ext[-(w - 1):].T, atol=0, rtol=0)
