"""A per-step record of the engine's decisions, for notebooks and debugging.

`StepTrace.attach(engine)` registers a listener on `LLMEngine.step_listeners`; after every
step that ran, it keeps a `StepRecord`: which requests ran and how many tokens each
computed, the KV blocks they hold, prefix-cache hits, preemptions, and how long the step
took. Nothing here changes what the engine does.

    trace = StepTrace.attach(llm.engine)
    llm.generate(prompts, params)
    trace.steps[0].chunks[0].num_tokens
    trace.detach()
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxserve.core.step_messages import ScheduledRequest


@dataclass(frozen=True)
class ChunkRecord:
    request_id: str
    start_position: int             # position of the chunk's first token
    num_tokens: int                 # tokens whose KV this step computed for the request
    is_prefill: bool                # False only for a one-token decode of a generated token
    sampled_token: int | None       # token sampled from the chunk's last position (None: mid-prompt)
    block_ids: tuple[int, ...]      # the request's whole block table after the step's allocation


@dataclass(frozen=True)
class StepRecord:
    step: int                       # 0-based index among the steps this trace saw
    seconds: float                  # host wall time of runner.execute + scheduler.update
    chunks: tuple[ChunkRecord, ...]  # in step order: running requests first, then new ones
    num_tokens: int                 # tokens computed this step (<= max_num_batched_tokens)
    kv_blocks_used: int             # distinct blocks in the block tables of the step's requests
    kv_blocks_total: int            # usable blocks (block 0, the null block, excluded)
    prefix_cache_hit_tokens: int    # tokens the step's new requests found in the prefix cache
                                    # (re-admissions after a preemption included)
    new_ids: tuple[str, ...]        # requests admitted (or re-admitted) this step
    preempted_ids: tuple[str, ...]  # requests preempted while building this step
    num_waiting: int                # requests waiting when the step's results came back
    num_running: int                # requests running then (the next step may be scheduled already)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(c.request_id for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_prefill)


def _chunk_record(sched: ScheduledRequest, tokens: list[int], num_prompt: int,
                  table: list[int]) -> ChunkRecord:
    # A decode computes one token that the model itself produced; everything else (prompt
    # chunks, recomputation after preemption) is prefill work.
    n = sched.num_tokens
    is_decode = n == 1 and sched.sample and sched.start_position >= num_prompt
    return ChunkRecord(request_id=sched.req_id, start_position=sched.start_position, num_tokens=n,
                       is_prefill=not is_decode, sampled_token=tokens[-1] if tokens else None,
                       block_ids=tuple(table))


def _chunks_text(s: StepRecord) -> str:
    """'a:16p b:1d': request id, tokens computed, p(refill) or d(ecode)."""
    return " ".join(f"{c.request_id}:{c.num_tokens}{'p' if c.is_prefill else 'd'}" for c in s.chunks)


class StepTrace:
    """Records one StepRecord per engine step; call `detach()` to stop recording."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[StepRecord] = []
        # Each request's block table and prompt length, rebuilt from the step messages' diffs
        # as the runner does (the messages carry no whole tables).
        self._tables: dict[str, list[int]] = {}
        self._prompt_lens: dict[str, int] = {}

    @classmethod
    def attach(cls, engine) -> "StepTrace":
        trace = cls(engine)
        engine.step_listeners.append(trace)
        return trace

    def detach(self) -> None:
        if self in self.engine.step_listeners:
            self.engine.step_listeners.remove(self)

    def clear(self) -> None:
        self.steps.clear()

    def __call__(self, outcome) -> None:
        """Record one engine step (an engine.core.StepOutcome)."""
        out, result = outcome.scheduled, outcome.result
        scheduler = self.engine.scheduler
        for rid in out.finished_req_ids:
            self._tables.pop(rid, None)
        for new in out.new_requests:
            self._tables[new.req_id] = []
            self._prompt_lens[new.req_id] = len(new.prompt_token_ids)
        chunks = []
        for sched, tokens in zip(out.scheduled, result.sampled_token_ids):
            table = self._tables.setdefault(sched.req_id, [])
            if sched.new_block_ids:
                table += sched.new_block_ids[0]
            chunks.append(_chunk_record(sched, tokens, self._prompt_lens.get(sched.req_id, 0), table))
        new = {n.req_id for n in out.new_requests}
        self.steps.append(StepRecord(
            step=len(self.steps), seconds=outcome.seconds, chunks=tuple(chunks),
            num_tokens=out.num_tokens,
            # NOTE: counted from the step itself, not from the pool: with a pipelined engine the
            # next step has already allocated its blocks by the time this listener runs.
            kv_blocks_used=len({b for c in chunks for b in c.block_ids}),
            kv_blocks_total=scheduler.pool.num_blocks - 1,
            # NOTE: a (re-)admitted request starts at the first token the cache did not have;
            # out.num_cached_tokens counts only first admissions' prompt tokens.
            prefix_cache_hit_tokens=sum(c.start_position for c in chunks if c.request_id in new),
            new_ids=tuple(n.req_id for n in out.new_requests),
            preempted_ids=tuple(out.preempted_ids),
            num_waiting=len(scheduler.waiting), num_running=len(scheduler.running)))

    # -- views for tables and plots -----------------------------------------------------
    def request_ids(self) -> list[str]:
        """Every request seen, in order of first appearance."""
        seen: dict[str, None] = {}
        for s in self.steps:
            for c in s.chunks:
                seen.setdefault(c.request_id, None)
        return list(seen)

    def tokens_by_request(self) -> dict[str, list[int]]:
        """{request id: tokens computed in each step} (0 where it did not run): a stacked-bar input."""
        table = {rid: [0] * len(self.steps) for rid in self.request_ids()}
        for s in self.steps:
            for c in s.chunks:
                table[c.request_id][s.step] += c.num_tokens
        return table

    def rows(self) -> list[dict]:
        """One flat dict per step (e.g. for `pandas.DataFrame(trace.rows())`)."""
        out = []
        for s in self.steps:
            row = asdict(s)
            row.pop("chunks")
            row["requests"] = _chunks_text(s)
            row["num_prefill_tokens"] = s.num_prefill_tokens
            row["num_decode_tokens"] = s.num_decode_tokens
            out.append(row)
        return out

    def format_table(self) -> str:
        """A plain-text table of the steps (p = prefill chunk, d = decode)."""
        lines = [f"{'step':>4} {'tok':>4} {'kv':>5} {'hit':>4} {'wait':>4}  requests (id:tokens)"]
        for s in self.steps:
            chunks = _chunks_text(s)
            extra = f"  preempted {','.join(s.preempted_ids)}" if s.preempted_ids else ""
            lines.append(f"{s.step:>4} {s.num_tokens:>4} {s.kv_blocks_used:>2}/{s.kv_blocks_total:<2} "
                         f"{s.prefix_cache_hit_tokens:>4} {s.num_waiting:>4}  {chunks}{extra}")
        return "\n".join(lines)
