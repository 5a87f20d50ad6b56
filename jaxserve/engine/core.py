"""The engine core: schedule -> execute -> update, and the only place that pipelines.

Pipelined: before waiting for step N's tokens, step N+1 is scheduled and dispatched, taking
N's sampled tokens straight from the device; N's tokens are then read and applied one step
late. Requests that finish at N waste one token of N+1. Requests whose next step needs the
host's view of this step's tokens (penalties read the whole history) make the core wait for
each step before scheduling the next.

Speculative decoding: N+1 is scheduled with N's drafts assumed kept (scheduler.py:
scheduling past drafts), its own drafts proposed ahead (spec_decode/drafting.py
propose_ahead): from N's tokens as scheduled (n-gram, the draft model), or left on the device
by the proposer's pass queued right behind N (MTP, EAGLE3: spec_decode/hidden_steps.py). So
the core pipelines as without speculation; a request whose drafts N rejects loses its chunk
of N+1. The core waits for each step for a model with recurrent state (its rollback), for
structured output (the grammar would have to follow the assumed drafts) and while the
requests' acceptance is so low that void chunks would cost more than the waits
(spec_decode/pacing.py). A step it waited for launches the next one as soon as it is read and
applied, before its outputs are processed (detokenized, stop strings) by the caller.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import RequestUpdate, Scheduler
from jaxserve.core.step_messages import RunnerOutput, SchedulerOutput
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.spec_decode import drafting
from jaxserve.spec_decode.pacing import DraftPacing
from jaxserve.spec_decode.proposer import Proposer
from jaxserve.worker.runner import ModelRunner
from jaxserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    """One finished step, for output processing and step listeners."""
    scheduled: SchedulerOutput
    result: RunnerOutput
    updates: list[RequestUpdate]
    seconds: float                  # host time of step(): reading this step, the updates, the next dispatch


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, proposer: Proposer | None = None,
                 structured: StructuredOutputManager | None = None):
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer       # drafts for the next step (spec_decode/), or None
        self.structured = structured   # the matchers and grammar masks (None: no tokenizer)
        self._inflight = None          # the dispatched step whose tokens are not read yet
        # Whether to pipeline behind speculative steps, from the requests' running acceptance
        # (spec_decode/pacing.py; None: always, where nothing else makes the core wait)
        # NOTE: off by default (pacing None, launch_after_wait False), as before issue 67: not
        # yet measured on a GPU, and CPU test runs with them on segfaulted in XLA three times,
        # always in speculative tests (cause not found)
        self.pacing: DraftPacing | None = None
        # A step the core waited for: the next one launches as soon as its inputs are known,
        # before this step's outputs are processed (False: on the next call, as before)
        self.launch_after_wait = False
        self.failed: list[tuple[str, str]] = []   # (request id, error) failed building a step

    def add(self, req: EngineRequest) -> None:
        self.scheduler.add_request(Request(
            req.request_id, list(req.prompt_token_ids), req.sampling_params,
            arrival_time=req.arrival_time, eos_token_ids=req.eos_token_ids, seed=req.seed,
            lora_request=req.lora_request))

    def finish(self, request_ids, status: RequestStatus) -> None:
        for rid in request_ids:
            self.scheduler.finish_request(rid, status)

    def _must_wait(self) -> bool:
        spec = self.proposer is not None
        if spec and not (self.proposer.pipelines and self.scheduler.schedules_past_drafts):
            return True
        if spec and self.pacing is not None and not self.pacing.pipelines(self.scheduler.running):
            return True
        return any(r.sampling_params.uses_penalties
                   or (spec and r.sampling_params.structured_outputs is not None)
                   for r in self.scheduler.running)

    def step(self) -> StepOutcome | None:
        """Finish one step (None: nothing ran)."""
        if self._inflight is None:
            out = self.scheduler.schedule()
            if out.scheduled:
                self._inflight = self._dispatch(out)
            if self._inflight is None:
                return None
        current, self._inflight = self._inflight, None
        t0 = time.perf_counter()
        waits = self._must_wait()
        if not waits:
            if self.proposer is not None:
                drafting.propose_ahead(self.proposer, self.scheduler.running, self.proposer.k,
                                       self.scheduler.config.max_model_len)
            self._dispatch_next()
        out, step = current
        result = self.runner.collect(step)
        updates = self.scheduler.update(out, result)
        if self.structured is not None:
            self.structured.accept(updates)
        if self.proposer is not None:
            self.proposer.observe(out, step, result)
            if self.pacing is not None:
                self.pacing.observe(out, result)
                self.pacing.retain(r.request_id for r in self.scheduler.running)
            drafting.propose_drafts(self.proposer, self.scheduler.running, self.proposer.k,
                                    self.scheduler.config.max_model_len,
                                    valid=self.structured.valid_drafts if self.structured else None)
        if waits and self.launch_after_wait:
            # Everything the next step needs of this one is in (its tokens, the matchers',
            # the drafts): the device starts it while the caller processes this step's
            # outputs; one that ends a request on a stop string wastes its chunk, as pipelined
            self._dispatch_next()
        return StepOutcome(out, result, updates, time.perf_counter() - t0)

    def _dispatch_next(self) -> None:
        upcoming = self.scheduler.schedule()
        if upcoming.scheduled:
            self._inflight = self._dispatch(upcoming)

    def drain(self) -> None:
        """Read the dispatched step, if any, and drop it (the engine is stopping): the device
        is idle and no transfer is in flight when the process exits."""
        if self._inflight is not None:
            _, step = self._inflight
            self._inflight = None
            jax.device_get((step.result, step.prompt))

    def _dispatch(self, out: SchedulerOutput):
        """Launch a step. If its inputs cannot be built, the requests at fault fail alone
        (listed in self.failed) and the step is taken back; a failure no single request
        explains propagates (the engine stops)."""
        # the structured-output manager takes in the step's requests first, and the runner
        # asks for the masks once it has built the step (they wait for the step before)
        masks = self.structured.schedule(out) if self.structured else None
        try:
            step = self.runner.dispatch(out, masks)
        except Exception as e:
            bad = self.runner.failing_requests(out)
            if not bad:
                raise
            logger.exception("could not build a step's inputs; failing %d request(s)", len(bad))
            self.scheduler.unschedule(out)
            for i in bad:
                rid = out.scheduled[i].req_id
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
                self.failed.append((rid, f"{type(e).__name__}: {e}"))
            return None
        if self.proposer is not None:
            # A pass behind the step (MTP, EAGLE3) queues there and leaves its drafts in the
            # last ids the next step reads (spec_decode/hidden_steps.py)
            self.runner.set_prev_ids(self.proposer.after_dispatch(step, self.runner.prev_ids))
        return out, step
