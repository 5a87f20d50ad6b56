"""Ragged paged attention on the GPU: the Triton `pallas_call` kernel, our Mosaic GPU kernel
(prefill and decode configurations, both tilings) and the dispatching `impl="pallas"` against
a dense f32 reference, at the engine's shapes: decode-only, prefill-only and mixed ragged
batches, with padding tokens and padding sequence slots. The CPU tests run these kernels in
interpret mode, which differs from the GPU path (the Mosaic GPU kernel keeps P in registers
for the P V product only on the GPU); these run the compiled kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import ragged_paged_attention as rpa
from jaxserve.pallas_kernels import ragged_paged_attention_mgpu as mg

from kernel_batches import paged_batch

pytestmark = pytest.mark.gpu

# (query heads, kv heads, head dim): Llama-3.1-8B, Qwen3-30B-A3B, SmolLM2-135M (G = 3)
LLAMA, QWEN_MOE, SMOLLM2 = (32, 8, 128), (32, 4, 128), (9, 3, 64)
P = 16                                   # the engine's cache block size


def batch(qlens, ctxs, heads=LLAMA, *, seed=0, pad_tokens=3, dtype=jnp.bfloat16):
    n, kh, e = heads
    return paged_batch(qlens, ctxs, n=n, kh=kh, e=e, p=P, seed=seed, pad_tokens=pad_tokens,
                       extra_blocks=16, dtype=dtype)


@jax.default_matmul_precision("highest")       # f32 products, not TF32, on the GPU
def dense_reference(args, *, sm_scale, sliding_window=None, soft_cap=None):
    """Causal attention of each sequence over its own gathered context, in f32 (cheaper than
    the kernel module's token-by-token reference at 2K-token prompts)."""
    q, k_cache, v_cache, qsl, seq_lens, bt = args
    t, n, e = q.shape
    kh = k_cache.shape[2]
    g = n // kh
    out = np.zeros((t, n, e), np.float32)
    qsl, seq_lens = np.asarray(qsl), np.asarray(seq_lens)
    for s in range(len(seq_lens)):
        a, b, ctx = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        if b == a:
            continue
        k = k_cache[bt[s]].reshape(-1, kh, e)[:ctx].astype(jnp.float32)
        v = v_cache[bt[s]].reshape(-1, kh, e)[:ctx].astype(jnp.float32)
        qs = q[a:b].reshape(b - a, kh, g, e).astype(jnp.float32)
        scores = jnp.einsum("tkge,lke->kgtl", qs, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        pos = ctx - (b - a) + jnp.arange(b - a)[:, None]
        key = jnp.arange(ctx)[None, :]
        visible = key <= pos
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        o = jnp.einsum("kgtl,lke->tkge", jax.nn.softmax(scores, axis=-1), v)
        out[a:b] = np.asarray(o.reshape(b - a, n, e))
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
    return rpa.ragged_paged_attention(*a, impl="triton", **kw)


def pallas(*a, **kw):
    return rpa.ragged_paged_attention(*a, impl="pallas", **kw)


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


@pytest.mark.parametrize("heads", [LLAMA, QWEN_MOE, SMOLLM2], ids=["llama8b", "qwen3moe", "smollm2"])
@pytest.mark.parametrize("case", list(ALL))
def test_triton_kernel(case, heads):
    check(batch(*ALL[case], heads), triton)


@pytest.mark.parametrize("case", list(ALL))
def test_pallas_dispatch(case):
    # what the engine calls: Mosaic GPU for prefill-heavy batches, Triton for the rest
    check(batch(*ALL[case]), pallas)


@pytest.mark.parametrize("case", list(DECODE))
def test_triton_decode_tilings_the_engine_picks(case):
    args = batch(*DECODE[case])
    busy = int((np.asarray(args[3])[1:] > np.asarray(args[3])[:-1]).sum())
    check(args, triton, busy_seqs=busy)
    check(args, triton, busy_seqs=0)                          # padded bucket: fill_splits
    check(args, triton, busy_seqs=0, skewed=True)
    check(args, triton, num_splits=4)


def test_triton_sliding_window_soft_cap_and_float32():
    args = batch(*MIXED["chunks, decodes, padding slots"])
    check(args, triton, sliding_window=256)
    check(args, triton, soft_cap=30.0)
    check(batch(*MIXED["1K chunk + 32 decodes"], dtype=jnp.float32), triton)


@pytest.mark.parametrize("heads", [LLAMA, QWEN_MOE], ids=["llama8b", "qwen3moe"])
@pytest.mark.parametrize("case", list(PREFILL) + list(MIXED))
def test_mosaic_gpu_kernel_prefill_config_sequence_tiling(case, heads):
    check(batch(*ALL[case], heads), mgpu(**mg.PREFILL_CONFIG))


@pytest.mark.parametrize("case", list(PREFILL))
def test_mosaic_gpu_kernel_flat_tiling_on_prefill_only_batches(case):
    check(batch(*PREFILL[case]), mgpu(**mg.PREFILL_CONFIG, tiling="flat"))


@pytest.mark.parametrize("case", list(DECODE) + list(MIXED))
def test_mosaic_gpu_kernel_decode_config(case):
    check(batch(*ALL[case]), mgpu(**mg.DECODE_CONFIG))


def test_mosaic_gpu_kernel_float16():
    check(batch(*PREFILL["ragged prompts"], dtype=jnp.float16), mgpu(**mg.PREFILL_CONFIG))
