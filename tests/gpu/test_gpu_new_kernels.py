"""The newer Pallas kernels compiled for the GPU (Triton lowering, interpret=False) against
their plain-jnp / XLA references, at the models' shapes, on decode, prefill and mixed batches:
the indexer's TopK with indices (DeepSeek V3.2), MLA over the paged latent cache (DeepSeek-V3,
dense and sparse), the gated-DeltaNet decode, chunked and post-conv kernels (Qwen3.5 /
Qwen3-Next), and MiniMax-M2's fused full-width QK-norm + partial RoPE + KV write. The CPU
tests (tests/pallas_kernels/) run the same kernels in interpret mode at tiny shapes; these
reuse their batch builders and references. References run at matmul precision "highest"
(XLA's default on the GPU is TF32)."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_gdn_post_conv as post_conv_cpu
import test_mla_attention as mla_cpu
from gdn_batches import gdn_batch
from jaxserve.models import layers
from jaxserve.pallas_kernels import full_qk_norm_rope_kv_write as fqr
from jaxserve.pallas_kernels import gated_delta_chunked as gdc
from jaxserve.pallas_kernels import gated_delta_decode as gdd
from jaxserve.pallas_kernels import gdn_post_conv as gpc
from jaxserve.pallas_kernels import mla_attention as mk
from jaxserve.pallas_kernels import topk as tk
from test_full_qk_norm_rope_kv_write import _norms
from test_qk_norm_rope_kv_write import make as qkv_batch
from test_topk import _check as check_topk
from test_topk import hard_rows

pytestmark = pytest.mark.gpu

BF16, F32 = jnp.bfloat16, jnp.float32


def highest(fn, *args, **static):
    """A reference, compiled, at f32 matmul precision (no TF32); `static`: its non-array
    keyword arguments."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(fn, **static))(*args)


def close(got, want, tol, rtol=None, err_msg=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), err_msg
    np.testing.assert_allclose(got, want, rtol=tol if rtol is None else rtol, atol=tol,
                               err_msg=err_msg)


def at_shapes(builder, **consts):
    """A CPU test's batch builder with its module's shape constants (C, R, P; G, H, K, V)
    replaced: the same code at the models' shapes."""
    fn = types.FunctionType(builder.__code__, {**builder.__globals__, **consts}, builder.__name__,
                            builder.__defaults__, builder.__closure__)
    fn.__kwdefaults__ = builder.__kwdefaults__
    return fn


# -- TopK with indices (the V3.2 indexer: 2,048 of each query token's context) ------------------
def indexer_scores(ctxs, l, dtype, seed):
    """One row per query token: scores of its ctxs[i] visible keys, -inf past them (causal).
    bf16 scores hold many ties, so k often cuts through a run of equal values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((len(ctxs), l)) * 3).astype(np.float32)
    x[np.arange(l)[None, :] >= np.asarray(ctxs)[:, None]] = -np.inf
    return jnp.asarray(x, dtype)


TOPK_BATCHES = {   # visible keys of each row, row length (the padded context)
    "decode": ([131072, 100000, 65537, 2048, 2047, 5, 40000, 8191], 131072),
    "prefill": (list(range(1800, 2312)), 4096),                       # 512 tokens across k
    "mixed": ([70000, 1, 3000] + list(range(1990, 2110)), 70000),      # not a multiple of a block
}


@pytest.mark.parametrize("kind,dtype", [("decode", F32), ("decode", BF16), ("prefill", BF16),
                                        ("mixed", F32)])
def test_topk_indexer(kind, dtype, k=2048):
    ctxs, l = TOPK_BATCHES[kind]
    x = indexer_scores(ctxs, l, dtype, seed=len(ctxs))
    got = tk.topk(x, k, impl="pallas", interpret=False)
    check_topk(x, k, got, sorted_out=False)           # exact: the same set as lax.top_k
    n_chosen = (np.asarray(got[1]) >= 0).sum(axis=1)
    np.testing.assert_array_equal(n_chosen, np.minimum(ctxs, k))


@pytest.mark.parametrize("k,sorted_out", [(2048, True), (37, False)])
def test_topk_ties_masks_and_short_rows(k, sorted_out):
    x = hard_rows(l=8192)                             # ties, -inf rows, 5 finite entries, ...
    check_topk(x, k, tk.topk(x, k, impl="pallas", sorted=sorted_out, interpret=False), sorted_out)


# -- MLA over the paged latent cache (DeepSeek-V3: latent 512 + rope 64, 128 heads) --------------
MLA_C, MLA_R, MLA_P = 512, 64, 64
MLA_SCALE = 0.135                                     # (128 + 64)^-0.5 times YaRN's mscale^2
MLA_BATCHES = {   # (query lengths, context lengths): contexts past 2,048 make sparse differ
    "decode": ([1] * 6, [4096, 2049, 3000, 100, 1, 2500]),
    "prefill": ([256, 64], [256, 2600]),                              # fresh, and a later chunk
    "mixed": ([1, 128, 1, 33], [3500, 128, 2100, 2080]),
}
# every batch padded to one shape (the kernel compiles once per dtype and form): 8 sequences
# (fillers with no token hold the rest of the blocks), 64 blocks each, 256 blocks, 384 tokens
MLA_SEQS, MLA_MAX_BLOCKS, MLA_BLOCKS, MLA_T = 8, 64, 256, 384


def mla_batch(kind, *, n, k, dtype, c=MLA_C, r=MLA_R, p=MLA_P, seed=0):
    qlens, ctxs = map(list, MLA_BATCHES[kind])
    left = MLA_BLOCKS - sum(-(-x // p) for x in ctxs)
    if max(ctxs) < MLA_MAX_BLOCKS * p:                # the widest block table: a filler
        qlens, ctxs, left = qlens + [0], ctxs + [MLA_MAX_BLOCKS * p], left - MLA_MAX_BLOCKS
    while len(ctxs) < MLA_SEQS:
        take = min(left, MLA_MAX_BLOCKS)
        qlens, ctxs, left = qlens + [0], ctxs + [take * p], left - take
    assert left == 0 and max(ctxs) == MLA_MAX_BLOCKS * p, (qlens, ctxs, left)
    build = at_shapes(mla_cpu.mla_batch, C=c, R=r, P=p)
    q, lat, bt, seq, pos, sel, real = build(qlens, ctxs, n=n, k=k, pad_tokens=MLA_T - sum(qlens),
                                            seed=seed)
    return q.astype(dtype), lat.astype(dtype), bt, seq, pos, sel, real


@pytest.mark.parametrize("kind", list(MLA_BATCHES))
@pytest.mark.parametrize("sparse", [False, True])
def test_mla_attention(kind, sparse, dtype=BF16, n=128, k=2048, c=MLA_C, r=MLA_R, p=MLA_P,
                       splits=None):
    """bf16, 128 heads (8 tiles of 16), k = 2,048 selected positions a token (sparse); the
    key-range splits of key_splits (or `splits`), merged by split_merge's kernel."""
    q, lat, bt, seq, pos, sel, real = mla_batch(kind, n=n, k=k, dtype=dtype, c=c, r=r, p=p,
                                                seed=len(kind) + sparse)
    sel = sel if sparse else None
    kw = dict(sm_scale=MLA_SCALE, value_dim=c)
    want = highest(lambda *a: mk.ref_mla_attention(*a[:5], selected_Tk=a[5], **kw),
                   q, lat, bt, seq, pos, sel)
    got = mk.mla_attention(q, lat, bt, seq, pos, sel, impl="pallas", interpret=False,
                           splits=splits, **kw)
    assert got.shape == (q.shape[0], n, c) and got.dtype == dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    # bf16 inputs, probabilities and output: measured max error 0.0156 (an ulp at 2-4);
    # f32 (below): the kernel's dots take TF32 inputs, measured 0.0043
    close(np.asarray(got, np.float32)[:real], np.asarray(want, np.float32)[:real],
          2e-2 if dtype == BF16 else 1e-2)


@pytest.mark.parametrize("splits", [4, 16])
@pytest.mark.parametrize("sparse", [False, True])
def test_mla_attention_key_splits(sparse, splits):
    """Each token's keys in 4 or 16 ranges (some empty for short contexts), merged."""
    test_mla_attention("mixed", sparse, splits=splits)


@pytest.mark.parametrize("sparse", [False, True])
def test_mla_attention_f32(sparse):
    """f32, the 16 heads of one tensor-parallel shard of 8 (one tile), on the mixed batch."""
    test_mla_attention("mixed", sparse, dtype=F32, n=16)


# -- gated DeltaNet (Qwen3.5-397B-A17B: 16 key / 64 value heads; Qwen3-Next-80B: 16 / 32) --------
GDN_HEADS = {"qwen3.5-397b": (16, 64, 128, 128), "qwen3-next-80b": (16, 32, 128, 128)}
GDN_SLOTS = 32


def gdn_decode_batch(seed):
    """24 decode rows, 3 padding sequences (no token, slot 0) among them, 5 fresh sequences,
    the rest continuing; state slots scattered over 1..31."""
    rng = np.random.default_rng(seed)
    qlens = [1] * 24
    for i in (5, 17, 23):
        qlens[i] = 0
    starts = [0 if i % 5 == 0 or not qlens[i] else int(rng.integers(1, 5000)) for i in range(24)]
    slots = rng.permutation(np.arange(1, GDN_SLOTS))[:24]
    slots = [int(s) if n else 0 for s, n in zip(slots, qlens)]
    return qlens, starts, slots


@pytest.mark.parametrize("model,v_dtype", [("qwen3.5-397b", BF16), ("qwen3-next-80b", F32)])
def test_gated_delta_decode(model, v_dtype, heads=None):
    g, h, kd, vd = heads or GDN_HEADS[model]
    qlens, starts, slots = gdn_decode_batch(seed=h)
    q, k, v, gg, beta, qsl, seq_lens, slots_S, state = gdn_batch(
        qlens, starts, slots, g=g, h=h, k=kd, v=vd, num_slots=GDN_SLOTS, pad_tokens=2, seed=h)
    v = v.astype(v_dtype)
    want_o, want_state = highest(gdd.ref_gated_delta_decode, q, k, v, gg, beta, qsl, seq_lens,
                                 slots_S, state)
    got_o, got_state = gdd.gated_delta_decode(q, k, v, gg, beta, qsl, seq_lens, slots_S, jnp.copy(state),
                                              impl="pallas", interpret=False)
    close(got_o, want_o, 1e-4)
    close(got_state, want_state, 1e-4)
    untouched = np.setdiff1d(np.arange(GDN_SLOTS), [s for s, n in zip(slots, qlens) if n])
    np.testing.assert_array_equal(np.asarray(got_state)[untouched], np.asarray(state)[untouched])
    np.testing.assert_array_equal(np.asarray(got_o)[[i for i, n in enumerate(qlens) if not n]], 0.0)


GDN_CHUNKED_T = 432
GDN_CHUNKED_BATCHES = {   # (query lengths, tokens already computed, state slots), 8 sequences
    # and 432 tokens each (padding sequences at slot 0, then padding tokens): one compile
    "decode": ([1] * 8, [0, 7, 300, 1, 0, 64, 65, 2000], [3, 9, 14, 1, 22, 5, 30, 11]),
    "prefill": ([300, 129] + [0] * 6, [0, 700] + [0] * 6, [6, 21] + [0] * 6),  # fresh; a later chunk
    "mixed": ([1, 70, 1, 0, 200, 1, 64, 0], [500, 0, 33, 0, 64, 0, 128, 0],
              [4, 12, 27, 0, 8, 19, 15, 0]),
}


@pytest.mark.parametrize("kind", list(GDN_CHUNKED_BATCHES))
def test_gated_delta_chunked(kind, model="qwen3.5-397b", v_dtype=BF16, heads=None,
                             num_tokens=GDN_CHUNKED_T):
    """The model's call: v bf16 (post-conv keeps conv's dtype), default chunk 64 and 32 value
    rows a program."""
    g, h, kd, vd = heads or GDN_HEADS[model]
    qlens, starts, slots = GDN_CHUNKED_BATCHES[kind]
    q, k, v, gg, beta, qsl, seq_lens, slots_S, state = gdn_batch(
        qlens, starts, slots, g=g, h=h, k=kd, v=vd, num_slots=GDN_SLOTS,
        pad_tokens=num_tokens - sum(qlens), max_decay=0.6, state_scale=0.3, seed=sum(qlens))
    v = v.astype(v_dtype)
    want_o, want_state = highest(gdc.ref_gated_delta_chunked, q, k, v, gg, beta, qsl, seq_lens,
                                 slots_S, state)
    got_o, got_state = gdc.gated_delta_chunked(q, k, v, gg, beta, qsl, seq_lens, slots_S,
                                               jnp.copy(state), impl="pallas", interpret=False)
    # the kernel's dots are TF32, as XLA runs the jnp form's at default precision (the path it
    # replaces): its error against the f32 reference is held to twice that form's
    base_o, base_state = jax.jit(gdc.ref_gated_delta_chunked)(q, k, v, gg, beta, qsl, seq_lens,
                                                              slots_S, state)
    for got, base, want in ((got_o, base_o, want_o), (got_state, base_state, want_state)):
        err = float(jnp.max(jnp.abs(got - want)))
        base_err = float(jnp.max(jnp.abs(base - want)))
        assert err <= 2 * base_err + 1e-6, (err, base_err)
        close(got, want, 5e-3 * float(jnp.max(jnp.abs(want))))
    untouched = np.setdiff1d(np.arange(GDN_SLOTS), [s for s, n in zip(slots, qlens) if n])
    np.testing.assert_array_equal(np.asarray(got_state)[untouched], np.asarray(state)[untouched])
    np.testing.assert_array_equal(np.asarray(got_o)[int(qsl[-1]):], 0.0)     # padding tokens


@pytest.mark.parametrize("kind", list(GDN_CHUNKED_BATCHES))
def test_gated_delta_chunked_float32_is_exact(kind, model="qwen3-next-80b", num_tokens=GDN_CHUNKED_T):
    """A float32 model (v f32): full-precision dots (issue 70), so the kernel matches the f32
    reference to f32 rounding, not TF32's (the bf16 test above allows 5e-3 of the output's
    scale; TF32 here gave a float32 Qwen3.5 0.1-nat first-token logprob errors)."""
    g, h, kd, vd = GDN_HEADS[model]
    qlens, starts, slots = GDN_CHUNKED_BATCHES[kind]
    q, k, v, gg, beta, qsl, seq_lens, slots_S, state = gdn_batch(
        qlens, starts, slots, g=g, h=h, k=kd, v=vd, num_slots=GDN_SLOTS,
        pad_tokens=num_tokens - sum(qlens), max_decay=0.6, state_scale=0.3, seed=sum(qlens))
    want_o, want_state = highest(gdc.ref_gated_delta_chunked, q, k, v, gg, beta, qsl, seq_lens,
                                 slots_S, state)
    got_o, got_state = gdc.gated_delta_chunked(q, k, v, gg, beta, qsl, seq_lens, slots_S,
                                               jnp.copy(state), impl="pallas", interpret=False)
    for got, want in ((got_o, want_o), (got_state, want_state)):
        close(got, want, 1e-4 * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.parametrize("model,dtype", [("qwen3.5-397b", BF16), ("qwen3-next-80b", F32)])
@pytest.mark.parametrize("t", [1, 37, 2048])          # a decode row, a ragged block, a prefill
def test_gdn_post_conv(t, model, dtype, heads=None):
    g, h, kd, vd = heads or GDN_HEADS[model]
    ins = at_shapes(post_conv_cpu._inputs, G=g, H=h, K=kd, V=vd)(t, dtype, seed=t + h)
    kw = dict(num_k_heads=g, k_dim=kd, v_dim=vd)
    want = gpc.ref_gdn_post_conv(*ins, **kw)
    got = gpc.gdn_post_conv(*ins, **kw, impl="pallas", interpret=False)
    for name, w, o in zip("q k v g beta".split(), want, got):
        assert o.shape == w.shape and o.dtype == w.dtype, name
        if name == "v":                               # a copy
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(w, np.float32))
        else:                                         # f32 math on the same inputs either way
            close(o, w, 1e-5, err_msg=name)


# -- MiniMax-M2: full-width QK-norm + partial RoPE + paged KV write ------------------------------
MINIMAX = dict(n=48, kh=8, e=128, rotary=64, theta=5e6)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("t,max_pos", [(8, 200_000), (1024, 200_000)])
def test_full_qk_norm_rope_kv_write(t, max_pos, dtype, shape=MINIMAX):
    """Decode (8 tokens) and prefill token counts, 2 of them padding (slot 0); positions up to
    MiniMax-M2's 196K context; every cache slot not written comes back bit-identical."""
    n, kh, e, p = shape["n"], shape["kh"], shape["e"], 16
    nb = t // p + 8
    rng = np.random.default_rng(t)
    q, k, v, pos, slots, kc, vc = qkv_batch(rng, t=t, n=n, kh=kh, e=e, nb=nb, p=p, dtype=dtype)
    pos = jnp.asarray(rng.integers(0, max_pos, t).astype(np.int32))
    inv = layers.rope_inv_freq(shape["rotary"], shape["theta"], None)
    q_norm, k_norm = (w.astype(dtype) for w in _norms(rng, n, kh, e=e))
    args = (q, k, v, pos, slots, kc, vc, inv, q_norm, k_norm)
    want = fqr.ref_full_qk_norm_rope_kv_write(*args, eps=1e-6)
    got = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, jnp.copy(kc), jnp.copy(vc), inv,
                                         q_norm, k_norm, eps=1e-6, impl="pallas", interpret=False)
    tol = 2e-2 if dtype == BF16 else 1e-4            # bf16: the norm's rounding may flip an ulp
    close(got[0], want[0], tol, err_msg="q")
    written = np.asarray(slots)[np.asarray(slots) != 0]
    untouched = np.setdiff1d(np.arange(p, nb * p), written)
    for name, g_, w_ in zip(("k_cache", "v_cache"), got[1:], want[1:]):
        g_ = np.asarray(g_, np.float32).reshape(nb * p, kh, e)
        w_ = np.asarray(w_, np.float32).reshape(nb * p, kh, e)
        if name == "v_cache":
            np.testing.assert_array_equal(g_[written], w_[written])
        else:
            close(g_[written], w_[written], tol, err_msg=name)
        np.testing.assert_array_equal(g_[untouched], w_[untouched], err_msg=name)   # NaN == NaN


# -- DeepSeek's grouped, biased router and MLA's fused cache writes (issue 30) -------------------
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_deepseek_router(tokens):
    """DeepSeek-V3's choice (256 experts, 8 groups, 4 kept, top-8, scale 2.5): the kernel's
    experts equal the jnp reference's, weights within f32 rounding."""
    from jaxserve.pallas_kernels import moe_router as mr

    rng = np.random.default_rng(tokens)
    logits = jnp.asarray(rng.normal(size=(tokens, 256)) * 2, F32)
    bias = jnp.asarray(rng.normal(size=(256,)) * 0.3, F32)
    kw = dict(top_k=8, scoring="sigmoid", renormalize=True, scaling=2.5, bias=bias, n_group=8,
              topk_group=4)
    w, e = mr.moe_router(logits, impl="pallas", interpret=False, **kw)
    rw, re_ = highest(mr.ref_moe_router, logits, **kw)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(re_))
    close(w, rw, 1e-5)


@pytest.mark.parametrize("tokens,index,dtype", [(1, True, BF16), (64, True, BF16), (300, False, BF16),
                                                (37, True, F32)])
def test_mla_latent_write(tokens, index, dtype):
    """DeepSeek-V3.2's widths (C 512, R 64, J 128), YaRN's factor, 64-token blocks."""
    import test_mla_latent_write as lw_cpu
    from jaxserve.models.layers import mla
    from jaxserve.pallas_kernels import mla_latent_write as mlw

    rng = np.random.default_rng(tokens)
    args, slots = lw_cpu.make(rng, t=tokens + 2, c=512, r=64, j=128, nb=40, p=64, dtype=dtype,
                              index=index)
    inv, factor = mla.rope_tables(64, 10000.0, lw_cpu.YARN, 163840)
    got = mlw.mla_latent_write(inv_freq_H=inv, factor=factor, impl="pallas", interpret=False, **args)
    want = highest(mlw.ref_mla_latent_write, inv_freq_H=inv, factor=factor, **args)
    lw_cpu.compare(got, want, slots, 2e-2 if dtype == BF16 else 1e-5)


@pytest.mark.parametrize("shape,tokens,chunks", [((128, 2048, 768, 8), 1, 1), ((128, 2048, 768, 8), 4, 1),
                                                 ((256, 7168, 2048, 8), 1, 2)])
def test_moe_decode(shape, tokens, chunks):
    """The fused MoE decode kernels at Qwen3-30B-A3B's experts (gate|up fused) and DeepSeek-V3's
    (in two expert chunks, as the engine holds them), bf16, against the jnp reference."""
    from jaxserve.pallas_kernels import moe_decode as md
    from jaxserve.pallas_kernels.grouped_matmul import split_experts

    x, d, f, k = shape
    rng = np.random.default_rng(tokens)
    key = jax.random.key(tokens)
    gate_up = (jax.random.normal(key, (x, d, 2 * f), BF16) * d ** -0.5)
    down = (jax.random.normal(jax.random.fold_in(key, 1), (x, f, d), BF16) * f ** -0.5)
    h = jnp.asarray(rng.standard_normal((tokens, d)), BF16)
    experts = jnp.asarray(np.stack([rng.choice(x, k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), F32)
    gu, dn = (split_experts(gate_up), split_experts(down)) if chunks > 1 else (gate_up, down)
    got = md.moe_decode(h, weights, experts, gu, None, dn, impl="pallas", interpret=False)
    want = highest(md.ref_moe_decode, h, weights, experts, gate_up, None, down)
    close(got, want, 3e-2)


@pytest.mark.parametrize("tokens,fused", [(1, False), (4, True)])
def test_moe_decode_fp8(tokens, fused):
    """The fused MoE decode kernels on DeepSeek-V3's block-scaled FP8 experts (256 x 7168 x
    2048, top-8, 128 x 128 scale blocks; gate and up separate as its checkpoints hold them, or
    fused), in expert chunks within int32 as the engine holds them (fused gate|up: four),
    bf16 activations, against the jnp
    reference (which dequantizes to f32) over just the experts the tokens chose."""
    from jaxserve.pallas_kernels import moe_decode as md
    from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8

    x, d, f, k, b = 256, 7168, 2048, 8, 128
    rng = np.random.default_rng(tokens)
    key = jax.random.key(tokens)

    def fp8(i, kdim, n):    # e4m3 values drawn in place (no bf16 copy), scales varying by block
        draw = jax.jit(lambda key: jax.random.normal(key, (x, kdim, n), F32).astype(jnp.float8_e4m3fn))
        values = draw(jax.random.fold_in(key, i))
        scales = jnp.asarray(rng.uniform(0.5, 2.0, (x, kdim // b, n // b)) * kdim ** -0.5, F32)
        return BlockScaledFp8(values, scales, b)

    gate, up = (fp8(0, d, 2 * f), None) if fused else (fp8(0, d, f), fp8(1, d, f))
    down = fp8(2, f, d)
    h = jnp.asarray(rng.standard_normal((tokens, d)), BF16)
    experts = np.stack([rng.choice(x, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = jnp.asarray(rng.random((tokens, k)), F32)
    got = md.moe_decode(h, weights, jnp.asarray(experts), gate.split(4 if up is None else 2),
                        None if up is None else up.split(2), down.split(2), impl="pallas",
                        interpret=False)
    chosen = np.unique(experts)         # the reference over these experts only (f32 copies)
    sub = lambda w: w and BlockScaledFp8(w.values[chosen], w.scales[chosen], b)  # noqa: E731
    local = jnp.asarray(np.searchsorted(chosen, experts), jnp.int32)
    want = highest(md.ref_moe_decode, h, weights, local, sub(gate), sub(up), sub(down))
    # the kernel rounds the activations to bf16 (as the grouped path does), the reference not:
    # near-zero outputs then differ by ~1 % of the output's scale
    close(got, want, 3e-2 * max(1.0, float(jnp.max(jnp.abs(want)))) / 4, rtol=3e-2)


@pytest.mark.parametrize("case", ["decode", "prefill", "mixed"])
def test_indexer_scores(case):
    """V3.2's indexer scores at its shapes (64 heads of 128, 64-token blocks), bf16, against
    the model's XLA path: decode rows up to 40K keys, a 1K-token prefill, a mix."""
    import test_indexer_scores as is_cpu
    from jaxserve.pallas_kernels import indexer_scores as isc

    qlens, ctxs = {"decode": ([1] * 4, [40000, 2048, 77, 1]), "prefill": ([1024], [1500]),
                   "mixed": ([1, 300, 1], [9000, 300, 5])}[case]
    args = is_cpu.batch(np.random.default_rng(0), qlens, ctxs, heads=64, j=128, p=64, dtype=BF16)
    got = isc.indexer_scores(*args, scale=128 ** -0.5, impl="pallas", interpret=False)
    want = highest(isc.ref_indexer_scores, *args, scale=128 ** -0.5)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    close(np.asarray(got)[finite], np.asarray(want)[finite], 2e-2)
