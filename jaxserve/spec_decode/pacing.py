"""Whether the engine pipelines behind a speculative step, from each request's running acceptance.

Pipelined (engine/core.py), step N+1 is scheduled and launched before N is read, assuming N
keeps all its drafts; a request whose drafts N rejects loses its chunk of N+1 (void:
core/scheduler.py), a whole step of the device for that request. Waiting for N instead costs
every request the host's gap between reading N and launching N+1. So pipelining pays while
the share of requests whose chunk would be void stays under the gap's share of a step.

Measured (H100, 8B shape, batch 1, k = 3, replayed drafts; BENCHMARKS.md): a pipelined step
of 5.98 ms against 7.45 ms waited, a gap of about a quarter of a step; with 70 % of drafts
right, all three are kept in 34 % of steps and pipelining ran at 1.54x no speculation against
2.03x waiting. Hence `MAX_VOID_RATE` = 0.25: the core waits while the expected share of void
chunks is above it and pipelines again when acceptance comes back.

Each request's chance of keeping all its drafts is a running mean (weight `WEIGHT` on the
newest step) of its verifying steps' outcomes, starting from the same mean over every
request's steps (1 before any: a new engine pipelines). Only a request whose step in flight
verifies drafts (`Request.inflight_drafts`) can have its next chunk voided; the others count
as never void. Steps are observed whether the core waited for them or not (a void chunk says
nothing and is skipped), so the rates follow acceptance both ways.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.core.request import Request
from jaxserve.core.step_messages import RunnerOutput, SchedulerOutput

MAX_VOID_RATE = 0.25
WEIGHT = 0.25


class DraftPacing:
    """The running rate at which each request's verifying steps keep all their drafts."""

    def __init__(self, max_void_rate: float = MAX_VOID_RATE, weight: float = WEIGHT):
        if not 0.0 <= max_void_rate <= 1.0:
            raise ValueError(f"max_void_rate must be in [0, 1]; got {max_void_rate!r}")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1]; got {weight!r}")
        self.max_void_rate, self.weight = max_void_rate, weight
        self.kept_all: dict[str, float] = {}    # request id -> running rate of all drafts kept
        self.prior = 1.0                        # the same over every request: a new one's start

    def observe(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """A step was read: each request that verified drafts kept all of them or not."""
        for sched, tokens in zip(out.scheduled, result.sampled_token_ids):
            k = len(sched.spec_token_ids)
            if k and tokens:                    # (no tokens: its chunk was void, or no sample)
                hit = float(len(tokens) == k + 1)
                rate = self.kept_all.get(sched.req_id, self.prior)
                self.kept_all[sched.req_id] = rate + self.weight * (hit - rate)
                self.prior += self.weight * (hit - self.prior)

    def retain(self, running_ids: Iterable[str]) -> None:
        """Forget every request but these."""
        keep = set(running_ids)
        for rid in [r for r in self.kept_all if r not in keep]:
            del self.kept_all[rid]

    def void_rate(self, running: list[Request]) -> float:
        """The expected share of these requests whose chunk scheduled behind the step in
        flight would be void."""
        void = sum(1.0 - self.kept_all.get(r.request_id, self.prior) for r in running if r.inflight_drafts)
        return void / len(running) if running else 0.0

    def pipelines(self, running: list[Request]) -> bool:
        """Whether to launch the next step before reading the one in flight."""
        return self.void_rate(running) <= self.max_void_rate
