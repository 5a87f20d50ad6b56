"""The fused linear layer (pallas_kernels/fused_linear.py) in interpret mode against its plain-jnp
reference on decode, prefill and odd row counts; the packed q/k/v rope + KV-write kernel against
the unpacked one; and the fused dense stack (models/llama.py fused_stack, Kernels.linear) inside
the model step against the XLA path on a mixed batch."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import layers, llama, registry
from jaxserve.pallas_kernels import policy
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.pallas_kernels import fused_linear as fl
from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables  # noqa: E402

VARIANTS = {
    "plain": dict(),
    "norm": dict(norm=True),
    "norm+bias": dict(norm=True, bias=True),
    "residual": dict(residual=True),
    "norm+gated": dict(norm=True, gated=True),
    "gated+bias": dict(gated=True, bias=True),
}


def operands(rng, t, k, n, dtype, *, norm=False, bias=False, residual=False, gated=False):
    r = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.5, dtype)  # noqa: E731
    kw = dict(gated=gated)
    if norm:
        kw["norm_K"] = r(k) + 1
    if bias:
        kw["bias_N"] = r(n)
    if residual:
        kw["residual_TN"] = r(t, n)
    return r(t, k), r(k, n), kw


def ulps(got, want, dtype):
    """Largest |got - want| in units of the dtype's spacing at want's magnitude."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    eps = float(jnp.finfo(dtype).eps)
    return float(np.max(np.abs(got - want) / (eps * np.maximum(np.abs(want), 1.0))))


@pytest.mark.parametrize("t", [1, 5, 40, 70])                # decode, few rows, prefill tiles
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_float32(t, variant):
    x, w, kw = operands(np.random.default_rng(t), t, 96, 160, jnp.float32, **VARIANTS[variant])
    got = fl.fused_linear(x, w, impl="pallas", **kw)
    with jax.default_matmul_precision("highest"):   # (a GPU's default f32 matmul is TF32)
        want = fl.ref_fused_linear(x, w, **kw)
    assert got.shape == want.shape == (t, 80 if kw["gated"] else 160)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_bfloat16(variant):
    """bf16 rounds as the model's ops do, but for the norm (x * w rounded before the row scale,
    not after: half an ulp of each input, ~sqrt(K) of them summed), sums in another order and
    XLA's own sigmoid: a few ulps of the output's scale, no more."""
    x, w, kw = operands(np.random.default_rng(1), 19, 64, 96, jnp.bfloat16, **VARIANTS[variant])
    got = fl.fused_linear(x, w, impl="pallas", **kw)
    assert got.dtype == jnp.bfloat16
    assert ulps(got, fl.ref_fused_linear(x, w, **kw), jnp.bfloat16) <= 8


@pytest.mark.parametrize("t", [1, 33])
def test_lm_head_over_a_tied_embedding_keeps_float32(t):
    """w_layout="NK": the [V, D] embedding read as is; out_dtype f32: the accumulator, as
    jnp.dot(..., preferred_element_type=f32) gives it."""
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, 64)), jnp.bfloat16)
    embed = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    got = fl.fused_linear(x, embed, w_layout="NK", out_dtype=jnp.float32, impl="pallas")
    want = jnp.dot(x, embed.T, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_row_program_matches_the_reference(variant, dtype):
    """One row over [N, K] weights (the fused stack's decode step) takes the one-row program:
    products in f32 summed along K, in BN-row programs, K past one step masked."""
    x, w, kw = operands(np.random.default_rng(3), 1, 96, 160, dtype, **VARIANTS[variant])
    w_nk = w.T
    assert fl.one_row(1, w.size, "NK") and not fl.one_row(2, w.size, "NK")
    want = fl.ref_fused_linear(x, w, **kw) if dtype == jnp.bfloat16 else None
    if want is None:
        with jax.default_matmul_precision("highest"):
            want = fl.ref_fused_linear(x, w, **kw)
    for block_n, block_k in ((None, None), (4, 32), (16, 64)):
        got = fl.fused_linear(x, w_nk, w_layout="NK", impl="pallas",
                              tiling=fl.LinearTiling(block_n=block_n, block_k=block_k), **kw)
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        else:
            assert got.dtype == jnp.bfloat16 and ulps(got, want, jnp.bfloat16) <= 8
    with pytest.raises(ValueError, match="block_n"):
        fl.fused_linear(x, w_nk, w_layout="NK", impl="pallas", tiling=fl.LinearTiling(block_n=3),
                        **kw)
    with pytest.raises(ValueError, match="one-row"):
        fl.fused_linear(jnp.concatenate([x, x]), w_nk, w_layout="NK", impl="pallas",
                        tiling=fl.LinearTiling(one_row_program=True), gated=kw["gated"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,block_k", [(1, None), (1, 32), (3, None), (20, 32)])
def test_normed_out_is_the_models_norm(t, block_k, dtype):
    """normed_out: the normalised rows too, bit for bit as models/layers.py rms_norm gives them
    (a few f32 ulps apart: the mean square is summed in another order), from the one-row and the dot program, over
    one K step and several; the product as without it."""
    rng = np.random.default_rng(t)
    x = jnp.asarray(rng.standard_normal((t, 96)) * 3 + 1, dtype)
    w = jnp.asarray(rng.standard_normal((32, 96)) * 0.1, dtype)
    norm = jnp.asarray(rng.standard_normal(96) * 0.5 + 1, dtype)
    y, h = fl.fused_linear(x, w, norm_K=norm, eps=1e-5, w_layout="NK", normed_out=True,
                           impl="pallas", tiling=fl.LinearTiling(block_k=block_k))
    y_alone = fl.fused_linear(x, w, norm_K=norm, eps=1e-5, w_layout="NK", impl="pallas",
                              tiling=fl.LinearTiling(block_k=block_k))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_alone))
    want = layers.rms_norm(x, norm, 1e-5)
    assert h.dtype == dtype
    assert ulps(h, want, dtype) <= (4 if dtype == jnp.float32 else 1)
    ref_y, ref_h = fl.ref_fused_linear(x, w, norm_K=norm, eps=1e-5, w_layout="NK", normed_out=True)
    np.testing.assert_array_equal(np.asarray(ref_h), np.asarray(want))
    with pytest.raises(ValueError, match="normed_out needs norm_K"):
        fl.fused_linear(x, w, w_layout="NK", normed_out=True, impl="pallas")


def test_block_n_and_tiling_rules():
    x, w, _ = operands(np.random.default_rng(0), 3, 32, 64, jnp.float32)
    with jax.default_matmul_precision("highest"):       # (a GPU's default f32 matmul is TF32)
        want = np.asarray(x @ w)
    for bn in (16, 32, 64):
        np.testing.assert_allclose(np.asarray(fl.fused_linear(x, w, impl="pallas", tiling=fl.LinearTiling(block_n=bn))),
                                   want, rtol=1e-5, atol=1e-5)
    for bk in (16, 32, 64):      # a K step of 16..64 (64: one step, K=32 masked past half)
        np.testing.assert_allclose(np.asarray(fl.fused_linear(x, w, impl="pallas", tiling=fl.LinearTiling(block_k=bk))),
                                   want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_n"):
        fl.fused_linear(x, w, impl="pallas", tiling=fl.LinearTiling(block_n=48))
    with pytest.raises(ValueError, match="block_k"):
        fl.fused_linear(x, w, impl="pallas", tiling=fl.LinearTiling(block_k=24))
    # decode: the widest column block that still gives each of the 132 SMs a program
    assert fl.dot_tiling(1, 576, 1536, "KN") == (16, 16, 256)      # 96 programs even at 16
    assert fl.dot_tiling(1, 576, 49152, "NK") == (16, 128, 128)    # 384 programs at 128
    assert fl.dot_tiling(512, 576, 576, "KN") == (64, 32, 256)     # 8 row tiles x 18
    assert fl.dot_tiling(512, 4096, 4096, "KN") == (64, 128, 64)   # (shared memory: see tiling)
    assert fl.dot_tiling(1, 32, 64, "KN") == (16, 16, 32)


def test_shapes_the_kernel_cannot_take_are_named():
    x, w, _ = operands(np.random.default_rng(0), 3, 32, 64, jnp.float32)
    with pytest.raises(ValueError, match="K=32"):
        fl.fused_linear(x[:, :24], w, impl="pallas")
    with pytest.raises(ValueError, match="norm_K"):
        fl.fused_linear(x, w, norm_K=jnp.ones(8), impl="pallas")
    with pytest.raises(ValueError, match="multiples of 16"):
        fl.fused_linear(x, w[:, :40], impl="pallas")
    # "auto" off the kernel's shapes: the reference, not an error
    np.testing.assert_allclose(np.asarray(fl.fused_linear(x, w[:, :40])), np.asarray(x @ w[:, :40]),
                               rtol=1e-6)


def test_lowers_for_cuda_at_the_default_models_shapes():
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def layer_and_head(x, wqkv, wn, wgu, wd, emb, w_kn):
        nk = dict(w_layout="NK", impl="pallas", interpret=False)
        qkv = fl.fused_linear(x, wqkv, norm_K=wn, **nk)
        act = fl.fused_linear(x, wgu, norm_K=wn, gated=True, **nk)
        x = fl.fused_linear(act, wd, residual_TN=x, **nk)
        return (qkv, fl.fused_linear(x, emb, out_dtype=jnp.float32, **nk),
                fl.fused_linear(x, w_kn, impl="pallas", interpret=False))

    # the engine's layers ([out, in] weights: transpose_for_fused_stack), the head, one [in, out]
    args = (sds((1, 576), bf), sds((960, 576), bf), sds((576,), bf), sds((3072, 576), bf),
            sds((576, 1536), bf), sds((49152, 576), bf), sds((576, 1536), bf))
    names = triton_kernel_names(export_for_cuda(layer_and_head, *args))
    # one row: the one-row program up to 16M weight elements (the layer), the dot beyond (head)
    assert names == ["fused_linear_norm_bm1_bn4_bk1024", "fused_linear_norm_gated_bm1_bn4_bk1024",
                     "fused_linear_res_bm1_bn4_bk2048", "fused_linear_bm16_bn128_bk128",
                     "fused_linear_bm16_bn16_bk256"]


def test_lowers_for_cuda_at_qwen3_moe_shapes():
    """The fused stack's MoE layer projections (Qwen3-30B-A3B): q|k|v and o on the one-row
    program (up to 16M weight elements), the router with its normalised rows."""
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def projections(x, wqkv, wn, wo, o, wr):
        nk = dict(w_layout="NK", impl="pallas", interpret=False)
        return (fl.fused_linear(x, wqkv, norm_K=wn, **nk), fl.fused_linear(o, wo, residual_TN=x, **nk),
                fl.fused_linear(x, wr, norm_K=wn, normed_out=True, **nk))

    args = (sds((1, 2048), bf), sds((5120, 2048), bf), sds((2048,), bf), sds((2048, 4096), bf),
            sds((1, 4096), bf), sds((128, 2048), bf))
    assert triton_kernel_names(export_for_cuda(projections, *args)) == [
        "fused_linear_norm_bm1_bn4_bk2048", "fused_linear_res_bm1_bn4_bk2048",
        "fused_linear_norm_normed_bm1_bn4_bk2048"]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_packed_qkv_rope_write_equals_the_unpacked_kernel(qk_norm):
    rng = np.random.default_rng(5)
    t, n, kh, e, nb, p = 7, 6, 2, 32, 6, 4
    qkv = jnp.asarray(rng.standard_normal((t, n + 2 * kh, e)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(p, nb * p))[:t], jnp.int32)
    pos = jnp.asarray(rng.integers(0, 300, t), jnp.int32)
    kc = jnp.full((nb, p, kh, e), jnp.nan, jnp.float32)
    vc = jnp.full((nb, p, kh, e), -3.0, jnp.float32)
    inv = layers.rope_inv_freq(e, 10000.0, None)
    norms = (jnp.asarray(rng.standard_normal(e), jnp.float32),) * 2 if qk_norm else (None, None)
    got = qrk.qkv_norm_rope_kv_write(qkv, pos, slots, kc, vc, inv, *norms, num_heads=n,
                                     impl="pallas")
    want = qrk.ref_qk_norm_rope_kv_write(qkv[:, :n], qkv[:, n:n + kh], qkv[:, n + kh:], pos, slots,
                                         kc, vc, inv, *norms)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="N \\+ 2K"):
        qrk.qkv_norm_rope_kv_write(qkv[:, 1:], pos, slots, kc, vc, inv, num_heads=n, impl="pallas")


# -- the fused dense stack inside the model step ----------------------------------------------

BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ, STEP_T, S = 8, 32, 6, 24, 4
MODELS = {   # tied embeddings + q/k norms (Qwen3); qkv bias (Qwen2); plain Llama, untied; MoE
    "qwen3-tied": {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True},
    "qwen2-bias": {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False},
    "llama": {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "tie_word_embeddings": False,
                  "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48,
                  "norm_topk_prob": True},
}
# the fused kernels each takes: MoE layers also through moe_decode (models/moe.py residual_moe)
FUSED = {name: frozenset({"linear", "moe"} if "moe" in name else {"linear"}) for name in MODELS}


@functools.partial(jax.jit, static_argnums=(0, 4))
def _step(cfg, params, kv_cache, x, fused):
    kernels = llama.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(cfg, "llama", fused))
    kv_cache, hidden_TD, aux = llama.forward(cfg, params, kv_cache, x, kernels, (0,))
    return kv_cache, llama.compute_logits(cfg, params, hidden_TD, kernels), aux


STEPS = {   # (chunks as (sequence, tokens, start), padded tokens)
    # a prefill chunk, a whole short prompt and a chunk continuing at position 9: a mixed batch
    "mixed": ([(0, 5, 0), (1, 9, 0), (2, 3, 9)], STEP_T),
    # three sequences decoding one token each (MoE layers: moe_decode, its input normalised by
    # the router projection)
    "decode": ([(0, 1, 11), (1, 1, 4), (2, 1, 30)], 4),
    # one sequence, one token: the one-row program, the router's normalised rows too
    "one": ([(0, 1, 11)], 1),
    # the same, with every weight "large": the projections through XLA (the stack's rule for
    # weights past the one-row program's reach), moe_decode still
    "one-xla": ([(0, 1, 11)], 1),
}


@pytest.mark.parametrize("name,step", [(name, "mixed") for name in MODELS]
                         + [("qwen3-moe", s) for s in ("decode", "one", "one-xla")])
def test_fused_stack_matches_the_xla_path(name, step, monkeypatch):
    from jaxserve.models.loader import load_dummy
    from jaxserve.pallas_kernels import moe_decode as md

    cfg, params = load_dummy({**MODELS[name], "vocab_size": 128, "hidden_size": 64,
                              "intermediate_size": 96, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                              "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                              "rope_theta": 10000.0}, seed=3)
    params = llama.fuse_projections(cfg, jax.tree.map(lambda a: a, params))
    params_t = llama.transpose_for_fused_stack(cfg, jax.tree.map(lambda a: a, params))
    assert "wqkv_t" in params_t["layers"][0] and "wqkv" not in params_t["layers"][0]
    assert ("router_t" in params_t["layers"][0]) == cfg.is_moe
    linear = KernelPlan.for_model(cfg, "llama", {"linear"})
    assert llama.make_kernels(cfg, "pallas", kernel_plan=linear).linear
    assert not llama.make_kernels(cfg, "xla", kernel_plan=linear).linear
    rng = np.random.default_rng(0)
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=2)
    spans, step_t = STEPS[step]
    chunks = [Chunk(seq, rng.integers(0, 128, n).tolist(), start) for seq, n, start in spans]
    x = build_step(chunks, tables, BLOCK_SIZE, step_t, S)
    _step.clear_cache()      # traced anew: the patches and the recorders below see the trace
    if step == "one-xla":
        monkeypatch.setattr(fl, "SMALL_WEIGHT_ELEMENTS", 0)
        monkeypatch.setattr(fl, "ONE_ROW_MAX_ELEMENTS", 0)
    kernel_names = []
    real_call = fl.pl.pallas_call
    monkeypatch.setattr(fl.pl, "pallas_call", lambda *a, **kw: kernel_names.append(
        kw.get("name", "")) or real_call(*a, **kw))
    calls = []
    real_md = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda *a, **kw: calls.append(a[0].shape) or real_md(*a, **kw))
    outs = []
    # the XLA path, on both layouts of the weights (each model's mixed step: the layouts'
    # agreement does not depend on the step, and each run compiles a program), then the fused
    # stack
    runs = [(params, frozenset()), (params_t, frozenset()), (params_t, FUSED[name])]
    if step != "mixed":
        del runs[1]
    for p, fused in runs:
        kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
        with jax.default_matmul_precision("highest"):   # (a GPU's default f32 matmul is TF32)
            outs.append(jax.device_get(_step(cfg, p, kv, x, fused)))
    (kv_x, logits_x, aux_x), (kv_f, logits_f, aux_f) = outs[0], outs[-1]
    # a decode step of an MoE model: every MoE layer through moe_decode (residual_moe)
    assert calls == ([(step_t, 64)] * cfg.num_layers if cfg.is_moe and step != "mixed" else [])
    if step == "one":        # (traced once: the names of one layer's fused_linear kernels)
        assert any("normed_bm1" in n for n in kernel_names), kernel_names
        assert any(n.startswith("fused_linear_norm_bm1") for n in kernel_names), kernel_names
    if step == "one-xla":
        assert not any("fused_linear" in n and "bm1_" in n for n in kernel_names), kernel_names
    real = int(x.query_start_loc[3])
    if step == "mixed":
        np.testing.assert_allclose(outs[1][1][:real], logits_x[:real], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits_f[:real], logits_x[:real], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(aux_f[0][:real], aux_x[0][:real], atol=1e-5, rtol=1e-5)
    for layer_x, layer_f in zip(kv_x, kv_f):
        for part in ("k", "v"):                                     # block 0 takes padding writes
            np.testing.assert_allclose(layer_f[part][1:], layer_x[part][1:], atol=1e-5)


def test_auto_turns_linear_on_for_small_dense_models_and_moe_for_experts():
    from jaxserve.config import ModelConfig
    small = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                        head_dim=64)
    assert policy.auto_fused_kernels(small, "llama") == ("linear",)
    import dataclasses
    assert policy.auto_fused_kernels(dataclasses.replace(small, hidden_size=4096), "llama") == ()
    assert policy.auto_fused_kernels(dataclasses.replace(small, head_dim=80), "llama") == ()
    assert policy.auto_fused_kernels(small, "qwen3_next") == ()
    # MoE: the fused stack where its router's width (the experts) tiles, moe_decode always
    moe = dataclasses.replace(small, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                              hidden_size=2048)
    assert policy.auto_fused_kernels(moe, "llama") == ("linear", "moe")
    assert policy.auto_fused_kernels(dataclasses.replace(moe, num_experts=8), "llama") == ("moe",)   # Mixtral
    assert policy.auto_fused_kernels(moe, "qwen3_next") == ("moe",)
    # other families' MoE models keep their own stacks, and "linear" named for one changes
    # nothing (before the MoE fused stack it never applied to MoE models)
    from jaxserve.models import loader, minimax_m2
    from jaxserve.models.loaders import dummy
    golden = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "ckpt")
    for name in ("minimax_m2", "deepseek_v3", "qwen3_5_moe"):
        cfg = loader.model_config_from_hf(dummy.read_config(os.path.join(golden, name, "config.json")))
        family = registry.get_family(cfg.architecture).name
        assert cfg.is_moe and not policy.fused_stack_fits(cfg, family), name
    cfg = loader.model_config_from_hf(dummy.read_config(os.path.join(golden, "minimax_m2", "config.json")))
    assert not minimax_m2.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(
        cfg, "minimax_m2", {"linear", "norm"})).linear


@pytest.mark.parametrize("name", ["qwen3-tied", "qwen2-bias", "qwen3-moe"])
def test_engine_with_fused_linear_equals_the_engine_without(name, tmp_path):
    """The runner stores the projections [out, in] for fused_stack, and greedy output with it
    (decode steps through the fused stack, a prefill step of 40 tokens through XLA over the
    transposed weights) equals the Pallas engine without it, batched (dummy weights). An MoE
    model's decode steps of up to 4 tokens run its experts through moe_decode, larger ones
    through the grouped path."""
    import json

    from jaxserve import LLM, SamplingParams

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**MODELS[name], "vocab_size": 256, "hidden_size": 64,
                                  "intermediate_size": 96, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 32, "max_position_embeddings": 128}))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    stack = ",".join(sorted(FUSED[name]))
    for fused in ("none", stack):
        llm = LLM(str(config), load_format="dummy", dtype="float32", attention_impl="pallas",
                  fused_kernels=fused, warmup=False, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=64, num_kv_blocks=32)
        layer = llm.engine.runner.params["layers"][0]
        assert ("wqkv_t" in layer) == (fused == stack)
        outs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outs[stack] == outs["none"]
    with pytest.raises(ValueError, match="fused_kernels"):
        LLM(str(config), load_format="dummy", fused_kernels="linear,lineer", warmup=False)


def test_fused_kernels_option():
    import argparse

    from jaxserve.engine.args import add_engine_arguments

    cfg = llama.ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                            intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=1,
                            head_dim=32)
    def resolve_fused_kernels(option, cfg, num_devices):
        return KernelPlan.resolve(option, cfg, "llama", num_devices).fused
    assert resolve_fused_kernels("auto", cfg, 1) == ()            # (on a CPU: nothing)
    assert resolve_fused_kernels("none", cfg, 1) == ()
    assert resolve_fused_kernels("linear, rope", cfg, 1) == ("linear", "rope")
    with pytest.raises(ValueError, match="one device"):
        resolve_fused_kernels("linear", cfg, 2)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert parser.parse_args(["--fused-kernels", "none"]).fused_kernels == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--fused-kernels", "fast"])
