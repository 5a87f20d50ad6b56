"""Shared helpers for the kernel tests: random paged-attention batches and lowering shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def paged_batch(qlens, ctxs, *, n=8, kh=2, e=32, p=8, pad_tokens=3, extra_blocks=4, seed=0,
                dtype=jnp.float32):
    """q, k_cache, v_cache, query_start_loc, seq_lens, block_tables for the given per-sequence
    query lengths and context lengths (context includes this step's tokens). Blocks are
    scattered over a shuffled pool; block 0 stays the null block."""
    rng = np.random.default_rng(seed)
    s = len(qlens)
    b = max(1, max(-(-c // p) for c in ctxs))
    nb = sum(-(-c // p) for c in ctxs) + 1 + extra_blocks
    t = sum(qlens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((t, n, e)), dtype)
    k = jnp.asarray(rng.standard_normal((nb, p, kh, e)), dtype)
    v = jnp.asarray(rng.standard_normal((nb, p, kh, e)), dtype)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    bt = np.zeros((s, b), np.int32)
    perm = rng.permutation(np.arange(1, nb))
    i = 0
    for si, c in enumerate(ctxs):
        nblk = -(-c // p)
        bt[si, :nblk] = perm[i:i + nblk]
        i += nblk
    return (q, k, v, jnp.asarray(qsl), jnp.asarray(np.asarray(ctxs, np.int32)),
            jnp.asarray(bt))


def cuda_attention_shapes(t=64, n=32, kh=8, e=128, nb=256, p=16, s=8, b=32, dtype=jnp.bfloat16):
    """Abstract (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables) for lowering an
    attention kernel for CUDA without a GPU (Llama-3.1-8B heads by default)."""
    sds = jax.ShapeDtypeStruct
    return (sds((t, n, e), dtype), sds((nb, p, kh, e), dtype), sds((nb, p, kh, e), dtype),
            sds((s + 1,), jnp.int32), sds((s,), jnp.int32), sds((s, b), jnp.int32))
