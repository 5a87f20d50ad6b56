"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers loading the same
GGUF (goldens: tests/golden/smollm2_greedy.json): tokenizer, chat template, first-step
top-5 logits and 24-token greedy continuations, all prompts batched in one paged cache.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.models.loader import load_model
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "smollm2_greedy.json")
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


@functools.partial(jax.jit, static_argnums=0)
def _step(cfg, params, kv_cache, x):
    kv_cache, hidden_TD, _ = llama.forward(cfg, params, kv_cache, x)
    hidden_SD = hidden_TD[x.logits_indices]
    return kv_cache, llama.compute_logits(cfg, params, hidden_SD)


def test_tokenizer_matches_transformers(smollm2, golden):
    _, _, tok = smollm2
    for case in golden["tokenization"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    assert chat == golden["chat_text"]
    for p in golden["prompts"]:
        assert tok.encode(p["text"], add_special_tokens=False) == p["prompt_token_ids"]


def test_greedy_matches_transformers(smollm2, golden):
    cfg, params, _ = smollm2
    prompts = [p["prompt_token_ids"] for p in golden["prompts"]]
    new = golden["new_tokens"]
    n = len(prompts)
    blocks_per_seq = -(-(max(map(len, prompts)) + new) // BLOCK_SIZE)
    num_blocks = n * blocks_per_seq + 3
    tables = scattered_block_tables(n, blocks_per_seq, num_blocks, seed=7)
    kv = empty_kv_cache(cfg, num_blocks, BLOCK_SIZE)
    padded_t = -(-sum(map(len, prompts)) // 16) * 16
    x = build_step([Chunk(i, p, 0) for i, p in enumerate(prompts)], tables, BLOCK_SIZE, padded_t, n)
    kv, logits_SV = _step(cfg, params, kv, x)
    logits_SV = np.asarray(logits_SV)
    for i, p in enumerate(golden["prompts"]):
        top5 = p["first_top5"]
        assert np.argsort(-logits_SV[i])[:5].tolist() == top5["ids"], f"top-5 ids, prompt {i}"
        np.testing.assert_allclose(logits_SV[i][top5["ids"]], top5["logits"], atol=2e-3, rtol=0)
    tokens = [[int(np.argmax(row))] for row in logits_SV]
    for step in range(new - 1):
        chunks = [Chunk(i, [tokens[i][-1]], len(prompts[i]) + step) for i in range(n)]
        kv, logits_SV = _step(cfg, params, kv, build_step(chunks, tables, BLOCK_SIZE, n, n))
        for i, row in enumerate(np.asarray(logits_SV)):
            tokens[i].append(int(np.argmax(row)))
    for i, p in enumerate(golden["prompts"]):
        assert tokens[i] == p["greedy"], f"greedy continuation of {p['text'][:40]!r}"
