"""Per-sequence sampling parameters as fixed-shape numpy arrays, built on the host each step.

Legend: S sequences (padded), V vocabulary, L max_model_len, M MAX_LOGIT_BIAS_ENTRIES,
W = ceil(V / 8) bytes of a packed token bitmask.

NOTE: every array's shape depends only on S and on constants (V, L, M): a new shape would
be a recompilation of the jitted step. Padding rows are greedy with no penalties.
With `with_extras=False` the penalty, logit_bias and token-mask arrays have width 0 and
the sampler skips that work (a second compiled variant a runner may choose for steps in
which no row uses them: `needs_extras(rows)`).
Random keys are not built here: the device derives them from (seed, offset), so a seeded
request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array         # f32[S]; below GREEDY_TEMPERATURE = greedy
    top_k: jax.Array               # i32[S]; 0 = off
    top_p: jax.Array               # f32[S]; 1 = off
    min_p: jax.Array               # f32[S]; 0 = off
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    presence_penalty: jax.Array    # f32[S]; 0 = off
    frequency_penalty: jax.Array   # f32[S]; 0 = off
    seeds: jax.Array               # u32[S, 2] request seed as (high, low) 32-bit words
    offsets: jax.Array             # i32[S] index of the token being sampled (0 = first output)
    # The extras (width 0 when built with with_extras=False):
    token_history: jax.Array       # i32[S, L] prompt then output ids, padded with V; only for rows with penalties
    num_prompt_tokens: jax.Array   # i32[S] how many leading history entries are prompt
    allowed_mask: jax.Array        # u8[S, W] packed (little-endian bits) tokens that may be sampled
    bias_ids: jax.Array            # i32[S, M] logit_bias token ids, padded with V
    bias_values: jax.Array         # f32[S, M] logit_bias values, padded with 0

    @property
    def num_seqs(self) -> int:
        return self.temperature.shape[0]


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One sequence's sampling state for this step (row order = the step's sequence order)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int                                # the request's seed (the engine picks one if the user did not)
    offset: int                              # index of the token being sampled, 0 = first generated token
    eos_token_ids: tuple[int, ...] = ()      # banned, with stop_token_ids, until min_tokens are generated


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 7) // 8


def needs_extras(rows: Sequence[SamplingRow]) -> bool:
    """Whether any row uses penalties, logit_bias, allowed_token_ids or a min_tokens ban."""
    return any(r.params.uses_penalties or r.params.logit_bias or r.params.allowed_token_ids is not None
               or _banned_until_min_tokens(r) for r in rows)


def make_sampling_tensors(rows: Sequence[SamplingRow], num_seqs: int, vocab_size: int,
                          max_model_len: int, *, with_extras: bool = True,
                          with_mask: bool | None = None) -> SamplingTensors:
    """Numpy SamplingTensors for `rows`, padded with greedy rows to `num_seqs`.

    `with_mask` (default: with_extras) keeps the allowed-token mask at full width alone: a
    step whose only extra is a grammar's mask (jaxserve/structured/) then runs neither the
    penalties nor logit_bias, in a program of its own."""
    with_mask = with_extras if with_mask is None else with_mask
    if len(rows) > num_seqs:
        raise ValueError(f"rows must be at most num_seqs ({num_seqs}); got {len(rows)} rows")
    if not with_extras and needs_extras(rows):
        raise ValueError("with_extras=False, but a row uses penalties, logit_bias, allowed_token_ids "
                         "or min_tokens: build with with_extras=True (see needs_extras)")
    S, V = num_seqs, vocab_size
    L, M = (max_model_len, MAX_LOGIT_BIAS_ENTRIES) if with_extras else (0, 0)
    W = mask_width(V) if with_mask else 0
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    repetition = np.ones(S, np.float32)
    presence = np.zeros(S, np.float32)
    frequency = np.zeros(S, np.float32)
    seeds = np.zeros((S, 2), np.uint32)
    offsets = np.zeros(S, np.int32)
    history = np.full((S, L), V, np.int32)
    num_prompt = np.zeros(S, np.int32)
    allowed = np.full((S, W), 0xFF, np.uint8)
    bias_ids = np.full((S, M), V, np.int32)
    bias_values = np.zeros((S, M), np.float32)

    n = len(rows)
    params = [r.params for r in rows]
    # Whole columns at once: the common rows need no per-row numpy work.
    temperature[:n] = [p.temperature for p in params]
    top_k[:n] = [p.top_k for p in params]
    top_p[:n] = [p.top_p for p in params]
    min_p[:n] = [p.min_p for p in params]
    seed_n = np.array([r.seed & 0xFFFF_FFFF_FFFF_FFFF for r in rows], np.uint64)   # negative seeds wrap
    seeds[:n, 0], seeds[:n, 1] = seed_n >> np.uint64(32), seed_n & np.uint64(0xFFFF_FFFF)
    offsets[:n] = [r.offset for r in rows]
    for i, row in enumerate(rows):
        p = params[i]
        if p.uses_penalties:
            repetition[i], presence[i], frequency[i] = (
                p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            n_p, n_o = len(row.prompt_token_ids), len(row.output_token_ids)
            if n_p + n_o > L:
                raise ValueError(f"prompt + output tokens must be at most max_model_len ({L}); "
                                 f"got {n_p} + {n_o}")
            history[i, :n_p] = row.prompt_token_ids
            history[i, n_p:n_p + n_o] = row.output_token_ids
            num_prompt[i] = n_p
        if p.min_tokens or p.allowed_token_ids is not None:
            banned = _banned_until_min_tokens(row)
            if p.allowed_token_ids is not None or banned:
                allowed[i] = _packed_mask(V, p.allowed_token_ids, banned)
        if p.logit_bias:
            bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
            bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())

    return SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        seeds=seeds, offsets=offsets, token_history=history, num_prompt_tokens=num_prompt,
        allowed_mask=allowed, bias_ids=bias_ids, bias_values=bias_values)


def _banned_until_min_tokens(row: SamplingRow) -> list[int]:
    """EOS (unless ignore_eos) and stop_token_ids while fewer than min_tokens are generated."""
    p = row.params
    if row.offset >= p.min_tokens:     # offset counts tokens generated so far, pending ones too
        return []
    eos = [] if p.ignore_eos else list(row.eos_token_ids)
    return eos + list(p.stop_token_ids)


def _packed_mask(vocab_size: int, allowed_ids: Sequence[int] | None, banned_ids: Sequence[int]) -> np.ndarray:
    ok_V = np.zeros(vocab_size, bool) if allowed_ids is not None else np.ones(vocab_size, bool)
    if allowed_ids is not None:
        ok_V[np.asarray(allowed_ids, np.int64)] = True
    banned = [t for t in banned_ids if 0 <= t < vocab_size]
    ok_V[banned] = False
    return np.packbits(ok_V, bitorder="little")
