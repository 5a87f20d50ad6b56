"""The input of a proposer that runs after each target step on its hidden states (MTP,
EAGLE3): the positions of that step whose KV stayed valid, each paired with the token after
it and with its row of the target step's hidden states.

Such a proposer keeps its cache paged on the target's block tables (one slot per position,
the same as the target's), so it needs no blocks of its own: a position p it computes is
one the target has computed, and the rejected drafts' positions (beyond the last kept
token) are left out, to be written again when they are computed again.

Chained drafts (k > 1): after that pass the proposer runs k - 1 more one-token steps per
sampling sequence (`chained_input`), each on the draft before it, writing its K/V at the
next position: up to k - 2 positions past the request's last token, in blocks the scheduler
allocated ahead for them (Scheduler num_lookahead_tokens). Those positions hold drafts, not
verified tokens; nothing reads them before the next step's pass rewrites them (it covers
every position up to the last kept token, and attention reads no position past its own).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.compiling import BackgroundCompiler, abstract, wait_all
from jaxserve.step_input import StepInput
from jaxserve.step_messages import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


def after_step_input(runner, out: SchedulerOutput, step, result):
    """(StepInput over the valid positions with token p + 1 at each position p, rows i32[T]
    of step.hidden for each, bool[S] whether each sequence's last position predicts its
    request's next drafts, the request ids of those (else None)) or None when there is
    nothing to compute. Padded to the target step's bucket (T of step.hidden), so that the
    proposer has one program per bucket (not one per pair of the step's and its own)."""
    plan, batch = step.plan, runner.batch
    chunks, rows, tokens = [], [], []
    for i, (sched, kept) in enumerate(zip(out.scheduled, result.sampled_token_ids)):
        req = plan.requests[i]
        if batch.requests.get(req.req_id) is not req:
            continue                  # dropped meanwhile
        # Positions whose token p + 1 is known: up to the last kept token.
        n = min(sched.num_tokens, req.num_tokens - 1 - sched.start_position)
        if n <= 0:
            continue
        chunks.append(ScheduledRequest(req.req_id, sched.start_position, n, [], bool(kept)))
        first = int(plan.query_start_loc[i])
        rows += range(first, first + n)
        tokens += req.tokens(sched.start_position + 1, sched.start_position + n + 1)
    if not chunks:
        return None
    x, ids_T = _input(runner, chunks, len(tokens), step.hidden.shape[0])
    ids_T[:len(tokens)] = tokens
    rows_T = np.zeros(len(ids_T), np.int32)
    rows_T[:len(tokens)] = rows
    sample_S = np.zeros(x.num_seqs, bool)
    sample_S[:len(chunks)] = [c.sample for c in chunks]
    return x, rows_T, sample_S, [c.req_id if c.sample else None for c in chunks]


def _input(runner, chunks, num_tokens: int, bucket: int) -> tuple[StepInput, np.ndarray]:
    """(the proposer's StepInput of `chunks` padded to `bucket`, its token ids to fill in):
    the target's positions, slots and block tables, without what only the target's step
    reads (sampling, prompt logprobs, tokens on their way), so that every pass of a bucket
    has the same input structure."""
    x, _ = runner.batch.build(SchedulerOutput([], chunks, [], num_tokens, [], 0), *runner.bucket(bucket))
    ids_T = np.zeros(bucket, np.int32)
    return dataclasses.replace(x, token_ids=ids_T, prev_token_rows=None, next_token_ids=None,
                               sampling=None), ids_T


def chain_order(sample_S):
    """(order i32[S], back i32[S]): the sampling sequences first (the chained steps' sequence
    s is x's sequence order[s]); back undoes it."""
    order = jnp.argsort(~sample_S, stable=True).astype(jnp.int32)
    return order, jnp.argsort(order).astype(jnp.int32)


def chained_input(x: StepInput, sample_S, order_S, step, block_size: int) -> StepInput:
    """The input of chained step `step` (1..k-1) after the pass over x: one token per sampling
    sequence (in `order_S`, sampling ones first: the rest are padding), at its last position
    in x + step. A position past the block table (its draft is past every request's limit,
    drafting.draft_limit) writes the null slot and reads as the table's last position, so no
    kernel reads past a table. token_ids is left for the caller."""
    s, b = x.block_tables.shape
    live_S = jnp.arange(s) < jnp.sum(sample_S)
    want_S = jnp.where(live_S, x.positions[x.logits_indices[order_S]] + step, 0)
    pos_S = jnp.minimum(want_S, b * block_size - 1)
    tables_SB = jnp.where(live_S[:, None], x.block_tables[order_S], 0)
    block_S = tables_SB[jnp.arange(s), pos_S // block_size]
    slots_S = jnp.where(live_S & (want_S == pos_S), block_S * block_size + pos_S % block_size, 0)
    seq_S = jnp.where(live_S, jnp.arange(s, dtype=jnp.int32), 0)
    return StepInput(token_ids=jnp.zeros(s, jnp.int32), positions=pos_S.astype(jnp.int32),
                     slot_mapping=slots_S.astype(jnp.int32), token_seq_ids=seq_S,
                     query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32),
                                                      jnp.cumsum(live_S, dtype=jnp.int32)]),
                     seq_lens=jnp.where(live_S, pos_S + 1, 0).astype(jnp.int32),
                     block_tables=tables_SB, logits_indices=seq_S, sampling=x.sampling)


def chain_drafts(first, next_step, cache, x, sample_S, k: int, block_size: int):
    """Drafts i32[S, k] of x's sequences (rows of non-sampling ones are garbage) and the cache.
    first(cache) -> (cache, draft i32[S], hidden f[S, D]) at each sequence's last position
    of x; next_step(cache, x_j, ids_S, hidden_SD) -> the same for a chained input x_j (its
    sequence s is order[s], its token ids_S[s]). Inside jit: the k - 1 steps are one loop."""
    cache, ids_S, h_SD = first(cache)
    if k == 1:
        return cache, ids_S[:, None]
    order, back = chain_order(sample_S)

    def body(j, carry):
        cache, drafts_SK, h_SD = carry
        x_j = chained_input(x, sample_S, order, j, block_size)
        cache, ids_S, h_SD = next_step(cache, x_j, drafts_SK[:, j - 1], h_SD)
        return cache, drafts_SK.at[:, j].set(ids_S), h_SD

    drafts_SK = jnp.zeros((ids_S.shape[0], k), jnp.int32).at[:, 0].set(ids_S[order])
    cache, drafts_SK, _ = jax.lax.fori_loop(1, k, body, (cache, drafts_SK, h_SD[order]))
    return cache, drafts_SK[back]


class AfterStepProposer:
    """A proposer that drafts k tokens per request after each target step (MTP, EAGLE3).
    Subclasses call __init__, set `weights` (a pytree of arrays), `cache` (its paged cache)
    and `_step`: jax.jit of fn(weights, cache, x, hidden_TH, rows_T, sample_S) -> (cache,
    drafts i32[S, k]), donating the cache. The pass after a target step of bucket T runs the
    program of T; warmup() compiles every bucket's in the background."""

    weights: object
    cache: object
    _step: object

    def __init__(self, runner, k: int):
        self.runner, self.k = runner, k
        self._drafts: dict[str, list[int]] = {}
        self._compiler = BackgroundCompiler()
        self._pending: dict[int, concurrent.futures.Future] = {}   # bucket -> its compile
        self._hidden: dict[int, jax.ShapeDtypeStruct] = {}          # ... the hidden it takes

    @property
    def num_lookahead_tokens(self) -> int:
        """Positions past a scheduled chunk whose blocks the chained steps write (module doc)."""
        return self.k - 1

    def warmup(self) -> None:
        """Start compiling every target bucket's program on daemon threads; returns at once.
        Call after the target's warm-up: its compiled programs give the hidden states' shape.
        A pass whose program is still compiling waits for it."""
        jobs = []
        for t in self.runner.buckets:
            hidden = self.runner.hidden_spec(t)
            if hidden is None:          # the target's program did not compile: first use will
                continue
            x, _ = _input(self.runner, [], 0, t)
            args = (abstract(self.weights), abstract(self.cache), abstract(x), hidden,
                    jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((x.num_seqs,), jnp.bool_))
            self._hidden[t] = hidden
            jobs.append((t, functools.partial(_compile, self._step, args)))
        try:
            self._pending = self._compiler.start(jobs, os.cpu_count() or 1)
        except Exception:  # noqa: BLE001 - no threads: each program compiles on first use
            logger.warning("could not compile the proposer's programs in the background", exc_info=True)
            self._hidden = {}

    def wait_for_warmup(self, raise_errors: bool = True) -> None:
        wait_all(self._pending.values(), raise_errors)

    def _program(self, x, hidden):
        """Warm-up's program for this pass (waiting for it), or the jitted step when there is
        none for these arguments (it compiles on first use)."""
        t, want = x.num_tokens, self._hidden.get(x.num_tokens)
        if want is None or (hidden.shape, hidden.dtype, hidden.sharding) != (want.shape, want.dtype, want.sharding):
            return self._step
        try:
            return self._pending[t].result()
        except Exception:  # noqa: BLE001 - warm-up only saves time
            logger.warning("a proposer program failed to compile in warm-up; compiling again", exc_info=True)
            del self._hidden[t]
            return self._step

    def observe(self, out: SchedulerOutput, step, result) -> None:
        """Run over the step's valid positions; keep each sampling chunk's draft."""
        self._drafts = {}
        built = after_step_input(self.runner, out, step, result)
        if built is None:
            return
        x, rows_T, sample_S, sampled = built
        self.cache, drafts = self._program(x, step.hidden)(self.weights, self.cache, x, step.hidden,
                                                           rows_T, sample_S)
        for rid, draft in zip(sampled, np.asarray(drafts).tolist()):
            if rid is not None:
                self._drafts[rid] = draft

    def propose(self, requests, limits: list[int]) -> list[list[int]]:
        return [self._drafts.get(r.request_id, [])[:lim] for r, lim in zip(requests, limits)]

    def retain(self, running_ids) -> None:
        """Nothing per request: the cache lives on the target's blocks."""


def _compile(step, args):
    """step lowered for and compiled on abstract `args` (on a warm-up thread)."""
    return step.lower(*args).compile()
