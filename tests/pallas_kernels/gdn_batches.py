"""Random ragged batches for the gated-delta kernel tests: normalised q/k per key head, v,
decays and write strengths per value head, query_start_loc, seq_lens (computed + new), slots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.models.layers import deltanet as gdn


def gdn_batch(qlens, starts, slots, *, g, h, k, v, num_slots, pad_tokens=3, max_decay=1.5,
              state_scale=1.0, seed=0):
    """(q, k, v, g, beta, query_start_loc, seq_lens, state_slots, state f32[num_slots, H, V, K])."""
    rng = np.random.default_rng(seed)
    t = sum(qlens) + pad_tokens
    q_ = gdn.l2norm(jnp.asarray(rng.standard_normal((t, g, k)), jnp.float32)) * k ** -0.5
    k_ = gdn.l2norm(jnp.asarray(rng.standard_normal((t, g, k)), jnp.float32))
    v_ = jnp.asarray(rng.standard_normal((t, h, v)), jnp.float32)
    g_ = -jnp.asarray(rng.uniform(0.01, max_decay, (t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 0.95, (t, h)), jnp.float32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32))
    seq_lens = jnp.asarray(np.asarray(starts) + np.asarray(qlens), jnp.int32)
    state = jnp.asarray(state_scale * rng.standard_normal((num_slots, h, v, k)), jnp.float32)
    return q_, k_, v_, g_, beta, qsl, seq_lens, jnp.asarray(slots, jnp.int32), state
