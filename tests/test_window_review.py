"""Review of DeepSeek V4's sliding-window cache group (kv_cache/window_group.py): what the
first tests did not pin.

- A random walk of the scheduler as the engine drives it (the next step scheduled before the
  one in flight is read; drafts rejected under a chunk in flight; multi-step decode; prefix
  hits; aborts; preemption; a step taken back): every step reads only window blocks its
  request holds (from what `window` tokens back of its start reads to its last position and
  lookahead), the runner's copy of each window table agrees where the scheduler's is live,
  every block's reference count is the tables holding it, and both pools are free at the end.
- A DeepSeek V4 checkpoint as a draft model (speculative method "draft_model") is refused by
  what it keeps, a sliding-window cache group, not "per-request state" (it has none).
"""

import os
import random

import pytest

from jaxserve import LLM
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache.block_pool import NULL_BLOCK
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_messages import RunnerOutput
from jaxserve.sampling_params import SamplingParams

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
P, W = 4, 8
SPEC = PagedSpec((("kv", (2,)), ("comp", (3,))), sliding_window=W, tokens_per_row=(("comp", 4),),
                 window_arrays=("kv",))


def _check_refs(s):
    held = {}
    for table in s.kv.window.tables.values():
        for b in table:
            if b != NULL_BLOCK:
                held[b] = held.get(b, 0) + 1
    pool = s.kv.window.pool
    assert all(pool.ref_counts[b] == held.get(b, 0) for b in range(1, pool.num_blocks))


def _check_step(s, out, lookahead, runner):
    """What each chunk of `out` reads and writes is held by its request in the runner's table
    (W tokens back of its start, independently of WindowGroup.first_needed)."""
    w = s.kv.window
    for sched in out.scheduled:
        table, longest = runner[sched.req_id], s._longest(s.requests[sched.req_id])
        end = min(sched.start_position + sched.num_positions + lookahead, longest)
        for j in range(max(0, sched.start_position - W + 1) // P, -(-end // P)):
            assert j < len(table) and table[j] != NULL_BLOCK, (sched, j, table)
            assert w.pool.ref_counts[table[j]] > 0, (sched, j, "a freed block")
            assert w.tables[sched.req_id][j] == table[j]
    for rid, table in w.tables.items():
        if rid in runner:
            assert len(runner[rid]) == len(table)
            assert all(b in (NULL_BLOCK, r) for b, r in zip(table, runner[rid]))


def _walk(seed, steps=1, k=0, window_blocks=40, blocks=64):
    rng = random.Random(seed)
    lookahead = 2 * k
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64,
                                  num_scheduler_steps=steps),
                  CacheConfig(block_size=P), blocks, cache_specs=[SPEC],
                  num_window_blocks=window_blocks, num_lookahead_tokens=lookahead)
    prefixes = [list(range(200, 224)), list(range(300, 313))]
    for i in range(6):
        prompt = rng.choice(prefixes)[:rng.randint(4, 24)] + [rng.randint(5, 90)] * rng.randint(1, 12)
        logprobs = 1 if rng.random() < .15 else None          # (no prefix hits for those)
        s.add_request(Request(f"r{i}", prompt, SamplingParams(
            max_tokens=rng.randint(1, 20), ignore_eos=True, prompt_logprobs=logprobs), eos_token_ids=(2,)))
    runner, pending = {}, []          # the runner's window tables; the step in flight

    def read(o):
        tokens = [[] if not r.sample else
                  [rng.randint(5, 90) for _ in range(rng.randint(1, len(r.spec_token_ids) + 1))]
                  if r.spec_token_ids else [rng.randint(5, 90) for _ in range(r.num_steps)]
                  for r in o.scheduled]
        s.update(o, RunnerOutput(o.req_ids, tokens, [None] * len(tokens)))
        _check_refs(s)

    for _ in range(300):
        if not s.requests and not pending:
            break
        for r in s.running:           # drafts for a decoding request, proposed ahead
            if (k and not r.spec_token_ids and r.output_token_ids and r.num_output_placeholders <= 1
                    and r.num_computed_tokens == r.num_tokens + len(r.inflight_drafts) and rng.random() < .7):
                r.spec_token_ids = [rng.randint(5, 90) for _ in range(k)]
        out = s.schedule()
        for new in out.new_requests:
            runner[new.req_id] = []
        for sched in out.scheduled:
            runner[sched.req_id] = runner.get(sched.req_id, []) + list(sched.new_block_ids[1])
        _check_step(s, out, lookahead, runner)
        _check_refs(s)
        taken_back = out.scheduled and rng.random() < .05
        if taken_back:                # its inputs could not be built: one request fails
            s.unschedule(out)
            s.finish_request(rng.choice(out.req_ids), RequestStatus.FINISHED_ERROR)
        elif out.scheduled:
            pending.append(out)
        while pending and (len(pending) > 1 or not out.scheduled or taken_back):
            read(pending.pop(0))
        if s.requests and rng.random() < .05:
            s.finish_request(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
            _check_refs(s)
    assert not s.requests and not pending       # every request ran to its end
    assert s.kv.window.pool.num_used == 0 and s.pool.num_used == 0
    return s


@pytest.mark.parametrize("steps, k, window_blocks, blocks", [
    (1, 0, 40, 64),     # plenty: prefix hits, pipelined prefill chunks
    (1, 0, 9, 20),      # short pools: preemption
    (3, 0, 10, 14),     # multi-step decode, preemption
    (1, 2, 12, 16),     # drafts rejected under a chunk in flight
])
def test_a_random_walk_reads_only_held_window_blocks(steps, k, window_blocks, blocks):
    seen = [0, 0, 0]
    for seed in range(8):
        s = _walk(seed, steps, k, window_blocks, blocks)
        for i, n in enumerate((s.prefix_hits, s.num_preemptions, s.num_void_chunks)):
            seen[i] += n > 0
    assert seen[0] and (seen[1] or blocks == 64) and (seen[2] or not k)   # the walk got there


def test_a_v4_draft_model_is_refused_for_its_window_group():
    path = os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v4")
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*sliding-window") as error:
        LLM(path, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
            block_size=4, num_kv_blocks=32, warmup=False,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    assert "per-request state" not in str(error.value)
