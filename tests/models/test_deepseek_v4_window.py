"""DeepSeek V4's sliding-window cache group (kv_cache/manager.py). On the model step: the
goldens with the per-token rows on window tables whose entries before what a chunk may read
hold garbage. Through the engine: prompts much longer than the window (8 tokens on the tiny
checkpoint, 4-token blocks) give the same greedy tokens as an engine that never frees a
window block, while the window pool's blocks in use stay bounded; a chat's next turns hit
the prefix cache after their windows' blocks were freed; drafts right and wrong (pipelined
past them) keep the tokens too."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import test_deepseek_v4_golden as gold
import pytest

from jaxserve import LLM
from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.core.kv_cache.window_group import WindowGroup
from jaxserve.engine.startup_report import startup_lines
from jaxserve.models import deepseek_v4 as v4
from jaxserve.worker.cache_sizing import plan_caches
from jaxserve.worker.memory_plan import CacheDoesNotFit
from model_step_builder import Chunk, build_step, scattered_block_tables
from test_hybrid_speculation import NGRAM, Replay, counts, generate, make_llm
from test_new_families_engine import assert_all_free

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 256, n).tolist() for n in (150, 190)]
STEPS, P, WINDOW, BUDGET = 24, 4, 8, 16


def test_goldens_on_window_tables_whose_freed_entries_hold_garbage():
    """The model on the two groups' layout: the long golden prompt in chunks of 2, 3 and 5 tokens,
    its per-token rows on a pool of their own, every window entry before what a chunk may read
    (deepseek_v4.tokens_back) pointing at a block of NaN, as a freed and reused block holds
    garbage: the logits are still transformers'."""
    golden, cfg, params, prompts = gold._load()
    back = max(v4.tokens_back(cfg, t) for t in cfg.layer_types)
    blocks, window_blocks = gold.NUM_BLOCKS, 24
    tables = scattered_block_tables(1, gold.BLOCKS_PER_SEQ, blocks, seed=9)
    window = scattered_block_tables(1, gold.BLOCKS_PER_SEQ, window_blocks - 1, seed=4)
    garbage = window_blocks - 1                 # in no table
    caches = []
    for spec in v4.cache_specs(cfg):
        layer = {}
        for name, shape in spec.arrays:
            n = window_blocks if name in spec.window_arrays else blocks
            a = jnp.zeros((n, spec.rows(name, gold.BLOCK_SIZE), *shape), jnp.float32)
            layer[name] = a.at[garbage].set(jnp.nan) if name in spec.window_arrays else a
        caches.append(layer)
    prompt, start, got = prompts[2], 0, []
    for n in [2, 3, 5] * 5 + [100]:     # (starts 10, 30, ...: a block falls out right there)
        chunk = [Chunk(0, prompt[start:start + n], start)]
        freed = max(0, start - back + 1) // gold.BLOCK_SIZE
        step_window = np.zeros((gold.S, window.shape[1]), np.int32)
        step_window[0] = window[0]
        step_window[0, :freed] = garbage
        x = build_step(chunk, tables, gold.BLOCK_SIZE, gold.STEP_T, gold.S)
        x = dataclasses.replace(x, window_block_tables=jnp.asarray(step_window))
        caches, logits_TV = gold._step(cfg, params, caches, x)
        got.append(np.asarray(logits_TV)[:len(chunk[0].token_ids)])
        start += len(chunk[0].token_ids)
        if start >= len(prompt):
            break
    np.testing.assert_allclose(np.concatenate(got), golden["prefill_logits_2"], atol=gold.ATOL, rtol=0)


def test_one_budget_split_between_the_groups():
    _, cfg, _, _ = gold._load()
    specs = v4.cache_specs(cfg)

    def plan(budget):
        config = EngineConfig(model=cfg, cache=CacheConfig(block_size=P, kv_cache_memory_bytes=budget),
                              scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET,
                                                        max_model_len=256), dtype="float32", warmup=False)
        return plan_caches(config, specs, [], 0, 256 // P)
    windows = cache_manager.window_blocks(specs, block_size=P, max_num_seqs=4,
                                          max_num_batched_tokens=BUDGET, lookahead=1)
    per_window = cache_manager.bytes_per_block(specs, P, 4, window=True)
    per_block = cache_manager.bytes_per_block(specs, P, 4)
    assert per_window > 10 * per_block           # the rows; the entries on the full group
    budget = windows * per_window + 100 * per_block
    p = plan(budget)
    assert (p.num_window_blocks, p.bytes_per_window_block, p.num_blocks) == (windows, per_window, 100)
    assert p.memory.cache_bytes == budget
    with pytest.raises(CacheDoesNotFit, match="the sliding-window cache .* lower --max-num-seqs"):
        plan(windows * p.bytes_per_window_block)


def _llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("deepseek_v4"), dtype="float32", max_num_seqs=2,
               max_num_batched_tokens=BUDGET, max_model_len=256, block_size=P, num_kv_blocks=128,
               warmup=False)


def _peak_window_use(llm) -> list[int]:
    """The window pool's most blocks in use after any schedule(), as it runs (a list of one)."""
    s, peak = llm.engine.scheduler, [0]
    schedule = s.schedule

    def watched():
        out = schedule()
        peak[0] = max(peak[0], s.kv.window.pool.num_used)
        return out
    s.schedule = watched
    return peak


def test_long_prompts_free_their_window_blocks_and_keep_the_tokens(tiny_checkpoint, monkeypatch):
    with monkeypatch.context() as m:     # the reference: every window block kept
        m.setattr(WindowGroup, "slide", lambda self, request_id, start: None)
        m.setattr(cache_manager, "window_blocks", lambda *a, num_blocks=None, **k: num_blocks)
        keep = _llm(tiny_checkpoint)
        kept_peak = _peak_window_use(keep)
        want = generate(keep, PROMPTS, STEPS)
        turns = [p + w + [5, 6, 7] for p, w in zip(PROMPTS, want)]   # a chat's next turns
        want_turns = generate(keep, turns, STEPS)
    llm = _llm(tiny_checkpoint)
    runner = llm.engine.runner
    assert runner.num_window_blocks < runner.num_blocks
    # the start-up block: the tokens the full group holds, the window pool apart
    lines = startup_lines(llm.engine.config, runner.num_blocks, P, runner.bytes_per_block, on_cpu=True,
                          window=(runner.num_window_blocks, runner.bytes_per_window_block))
    assert f"KV cache: 128 blocks of 4 tokens, {127 * P} tokens" in lines[1]
    assert lines[2].startswith(f"sliding-window cache: {runner.num_window_blocks} blocks of 4 tokens")
    peak = _peak_window_use(llm)
    assert generate(llm, PROMPTS, STEPS) == want
    # each request: its window back from the start of its chunk in flight, that chunk and
    # the one scheduled (two steps' budgets between them), two partial blocks
    bound = 2 * (-(-WINDOW // P) + 2) + 2 * BUDGET // P
    assert peak[0] <= bound < kept_peak[0]
    assert_all_free(llm)
    # the next turns: a hit in both groups, every block but the last windows' freed long ago
    # (those went back last, so the pool reuses them last)
    hits = llm.get_metrics()["prefix_cache_hits_total"]
    assert generate(llm, turns, STEPS) == want_turns
    assert llm.get_metrics()["prefix_cache_hits_total"] - hits >= sum(len(t) - 2 * P for t in turns)
    assert_all_free(llm)


class AheadReplay(Replay):
    """Replay's drafts, proposed ahead of the step on the device (the engine pipelines past
    them: a rejection sends a request back into a chunk still in flight)."""
    pipelines = True

    def propose(self, requests, limits, tails=None):
        out = []
        for i, (req, limit) in enumerate(zip(requests, limits)):
            m = len(req.output_token_ids) + (len(tails[i]) if tails else 0)
            drafts = np.array(self.cont[tuple(req.prompt_token_ids)][m:m + min(self.k, limit)])
            wrong = self.rng.random(len(drafts)) >= self.p
            drafts[wrong] = (drafts[wrong] + 1) % 256
            out.append(drafts.tolist())
        return out


def test_drafts_over_freed_windows_keep_the_tokens(tiny_checkpoint):
    # without prefix caching a freed block goes to the front of the free queue: the next
    # allocation reuses it, so a block freed too early is overwritten before it is read
    llm = make_llm(tiny_checkpoint, "deepseek_v4", None, max_num_seqs=2, max_model_len=256,
                   num_kv_blocks=128, caching=False)
    want = generate(llm, PROMPTS, STEPS)
    llm = make_llm(tiny_checkpoint, "deepseek_v4", NGRAM, max_num_seqs=2, max_model_len=256,
                   num_kv_blocks=128, caching=False)
    llm.engine.core.proposer = AheadReplay(PROMPTS, want, k=3, p=0.6)
    peak = _peak_window_use(llm)
    assert generate(llm, PROMPTS, STEPS) == want
    c = counts(llm)
    assert 0 < c["accepted"] < c["drafted"] and llm.engine.scheduler.num_void_chunks > 0
    assert peak[0] < llm.engine.runner.num_window_blocks - 1
    assert_all_free(llm)
