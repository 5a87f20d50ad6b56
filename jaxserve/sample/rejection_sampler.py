"""Verify draft tokens against the target model on the device: an exact rejection sampler.

Legend: S sequences (padded), D draft rows (padded), R = S + D logits rows, K the most drafts
one sequence carries, V vocabulary, N logprobs per token.

Rows of a verifying step: row s < S is sequence s's *bonus* row (the logits after its last
draft; the token sampled when every draft is accepted); row S + i is a *draft row*: the
logits that predict one draft token. `draft_rows_SK[s, j]` names the row of sequence s's
draft j (j < num_drafts_S[s]).

Per draft row, with p the target distribution after the same processing the normal sampler
applies (bans, bias, penalties, temperature, min_p / top_k / top_p; sampler.target_logits)
and q the proposer's distribution (one-hot on the draft when the proposer has none):
  greedy rows:  accept while the draft is the target's argmax; else emit the argmax.
  random rows:  accept with probability min(1, p(d) / q(d)); else draw from
                normalize(max(p - q, 0)) (for one-hot q: p without the draft).
A sequence keeps its accepted prefix of a drafts, then one more token: the recovered token of
draft a, or the bonus row's own sample when all were accepted. The kept tokens are then
distributed exactly as tokens sampled one at a time from the target (Leviathan et al. 2023).

Random keys come from (seed, offset) as in the normal sampler, offset = the output index a
row's token would take, so no two kept decisions share a key.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sample import sampler
from jaxserve.sample.tensors import SamplingTensors

# fold_in tags: the acceptance draw of a row must not reuse the noise of its Gumbel draw.
_ACCEPT_STREAM = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    rows: sampler.SamplerOutput     # per row R: the token it emits (a draft row: the draft if
                                    # accepted, else its recovered token) and its logprobs
    num_accepted: jax.Array         # i32[S] leading drafts accepted (kept tokens = this + 1)
    last_ids: jax.Array             # i32[S] each sequence's last kept token


def accept_rows(x_RV: jax.Array, greedy_R: jax.Array, is_greedy_R: jax.Array,
                draft_ids_R: jax.Array, keys_R: jax.Array,
                draft_probs_RV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(accepted bool[R], emitted token i32[R]) of each row on its own. `draft_ids_R` < 0
    marks a row without a draft (a bonus row): it is sampled as the normal sampler does.
    `draft_probs_RV`: the proposer's q per row (None: one-hot on the draft)."""
    R, V = x_RV.shape
    has_draft_R = draft_ids_R >= 0
    draft_R = jnp.maximum(draft_ids_R, 0)
    p_RV = jax.nn.softmax(x_RV, axis=-1)
    p_draft_R = jnp.take_along_axis(p_RV, draft_R[:, None], axis=-1)[:, 0]
    if draft_probs_RV is None:
        ratio_R = p_draft_R                          # q(d) = 1
        draft_V = jnp.arange(V)[None, :] == draft_R[:, None]
        residual_RV = jnp.where(draft_V & has_draft_R[:, None], -jnp.inf, x_RV)
    else:
        q_RV = jnp.where(has_draft_R[:, None], draft_probs_RV.astype(jnp.float32), 0.0)
        q_draft_R = jnp.take_along_axis(q_RV, draft_R[:, None], axis=-1)[:, 0]
        ratio_R = p_draft_R / jnp.maximum(q_draft_R, 1e-30)
        residual_RV = jnp.log(jnp.maximum(p_RV - q_RV, 0.0))
        # Where p <= q everywhere (then p == q: acceptance is certain) keep p, not all -inf.
        residual_RV = jnp.where(jnp.any(residual_RV > -jnp.inf, axis=-1, keepdims=True),
                                residual_RV, x_RV)
    u_R = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_STREAM)))(keys_R)
    accepted_R = jnp.where(is_greedy_R, greedy_R == draft_R, u_R < ratio_R) & has_draft_R
    recovered_R = jnp.where(is_greedy_R, greedy_R, sampler.gumbel_draw(residual_RV, keys_R))
    return accepted_R, jnp.where(accepted_R, draft_R, recovered_R)


def combine(accepted_R: jax.Array, emitted_R: jax.Array, draft_rows_SK: jax.Array,
            num_drafts_S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens i32[S, K+1], kept i32[S]) per sequence: tokens[s, :kept[s]] are the kept ones."""
    S, K = draft_rows_SK.shape
    valid_SK = jnp.arange(K)[None, :] < num_drafts_S[:, None]
    acc_SK = accepted_R[draft_rows_SK] & valid_SK
    num_acc_S = jnp.sum(jnp.cumprod(acc_SK.astype(jnp.int32), axis=-1), axis=-1)
    j_J = jnp.arange(K + 1)[None, :]
    from_draft_SJ = emitted_R[draft_rows_SK[:, jnp.minimum(jnp.arange(K + 1), K - 1)]]
    tokens_SJ = jnp.where(j_J < num_drafts_S[:, None], from_draft_SJ, emitted_R[:S, None])
    return tokens_SJ, num_acc_S + 1


def verify(logits_RV: jax.Array, t: SamplingTensors, draft_ids_R: jax.Array,
           draft_rows_SK: jax.Array, num_drafts_S: jax.Array, num_top: int,
           truncate: bool = True, kernels: bool = True,
           draft_probs_RV: jax.Array | None = None) -> VerifyOutput:
    """Sample the bonus rows and verify the draft rows of a step (call inside jit; `num_top`,
    `truncate`, `kernels` are static). `t` has one row per logits row (a draft row: its
    sequence's parameters, its history with the earlier drafts, its own offset)."""
    logits_RV = logits_RV.astype(jnp.float32)
    x_RV, greedy_R, is_greedy_R = sampler.target_logits(logits_RV, t, truncate, kernels)
    keys_R = sampler.row_keys(t.seeds, t.offsets)
    accepted_R, emitted_R = accept_rows(x_RV, greedy_R, is_greedy_R, draft_ids_R, keys_R,
                                        draft_probs_RV)
    tokens_SJ, kept_S = combine(accepted_R, emitted_R, draft_rows_SK, num_drafts_S)
    last_S = jnp.take_along_axis(tokens_SJ, (kept_S - 1)[:, None], axis=-1)[:, 0]
    return VerifyOutput(sampler.token_logprobs(logits_RV, emitted_R, num_top), kept_S - 1, last_S)
