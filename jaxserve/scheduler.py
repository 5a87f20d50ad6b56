"""The scheduler: decides, each step, which requests run and how many tokens each computes.

There is no prefill/decode split. Each request has `num_computed_tokens` catching up with
`num_tokens`; one token budget per step is filled with running requests first (oldest
first), then waiting ones, chunking long prompts. A prefix-cache hit simply starts
`num_computed_tokens` further on. When blocks run out the newest running request is
preempted: its blocks are freed and it recomputes later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.kv_cache.block_pool import BlockPool
from jaxserve.kv_cache.prefix_cache import extend_block_hashes
from jaxserve.request import Request, RequestStatus


# Smallest step size a prefill chunk is cut to fit (Scheduler._fit). An H200 does ~190 FLOPs
# per byte of HBM (794 TFLOP/s, 4.24 TB/s): below ~128-256 tokens a step costs its weight reads.
FIT_MIN_STEP = 128

PENDING_TOKEN = -1   # a token id not yet known on the host: the runner takes it from the device


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request            # read-only downstream: the runner reads its tokens and params
    token_ids: list[int]        # tokens whose KV this step computes (PENDING_TOKEN: from the device)
    start_position: int         # position of token_ids[0] (num_computed_tokens before the step)
    block_ids: list[int]        # the request's whole block table after this step's allocation
    sample: bool                # the chunk reaches the last known token: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]    # in step order (running requests first)
    num_tokens: int                 # total tokens computed this step
    preempted_ids: list[str]        # requests preempted while building this step
    new_ids: list[str]              # requests that started (or restarted) this step
    num_cached_tokens: int          # prompt tokens this step's new requests found in the cache


@dataclass(frozen=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]    # tokens appended this step (0 or 1 per request here)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 step_sizes: tuple[int, ...] = ()):
        """step_sizes: the token counts the runner pads a step to (its buckets), if any; a
        step that would spill a little past one is cut to end there (see _fit)."""
        self.config = config
        self.step_sizes = sorted(step_sizes)
        self.block_size = cache.block_size
        self.pool = BlockPool(num_blocks, cache.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.blocks: dict[str, list[int]] = {}
        self.hashes: dict[str, list[bytes]] = {}
        # Counters (cumulative) for metrics.
        self.prefix_queries = 0     # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0        # of those, found
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.hashes[req.request_id] = []
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error): free its blocks, forget it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._free_blocks(req)
        self.hashes.pop(request_id, None)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step --------------------------------------------------------------------------
    def _cap(self, n: int) -> int:
        """A prefill chunk's tokens after long_prefill_token_threshold (decode rows are 1)."""
        limit = self.config.long_prefill_token_threshold
        return min(n, limit) if limit > 0 else n

    def _fit(self, chunks: list[ScheduledChunk], total: int) -> list[ScheduledChunk]:
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
            ch = chunks[i]
            n = len(ch.token_ids)
            if n > spill and PENDING_TOKEN not in ch.token_ids:     # a prefill chunk
                req = ch.request
                req.num_computed_tokens -= n
                req.num_pending_tokens -= int(ch.sample)
                return chunks[:i] + [self._chunk(req, n - spill)] + chunks[i + 1:]
        return chunks

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._cap(min(req.num_tokens + req.num_pending_tokens - req.num_computed_tokens, budget))
            if n <= 0 or self._ends_with_pending_token(req):
                i += 1
                continue
            need = self._blocks_needed(req, req.num_computed_tokens + n)
            while self.pool.num_free < need and self.running[-1] is not req:
                preempted.append(self._preempt(self.running.pop()).request_id)
            if self.pool.num_free < need:      # even alone it does not fit: preempt itself
                preempted.append(self._preempt(self.running.pop()).request_id)
                break
            self.blocks[req.request_id] += self.pool.allocate(need)
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1

        new_ids: list[str] = []
        cached_tokens = 0
        # Keep free the blocks that running requests need for their next token, or a request
        # admitted now would be preempted by them at the very next step (and again, and again).
        reserve = sum(1 for r in self.running if r.num_computed_tokens % self.block_size == 0)
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            # Prompt logprobs need every prompt position's logits: no cache hits for those.
            wants_prompt_lp = req.sampling_params.prompt_logprobs is not None
            hits = self._prefix_hits(req) if req.num_computed_tokens == 0 and not wants_prompt_lp else []
            computed = len(hits) * self.block_size if hits else req.num_computed_tokens
            n = self._cap(min(req.num_tokens - computed, budget))
            need = -(-(computed + n) // self.block_size) - len(hits)
            if self.pool.num_free - self.pool.num_reclaimable(hits) - need < reserve:
                break
            self.waiting.popleft()
            self.pool.touch(hits)
            self.blocks[req.request_id] = hits + self.pool.allocate(need)
            if req.status == RequestStatus.WAITING:       # first admission: count the lookup
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += min(computed, req.num_prompt_tokens)
                req.num_cached_tokens = min(computed, req.num_prompt_tokens)
                cached_tokens += req.num_cached_tokens
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_ids.append(req.request_id)
            chunks.append(self._chunk(req, n))
            budget -= n

        total = self.config.max_num_batched_tokens - budget
        chunks = self._fit(chunks, total)
        return SchedulerOutput(chunks=chunks, num_tokens=sum(len(c.token_ids) for c in chunks),
                               preempted_ids=preempted, new_ids=new_ids, num_cached_tokens=cached_tokens)

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[RequestUpdate]:
        """Apply a step's results: append sampled tokens, cache newly full blocks, check the
        token-level stop conditions (EOS, stop_token_ids, max_tokens, max_model_len).

        `sampled[i]` is the token sampled for `out.chunks[i]` (None where the chunk did not
        sample). The next step may already have been scheduled (and dispatched): its chunks
        count this step's tokens as pending. Returns one entry per request still known."""
        results = []
        for chunk, token in zip(out.chunks, sampled):
            req = chunk.request
            if chunk.sample:
                req.num_pending_tokens -= 1
            if self.requests.get(req.request_id) is not req:   # finished or aborted meanwhile
                continue
            if req.status == RequestStatus.RUNNING:
                self._cache_full_blocks(req, chunk.start_position + len(chunk.token_ids))
            new = []
            if chunk.sample and token is not None:
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                new.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish_request(req.request_id, status)
            results.append(RequestUpdate(req, new))
        return results

    def unschedule(self, out: SchedulerOutput) -> None:
        """Take back a step that never ran (its inputs could not be built): its requests go
        on from where they were. Their blocks stay allocated; the next step reuses them."""
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start_position
            req.num_pending_tokens -= int(chunk.sample)

    # -- helpers ---------------------------------------------------------------------------
    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        """Schedule n tokens of `req`: they count as computed from now on, and the token the
        step samples counts as pending until update() sees it."""
        start = req.num_computed_tokens
        tokens = req.token_slice(start, start + n)
        tokens += [PENDING_TOKEN] * (n - len(tokens))     # sampled by the previous step
        sample = start + n == req.num_tokens + req.num_pending_tokens
        req.num_computed_tokens += n
        req.num_pending_tokens += int(sample)
        return ScheduledChunk(request=req, token_ids=tokens, start_position=start,
                              block_ids=list(self.blocks[req.request_id]), sample=sample)

    def _ends_with_pending_token(self, req: Request) -> bool:
        """The token on its way back will end the request (max_tokens / max_model_len): don't
        compute past it."""
        if not req.num_pending_tokens:
            return False
        p = req.sampling_params
        return ((p.max_tokens is not None and req.num_generated >= p.max_tokens)
                or req.num_tokens + req.num_pending_tokens >= self.config.max_model_len)

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(self.blocks[req.request_id]))

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks. At least one token is
        always left to compute, so the step still produces logits for it."""
        hashes = self.hashes[req.request_id]
        extend_block_hashes(hashes, req.all_token_ids, self.block_size)
        limit = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _cache_full_blocks(self, req: Request, computed: int) -> None:
        """Register the blocks that the first `computed` tokens fill (their KV is now written)."""
        if not self.pool.enable_caching:
            return
        hashes = self.hashes[req.request_id]
        full = computed // self.block_size
        if len(hashes) < full:
            extend_block_hashes(hashes, req.all_token_ids[:computed], self.block_size)
        blocks = self.blocks[req.request_id]
        for j in range(min(full, len(hashes), len(blocks))):
            self.pool.cache_block(blocks[j], hashes[j])

    def _preempt(self, req: Request) -> Request:
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        return req

    def _free_blocks(self, req: Request) -> None:
        blocks = self.blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(blocks)

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
