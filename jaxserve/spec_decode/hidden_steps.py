"""A proposer that runs after each target step on its hidden states (MTP, EAGLE3), on the
device, queued right behind the step: the host reads neither the step nor the drafts before
the next step is dispatched, so a speculating engine pipelines as one without speculation.

The pass covers every position of the step, each paired with its row of the step's hidden
states and the token after it (`next_ids`, from the step: the next input token, or what the
step emitted at a logits row; the host gives the one token it alone knows, the prompt token
after a chunk that does not sample). Each sampling sequence drafts at its last kept position
(`kept_rows`, from the verified step's accepted count), so the drafts are right whether or
not the step kept its own drafts. They are written into the columns of the runner's last
sampled ids after the token (the pass takes those ids and returns them with its drafts:
Proposer.after_dispatch; the engine core hands them over), where the next step, scheduled on the
assumption that every draft is kept, reads them (the scheduler sends DRAFT_ON_DEVICE); when
a draft was rejected that step's chunk is void (scheduler.py), and the host reads the pass's
drafts with the step's tokens (`observe`) for the request's next step.

Such a proposer keeps its cache paged on the target's block tables (one slot per position,
the same as the target's), so it needs no blocks of its own. Positions past a sequence's
last kept one get K/V from tokens that were not kept; they are computed again before anything
reads them (attention reads no position past its own, and every later pass starts at the
first position not yet kept).

Chained drafts (k > 1): after that pass the proposer runs k - 1 more one-token steps per
sampling sequence (`chained_input`), each on the draft before it, writing its K/V at the
next position: up to k - 2 positions past the request's last token, in blocks the scheduler
allocated ahead for them (Scheduler num_lookahead_tokens). Those positions hold drafts, not
verified tokens, rewritten like the rest.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.step_input import StepInput
from jaxserve.core.step_messages import DRAFT_ON_DEVICE, SchedulerOutput
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.worker.compiling import BackgroundCompiler, abstract, wait_all
from jaxserve.worker.target_view import TargetView

logger = logging.getLogger(__name__)


def pass_input(x: StepInput, plan) -> tuple[StepInput, np.ndarray]:
    """(the pass's StepInput over the target step's positions, slots and tables, with the
    host's known next tokens in token_ids; bool[S] the sequences that sample) from the
    step's host-side input and plan. token_ids is -1 where the step's next_ids holds the token."""
    s = x.num_seqs
    n = len(plan.requests)
    qsl = x.query_start_loc
    ids_T = np.full(x.num_tokens, -1, np.int32)
    sample_S = np.zeros(s, bool)
    sample_S[:n] = plan.samples
    for i in np.flatnonzero(~sample_S[:n]):
        # a chunk that does not sample: the prompt token after it (its inputs end there)
        nxt = plan.requests[i].tokens(plan.input_ends[i], plan.input_ends[i] + 1)
        ids_T[qsl[i + 1] - 1] = nxt[0] if nxt else 0
    return StepInput(token_ids=ids_T, positions=x.positions, slot_mapping=x.slot_mapping,
                     token_seq_ids=x.token_seq_ids, query_start_loc=qsl, seq_lens=x.seq_lens,
                     block_tables=x.block_tables, logits_indices=x.logits_indices[:s],
                     window_block_tables=x.window_block_tables, sampling=None), sample_S


def empty_pass_input(target: TargetView, bucket: int) -> StepInput:
    """The pass's input for a target step of `bucket` (its shapes, for warm-up)."""
    return pass_input(*target.empty_step(bucket))[0]


def _run_pass(forward, weights, cache, prev_ids_MC, x: StepInput, sample_S, hidden_TH, next_T, kept_S):
    """(cache, the runner's last ids with the drafts in columns 1..k, drafts i32[S, k]):
    forward(weights, cache, x, hidden, sample_S) over x, its tokens the host's where it knew
    them and else the step's next_T, drafting at the kept rows."""
    x = dataclasses.replace(x, token_ids=jnp.where(x.token_ids >= 0, x.token_ids, next_T),
                            logits_indices=kept_S)
    cache, drafts_SK = forward(weights, cache, x, hidden_TH, sample_S)
    s, k = drafts_SK.shape
    c = min(k, prev_ids_MC.shape[1] - 1)   # the runner's draft columns (none: another proposer's)
    return cache, prev_ids_MC.at[:s, 1:1 + c].set(drafts_SK[:, :c]), drafts_SK


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
    window_SB = (None if x.window_block_tables is None    # (a sliding-window group's, reordered alike)
                 else jnp.where(live_S[:, None], x.window_block_tables[order_S], 0))
    block_S = tables_SB[jnp.arange(s), pos_S // block_size]
    slots_S = jnp.where(live_S & (want_S == pos_S), block_S * block_size + pos_S % block_size, 0)
    seq_S = jnp.where(live_S, jnp.arange(s, dtype=jnp.int32), 0)
    return StepInput(token_ids=jnp.zeros(s, jnp.int32), positions=pos_S.astype(jnp.int32),
                     slot_mapping=slots_S.astype(jnp.int32), token_seq_ids=seq_S,
                     query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32),
                                                      jnp.cumsum(live_S, dtype=jnp.int32)]),
                     seq_lens=jnp.where(live_S, pos_S + 1, 0).astype(jnp.int32),
                     block_tables=tables_SB, logits_indices=seq_S, sampling=x.sampling,
                     window_block_tables=window_SB)


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


class AfterStepProposer(Proposer):
    """A proposer that drafts k tokens per request after each target step (MTP, EAGLE3).
    Subclasses call __init__, and when bound set `weights` (a pytree of arrays), `cache` (its
    paged cache on the target's blocks) and `forward`: fn(weights, cache, x, hidden_TH,
    sample_S) -> (cache, drafts i32[S, k]), traced inside the pass's jit (x: the pass's input,
    its logits_indices the kept rows). The pass after a target step of bucket T runs the
    program of T; warmup() compiles every bucket's in the background."""

    pipelines = True           # drafts ahead on the device (module doc)
    needs_hidden_states = True
    weights: object
    cache: object
    forward: object
    target: TargetView

    def __init__(self, k: int):
        self.k = k
        self.device_draft_columns = k          # its drafts stay on the device for the next step
        self._observed = None                  # (drafts on the device, request id per row)
        self._drafts_read: dict[str, list[int]] | None = None
        self._passes = collections.deque(maxlen=4)   # (step, its pass's drafts), newest last
        self._compiler = BackgroundCompiler()
        self._pending: dict[int, concurrent.futures.Future] = {}   # bucket -> its compile
        self._hidden: dict[int, jax.ShapeDtypeStruct] = {}          # ... the hidden it takes

    @functools.cached_property
    def _step(self):
        """The pass, jitted: the cache and the runner's last ids are donated and replaced."""
        return jax.jit(functools.partial(_run_pass, self.forward), donate_argnums=(1, 2))

    @property
    def num_lookahead_tokens(self) -> int:
        """Positions past a scheduled chunk whose blocks the chained steps write (module doc)."""
        return self.k - 1

    def warmup(self) -> None:
        """Start compiling every target bucket's program on daemon threads; returns at once.
        Call after the target's warm-up: its compiled programs give the hidden states' shape.
        A pass whose program is still compiling waits for it."""
        jobs, target = [], self.target
        ids = target.last_ids
        for t in target.buckets:
            hidden = target.hidden_spec(t)
            if hidden is None:          # the target's program did not compile: first use will
                continue
            x = empty_pass_input(target, t)
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
            args = (abstract(self.weights), abstract(self.cache), ids, abstract(x),
                    jax.ShapeDtypeStruct((x.num_seqs,), jnp.bool_), hidden, i32(t), i32(x.num_seqs))
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

    def after_dispatch(self, step, prev_ids):
        """Queue the pass over a dispatched target step (module doc): its drafts go into the
        runner's last ids (`prev_ids`, donated: the ids returned replace them) for the next
        step, and are kept for `observe`."""
        x, sample_S = pass_input(step.inputs, step.plan)
        self.cache, prev_ids, drafts = self._program(x, step.hidden)(
            self.weights, self.cache, prev_ids, x, sample_S, step.hidden, step.next_ids,
            step.kept_rows)
        self._passes.append((step, drafts))
        return prev_ids

    def observe(self, out: SchedulerOutput, step, result) -> None:
        """The step is read: its pass's drafts are those of each request it kept tokens of
        (a void chunk keeps none), read from the device when first asked for."""
        drafts = next((d for s, d in self._passes if s is step), None)
        rows = [rid if tokens else None for rid, tokens in zip(result.req_ids, result.sampled_token_ids)]
        self._observed = None if drafts is None else (drafts, rows)
        self._drafts_read = None

    @property
    def _drafts(self) -> dict[str, list[int]]:
        """Request id -> the drafts of the last observed step's pass (on the host)."""
        if self._drafts_read is None:
            self._drafts_read = {}
            if self._observed is not None:
                drafts, rows = self._observed
                for rid, d in zip(rows, np.asarray(drafts).tolist()):
                    if rid is not None:
                        self._drafts_read[rid] = d
        return self._drafts_read

    def propose(self, requests, limits: list[int], tails=None) -> list[list[int]]:
        """The observed step's drafts; with `tails` (drafting ahead: each request's step is
        still on the device), the newest pass's, which the next step takes on the device."""
        if tails is not None:
            return [[DRAFT_ON_DEVICE] * lim for lim in limits]
        return [self._drafts.get(r.request_id, [])[:lim] for r, lim in zip(requests, limits)]

    def retain(self, running_ids) -> None:
        """Nothing per request: the cache lives on the target's blocks."""


def _compile(step, args):
    """step lowered for and compiled on abstract `args` (on a warm-up thread)."""
    return step.lower(*args).compile()
