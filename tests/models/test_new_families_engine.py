"""DeepSeek V3/V3.2 (MLA latent cache, indexer keys), Qwen3-Next/Qwen3.5 (paged K/V beside
per-request state slots) and DeepSeek V4 (window rows, compressor carry and compressed entries,
all per token: a prefix hit resumes mid-window) through the whole engine: cache specs -> cache manager -> runner ->
model. Greedy tokens equal transformers' (the goldens) batched, prefilled in small chunks,
on prefix-cache hits and under preemption; every block and state slot is free afterwards."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
FAMILIES = ["deepseek_v3", "deepseek_v32", "qwen3_next", "qwen3_5_moe", "deepseek_v4"]
STEPS = 8


def golden(name):
    g = np.load(os.path.join(GOLDEN, f"{name}.npz"))
    return [g[f"prompt_{i}"].tolist() for i in range(3)], [g[f"greedy_{i}"].tolist() for i in range(3)]


def run(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    """No block (of either paged group), live slot or planned state save is held once every
    request has ended."""
    s = llm.engine.scheduler
    assert not s.requests and s.pool.num_used == 0 and not s.kv.slots
    assert s.kv.window is None or s.kv.window.pool.num_used == 0    # (DeepSeek V4's window group)
    assert len(s.kv.free_slots) == max(0, s.kv.num_live_slots - 1)
    assert s.kv.states is None or s.kv.states.num_reserved == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_matches_transformers_batched_and_chunked(name, tiny_checkpoint):
    prompts, want = golden(name)
    # 8-token steps: the long prompts are prefilled in chunks beside the others' decodes
    # (room for every saved state: the hybrid models save at most of these 4-token boundaries)
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              max_model_len=128, block_size=4, num_kv_blocks=64, num_cached_states=32, warmup=False)
    assert run(llm, prompts) == [w[:STEPS] for w in want]
    assert_all_free(llm)
    # A second pass: prefix hits (hybrid models: resumed from states saved at block boundaries)
    hits_before = llm.get_metrics()["prefix_cache_hits_total"]
    assert run(llm, prompts) == [w[:STEPS] for w in want]
    hits = llm.get_metrics()["prefix_cache_hits_total"] - hits_before
    assert hits > 0
    assert_all_free(llm)


@pytest.mark.parametrize("name", ["deepseek_v32", "qwen3_next", "deepseek_v4"])
def test_engine_matches_transformers_under_preemption(name, tiny_checkpoint):
    prompts, want = golden(name)
    longest = max(len(p) for p in prompts) + STEPS
    # Room for about one and a half sequences: the newest is preempted and recomputed
    blocks = -(-longest // 4) * 3 // 2 + 1
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=3, max_num_batched_tokens=16,
              max_model_len=(blocks - 1) * 4, block_size=4, num_kv_blocks=blocks, warmup=False)
    assert run(llm, prompts) == [w[:STEPS] for w in want]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_free(llm)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe"])
def test_expert_weights_past_the_kernels_reach_run_as_chunks(name, tiny_checkpoint, monkeypatch):
    """With the grouped-matmul kernel's reach shrunk below one MoE layer's experts, the engine
    keeps them as expert chunks (models/moe.py split_expert_weights) and its greedy tokens are
    still transformers'."""
    from jaxserve.models import llama
    from jaxserve.pallas_kernels import grouped_matmul as gm

    prompts, want = golden(name)
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              max_model_len=128, block_size=4, num_kv_blocks=64, warmup=False)
    layer = next(lp for lp in llm.engine.runner.params["layers"] if "w_down" in lp and lp["w_down"].ndim == 3)
    limit = layer["w_down"].size // 2
    monkeypatch.setattr(gm, "MAX_WEIGHT_ELEMENTS", limit)
    monkeypatch.setattr(llama, "MAX_WEIGHT_ELEMENTS", limit)
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
              max_model_len=128, block_size=4, num_kv_blocks=64, warmup=False, attention_impl="pallas")
    split = [lp for lp in llm.engine.runner.params["layers"] if isinstance(lp.get("w_down"), tuple)]
    # (gate|up stay apart, or come split too where the checkpoint has them fused)
    assert split and all(len(lp["w_down"]) == 2 and isinstance(lp.get("w_gate_up", ()), tuple)
                         for lp in split)
    assert run(llm, prompts) == [w[:STEPS] for w in want]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_pallas_path_batched_equals_alone_and_transformers(name, tiny_checkpoint):
    """The gated-DeltaNet kernels (interpreted here; tests/gpu/test_gpu_hybrid.py runs them on
    the GPU) in float32: each request batched with the others (the long prompt in chunks beside
    decode rows, which then go through the chunked kernel) gives what it gives alone (the decode
    kernel), and both give transformers' greedy tokens and first-token logprob (issue 70)."""
    g = np.load(os.path.join(GOLDEN, f"{name}.npz"))
    prompts, want = golden(name)
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=128, block_size=4, num_kv_blocks=64, warmup=False, attention_impl="pallas",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    batched = generate(prompts)
    alone = [generate([p])[0] for p in prompts]
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b.token_ids == a.token_ids == want[i][:STEPS], i
        first = _log_softmax(g[f"prefill_logits_{i}"][-1])[want[i][0]]
        for out in (b, a):
            assert abs(out.logprobs[0][want[i][0]].logprob - first) < 1e-4, i
        for lb, la, t in zip(b.logprobs, a.logprobs, b.token_ids):
            assert abs(lb[t].logprob - la[t].logprob) < 1e-4, i
    assert_all_free(llm)
