"""The input of a proposer that runs after each target step on its hidden states (MTP,
EAGLE3): the positions of that step whose KV stayed valid, each paired with the token after
it and with its row of the target step's hidden states.

Such a proposer keeps its cache paged on the target's block tables (one slot per position,
the same as the target's), so it needs no blocks of its own: a position p it computes is
one the target has computed, and the rejected drafts' positions (beyond the last kept
token) are left out, to be written again when they are computed again.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.step_messages import ScheduledRequest, SchedulerOutput


def after_step_input(runner, out: SchedulerOutput, step, result):
    """(StepInput over the valid positions with token p + 1 at each position p, rows i32[T]
    of step.hidden for each, the request ids of the sequences whose last position predicts
    their next draft) or None when there is nothing to compute."""
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
    total = len(tokens)
    t_pad, s_pad = runner.bucket(total)
    x, _ = batch.build(SchedulerOutput([], chunks, [], total, [], 0), t_pad, s_pad)
    ids_T = np.zeros(t_pad, np.int32)
    ids_T[:total] = tokens
    rows_T = np.zeros(t_pad, np.int32)
    rows_T[:total] = rows
    x = dataclasses.replace(x, token_ids=ids_T, prev_token_rows=None)
    return x, rows_T, [c.req_id if c.sample else None for c in chunks]


class AfterStepProposer:
    """A proposer that drafts one token per request after each target step (MTP, EAGLE3):
    subclasses set `runner` and `k` and define `_drafts_of(x, hidden, rows_T)` -> i32[S]."""

    _drafts: dict[str, list[int]]

    def observe(self, out: SchedulerOutput, step, result) -> None:
        """Run over the step's valid positions; keep each sampling chunk's draft."""
        self._drafts = {}
        built = after_step_input(self.runner, out, step, result)
        if built is None:
            return
        x, rows_T, sampled = built
        drafts = np.asarray(self._drafts_of(x, step.hidden, rows_T)).tolist()
        for rid, draft in zip(sampled, drafts):
            if rid is not None:
                self._drafts[rid] = [draft]

    def propose(self, requests, limits: list[int]) -> list[list[int]]:
        return [self._drafts.get(r.request_id, [])[:lim] for r, lim in zip(requests, limits)]

    def retain(self, running_ids) -> None:
        """Nothing per request: the cache lives on the target's blocks."""
