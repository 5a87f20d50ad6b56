"""Ragged paged attention on the GPU: the Triton `pallas_call` kernel, our Mosaic GPU kernel
(prefill and decode configurations, both tilings) and the dispatching `impl="pallas"` against
a dense f32 reference, at the engine's shapes: decode-only, prefill-only and mixed ragged
batches, with padding tokens and padding sequence slots. The CPU tests run these kernels in
interpret mode, which differs from the GPU path (the Mosaic GPU kernel keeps P in registers
for the P V product only on the GPU); these run the compiled kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.ragged_paged_attention import wrapper
from jaxserve.pallas_kernels.ragged_paged_attention import mgpu as mg
from jaxserve.pallas_kernels.ragged_paged_attention.tuning import gather_tiling

from kernel_batches import paged_batch

pytestmark = pytest.mark.gpu

# (query heads, kv heads, head dim): Llama-3.1-8B, Qwen3-30B-A3B, SmolLM2-135M (G = 3)
LLAMA, QWEN_MOE, SMOLLM2 = (32, 8, 128), (32, 4, 128), (9, 3, 64)
P = 16                                   # the engine's cache block size


def batch(qlens, ctxs, heads=LLAMA, *, seed=0, pad_tokens=3, dtype=jnp.bfloat16):
    n, kh, e = heads
    return paged_batch(qlens, ctxs, n=n, kh=kh, e=e, p=P, seed=seed, pad_tokens=pad_tokens,
                       extra_blocks=16, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def _one_sequence(q_QNE, k_cache, v_cache, blocks_B, ctx, qlen, *, sm_scale, sliding_window,
                  soft_cap):
    """One sequence's causal attention in f32 over its gathered context (all B x P slots,
    those past ctx masked): q padded to a power of two, so few shapes compile."""
    qp, n, e = q_QNE.shape
    kh = k_cache.shape[2]
    k = k_cache[blocks_B].reshape(-1, kh, e).astype(jnp.float32)
    v = v_cache[blocks_B].reshape(-1, kh, e).astype(jnp.float32)
    q = q_QNE.reshape(qp, kh, n // kh, e).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):             # f32 products, not TF32
        scores = jnp.einsum("tkge,lke->kgtl", q, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        pos = ctx - qlen + jnp.arange(qp)[:, None]
        key = jnp.arange(k.shape[0])[None, :]
        visible = key <= pos
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        o = jnp.einsum("kgtl,lke->tkge", jax.nn.softmax(scores, axis=-1), v)
    return o.reshape(qp, n, e)


def dense_reference(args, *, sm_scale, sliding_window=None, soft_cap=None):
    """Causal attention of each sequence over its own context, in f32 (cheaper than the
    kernel module's token-by-token reference at 2K-token prompts); padding tokens 0."""
    q, k_cache, v_cache, qsl, seq_lens, bt = args
    out = np.zeros(q.shape, np.float32)
    qsl, seq_lens = np.asarray(qsl), np.asarray(seq_lens)
    for s in range(len(seq_lens)):
        a, b = int(qsl[s]), int(qsl[s + 1])
        if b == a:
            continue
        qp = 1 << (b - a - 1).bit_length()
        q_pad = jnp.zeros((qp,) + q.shape[1:], q.dtype).at[:b - a].set(q[a:b])
        o = _one_sequence(q_pad, k_cache, v_cache, bt[s], int(seq_lens[s]), b - a,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        out[a:b] = np.asarray(o[:b - a])
    return out


def check(args, fn, **kw):
    """fn's output against the reference; kw: sliding_window / soft_cap (both), tuning (fn)."""
    sm_scale = 1.0 / np.sqrt(args[0].shape[-1])
    opts = {k: kw[k] for k in ("sliding_window", "soft_cap") if k in kw}
    want = dense_reference(args, sm_scale=sm_scale, **opts)
    got = np.asarray(jax.block_until_ready(fn(*args, sm_scale=sm_scale, **kw)), np.float32)
    real = int(args[3][-1])
    assert np.isfinite(got).all(), "an output element is not finite"
    err = np.linalg.norm(got[:real] - want[:real]) / np.linalg.norm(want[:real])
    assert err < 1e-2, f"relative error {err:.2e}"          # bf16: ~3e-3 measured
    np.testing.assert_allclose(got[:real], want[:real], atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(got[real:], 0.0)           # padding tokens: zeros
    return got


def triton(*a, **kw):
    return wrapper.ragged_paged_attention(*a, impl="triton", **gather_tiling(kw))


def pallas(*a, **kw):
    return wrapper.ragged_paged_attention(*a, impl="pallas", **kw)


def mgpu(**config):
    return lambda *a, **kw: mg.ragged_paged_attention_mgpu(*a, **config, **kw)


def decode_lens(count, lo, hi, seed):
    return list(np.random.default_rng(seed).integers(lo, hi, count))


# -- batches as the engine builds them ---------------------------------------------------------
DECODE = {
    "1x1K": ([1], [1024]),
    "1x8K": ([1], [8192]),
    "16 ragged ~1K": ([1] * 16, decode_lens(16, 600, 1500, 1)),
    "64 ragged ~2K": ([1] * 64, decode_lens(64, 100, 4000, 2)),
    "skewed: one 8K among 15 x 1K": ([1] * 16, [8192] + [1024] * 15),
    "padded: 12 of 16 slots": ([1] * 12 + [0] * 4, decode_lens(12, 500, 1500, 3) + [0] * 4),
}
PREFILL = {
    "one 2K prompt": ([2048], [2048]),
    "4 x 512-token chunks at 2K": ([512] * 4, [2048] * 4),
    "ragged prompts": ([700, 33, 1, 300], [700, 33, 1, 300]),
}
MIXED = {
    "1K chunk + 32 decodes": ([1024] + [1] * 32, [1024] + decode_lens(32, 200, 3000, 4)),
    "chunks, decodes, padding slots": ([300, 1, 0, 1, 129, 0], [900, 1500, 0, 40, 129, 0]),
}
ALL = {**DECODE, **PREFILL, **MIXED}


@functools.lru_cache(maxsize=16)
def case_batch(case, heads=LLAMA, dtype=jnp.bfloat16):
    """The batch of a named case (built once: the larger ones hold GBs of random K/V)."""
    return batch(*ALL[case], heads, dtype=dtype)


@pytest.mark.parametrize("heads", [LLAMA, QWEN_MOE, SMOLLM2], ids=["llama8b", "qwen3moe", "smollm2"])
@pytest.mark.parametrize("case", list(ALL))
def test_triton_kernel(case, heads):
    check(case_batch(case, heads), triton)


@pytest.mark.parametrize("case", list(ALL))
def test_pallas_dispatch(case):
    # what the engine calls: Mosaic GPU for prefill-heavy batches, Triton for the rest
    check(case_batch(case), pallas)


@pytest.mark.parametrize("case", list(DECODE))
def test_triton_decode_tilings_the_engine_picks(case):
    args = case_batch(case)
    busy = int((np.asarray(args[3])[1:] > np.asarray(args[3])[:-1]).sum())
    check(args, triton, busy_seqs=busy)
    check(args, triton, busy_seqs=0)                          # padded bucket: fill_splits
    check(args, triton, busy_seqs=0, skewed=True)
    check(args, triton, num_splits=4)


def test_triton_sliding_window_soft_cap_and_float32():
    args = case_batch("chunks, decodes, padding slots")
    check(args, triton, sliding_window=256)
    check(args, triton, soft_cap=30.0)
    check(case_batch("1K chunk + 32 decodes", dtype=jnp.float32), triton)


@pytest.mark.parametrize("heads", [LLAMA, QWEN_MOE], ids=["llama8b", "qwen3moe"])
@pytest.mark.parametrize("case", list(PREFILL) + list(MIXED))
def test_mosaic_gpu_kernel_prefill_config_sequence_tiling(case, heads):
    check(case_batch(case, heads), mgpu(**mg.PREFILL_CONFIG))


# The flat tiling fails on one 2K-token prompt inside Mosaic GPU's layout inference (H200,
# 2026-12-01, benchmarks' run3-gpu-attention.log): a tiling the engine never picks (mgpu.py:
# sequence tiling by default), kept for the kernel's own benchmarks.
FLAT_XFAIL = {"one 2K prompt": pytest.mark.xfail(
    reason="Mosaic GPU layout inference fails for the flat tiling on one 2K-token prompt "
           "(a tiling the engine does not pick)", strict=False)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=FLAT_XFAIL.get(c, ())) for c in PREFILL])
def test_mosaic_gpu_kernel_flat_tiling_on_prefill_only_batches(case):
    check(case_batch(case), mgpu(**mg.PREFILL_CONFIG, tiling="flat"))


@pytest.mark.parametrize("case", list(DECODE) + list(MIXED))
def test_mosaic_gpu_kernel_decode_config(case):
    check(case_batch(case), mgpu(**mg.DECODE_CONFIG))


def test_mosaic_gpu_kernel_float16():
    check(case_batch("ragged prompts", dtype=jnp.float16), mgpu(**mg.PREFILL_CONFIG))
