"""Every architecture against transformers on the same tiny random weights (goldens from
tests/golden/make_golden.py): chunked ragged prefill through a scattered paged cache, then
16 batched greedy decode steps; logits within 1e-4 (f32) and identical greedy tokens.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.models.loader import load_model
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "llama_tied": "LlamaForCausalLM",
                 "llama3_rope": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ = 8, 32, 6
STEP_T, S = 24, 4          # every step (prefill and decode) is padded to this shape
ATOL = 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _step(cfg, params, kv_cache, x):
    kv_cache, hidden_TD, _ = llama.forward(cfg, params, kv_cache, x)
    return kv_cache, llama.compute_logits(cfg, params, hidden_TD)


def _prefill_chunks(prompts):
    """Two steps: short prompts whole + the head of the long one, then its tail (chunked prefill)."""
    split = 12
    first = [Chunk(i, p, 0) for i, p in enumerate(prompts[:-1])] + [Chunk(2, prompts[-1][:split], 0)]
    second = [Chunk(2, prompts[-1][split:], split)]
    return [first, second]


# The engine runs on fused projections (llama.fuse_projections): check that layout too, on
# the architectures whose fusion differs (plain, q/k/v bias, q/k norm, both MoE kinds).
CASES = [(name, False) for name in ARCHITECTURES] + [
    (name, True) for name in ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")]


@pytest.mark.parametrize("name, fused", CASES)
def test_matches_transformers(name, fused, tiny_checkpoint):
    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    cfg, params, tokenizer = load_model(tiny_checkpoint(name))
    if fused:
        llama.fuse_projections(cfg, params)
        assert "wqkv" in params["layers"][0] and "wq" not in params["layers"][0]
    assert cfg.architecture == ARCHITECTURES[name]
    assert tokenizer is None          # no tokenizer files in the tiny checkpoints
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=len(name))
    kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)

    # Prefill: every position's logits, gathered back per prompt.
    got_prefill = {i: [] for i in range(3)}
    for chunks in _prefill_chunks(prompts):
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
        kv, logits_TV = _step(cfg, params, kv, x)
        t = 0
        for c in chunks:
            got_prefill[c.seq].append(np.asarray(logits_TV[t:t + len(c.token_ids)]))
            t += len(c.token_ids)
    for i in range(3):
        np.testing.assert_allclose(np.concatenate(got_prefill[i]), golden[f"prefill_logits_{i}"],
                                   atol=ATOL, rtol=0, err_msg=f"{name} prefill, prompt {i}")

    # Decode: feed our own greedy tokens back, all three sequences in each step.
    tokens = [[int(np.argmax(got_prefill[i][-1][-1]))] for i in range(3)]
    for step in range(16):
        chunks = [Chunk(i, [tokens[i][-1]], len(prompts[i]) + step) for i in range(3)]
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)   # one shape: one compilation
        kv, logits_TV = _step(cfg, params, kv, x)
        logits_SV = np.asarray(logits_TV)[np.asarray(x.logits_indices)[:3]]
        for i in range(3):
            np.testing.assert_allclose(logits_SV[i], golden[f"decode_logits_{i}"][step], atol=ATOL,
                                       rtol=0, err_msg=f"{name} decode step {step}, seq {i}")
            tokens[i].append(int(np.argmax(logits_SV[i])))
    for i in range(3):
        assert tokens[i] == golden[f"greedy_{i}"].tolist(), f"{name} greedy tokens, seq {i}"


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bfloat16_prefill_is_close(name, tiny_checkpoint):
    """bf16 weights, activations and cache: logits near the f32 golden, top-1 nearly always equal."""
    import jax.numpy as jnp

    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    cfg, params, _ = load_model(tiny_checkpoint(name), dtype="bfloat16")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS)
    kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE, dtype=jnp.bfloat16)
    x = build_step([Chunk(i, p, 0) for i, p in enumerate(prompts)], tables, BLOCK_SIZE, 32, S)
    _, logits_TV = _step(cfg, params, kv, x)
    want = np.concatenate([golden[f"prefill_logits_{i}"] for i in range(3)])
    got = np.asarray(logits_TV, np.float32)
    np.testing.assert_allclose(got, want, atol=0.08, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
