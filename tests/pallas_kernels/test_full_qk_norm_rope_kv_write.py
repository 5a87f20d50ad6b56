"""Fused full-width QK-norm + partial rotary + paged KV write (MiniMax-M2): the Pallas kernel
(interpret mode) against the model's own XLA path (models/layers/full_qk_norm.py rope_write_xla), and
inside the model against the transformers golden."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers, minimax_m2
from jaxserve.models.layers import full_qk_norm
from jaxserve.pallas_kernels import full_qk_norm_rope_kv_write as fqr
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.sharding import kernels as sharded
from test_qk_norm_rope_kv_write import make


_TINY16 = {"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8, "num_local_experts": 4,
           "num_experts_per_tok": 2}   # E 16: below the kernel's 32


def _norms(rng, n, kh, e=32):
    return (jnp.asarray(1 + 0.3 * rng.standard_normal(n * e), jnp.float32),
            jnp.asarray(1 + 0.3 * rng.standard_normal(kh * e), jnp.float32))


@pytest.mark.parametrize("n,kh,rotary", [(6, 2, 16), (9, 3, 32), (4, 4, 8)])
def test_matches_model_blocks(n, kh, rotary):
    """Non-power-of-two head counts (masked rows), partial and whole rotary; padding tokens
    write only the null block; every other slot comes back bit-identical."""
    rng = np.random.default_rng(n + rotary)
    q, k, v, pos, slots, kc, vc = make(rng, n=n, kh=kh)
    inv = layers.rope_inv_freq(rotary, 5e6, None)
    args = (q, k, v, pos, slots, kc, vc, inv, *_norms(rng, n, kh))
    got = fqr.full_qk_norm_rope_kv_write(*args, eps=1e-6, impl="pallas")
    want = fqr.ref_full_qk_norm_rope_kv_write(*args, eps=1e-6)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    written = np.asarray(slots)[np.asarray(slots) != 0]
    for g, w in zip(got[1:], want[1:]):
        g, w = np.asarray(g).reshape(-1, kh, 32), np.asarray(w).reshape(-1, kh, 32)
        np.testing.assert_allclose(g[written], w[written], rtol=1e-5, atol=1e-5)
        untouched = np.setdiff1d(np.arange(4, g.shape[0]), written)   # blocks 1.. not written
        np.testing.assert_array_equal(g[untouched], w[untouched])     # NaN == NaN here


def test_norm_spans_every_head():
    """Scaling one head of q changes every head's output (a per-head norm would not)."""
    rng = np.random.default_rng(0)
    q, k, v, pos, slots, kc, vc = make(rng, n=4, kh=2)
    inv = layers.rope_inv_freq(16, 1e4, None)
    norms = _norms(rng, 4, 2)
    a = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, impl="pallas")[0]
    b = fqr.full_qk_norm_rope_kv_write(q.at[:, 0].multiply(3.0), k, v, pos, slots, kc, vc, inv, *norms,
                                       impl="pallas")[0]
    assert float(jnp.abs(a[:, 1:] - b[:, 1:]).min(axis=(0, 2)).max()) > 1e-3


def test_given_sums_of_squares_normalise_like_the_whole_row():
    """The tensor-parallel form: given the whole rows' sums of squares and widths (here, of the
    same rows, as a psum over every rank gives), the kernel equals the one that sums them."""
    rng = np.random.default_rng(5)
    q, k, v, pos, slots, kc, vc = make(rng, n=4, kh=2)
    inv = layers.rope_inv_freq(16, 1e4, None)
    norms = _norms(rng, 4, 2)
    want = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, impl="pallas")
    ss = jnp.stack([jnp.sum(jnp.square(a), axis=(1, 2)) for a in (q, k)], -1)
    widths = (q.shape[1] * q.shape[2], k.shape[1] * k.shape[2])
    got = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, ss, impl="pallas",
                                         widths=widths)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)
    # a half-width row's sum (one rank's share) must not pass for the whole one
    half = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, ss / 2, impl="pallas",
                                          widths=widths)[0]
    assert float(jnp.abs(half - want[0]).max()) > 1e-3
    with pytest.raises(ValueError, match="sumsq_T2 and widths"):
        fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, ss, impl="pallas")
    with pytest.raises(ValueError, match="sumsq_T2 must be"):
        fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, *norms, ss, impl="xla",
                                       widths=widths)


def test_bf16_and_errors():
    rng = np.random.default_rng(3)
    args = make(rng, dtype=jnp.bfloat16)
    inv = layers.rope_inv_freq(16, 5e6, None)
    norms = _norms(rng, 6, 2)
    got = fqr.full_qk_norm_rope_kv_write(*args, inv, *norms, impl="pallas")
    want = fqr.full_qk_norm_rope_kv_write(*args, inv, *norms, impl="xla")
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="q_norm"):
        fqr.full_qk_norm_rope_kv_write(*args, inv, norms[0][:32], norms[1], impl="pallas")
    with pytest.raises(ValueError, match="inv_freq"):
        fqr.full_qk_norm_rope_kv_write(*args, jnp.zeros(17), *norms, impl="pallas")


def test_lowers_for_cuda_with_aliased_caches():
    """The reduced-depth MiniMax-M2 shape: 48 heads, 8 kv heads, E 128, R 64."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((64, 48, 128), bf), sds((64, 8, 128), bf), sds((64, 8, 128), bf),
            sds((64,), jnp.int32), sds((64,), jnp.int32), sds((512, 16, 8, 128), bf),
            sds((512, 16, 8, 128), bf), sds((32,), jnp.float32), sds((48 * 128,), bf), sds((8 * 128,), bf))
    exported = export_for_cuda(lambda *a: fqr.full_qk_norm_rope_kv_write(*a, impl="pallas", interpret=False),
                               *args)
    assert triton_kernel_names(exported) == ["full_qk_norm_rope_kv_write"]


def ROPE(cfg):
    """The plan of the fused "rope" kernel for a MiniMax-M2 config."""
    return KernelPlan.for_model(cfg, "minimax_m2", {"rope"})


def test_make_kernels_picks_the_fused_kernel_only_when_asked():
    """The model with the kernel against transformers: tests/models/test_minimax_m2_golden.py."""
    cfg = minimax_m2.MiniMaxM2Config.from_hf({**_TINY16, "head_dim": 32, "rotary_dim": 16})
    assert minimax_m2.make_kernels(cfg, "pallas").rope_write.func is full_qk_norm.rope_write_xla
    assert minimax_m2.make_kernels(cfg, "xla", kernel_plan=ROPE(cfg)).rope_write.func is full_qk_norm.rope_write_xla
    fused = minimax_m2.make_kernels(cfg, "pallas", kernel_plan=ROPE(cfg)).rope_write   # per shard under a mesh
    assert fused.func is sharded.full_qk_norm_rope_kv_write
    assert fused.args[0].func is fqr.full_qk_norm_rope_kv_write
    small = minimax_m2.MiniMaxM2Config.from_hf(_TINY16)
    assert minimax_m2.make_kernels(small, "pallas", kernel_plan=ROPE(small)).rope_write.func is full_qk_norm.rope_write_xla
