"""MiniMax-M2 against transformers on tiny random weights (golden from
tests/golden/make_golden_minimax.py: non-zero correction bias, rotary_dim 16 of head_dim 32,
theta 5e4):
chunked ragged prefill inside a batch through a scattered paged cache, then 16 batched greedy
decode steps; a prefix-cache hit; logits close, first-token log-probabilities within 2e-3,
identical greedy tokens. Also the pieces alone: the full-width q/k norm and partial rotary
against plain formulas, and the routing's use of the bias."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import deepseek, llama, minimax_m2
from jaxserve.models.layers import full_qk_norm
from jaxserve.models.loader import load_model
from jaxserve.pallas_kernels.policy import KernelPlan
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
CKPT = os.path.join(GOLDEN_DIR, "ckpt", "minimax_m2")
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ = 8, 32, 6
STEP_T, S = 24, 4
ATOL = 1e-4
LOGPROB_TOL = 2e-3


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step(cfg, params, caches, x, kernels="xla"):
    caches, hidden_TD, _ = minimax_m2.forward(cfg, params, caches, x, kernels)
    return caches, minimax_m2.compute_logits(cfg, params, hidden_TD)


@functools.lru_cache(maxsize=None)
def _load(dtype="float32"):
    golden = np.load(os.path.join(GOLDEN_DIR, "minimax_m2.npz"))
    cfg, params, _ = load_model(CKPT, dtype=dtype)
    return golden, cfg, params, [golden[f"prompt_{i}"].tolist() for i in range(3)]


def _logprobs(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


def _decode_step(cfg, params, caches, tables, prompts, tokens, step, kernels="xla"):
    """One batched greedy step of the three sequences (caches updated in place); appends each
    sequence's argmax to `tokens`, returns the logits f32[3, V]."""
    chunks = [Chunk(i, [tokens[i][-1]], len(prompts[i]) + step) for i in range(3)]
    x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
    caches[:], logits_TV = _step(cfg, params, list(caches), x, kernels)
    logits_SV = np.asarray(logits_TV)[np.asarray(x.logits_indices)[:3]]
    for i in range(3):
        tokens[i].append(int(np.argmax(logits_SV[i])))
    return logits_SV


@pytest.mark.parametrize("fused", [False, True])
def test_matches_transformers(fused):
    """Chunked prefill inside a batch, then batched decode; `fused`: the engine's fused
    projections (wqkv, w_gate_up), which must not change a thing."""
    golden, cfg, params, prompts = _load()
    if fused:
        params = llama.fuse_projections(cfg, dict(params, layers=list(params["layers"])))
        assert "wqkv" in params["layers"][0] and "w_gate_up" in params["layers"][0]
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=5)
    caches = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
    split = 12      # the long prompt in two chunks, the first beside the two short prompts
    steps = [[Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:split], 0)],
             [Chunk(2, prompts[2][split:], split)]]
    got = {i: [] for i in range(3)}
    for chunks in steps:
        x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
        caches, logits_TV = _step(cfg, params, caches, x)
        ends = np.cumsum([len(c.token_ids) for c in chunks])
        for c, rows in zip(chunks, np.split(np.asarray(logits_TV)[:ends[-1]], ends[:-1])):
            got[c.seq].append(rows)
    for i in range(3):
        prefill = np.concatenate(got[i])
        want = golden[f"prefill_logits_{i}"]
        np.testing.assert_allclose(prefill, want, atol=ATOL, rtol=0, err_msg=f"prefill {i}")
        np.testing.assert_allclose(_logprobs(prefill[-1]), _logprobs(want[-1]), atol=LOGPROB_TOL, rtol=0)

    tokens = [[int(np.argmax(got[i][-1][-1]))] for i in range(3)]
    decode_SNV = np.stack([_decode_step(cfg, params, caches, tables, prompts, tokens, step)
                           for step in range(16)], axis=1)
    for i in range(3):
        np.testing.assert_allclose(decode_SNV[i], golden[f"decode_logits_{i}"], atol=ATOL, rtol=0,
                                   err_msg=f"decode, seq {i}")
        assert tokens[i] == golden[f"greedy_{i}"].tolist(), f"greedy tokens, seq {i}"


def test_prefix_cache_hit():
    """A second sequence whose table shares the first two (full) blocks of the long prompt
    computes only the prompt's tail, reading the shared keys and values."""
    golden, cfg, params, prompts = _load()
    tables = scattered_block_tables(2, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=3)
    shared = 2 * BLOCK_SIZE
    tables[1, :2] = tables[0, :2]
    caches = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
    x = build_step([Chunk(0, prompts[2], 0)], tables, BLOCK_SIZE, STEP_T, S)
    caches, _ = _step(cfg, params, caches, x)
    x = build_step([Chunk(1, prompts[2][shared:], shared)], tables, BLOCK_SIZE, STEP_T, S)
    _, logits_TV = _step(cfg, params, caches, x)
    n = len(prompts[2]) - shared
    np.testing.assert_allclose(np.asarray(logits_TV[:n]), golden["prefill_logits_2"][shared:],
                               atol=ATOL, rtol=0)


def test_config_fields():
    _, cfg, params, _ = _load()
    assert (cfg.rotary_dim, cfg.head_dim, cfg.rope_theta) == (16, 32, 50000.0)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    lp = params["layers"][0]
    assert lp["q_norm"].shape == (128,) and lp["k_norm"].shape == (64,)   # whole projections
    assert float(jnp.abs(lp["router_bias"]).max()) > 0.1                   # non-trivial bias


def test_qk_norm_and_partial_rope_against_formulas():
    """qk_norm over the whole rows and partial_rope on the first R dims, against numpy."""
    rng = np.random.default_rng(0)
    t, n, kh, e, r = 3, 4, 2, 16, 8
    q, k = rng.normal(size=(t, n * e)).astype(np.float32), rng.normal(size=(t, kh * e)).astype(np.float32)
    wq, wk = rng.normal(size=n * e).astype(np.float32), rng.normal(size=kh * e).astype(np.float32)
    gq, gk = full_qk_norm.qk_norm(jnp.asarray(q), jnp.asarray(k), jnp.asarray(wq), jnp.asarray(wk), kh, 1e-6)
    rms = lambda a: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6)  # noqa: E731
    np.testing.assert_allclose(np.asarray(gq), rms(q) * wq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gk), rms(k) * wk, rtol=1e-5, atol=1e-5)
    x = rng.normal(size=(t, n, e)).astype(np.float32)
    pos = np.array([0, 5, 17])
    inv = 1.0 / (50000.0 ** (np.arange(0, r, 2) / r))
    ang = pos[:, None, None] * inv[None, None, :]
    x1, x2 = x[..., : r // 2], x[..., r // 2: r]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang),
                           x[..., r:]], -1)
    got = full_qk_norm.partial_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(inv, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_routing_bias_chooses_but_does_not_weigh():
    """A bias that promotes experts 0 and 1 makes them chosen; their weights are their own
    sigmoid scores renormalised, the bias nowhere in them."""
    _, cfg, _, _ = _load()
    logits = jnp.asarray([[2.0, 1.0, 3.0, 0.5, -1.0, 0.0, 0.2, 0.1]])
    lp = {"router": jnp.eye(8), "router_bias": jnp.asarray([5.0, 5.0, 0, 0, 0, 0, 0, 0])}
    w, experts = deepseek.route(cfg, lp, logits)
    assert sorted(np.asarray(experts)[0].tolist()) == [0, 1]
    s = jax.nn.sigmoid(logits[0, :2])
    np.testing.assert_allclose(np.sort(np.asarray(w)[0]), np.sort(np.asarray(s / s.sum())), rtol=1e-6)


@pytest.mark.parametrize("fused", [(), ("rope",)])
def test_pallas_kernels_in_the_model(fused):
    """The ragged paged attention kernel (interpreted) inside the model, and with "rope" the
    fused full-width QK-norm + partial RoPE + KV write kernel too: a chunked prefill and two
    batched decode steps match the goldens."""
    golden, cfg, params, prompts = _load()
    kernels = minimax_m2.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(
        cfg, "minimax_m2", fused))
    assert (kernels.rope_write.func is full_qk_norm.rope_write_xla) == (not fused)
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=7)
    caches = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
    x = build_step([Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:10], 0)],
                   tables, BLOCK_SIZE, STEP_T, S)
    caches, _ = _step(cfg, params, caches, x, kernels)
    x = build_step([Chunk(2, prompts[2][10:], 10)], tables, BLOCK_SIZE, STEP_T, S)
    caches, logits_TV = _step(cfg, params, caches, x, kernels)
    np.testing.assert_allclose(np.asarray(logits_TV[:10]), golden["prefill_logits_2"][10:], atol=ATOL, rtol=0)
    tokens = [golden[f"greedy_{i}"].tolist()[:1] for i in range(3)]
    for step in range(2):
        logits_SV = _decode_step(cfg, params, caches, tables, prompts, tokens, step, kernels)
        want = np.stack([golden[f"decode_logits_{i}"][step] for i in range(3)])
        np.testing.assert_allclose(logits_SV, want, atol=ATOL, rtol=0)


def test_bfloat16_prefill_is_close():
    """bf16 weights, activations and caches (the router bias stays f32): logits near the f32
    golden, the top token nearly always the same. Most rows: a row whose token's biased
    scores nearly tie at the top-k boundary may choose another expert in bf16 (seen: one of
    32 rows, 0.22 off; the others within 0.02)."""
    golden, cfg, params, prompts = _load("bfloat16")
    assert params["layers"][0]["router_bias"].dtype == jnp.float32
    x = build_step([Chunk(i, p, 0) for i, p in enumerate(prompts)],
                   scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS), BLOCK_SIZE, 32, S)
    _, logits_TV = _step(cfg, params, empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE, jnp.bfloat16), x)
    want = np.concatenate([golden[f"prefill_logits_{i}"] for i in range(3)])
    got = np.asarray(logits_TV, np.float32)[:len(want)]
    assert (np.abs(got - want).max(-1) < 0.05).mean() >= 0.9, np.abs(got - want).max(-1)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
