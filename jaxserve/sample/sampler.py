"""On-device sampling and logprobs, batched over sequences with per-sequence parameter arrays.

Legend: S sequences, V vocabulary, L max_model_len, M logit_bias entries per sequence,
N logprobs returned per sequence (static: the engine's max_logprobs), T prompt positions.

Order of operations, as vLLM V1's sampler:
  allowed_token_ids and min_tokens bans (-inf) -> logit_bias -> penalties (repetition over
  prompt + output, presence / frequency over output) -> greedy argmax for greedy rows ->
  temperature -> min_p -> top_k -> top_p -> Gumbel-max draw.
Logprobs are those of the raw model distribution (vLLM's default "raw_logprobs").

NOTE: everything runs for every row, with neutral values on rows that don't use a feature:
a `lax.cond` on a data-dependent predicate would make the GPU wait for the host mid-step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.topk_threshold import topk_threshold, topp_threshold
from jaxserve.sampling_params import GREEDY_TEMPERATURE
from jaxserve.sample.tensors import SamplingRow, SamplingTensors, make_sampling_tensors, needs_extras

__all__ = ["SamplerOutput", "SamplingRow", "SamplingTensors", "make_sampling_tensors", "sample",
           "prompt_logprobs", "processed_logits", "row_keys", "needs_extras", "target_logits",
           "gumbel_draw", "token_logprobs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array     # i32[S] sampled token
    logprobs: jax.Array      # f32[S] log-probability of the sampled token (raw model distribution)
    ranks: jax.Array         # i32[S] 1 + number of tokens strictly more likely than the sampled one
    top_ids: jax.Array       # i32[S, N] most likely tokens
    top_logprobs: jax.Array  # f32[S, N] their log-probabilities


def sample(logits_SV: jax.Array, t: SamplingTensors, num_top: int, truncate: bool = True,
           kernels: bool = True, branch_on_greedy: bool = False) -> SamplerOutput:
    """Draw one token per row; call inside jit (`num_top`, `truncate`, `kernels` are static).

    `truncate=False` leaves min_p / top_k / top_p out of the program (no passes over the
    vocabulary for their thresholds): the runner passes it when no row of the step uses them.
    `kernels=False` keeps the Pallas threshold kernels out (a full sort instead): the runner's
    XLA path. Under a mesh the kernels run on gathered (replicated) logits (_truncate).
    `branch_on_greedy`: skip the Gumbel draw when every row is greedy, by a `lax.cond` (only
    where a branch is cheap, KernelPlan.cheap_branches: the draw over the vocabulary was
    ~1 ms of a ~40 ms CPU step, BENCHMARKS.md)."""
    logits_SV = logits_SV.astype(jnp.float32)
    x_SV, greedy_S, is_greedy_S = target_logits(logits_SV, t, truncate, kernels)
    keys_S = row_keys(t.seeds, t.offsets)
    if branch_on_greedy:
        drawn_S = jax.lax.cond(jnp.all(is_greedy_S), lambda: greedy_S,
                               lambda: gumbel_draw(x_SV, keys_S))
    else:
        drawn_S = gumbel_draw(x_SV, keys_S)
    ids_S = jnp.where(is_greedy_S, greedy_S, drawn_S)
    return token_logprobs(logits_SV, ids_S, num_top)


def target_logits(logits_SV: jax.Array, t: SamplingTensors, truncate: bool = True,
                  kernels: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits whose softmax is the distribution a random row samples from: processed, over
    the temperature, truncated; each row's greedy token; which rows are greedy). The
    rejection sampler (spec_decode/) verifies drafts against the same distribution."""
    x_SV = processed_logits(logits_SV.astype(jnp.float32), t)
    greedy_S = jnp.argmax(x_SV, axis=-1).astype(jnp.int32)
    is_greedy_S = t.temperature < GREEDY_TEMPERATURE
    temp_S = jnp.where(is_greedy_S, 1.0, t.temperature)
    x_SV = x_SV / temp_S[:, None]
    if truncate:
        x_SV = _truncate(x_SV, t, kernels)
    return x_SV, greedy_S, is_greedy_S


def gumbel_draw(x_SV: jax.Array, keys_S: jax.Array) -> jax.Array:
    """One token per row from softmax(x_SV), by the Gumbel-max trick with each row's key."""
    noise_SV = jax.vmap(lambda key: jax.random.gumbel(key, x_SV.shape[-1:], jnp.float32))(keys_S)
    return jnp.argmax(x_SV + noise_SV, axis=-1).astype(jnp.int32)


def token_logprobs(logits_SV: jax.Array, ids_S: jax.Array, num_top: int) -> SamplerOutput:
    """The chosen tokens with their logprobs, ranks and the top `num_top` under the raw model
    distribution."""
    logp_S, ranks_S, top_ids_SN, top_lp_SN = _logprobs(logits_SV.astype(jnp.float32), ids_S, num_top)
    return SamplerOutput(token_ids=ids_S, logprobs=logp_S, ranks=ranks_S, top_ids=top_ids_SN,
                         top_logprobs=top_lp_SN)


def prompt_logprobs(logits_TV: jax.Array, next_ids_T: jax.Array, num_top: int):
    """(logprob f32[T] of each next prompt token, top ids i32[T, N], top logprobs f32[T, N])."""
    logp_T, _, top_ids_TN, top_lp_TN = _logprobs(logits_TV.astype(jnp.float32), next_ids_T, num_top)
    return logp_T, top_ids_TN, top_lp_TN


def row_keys(seeds_S2: jax.Array, offsets_S: jax.Array) -> jax.Array:
    """One threefry key per row from (seed, offset): independent of the other rows."""
    keys = jax.random.wrap_key_data(seeds_S2.astype(jnp.uint32), impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, offsets_S.astype(jnp.uint32))


def processed_logits(logits_SV: jax.Array, t: SamplingTensors) -> jax.Array:
    """Logits after the argmax-changing steps: bans, logit_bias and penalties."""
    S, V = logits_SV.shape
    rows_S1 = jnp.arange(S)[:, None]
    x_SV = logits_SV
    # Width-0 arrays (with_extras=False) are static: their work is left out of the program.
    if t.allowed_mask.shape[1]:
        allowed_SV = jnp.unpackbits(t.allowed_mask, axis=-1, count=V, bitorder="little").astype(bool)
        x_SV = jnp.where(allowed_SV, x_SV, -jnp.inf)
    if t.bias_ids.shape[1]:
        x_SV = x_SV.at[rows_S1, t.bias_ids].add(t.bias_values, mode="drop")   # padding id V is dropped
    if t.token_history.shape[1]:
        x_SV = _apply_penalties(x_SV, t)
    return x_SV


def _apply_penalties(x_SV: jax.Array, t: SamplingTensors) -> jax.Array:
    S, V = x_SV.shape
    rows_S1 = jnp.arange(S)[:, None]
    hist_SL = t.token_history
    is_output_SL = jnp.arange(hist_SL.shape[1])[None, :] >= t.num_prompt_tokens[:, None]
    out_counts_SV = jnp.zeros((S, V), jnp.float32).at[rows_S1, hist_SL].add(
        is_output_SL.astype(jnp.float32), mode="drop")
    seen_SV = jnp.zeros((S, V), bool).at[rows_S1, hist_SL].set(True, mode="drop")
    rep_S1 = t.repetition_penalty[:, None]
    x_SV = jnp.where(seen_SV, jnp.where(x_SV > 0, x_SV / rep_S1, x_SV * rep_S1), x_SV)
    x_SV = x_SV - t.frequency_penalty[:, None] * out_counts_SV
    return x_SV - t.presence_penalty[:, None] * (out_counts_SV > 0)


# Up to this many rows top_k / top_p thresholds come from the radix-select kernels on a GPU;
# past it from one full sort of each row, which serves both (H200, min_p + top_k + top_p over
# 128K logits: 56 vs 65 us at 1 row, 372 vs 925 at 32, about level from 128: 1,331 vs 1,348,
# and 1,691 vs 1,554 over 152K; BENCHMARKS.md).
THRESHOLD_KERNEL_MAX_ROWS = 64


def threshold_kernels_apply(num_rows: int, kernels: bool) -> bool:
    """Whether _truncate finds its thresholds with the Pallas kernels (a GPU, `kernels`, and
    at most THRESHOLD_KERNEL_MAX_ROWS rows) rather than by one sort."""
    return kernels and num_rows <= THRESHOLD_KERNEL_MAX_ROWS and jax.default_backend() == "gpu"


def _truncate(x_SV: jax.Array, t: SamplingTensors, kernels: bool = True) -> jax.Array:
    """min_p, then top_k, then top_p (over what top_k kept); dropped tokens become -inf.

    top_k and top_p keep every logit >= a per-row threshold: found without sorting the rows
    where threshold_kernels_apply (pallas_kernels/topk_threshold.py: radix select; tokens tied
    with the k-th largest then all count in top_p's mass), else from one descending sort."""
    V = x_SV.shape[-1]
    # min_p: p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
    max_S1 = jnp.max(x_SV, axis=-1, keepdims=True)
    x_SV = jnp.where(x_SV >= max_S1 + jnp.log(t.min_p)[:, None], x_SV, -jnp.inf)
    if threshold_kernels_apply(x_SV.shape[0], kernels):
        # Under a mesh the (maybe vocab-split) logits are gathered and every rank finds the
        # same thresholds (sharding/kernels.replicated): a radix select needs whole rows.
        from jaxserve.sharding import kernels as sharded
        kth_S = sharded.replicated(functools.partial(topk_threshold, impl="pallas"), 2)(
            x_SV, t.top_k)                                            # -inf where top_k is off
        cut_S = sharded.replicated(functools.partial(topp_threshold, impl="pallas"), 3)(
            x_SV, t.top_p, kth_S)                                     # -inf where top_p is 1
        keep_SV = (x_SV >= kth_S[:, None]) & (x_SV >= cut_S[:, None])
        return jnp.where(keep_SV, x_SV, -jnp.inf)
    sorted_SV = -jnp.sort(-x_SV, axis=-1)   # descending
    k_S = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, V), V)
    kth_S1 = jnp.take_along_axis(sorted_SV, (k_S - 1)[:, None], axis=-1)
    sorted_SV = jnp.where(jnp.arange(V)[None, :] < k_S[:, None], sorted_SV, -jnp.inf)
    probs_SV = jax.nn.softmax(sorted_SV, axis=-1)
    mass_before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV
    # NOTE: top_p = 1 keeps everything even where float rounding lets the cumsum reach 1.
    in_nucleus_SV = (mass_before_SV < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)
    cutoff_S1 = jnp.min(jnp.where(in_nucleus_SV, sorted_SV, jnp.inf), axis=-1, keepdims=True)
    keep_SV = (x_SV >= kth_S1) & (x_SV >= cutoff_S1)
    return jnp.where(keep_SV, x_SV, -jnp.inf)


def _logprobs(logits_SV: jax.Array, ids_S: jax.Array, num_top: int):
    logp_SV = jax.nn.log_softmax(logits_SV, axis=-1)
    chosen_S = jnp.take_along_axis(logp_SV, ids_S[:, None].astype(jnp.int32), axis=-1)[:, 0]
    ranks_S = 1 + jnp.sum(logp_SV > chosen_S[:, None], axis=-1, dtype=jnp.int32)
    if num_top:
        top_lp_SN, top_ids_SN = jax.lax.top_k(logp_SV, num_top)
    else:
        top_lp_SN = jnp.zeros((logits_SV.shape[0], 0), jnp.float32)
        top_ids_SN = jnp.zeros((logits_SV.shape[0], 0), jnp.int32)
    return chosen_S, ranks_S, top_ids_SN.astype(jnp.int32), top_lp_SN
