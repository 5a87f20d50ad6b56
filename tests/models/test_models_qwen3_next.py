"""Qwen3-Next, Qwen3.5-MoE and dense Qwen3.5 (models/qwen3_next.py) against transformers on tiny random
weights (goldens from tests/golden/make_golden_qwen3_5.py).

Two schedules through a scattered paged cache and scattered state slots:
  - whole prompts in one step, then 16 batched decode steps (the recurrent decode form);
  - continuous batching: prompts prefilled in 16-token chunks (linear-layer states carried
    across chunks) in the same steps as other sequences' decode tokens (mixed batches).
Greedy tokens identical, every logit within ATOL, first-token logprobs within 2e-3.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest

from jaxserve.models import qwen3_next
from jaxserve.models.loader import load_model
from hybrid_step_builder import Chunk, build_hybrid_step, empty_caches, scattered_block_tables

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
ARCHS = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
         "qwen3_5": "Qwen3_5ForCausalLM"}
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ = 8, 32, 8
NUM_SLOTS = 6
SLOTS = np.array([3, 1, 5], np.int32)     # state slot of each sequence (0 is the null slot)
STEP_T, S = 64, 4                          # every step padded to this shape (one padding seq)
CHUNK = 16
ATOL = 2e-4
DECODE = 16


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step(cfg, params, caches, x, impl="xla"):
    caches, hidden_TD, _ = qwen3_next.forward(cfg, params, caches, x, impl)
    return caches, qwen3_next.compute_logits(cfg, params, hidden_TD)


def _load(name):
    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    cfg, params, _ = load_model(os.path.join(GOLDEN_DIR, "ckpt", name))
    assert cfg.architecture == ARCHS[name]
    assert isinstance(cfg, qwen3_next.Qwen3NextConfig)
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    return golden, cfg, params, prompts


def _run(cfg, params, prompts, chunk: int, impl: str = "xla"):
    """Continuous batching: each step every sequence brings up to `chunk` prompt tokens, or its
    next decode token once its prompt is done. Returns (logits of every prompt position,
    decode-step logits, generated tokens) per sequence."""
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=7)
    caches = empty_caches(qwen3_next.cache_specs(cfg), NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    done = [0, 0, 0]                          # tokens of each sequence already computed
    prefill = [[], [], []]
    decode = [[], [], []]
    tokens = [[], [], []]
    while any(len(d) < DECODE for d in decode):
        chunks = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                chunks.append(Chunk(i, p[done[i]:done[i] + chunk], done[i]))
            elif len(decode[i]) < DECODE:
                chunks.append(Chunk(i, [tokens[i][-1]], done[i]))
        x = build_hybrid_step(chunks, tables, SLOTS, BLOCK_SIZE, STEP_T, S)
        caches, logits_TV = _step(cfg, params, caches, x, impl)
        logits_TV = np.asarray(logits_TV)
        t = 0
        for c in chunks:
            n = len(c.token_ids)
            rows = logits_TV[t:t + n]
            if done[c.seq] < len(prompts[c.seq]):
                prefill[c.seq].append(rows)
            else:
                decode[c.seq].append(rows[-1])
            done[c.seq] += n
            if done[c.seq] >= len(prompts[c.seq]):
                tokens[c.seq].append(int(np.argmax(rows[-1])))
            t += n
    return [np.concatenate(p) for p in prefill], [np.stack(d) for d in decode], tokens


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# (name, prefill chunk, impl): the Pallas kernels (interpreted: slow) on the chunked schedule,
# which runs both of the delta rule's kernels (mixed steps: chunked; decode-only: recurrent)
# and the engine's fused projections (fuse_projections) on the MoE + dense-MLP model
CASES = ([(name, chunk, "xla", False) for name in ARCHS for chunk in (64, CHUNK)]
         + [("qwen3_5_moe", CHUNK, "pallas", False), ("qwen3_next", CHUNK, "xla", True)])


@pytest.mark.parametrize("name, chunk, impl, fused", CASES)
def test_matches_transformers(name, chunk, impl, fused):
    golden, cfg, params, prompts = _load(name)
    assert impl == "xla" or qwen3_next.pallas_fits(cfg)
    if fused:
        qwen3_next.fuse_projections(cfg, params)
        assert {"w_in", "wqkv", "w_gate_up", "ws_gate_up"} <= set().union(*params["layers"])
        assert not {"w_qkv", "wq", "w_gate", "ws_gate"} & set().union(*params["layers"])
    prefill, decode, tokens = _run(cfg, params, prompts, chunk, impl)
    for i in range(3):
        np.testing.assert_allclose(prefill[i], golden[f"prefill_logits_{i}"], atol=ATOL, rtol=0,
                                   err_msg=f"{name} prefill, prompt {i}")
        first = _log_softmax(prefill[i][-1])
        np.testing.assert_allclose(first, _log_softmax(golden[f"prefill_logits_{i}"][-1]), atol=2e-3,
                                   rtol=0, err_msg=f"{name} first-token logprobs, prompt {i}")
        np.testing.assert_allclose(decode[i], golden[f"decode_logits_{i}"], atol=ATOL, rtol=0,
                                   err_msg=f"{name} decode, seq {i}")
        assert tokens[i] == golden[f"greedy_{i}"].tolist(), f"{name} greedy tokens, seq {i}"


def test_config_from_hf_layouts():
    """Qwen3.5's ForConditionalGeneration config nests the text model's; layer types come
    from full_attention_interval when not listed."""
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, shared_expert_intermediate_size=8,
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, full_attention_interval=2,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25))
    cfg = qwen3_next.config_from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                     "text_config": text, "tie_word_embeddings": False})
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.split_projections and cfg.norm_topk_prob and cfg.rotary_dim == 4
    assert cfg.rope_theta == 1e6
    specs = qwen3_next.cache_specs(cfg)
    assert specs[0].arrays == (("conv", (32, 3)), ("ssm", (2, 8, 8)))
    assert specs[1].arrays == (("k", (1, 16)), ("v", (1, 16)))
    nxt = qwen3_next.config_from_hf(dict(text, architectures=["Qwen3NextForCausalLM"], norm_topk_prob=False))
    assert not nxt.split_projections and not nxt.norm_topk_prob


def test_resume_from_a_copied_state_matches():
    """A prefix-cache hit in vLLM's "align" mode: a new request with the same prompt shares the
    first 16 tokens' K/V blocks and starts from a copy of the linear layers' states kept at that
    block boundary (another slot), then prefills the rest and decodes: same logits."""
    golden, cfg, params, prompts = _load("qwen3_5_moe")
    prompt = prompts[2]
    tables = scattered_block_tables(2, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=3)
    tables[1, :2] = tables[0, :2]                  # 16 tokens = 2 shared blocks of 8
    slots = np.array([3, 5], np.int32)
    caches = empty_caches(qwen3_next.cache_specs(cfg), NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS)
    x = build_hybrid_step([Chunk(0, prompt[:16], 0)], tables, slots, BLOCK_SIZE, STEP_T, S)
    caches, logits = _step(cfg, params, caches, x)
    np.testing.assert_allclose(np.asarray(logits)[:16], golden["prefill_logits_2"][:16], atol=ATOL, rtol=0)
    caches = [{n: a.at[5].set(a[3]) for n, a in c.items()} if "ssm" in c else c for c in caches]
    x = build_hybrid_step([Chunk(1, prompt[16:], 16)], tables, slots, BLOCK_SIZE, STEP_T, S)
    caches, logits = _step(cfg, params, caches, x)
    np.testing.assert_allclose(np.asarray(logits)[:len(prompt) - 16], golden["prefill_logits_2"][16:],
                               atol=ATOL, rtol=0)
    token = int(np.argmax(np.asarray(logits)[len(prompt) - 17]))
    for step in range(4):
        x = build_hybrid_step([Chunk(1, [token], len(prompt) + step)], tables, slots, BLOCK_SIZE, STEP_T, S)
        caches, logits = _step(cfg, params, caches, x)
        row = np.asarray(logits)[0]
        np.testing.assert_allclose(row, golden["decode_logits_2"][step], atol=ATOL, rtol=0)
        token = int(np.argmax(row))


def test_bfloat16_prefill_is_close():
    """bf16 weights, activations, K/V and conv state (the recurrent state stays f32): logits
    near the f32 golden, top-1 nearly always equal."""
    import jax.numpy as jnp

    golden = np.load(os.path.join(GOLDEN_DIR, "qwen3_5_moe.npz"))
    cfg, params, _ = load_model(os.path.join(GOLDEN_DIR, "ckpt", "qwen3_5_moe"), dtype="bfloat16")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS)
    caches = empty_caches(qwen3_next.cache_specs(cfg), NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, dtype=jnp.bfloat16)
    x = build_hybrid_step([Chunk(i, p, 0) for i, p in enumerate(prompts)], tables, SLOTS, BLOCK_SIZE, 64, S)
    _, logits = _step(cfg, params, caches, x)
    want = np.concatenate([golden[f"prefill_logits_{i}"] for i in range(3)])
    got = np.asarray(logits, np.float32)[:len(want)]
    np.testing.assert_allclose(got, want, atol=0.15, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
