"""Qwen3-Next / Qwen3.5-MoE (gated DeltaNet beside attention) on the GPU path in float32, on
the tiny random-weight checkpoints (tests/golden/ckpt, goldens by transformers in f32):
greedy tokens and first-token logprobs equal transformers' alone and batched (issue 70: the
DeltaNet kernels' TF32 dots gave 0.1-nat errors and a batch differing from each request
alone), and a second pass over the same prompts resumes from saved states (prefix hits)
with the same output."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import GOLDEN_DIR

pytestmark = pytest.mark.gpu

HYBRIDS = ["qwen3_next", "qwen3_5_moe"]
STEPS = 16
LOGPROB_TOL = 1e-3      # f32 on both sides; the order of sums differs (transformers on a CPU)


def golden(name):
    g = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    n = sum(1 for k in g.files if k.startswith("prompt_"))
    return g, [g[f"prompt_{i}"].tolist() for i in range(n)], [g[f"greedy_{i}"].tolist() for i in range(n)]


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def make(name, tiny_checkpoint, **kw):
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, block_size=16, num_kv_blocks=64, warmup=False, **kw)
    assert llm.engine.runner.attention_impl == "pallas"       # the GPU path
    return llm


def generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                               use_tqdm=False)]


@pytest.mark.parametrize("name", HYBRIDS)
def test_float32_matches_transformers_alone_and_batched(name, tiny_checkpoint):
    g, prompts, want = golden(name)
    llm = make(name, tiny_checkpoint, enable_prefix_caching=False)
    batched = generate(llm, prompts)
    alone = [generate(llm, [p])[0] for p in prompts]
    for i, (b, a) in enumerate(zip(batched, alone)):
        first = log_softmax(g[f"prefill_logits_{i}"][-1])[want[i][0]]
        for how, out in (("batched", b), ("alone", a)):
            assert list(out.token_ids) == want[i][:STEPS], (how, i)
            assert abs(out.logprobs[0][want[i][0]].logprob - first) < LOGPROB_TOL, (how, i)
        for lb, la, t in zip(b.logprobs, a.logprobs, b.token_ids):
            assert abs(lb[t].logprob - la[t].logprob) < LOGPROB_TOL, i
    del llm
    gc.collect()


@pytest.mark.parametrize("name", HYBRIDS)
def test_prefix_hits_resume_from_saved_states_with_the_same_output(name, tiny_checkpoint):
    _, prompts, want = golden(name)
    llm = make(name, tiny_checkpoint, num_cached_states=16)
    first = [list(o.token_ids) for o in generate(llm, prompts)]
    assert first == [w[:STEPS] for w in want]
    hits = llm.get_metrics()["prefix_cache_hits_total"]
    second = [list(o.token_ids) for o in generate(llm, prompts)]
    assert second == first
    assert llm.get_metrics()["prefix_cache_hits_total"] > hits
    s = llm.engine.scheduler
    assert not s.requests and s.pool.num_used == 0
    del llm
    gc.collect()
