"""The structured-output manager: the engine's matchers, one per running constrained request,
and each step's grammar masks (vLLM V1's StructuredOutputManager).

The engine core drives it with the step messages the runner gets, so it holds a matcher for
each constrained request the runner's persistent batch holds: `schedule(out)` before each
dispatch (a finished or preempted request's matcher is dropped; a new or resumed one gets a
matcher that has consumed the tokens it generated before), `accept(updates)` after each step
(the matchers consume the kept tokens) and `valid_drafts` when drafts are proposed (cut at
the first token a grammar rejects). The masks (masks.py) go to the runner as data
(`GrammarMasks`), asked for only once the runner has built the step and launched its forward:
they wait for the in-flight step's sampled ids (`last_sampled`, the runner's), so the build
overlaps that step and the fill the step's own forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jaxserve.core.scheduler import RequestUpdate
from jaxserve.core.step_messages import (DRAFT_ON_DEVICE, GrammarMasks, NewRequestData,
                                         SchedulerOutput)
from jaxserve.sample.tensors import mask_width
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import masks
from jaxserve.structured.compiler import GrammarCompiler


@dataclasses.dataclass
class ConstrainedRequest:
    """A running request with structured output, as the manager knows it."""
    req_id: str
    sampling_params: SamplingParams
    num_prompt_tokens: int
    output_token_ids: list[int]      # its tokens read back so far (as the runner holds them)
    grammar: masks.RequestGrammar

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


class StructuredOutputManager:
    """One per engine (with a tokenizer): matchers by request id, and each step's masks."""

    def __init__(self, compiler: GrammarCompiler, last_sampled: Callable[[], dict[str, int]]):
        self.compiler = compiler
        # () -> each request's token sampled by the last dispatched step, by request id: the
        # runner's, waiting for that step's ids only
        self.last_sampled = last_sampled
        self.requests: dict[str, ConstrainedRequest] = {}

    def schedule(self, out: SchedulerOutput) -> Callable[[], GrammarMasks] | None:
        """Take in a step's finished and new requests (before the runner builds it: a step
        whose build fails has still sent them). Returns what makes the step's masks, for the
        runner to call once it has built the step (None: no constrained request samples)."""
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for new in out.new_requests:
            self.requests.pop(new.req_id, None)        # resumed after preemption: start again
            if new.sampling_params.structured_outputs is not None:
                self.add(new)
        if not self.requests or not any(s.sample and s.req_id in self.requests for s in out.scheduled):
            return None
        return functools.partial(self.step_masks, out)

    def add(self, new: NewRequestData) -> None:
        """A matcher for a request the runner takes in, having consumed the tokens it generated
        before a preemption."""
        self.requests[new.req_id] = ConstrainedRequest(
            new.req_id, new.sampling_params, len(new.prompt_token_ids), list(new.output_token_ids),
            masks.RequestGrammar.for_request(self.compiler, new))

    def accept(self, updates: list[RequestUpdate]) -> None:
        """The tokens a step kept (the scheduler's updates): each matcher consumes its own.
        (A request dropped meanwhile has none there, or no matcher: the scheduler skips one it
        no longer holds, and a preempted one's matcher is gone. One that stopped keeps its
        tokens up to the stop, and its matcher goes with the next step.)"""
        for update in updates:
            req = self.requests.get(update.request_id)
            if req is not None and update.new_token_ids:
                req.output_token_ids.extend(update.new_token_ids)
                req.grammar.catch_up(req.output_token_ids)

    def valid_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """`drafts` cut at the first token the request's grammar rejects (all of them for a
        request without one)."""
        req = self.requests.get(req_id)
        if req is None:
            return drafts
        return drafts[:req.grammar.valid_drafts(req.output_token_ids, drafts)]

    def step_masks(self, out: SchedulerOutput) -> GrammarMasks:
        """The masks of the step `out`'s constrained requests that sample, in step order, each
        request's rows its drafts' then its own (GrammarMasks). Waits for the last step's
        sampled ids when a request's last token is still on the device."""
        constrained, r = [], 0
        for sched in out.scheduled:
            req = self.requests.get(sched.req_id)
            if req is None or not sched.sample:
                continue
            drafts = tuple(sched.spec_token_ids)
            if DRAFT_ON_DEVICE in drafts:    # (the core waits for each step of a constrained
                # request with drafts, so they are read back: engine/core.py _must_wait)
                raise RuntimeError(f"request {req.req_id}: a grammar needs its drafts on the host")
            k = len(drafts)
            real = sched.start_position + sched.num_tokens - k    # the drafts are the last tokens
            constrained.append(masks.ConstrainedRows(r + k, req, req.num_tokens < real, drafts,
                                                     tuple(range(r, r + k))))
            r += k + 1
        bits = np.full((r, mask_width(self.compiler.vocab_size)), 0xFF, np.uint8)
        masks.fill_step_masks(self.compiler, bits, constrained, self.last_sampled)
        return GrammarMasks([c.request.req_id for c in constrained], bits)
