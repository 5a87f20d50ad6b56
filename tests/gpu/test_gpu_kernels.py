"""The other Pallas kernels on the GPU against their plain-jnp references, at the models'
shapes: fused add + RMSNorm, fused QK-norm + RoPE + paged KV write, the MoE router, the MoE
grouped matmul (our expert-skipping Triton kernel, and "auto", which takes JAX's Mosaic GPU
ragged dot for many rows), the split merge and the top-k / top-p thresholds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers
from jaxserve.pallas_kernels import fused_add_rms_norm as farn
from jaxserve.pallas_kernels import grouped_matmul as gm
from jaxserve.pallas_kernels import moe_router as mr
from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
from jaxserve.pallas_kernels import split_merge as sm
from jaxserve.pallas_kernels import topk_threshold as tk

pytestmark = pytest.mark.gpu


def rand(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# -- fused residual add + RMSNorm ---------------------------------------------------------------
@pytest.mark.parametrize("d", [576, 2048, 4096])            # SmolLM2, Qwen3-30B-A3B, Llama-8B
@pytest.mark.parametrize("t", [1, 16, 2048])
def test_fused_add_rms_norm(t, d):
    rng = np.random.default_rng(t + d)
    x, res, w = rand(rng, (t, d)), rand(rng, (t, d)), rand(rng, (d,))
    want_res, want = farn.ref_fused_add_rms_norm(x, res, w, eps=1e-5)
    got_res, got = farn.fused_add_rms_norm(x, res, w, eps=1e-5, impl="pallas")
    close(got_res, want_res, 1e-2)
    close(got, want, 3e-2)
    close(farn.fused_add_rms_norm(x, None, w, eps=1e-5, impl="pallas"),
          farn.ref_fused_add_rms_norm(x, None, w, eps=1e-5), 3e-2)


# -- fused QK-norm + RoPE + paged KV write ------------------------------------------------------
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("t", [1, 64, 2048])
@pytest.mark.parametrize("model", ["llama8b", "qwen3moe"])
def test_qk_norm_rope_kv_write(model, t):
    n, kh, e, nb, p = 32, (8 if model == "llama8b" else 4), 128, 512, 16
    rng = np.random.default_rng(t)
    q, k, v = rand(rng, (t, n, e)), rand(rng, (t, kh, e)), rand(rng, (t, kh, e))
    slots = rng.permutation(np.arange(p, nb * p))[:t].astype(np.int32)
    if t > 1:
        slots[-1] = 0                                         # a padding token -> null slot
    pos = jnp.asarray(rng.integers(0, 8000, t).astype(np.int32))
    slots = jnp.asarray(slots)
    k_cache, v_cache = rand(rng, (nb, p, kh, e)), rand(rng, (nb, p, kh, e))
    if model == "llama8b":
        inv, norms = layers.rope_inv_freq(e, 500000.0, LLAMA3), (None, None)
    else:
        inv, norms = layers.rope_inv_freq(e, 1000000.0, None), (rand(rng, (e,)), rand(rng, (e,)))
    want = qrk.ref_qk_norm_rope_kv_write(q, k, v, pos, slots, k_cache, v_cache, inv, *norms,
                                         eps=1e-6)
    want = [np.asarray(a, np.float32) for a in want]
    got = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, jnp.copy(k_cache), jnp.copy(v_cache),
                                    inv, *norms, eps=1e-6, impl="pallas")
    close(got[0], want[0], 3e-2)
    written = np.asarray(slots)[np.asarray(slots) != 0]
    for g, w in zip(got[1:], want[1:]):
        g = np.asarray(g, np.float32).reshape(nb * p, kh, e)
        w = w.reshape(nb * p, kh, e)
        close(g[written], w[written], 3e-2)
        untouched = np.setdiff1d(np.arange(p, nb * p), written)
        np.testing.assert_array_equal(g[untouched], w[untouched])


# -- MoE router ---------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 16, 2048])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("sigmoid", False)])
def test_moe_router(t, scoring, renormalize):
    logits = rand(np.random.default_rng(t), (t, 128), scale=3.0)   # Qwen3-30B-A3B: 128, top-8
    w, e = mr.moe_router(logits, top_k=8, scoring=scoring, renormalize=renormalize, impl="pallas")
    rw, re_ = mr.ref_moe_router(logits, top_k=8, scoring=scoring, renormalize=renormalize)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(re_))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-4, atol=1e-6)


# -- MoE grouped matmul -------------------------------------------------------------------------
def routed(rows, experts=128, top_k=8, seed=0):
    """Group sizes of `rows // top_k` tokens routed to top_k of `experts` each, at random."""
    rng = np.random.default_rng(seed)
    sizes = np.zeros(experts, np.int32)
    for _ in range(rows // top_k):
        sizes[rng.choice(experts, top_k, replace=False)] += 1
    return jnp.asarray(sizes)


@jax.jit
def _rows_times(x_RK, w_KN):
    with jax.default_matmul_precision("highest"):             # f32 products, not TF32
        return x_RK.astype(jnp.float32) @ w_KN.astype(jnp.float32)


def group_reference(x, w, sizes):
    """Each group's rows times its matrix, in f32 (rows padded to a power of two, so few
    shapes compile); rows past the groups 0."""
    out = np.zeros((x.shape[0], w.shape[2]), np.float32)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        size = int(size)
        if size:
            rows = 1 << (size - 1).bit_length()
            x_pad = jnp.zeros((rows, x.shape[1]), x.dtype).at[:size].set(x[start:start + size])
            out[start:start + size] = np.asarray(_rows_times(x_pad, w[g]))[:size]
        start += size
    return out


def check_grouped(x, w, sizes, impl):
    got = np.asarray(gm.grouped_matmul(x, w, sizes, impl=impl), np.float32)
    want = group_reference(x, w, sizes)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and err < 1e-2, f"{impl}: relative error {err:.2e}"
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    return got


@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048)])  # Qwen3-30B-A3B gate+up, down
@pytest.mark.parametrize("rows", [8, 128, 512, 4096])
def test_grouped_matmul(rows, k, n):
    rng = np.random.default_rng(rows)
    sizes = routed(rows, seed=rows)
    x = rand(rng, (rows, k))
    w = rand(rng, (128, k, n), scale=1 / np.sqrt(k))
    if rows <= gm.sparse_max_rows(128):
        check_grouped(x, w, sizes, "pallas")
    check_grouped(x, w, sizes, "auto")                       # Mosaic GPU ragged dot above 512
    if gm._mosaic_fits(x, w):
        check_grouped(x, w, sizes, "mosaic")


def test_grouped_matmul_rows_past_the_groups_are_zero():
    rng = np.random.default_rng(1)
    sizes = routed(64, seed=1)                                # 64 rows in groups, 16 beyond
    x, w = rand(rng, (80, 2048)), rand(rng, (128, 2048, 1536), scale=1 / 45)
    got = check_grouped(x, w, sizes, "pallas")
    assert (got[64:] == 0).all()


@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])  # DeepSeek-V3 gate, down
@pytest.mark.parametrize("rows", [8, 128, 4096])
def test_grouped_matmul_fp8_block_scaled(rows, k, n):
    """DeepSeek's FP8 experts kept as e4m3 + 128 x 128 scales ("auto" takes the kernel at any
    M) against the dequantized weights in f32; 16 of the 256 experts, so the test stays small."""
    rng = np.random.default_rng(rows + k)
    sizes = routed(rows, experts=16, seed=rows)
    x = rand(rng, (rows, k))
    w8 = rand(rng, (16, k, n), jnp.float32, scale=8.0).astype(jnp.float8_e4m3fn)
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (16, k // 128, n // 128)) / (8 * np.sqrt(k)), jnp.float32)
    w = gm.BlockScaledFp8(w8, scales)
    want = group_reference(x, gm.dequantize(w), sizes)
    for impl in ("pallas", "auto"):
        got = np.asarray(gm.grouped_matmul(x, w, sizes, impl=impl), np.float32)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert np.isfinite(got).all() and err < 1e-2, f"{impl}: relative error {err:.2e}"


@pytest.mark.parametrize("rows", [8, 4096])
def test_grouped_matmul_over_expert_chunks(rows):
    """Expert arrays past the kernel's int32 reach run as chunks (split_experts, as DeepSeek-V3's
    and MiniMax-M2's do in the engine): the same result as the whole array, sparse and dense."""
    rng = np.random.default_rng(rows + 7)
    sizes = routed(rows, seed=rows + 7)
    x, w = rand(rng, (rows, 2048)), rand(rng, (128, 2048, 1536), scale=1 / 45)
    chunks = gm.split_experts(w, limit=w.size // 4)
    want = group_reference(x, w, sizes)
    for impl in (("pallas", "auto") if rows <= gm.sparse_max_rows(128) else ("auto",)):
        got = np.asarray(gm.grouped_matmul(x, chunks, sizes, impl=impl), np.float32)
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2, err_msg=impl)


# -- merge of key-range splits ------------------------------------------------------------------
@pytest.mark.parametrize("x,t", [(4, 1), (32, 1), (8, 64), (32, 256)])
def test_merge_splits(x, t):
    n, e = 32, 128
    rng = np.random.default_rng(x * t)
    o = rng.standard_normal((x, t, n, e)).astype(np.float32)
    lse = (4 * rng.standard_normal((x, t, n))).astype(np.float32)
    lse[1:, 0] = -np.inf                                      # token 0: one split only
    o[lse == -np.inf] = np.nan                                # empty splits may hold garbage
    o, lse = jnp.asarray(o), jnp.asarray(lse)
    want = np.asarray(sm.ref_merge_splits(o, lse))
    close(sm.merge_splits(o, lse, impl="pallas"), want, 1e-4)
    close(sm.merge_splits(o, lse, out_dtype=jnp.bfloat16, impl="pallas"), want, 2e-2)
    live = jnp.asarray(np.r_[rng.integers(1, x + 1, t), t], jnp.int32)   # splits written a token
    written = np.arange(x)[:, None] < np.asarray(live[:t])[None, :]
    o_live = jnp.where(jnp.asarray(written)[..., None, None], o, jnp.nan)
    lse_live = jnp.where(jnp.asarray(written)[..., None], lse, -jnp.inf)
    want_live = np.asarray(sm.ref_merge_splits(o_live, lse_live))
    close(sm.merge_splits(o_live, jnp.where(jnp.asarray(written)[..., None], lse, jnp.nan), live,
                          impl="pallas"), want_live, 1e-4)


# -- top-k / top-p thresholds -------------------------------------------------------------------
@pytest.mark.parametrize("v", [128256, 151936])             # Llama-3, Qwen3 vocabularies
@pytest.mark.parametrize("rows", [1, 32, 64])
def test_topk_and_topp_thresholds(rows, v):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, v)).astype(np.float32) * 3)
    k = jnp.asarray(rng.integers(1, 2048, rows), jnp.int32)
    want_k = tk.ref_topk_threshold(x, k)
    got_k = tk.topk_threshold(x, k, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))   # exact by construction
    p = jnp.asarray(rng.uniform(0.5, 0.99, rows), jnp.float32)
    for floor in (jnp.full((rows,), -jnp.inf), want_k):
        got = np.asarray(tk.topp_threshold(x, p, floor, impl="pallas"))
        want = np.asarray(tk.ref_topp_threshold(x, p, floor))
        # the cut may land on a neighbouring value where the order of summation decides
        kept_got = (np.asarray(x) >= got[:, None]).sum(1)
        kept_want = (np.asarray(x) >= want[:, None]).sum(1)
        assert np.abs(kept_got - kept_want).max() <= 1, (kept_got, kept_want)


def test_engine_on_kept_fp8_experts(tmp_path):
    """The tiny DeepSeek-V3 stored as FP8 (16 x 16 blocks), run in float32 with the Pallas
    kernels: kept FP8 experts (the grouped matmul's FP8 path) give the greedy tokens of the
    dequantized load."""
    from jaxserve import LLM, SamplingParams
    from tests.models.test_deepseek_loader import _fp8_copy

    path = _fp8_copy(tmp_path, block=16)
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = [[list(o.outputs[0].token_ids) for o in
             LLM(path, dtype="float32", quantization=q, attention_impl="pallas", max_model_len=128,
                 max_num_seqs=4, warmup=False).generate(prompts, greedy, use_tqdm=False)]
            for q in (None, "fp8")]
    assert outs[0] == outs[1]
