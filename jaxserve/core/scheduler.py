"""The scheduler: decides, each step, which requests run and how many tokens each computes.

There is no prefill/decode split. Each request has `num_computed_tokens` catching up with
`num_tokens` (its draft tokens included); one token budget per step is filled with running
requests first (oldest first), then waiting ones, chunking long prompts. A prefix-cache hit
simply starts `num_computed_tokens` further on. When blocks run out the newest running
request is preempted: its blocks are freed and it recomputes later. A model with a sliding-
window group (kv_cache/manager.py) gives back a running request's window blocks that no later
step of it can read before its chunk is scheduled (`_floor`: drafts in flight may send it back).

A hybrid model's prefix hit needs a state saved at a block boundary (kv_cache/manager.py), so
with prefix caching its chunks are cut to end on one where they can (vLLM's "align" mode):
a 100-token prompt with 16-token blocks runs as 96 tokens, whose state is saved, then 4. A
multi-step decode step saves at the last boundary its loop crosses.

The scheduler alone advances and rolls back `num_computed_tokens`: a request that verified
k draft tokens and kept a of the k + 1 sampled ones goes back by k + 1 - a. It speaks to the
runner only through the data of jaxserve/step_messages.py.

Scheduling past drafts (the engine pipelining while it speculates): a verifying step's drafts
count as known tokens (`Request.inflight_drafts`) until the step is read, so the next step
can be scheduled on the assumption that all of them are kept: it starts after them, with the
step's last sampled token taken on the device. If the step then rejects a draft, that next
step's chunk of the request is void: its counts go back at once, its tokens are never read
(the runner drops them too: its chunk starts past what the request holds), and the request
goes on from what it kept, its next input known to the host.

With recurrent state (hybrid models) a rejected draft cannot be taken back by positions
alone: the verifying step folded it into the state. So a speculating request's state is
copied to its snapshot slot before each verifying step (a state load), and when a draft is
rejected the request goes back to the step's start: the snapshot is copied back before its
next step, which computes the kept tokens again (a few tokens, no drafts) and samples.

Multi-step decode (`num_scheduler_steps` K > 1, vLLM's multi-step scheduling): when every
running request is decoding one token with sampling that needs nothing from the host between
tokens (`_steps_ok`: no penalties, grammar, pending min_tokens ban or prompt logprobs), no
drafts are in play and no waiting request could start, a step runs K decode steps on the
device, each sampling the next input. Each request gets blocks for K positions (never past
its longest length: positions beyond it write nothing), counts K positions as computed and K
tokens as placeholders; update() appends the K tokens, stopping at the first that ends the
request (the rest were computed for nothing, as a finished request's token of the next step
is today).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache.manager import KVCacheManager
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduled_step import ScheduledStep
from jaxserve.lora.slots import LoRASlots
from jaxserve.core.step_messages import (NewRequestData, RunnerOutput, ScheduledRequest,
                                    SchedulerOutput)


# Smallest step size a prefill chunk is cut to fit (Scheduler._fit): below ~128-256 tokens a
# step costs its weight reads on a GPU, so padding costs little there.
FIT_MIN_STEP = 128


@dataclass(slots=True)     # one per running request per step: slots, not frozen (step_messages.py)
class RequestUpdate:
    """What one step did to one request, for output processing (not changed once made)."""
    request_id: str
    new_token_ids: list[int]            # tokens appended this step (0, 1 or more)
    finished: RequestStatus | None      # set when the step ended the request
    stop_reason: int | str | None       # the stop token id that ended it
    num_cached_tokens: int              # prompt tokens found in the prefix cache


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 step_sizes: tuple[int, ...] = (), cache_specs=None, num_slots: int = 0,
                 num_cached_states: int = 0, num_lookahead_tokens: int = 0,
                 state_snapshots: bool = False, max_loras: int = 0, num_window_blocks: int = 0):
        """step_sizes: the token counts the runner pads a step to (its buckets), if any; a
        step that would spill a little past one is cut to end there (see _fit). cache_specs:
        the model's per-layer specs (default: plain paged K/V). num_slots: state slots, of
        which the last num_cached_states hold saved states (hybrid prefix caching).
        num_lookahead_tokens: blocks are allocated for this many positions past each
        scheduled chunk (a proposer that chains drafts on the target's block tables writes
        there after the step: spec_decode/hidden_steps.py), never past what the request can
        reach. state_snapshots: the runner holds a snapshot slot past num_slots for each
        request's live slot (speculation with recurrent state: rollback in the module docstring).
        num_window_blocks: the sliding-window group's blocks (a model with one: kv_cache/manager.py)."""
        self.config = config
        self.num_lookahead_tokens = num_lookahead_tokens
        self.step_sizes = sorted(step_sizes)
        self.block_size = cache.block_size
        self.kv = KVCacheManager(cache_specs or [PagedSpec((("k", (1,)),))],
                                 block_size=cache.block_size, num_blocks=num_blocks,
                                 num_slots=num_slots, num_cached_states=num_cached_states,
                                 num_window_blocks=num_window_blocks,
                                 enable_prefix_caching=cache.enable_prefix_caching)
        self.pool = self.kv.pool
        self._align = self.kv.saves_states     # cut chunks to block boundaries (module doc)
        # Rollback of recurrent state (module doc): live slot s (>= 1) has snapshot slot
        # base + s, past the num_slots here; a request whose drafts were rejected copies it
        # back in its next step.
        self._snapshot_base = num_slots - 1 if state_snapshots else 0
        self._restores: dict[str, tuple[int, int]] = {}    # request -> (snapshot, live slot)
        self.num_state_rollbacks = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []       # for the next step's finished_req_ids
        self._unsent: set[str] = set()           # running requests the runner does not hold
        self.lora_slots = LoRASlots(max_loras)   # running requests' adapters: max_loras at once
        self._in_flight: deque[ScheduledStep] = deque()     # oldest first
        # Counters (cumulative) for metrics.
        self.prefix_queries = 0     # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0        # of those, found
        self.num_preemptions = 0
        self.num_chunks_past_drafts = 0     # chunks scheduled assuming in-flight drafts kept
        self.num_void_chunks = 0            # of those, void (a draft was rejected)

    # -- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.kv.salt_blocks(req.request_id, req.lora_request and req.lora_request.cache_salt)
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error): free its blocks, forget it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
            self._drop_from_runner(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._restores.pop(request_id, None)
        self.kv.free(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def _drop_from_runner(self, req: Request) -> None:
        self.lora_slots.drop(req.request_id)     # (only running requests hold a LoRA slot)
        if req.request_id in self._unsent:
            self._unsent.discard(req.request_id)
        else:
            self._finished_ids.append(req.request_id)

    # -- one step --------------------------------------------------------------------------
    def _cap(self, n: int) -> int:
        """A prefill chunk's tokens after long_prefill_token_threshold (decode rows are 1)."""
        limit = self.config.long_prefill_token_threshold
        return min(n, limit) if limit > 0 else n

    def _fit(self, chunks: list[tuple[Request, int]], total: int) -> list[tuple[Request, int]]:
        """Cut the step's last prefill chunk so the step ends at the step size it would cross,
        when it would spill past it by fewer tokens than the padding it causes: 20 decodes + a
        245-token prompt = 265 tokens run padded to 512, while 20 + 236 = 256 run unpadded and
        the last 9 prompt tokens ride along with the next step's decodes. Padded tokens cost
        full compute, and a step that carries a prefill delays every running request's next
        token (inter-token latency). Only at step sizes from FIT_MIN_STEP up: smaller steps
        are bound by reading the weights, padding costs little there, and cutting would only
        add steps. The cut request keeps the blocks it got (its next chunk needs them)."""
        below = [b for b in self.step_sizes if FIT_MIN_STEP <= b < total]
        above = [b for b in self.step_sizes if b >= total]
        if not below or not above:
            return chunks
        spill = total - below[-1]
        if spill >= above[0] - total:
            return chunks
        for i in range(len(chunks) - 1, -1, -1):
            req, n = chunks[i]
            if n > spill and req.num_computed_tokens + n <= req.num_tokens:   # a prefill chunk
                cut = n - spill
                if self._align:     # still on a block boundary where it can be
                    cut = self._aligned(req, req.num_computed_tokens, cut)
                return chunks[:i] + [(req, cut)] + chunks[i + 1:]
        return chunks

    def _aligned(self, req: Request, start: int, n: int) -> int:
        """n cut so the chunk from `start` ends on its last block boundary, when it crosses one
        and has no drafts (a hybrid model's state is saved only there: module docstring)."""
        end = (start + n) // self.block_size * self.block_size
        return end - start if end > start and not req.spec_token_ids else n

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []      # (request, tokens) in step order
        added: dict[str, list[list[int]]] = {}      # running requests' new ids per group
        preempted: list[str] = []
        state_loads: list[tuple[int, int]] = []
        skipped: list[Request] = []       # waiting on a LoRA slot: the others may go first
        steps = self._num_steps()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._cap(min(self._num_known(req) - req.num_computed_tokens, budget))
            if n <= 0 or self._ends_with_placeholder(req):
                i += 1
                continue
            if self._align and n > 1:
                n = self._aligned(req, req.num_computed_tokens, n)
            end = self._with_lookahead(req, req.num_computed_tokens + n, steps - 1)
            if self.kv.window is not None:    # give back the window blocks no later step reads
                self.kv.slide(req.request_id, self._floor(req))
            while self.kv.lacks(req.request_id, end) and self.running[-1] is not req:
                preempted.append(self._preempt(self.running.pop()).request_id)
            if self.kv.lacks(req.request_id, end):   # even alone it does not fit: preempt itself
                preempted.append(self._preempt(self.running.pop()).request_id)
                break
            added[req.request_id] = self.kv.grow_groups(req.request_id, end)
            chunks.append((req, n))
            budget -= n
            i += 1

        cached_tokens = 0
        # Keep free the blocks that running requests need for their next token, or a request
        # admitted now would be preempted by them at the very next step (and again, and again).
        planned = {r.request_id: n for r, n in chunks}
        reserve = sum(1 for r in self.running
                      if (r.num_computed_tokens + planned.get(r.request_id, 0)) % self.block_size == 0)
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if (lora := req.lora_request) and not self.lora_slots.can_acquire(lora.lora_int_id):
                skipped.append(self.waiting.popleft())     # max_loras adapters are running
                continue
            # Prompt logprobs need every prompt position's logits: no cache hits for those.
            wants_prompt_lp = req.sampling_params.prompt_logprobs is not None
            hits = (self.kv.prefix_hits(req.request_id, req.all_token_ids)
                    if req.num_computed_tokens == 0 and not wants_prompt_lp else [])
            computed = len(hits) * self.block_size if hits else req.num_computed_tokens
            n = self._cap(min(req.num_tokens - computed, budget))
            if self._align:
                n = self._aligned(req, computed, n)
            end = self._with_lookahead(req, computed + n)
            if not self.kv.can_admit(req.request_id, hits, end, reserve):
                break
            self.waiting.popleft()
            self.lora_slots.take(req.request_id, lora)    # (written before the step if new)
            load = self.kv.admit(req.request_id, hits, end)
            if load is not None:          # a hybrid hit: its saved state into its slot first
                state_loads.append(load)
            if req.status == RequestStatus.WAITING:       # first admission: count the lookup
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += min(computed, req.num_prompt_tokens)
                req.num_cached_tokens = min(computed, req.num_prompt_tokens)
                cached_tokens += req.num_cached_tokens
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._unsent.add(req.request_id)
            chunks.append((req, n))
            budget -= n

        self.waiting.extendleft(reversed(skipped))
        chunks = self._fit(chunks, self.config.max_num_batched_tokens - budget)
        new_requests, scheduled, state_saves = [], [], []
        for req, n in chunks:
            rid = req.request_id
            if rid in self._unsent:           # its whole table is new to the runner
                self._unsent.discard(rid)
                new_requests.append(NewRequestData(
                    rid, list(req.prompt_token_ids), list(req.output_token_ids),
                    req.sampling_params, req.seed, req.eos_token_ids, self.lora_slots.slot_for(rid)))
            new_ids = added.get(rid) if rid in added else self.kv.group_block_ids(rid)
            scheduled.append(sched := self._advance(req, n, new_ids, steps))
            if rid in self._restores:         # before the step: its state as before the drafts
                state_loads.append(self._restores.pop(rid))
            elif self._snapshot_base and sched.spec_token_ids:
                live = self.kv.slots[rid]
                state_loads.append((live, self._snapshot_base + live))
            if self._align and not sched.spec_token_ids:
                end = sched.start_position + sched.num_positions
                slot = (self.kv.plan_state_save(rid, end) if steps == 1 else
                        self.kv.plan_loop_save(rid, sched.start_position, end, self._longest(req)))
                sched.save_state_slot = slot
                if slot and steps == 1:     # (a multi-step's is copied inside its loop)
                    state_saves.append((self.kv.slots[rid], slot))
        finished = []
        if chunks:          # an empty step is never run: it carries nothing, not even these
            finished, self._finished_ids = self._finished_ids, []
            self._in_flight.append(ScheduledStep([req for req, _ in chunks], scheduled, set()))
        return SchedulerOutput(new_requests=new_requests, scheduled=scheduled,
                               finished_req_ids=finished, num_tokens=sum(r.num_tokens for r in scheduled),
                               preempted_ids=preempted, num_cached_tokens=cached_tokens,
                               state_loads=state_loads, state_saves=state_saves,
                               lora_loads=self.lora_slots.take_loads())

    def _advance(self, req: Request, n: int, new_ids: list[list[int]],
                 steps: int = 1) -> ScheduledRequest:
        """Schedule n tokens of `req`: they count as computed from now on, and the token the
        step samples counts as a placeholder until update() sees it. `new_ids`: the ids per
        group the runner does not hold yet. A budget that cuts into the drafts keeps the first
        ones. steps > 1 (multi-step decode, n = 1): steps positions and tokens."""
        start = req.num_computed_tokens
        # without this step's drafts (with those of the step before, assumed kept)
        base = req.num_tokens + req.num_output_placeholders + len(req.inflight_drafts)
        sample = start + n >= base
        drafts = []
        if req.spec_token_ids:
            drafts = req.spec_token_ids[:max(0, start + n - base)]
            req.spec_token_ids = []
        self.num_chunks_past_drafts += bool(req.inflight_drafts)
        req.inflight_drafts = drafts
        req.num_computed_tokens += n + steps - 1
        req.num_output_placeholders += steps * int(sample)
        return ScheduledRequest(req.request_id, start, n, new_ids, sample, drafts,
                                num_steps=steps)

    def _num_steps(self) -> int:
        """Decode steps the next step runs on the device (module doc: multi-step decode)."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or not self.running:
            return 1
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return 1                 # one could start: admit it at the next step
        return steps if all(self._steps_ok(r) for r in self.running) else 1

    def _steps_ok(self, req: Request) -> bool:
        """Whether `req` may decode several steps in one: one token to compute, no drafts,
        and sampling that needs nothing from the host between tokens (penalties read the
        tokens so far, a grammar its matcher's state, a min_tokens ban lifts at a count)."""
        p = req.sampling_params
        return (not req.spec_token_ids and not req.inflight_drafts
                and self._num_known(req) - req.num_computed_tokens == 1
                and not p.uses_penalties and p.structured_outputs is None
                and p.prompt_logprobs is None and req.num_generated >= p.min_tokens)

    def _num_known(self, req: Request) -> int:
        """Tokens whose ids exist (on the host or, as placeholders, on the device), drafts
        included: the request computes up to here."""
        return (req.num_tokens + req.num_output_placeholders + len(req.inflight_drafts)
                + len(req.spec_token_ids))

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """Apply a step's results: append sampled tokens, roll back rejected drafts, cache
        newly full blocks, check the token-level stop conditions (EOS, stop_token_ids,
        max_tokens, max_model_len).

        The next step may already have been scheduled (and dispatched): its chunks count this
        step's tokens as placeholders. Returns one entry per request still known."""
        step = self._in_flight.popleft()
        results = []
        for req, sched, tokens in zip(step.requests, out.scheduled, result.sampled_token_ids):
            if id(req) in step.void:        # its counts went back when it was made void
                continue
            if sched.sample:
                req.num_output_placeholders -= sched.num_steps
            if req.inflight_drafts is sched.spec_token_ids:    # no later step holds it
                req.inflight_drafts = []
            if self.requests.get(req.request_id) is not req:   # finished or aborted meanwhile
                if sched.save_state_slot:
                    self.kv.release_state_save(sched.save_state_slot)
                continue
            rejected = 0
            if sched.spec_token_ids and tokens and req.status == RequestStatus.RUNNING:
                # k drafts verified, a tokens kept: a - 1 drafts were right (plus one sampled
                # token), so the KV of the other k + 1 - a positions is garbage.
                rejected = len(sched.spec_token_ids) + 1 - len(tokens)
                req.num_computed_tokens -= rejected
                if rejected:
                    self._void_later(req)
            status, kept = None, []
            for token in tokens if sched.sample else ():
                req.output_token_ids.append(token)
                kept.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if req.status == RequestStatus.RUNNING:   # the KV this step wrote is valid now
                end = sched.start_position + sched.num_positions - rejected
                self.kv.cache_full_blocks(req.request_id, req.token_slice,
                                          min(end, req.num_tokens))
            if sched.save_state_slot:     # never with drafts: `end` is the chunk's end
                if req.status == RequestStatus.RUNNING:
                    end = end // self.kv.block_size * self.kv.block_size   # (a loop's last)
                    self.kv.commit_state_save(req.request_id, end, sched.save_state_slot,
                                              in_output=end > req.num_prompt_tokens)
                else:                     # preempted meanwhile: its blocks were not registered
                    self.kv.release_state_save(sched.save_state_slot)
            if rejected and self._snapshot_base and req.status == RequestStatus.RUNNING and status is None:
                # The recurrent state went over the rejected drafts too: back to the snapshot
                # from before the step, whose kept inputs are then computed again. NOTE: the
                # engine waits for each step of a model with state while speculating
                # (schedules_past_drafts), so no later step counted on this one's positions.
                assert not self._in_flight, "a state rollback needs the core to wait for each step"
                req.num_computed_tokens = sched.start_position
                live = self.kv.slots[req.request_id]
                self._restores[req.request_id] = (self._snapshot_base + live, live)
                self.num_state_rollbacks += 1
            if kept and req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if status is not None:
                self.finish_request(req.request_id, status)
            results.append(RequestUpdate(req.request_id, kept, status, req.stop_reason,
                                         req.num_cached_tokens))
        return results

    def _void_later(self, req: Request) -> None:
        """`req` rejected drafts that a later scheduled step assumed kept: that step's chunk
        of it is void (module doc); it goes on from what this step kept."""
        for later in self._in_flight:
            sched = later.chunk_of(req)
            if sched is None:
                continue
            later.void.add(id(req))
            self.num_void_chunks += 1
            req.num_computed_tokens -= sched.num_positions
            req.num_output_placeholders -= sched.num_steps * int(sched.sample)
            req.inflight_drafts = []

    @property
    def schedules_past_drafts(self) -> bool:
        """Whether a step may be scheduled before the verifying step ahead of it is read (not
        with recurrent state: its rollback recomputes from the step's start)."""
        return not self._snapshot_base

    def unschedule(self, out: SchedulerOutput) -> None:
        """Take back the newest step, which never ran (its inputs could not be built): its
        requests go on from where they were. Their blocks stay allocated and the runner has
        taken in the step's diffs (new requests, blocks), so only the counts go back."""
        step = self._in_flight.pop()
        for req, sched in zip(step.requests, out.scheduled):
            if sched.save_state_slot:    # the copy after the step never ran either
                self.kv.release_state_save(sched.save_state_slot)
            req.num_computed_tokens = sched.start_position
            req.num_output_placeholders -= sched.num_steps * int(sched.sample)
            req.spec_token_ids = list(sched.spec_token_ids)
            # the drafts of the step before, if it holds the request (not void), are in flight again
            before = next((s for s in (st.chunk_of(req) for st in reversed(self._in_flight)) if s), None)
            req.inflight_drafts = before.spec_token_ids if before else []

    # -- helpers ---------------------------------------------------------------------------
    def _floor(self, req: Request) -> int:
        """The oldest position a later step of `req` can start at: a rejected draft sends it
        back into a chunk in flight (its start + kept tokens), a step taken back to its start."""
        starts = [c.start_position for st in self._in_flight if (c := st.chunk_of(req))]
        return min(starts + [req.num_computed_tokens])     # (the least: never frees too much)

    def _with_lookahead(self, req: Request, end: int, more: int = 0) -> int:
        """Tokens the request's blocks must hold once `end` are computed: num_lookahead_tokens
        (and `more`: a multi-step's later positions) more, but no more than its longest
        possible sequence (the input processor checked that this fits the cache)."""
        ahead = self.num_lookahead_tokens + more
        return max(end, min(end + ahead, self._longest(req))) if ahead else end

    def _longest(self, req: Request) -> int:
        """Its longest possible sequence: max_model_len, or its prompt and max_tokens."""
        cap, max_tokens = self.config.max_model_len, req.sampling_params.max_tokens
        return cap if max_tokens is None else min(cap, req.num_prompt_tokens + max_tokens)

    def _ends_with_placeholder(self, req: Request) -> bool:
        """The token on its way back will end the request (max_tokens / max_model_len): don't
        compute past it."""
        if not req.num_output_placeholders:
            return False
        ahead = req.num_output_placeholders + len(req.inflight_drafts)
        return req.num_tokens + ahead >= self._longest(req)

    def _preempt(self, req: Request) -> Request:
        self._drop_from_runner(req)
        self.kv.free(req.request_id, forget=False)
        self._restores.pop(req.request_id, None)     # it recomputes its state from scratch
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.inflight_drafts = []
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        return req

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
