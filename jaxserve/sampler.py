"""On-device sampling, batched over sequences with per-sequence parameter arrays.

Legend: S sequences, V vocabulary, N logprobs returned per sequence (static, max_logprobs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array   # f32[S]; 0 = greedy
    top_k: jax.Array         # i32[S]; 0 = off
    top_p: jax.Array         # f32[S]; 1 = off
    rng_keys: jax.Array      # u32[S, 2]; per-request key for this token (seed, output index)

    @classmethod
    def host(cls, num_seqs: int) -> "SamplingTensors":
        """Greedy defaults as numpy arrays, filled in row by row by the runner."""
        return cls(temperature=np.zeros(num_seqs, np.float32), top_k=np.zeros(num_seqs, np.int32),
                   top_p=np.ones(num_seqs, np.float32), rng_keys=np.zeros((num_seqs, 2), np.uint32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array     # i32[S] sampled token
    logprobs: jax.Array      # f32[S] log-probability of the sampled token (raw model distribution)
    top_ids: jax.Array       # i32[S, N] most likely tokens
    top_logprobs: jax.Array  # f32[S, N] their log-probabilities


def sample(logits_SV: jax.Array, t: SamplingTensors, num_top: int) -> SamplerOutput:
    logits_SV = logits_SV.astype(jnp.float32)
    logp_SV = jax.nn.log_softmax(logits_SV, axis=-1)
    greedy = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
    temp = jnp.where(t.temperature > 0, t.temperature, 1.0)[:, None]
    scaled = logits_SV / temp
    v = logits_SV.shape[-1]
    # top-k and top-p over the sorted row: keep ranks below k and the nucleus mass.
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    cum_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    in_nucleus = cum_before < t.top_p[:, None]
    cutoff = jnp.min(jnp.where(in_nucleus, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    keep = (scaled >= kth) & (scaled >= cutoff)
    masked = jnp.where(keep, scaled, -jnp.inf)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(t.rng_keys, masked)
    ids = jnp.where(t.temperature > 0, drawn.astype(jnp.int32), greedy)
    chosen = jnp.take_along_axis(logp_SV, ids[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp_SV, num_top) if num_top else (
        jnp.zeros((logits_SV.shape[0], 0), jnp.float32), jnp.zeros((logits_SV.shape[0], 0), jnp.int32))
    return SamplerOutput(token_ids=ids, logprobs=chosen, top_ids=top_ids.astype(jnp.int32),
                         top_logprobs=top_lp)
