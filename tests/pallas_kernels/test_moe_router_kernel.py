"""MoE router kernel (interpret mode) against the plain-jnp reference; lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import moe_router as mr
from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda, triton_kernel_names


def check(logits, block_t=16, **kw):
    w, e = mr.moe_router(logits, impl="pallas", block_t=block_t, **kw)
    rw, re_ = mr.ref_moe_router(logits, **kw)
    assert w.dtype == jnp.float32 and e.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(e), np.asarray(re_))
    np.testing.assert_allclose(np.asarray(w), np.asarray(rw), rtol=1e-5, atol=1e-7)
    return w, e


@pytest.mark.parametrize("scoring,renormalize,scaling", [
    ("softmax", True, 1.0), ("softmax", False, 1.0), ("sigmoid", True, 2.5),
    ("sigmoid", False, 1.0)])
def test_matches_reference(scoring, renormalize, scaling):
    # Qwen3-30B-A3B's 128 experts, top-8; 19 tokens: a second program with 13 padding rows
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(19, 128)) * 3, jnp.float32)
    check(logits, top_k=8, scoring=scoring, renormalize=renormalize, scaling=scaling)


def test_odd_expert_count_bf16_logits_and_one_token():
    rng = np.random.default_rng(1)
    check(jnp.asarray(rng.normal(size=(1, 60)) * 2, jnp.bfloat16), top_k=6)   # Qwen2-MoE: 60
    check(jnp.asarray(rng.normal(size=(7, 8)), jnp.float32), top_k=2)        # Mixtral: 8, top-2
    check(jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), top_k=5, block_t=2)


def test_ties_pick_the_lowest_expert_first():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]], jnp.float32)
    _, e = check(logits, top_k=4)
    np.testing.assert_array_equal(np.asarray(e), [[1, 2, 4, 0]])


def test_bad_arguments_name_the_field():
    logits = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="top_k"):
        mr.moe_router(logits, top_k=9)
    with pytest.raises(ValueError, match="scoring"):
        mr.moe_router(logits, top_k=2, scoring="relu")
    with pytest.raises(ValueError, match=r"\[T, X\]"):
        mr.moe_router(jnp.zeros((8,)), top_k=2)


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(lambda x: mr.moe_router(x, top_k=8, impl="pallas", interpret=False),
                               sds((16, 128), jnp.bfloat16))
    assert triton_kernel_names(exported) == ["moe_router_softmax_k8"]
    assert [a.shape for a in exported.out_avals] == [(16, 8), (16, 8)]


def test_nan_logits_keep_expert_ids_in_range():
    logits = np.random.default_rng(2).normal(size=(3, 8)).astype(np.float32)
    logits[1, 5] = np.nan
    w, e = mr.moe_router(jnp.asarray(logits), top_k=3, scoring="sigmoid", impl="pallas")
    e = np.asarray(e)
    assert ((e >= 0) & (e < 8)).all() and e[1, 0] == 5       # the NaN expert ranks first
    rw, re_ = mr.ref_moe_router(jnp.asarray(logits[[0, 2]]), top_k=3, scoring="sigmoid")
    np.testing.assert_array_equal(e[[0, 2]], np.asarray(re_))  # other tokens untouched
    np.testing.assert_allclose(np.asarray(w)[[0, 2]], np.asarray(rw), rtol=1e-5)


@pytest.mark.parametrize("x,n_group,topk_group,top_k", [
    (256, 8, 4, 8),      # DeepSeek-V3: 256 experts in 8 groups, the 4 best groups, top-8
    (64, 4, 2, 6),       # a tiny DeepSeek
    (60, 1, 1, 4),       # MiniMax-M2's choice: bias, no group limit (and X not a power of two)
    (12, 6, 6, 3),       # every group kept: the limit is a no-op
])
def test_biased_grouped_choice_matches_reference(x, n_group, topk_group, top_k):
    rng = np.random.default_rng(x + n_group)
    logits = jnp.asarray(rng.normal(size=(21, x)) * 2, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(x,)) * 0.5, jnp.float32)
    w, e = check(logits, block_t=4, top_k=top_k, scoring="sigmoid", renormalize=True, scaling=2.5,
                 bias=bias, n_group=n_group, topk_group=topk_group)
    # the weights are the UNBIASED scores of the chosen experts
    s = jax.nn.sigmoid(logits)
    chosen = np.take_along_axis(np.asarray(s), np.asarray(e), axis=1)
    np.testing.assert_allclose(np.asarray(w), 2.5 * chosen / chosen.sum(1, keepdims=True), rtol=1e-5)
    if topk_group < n_group:   # every chosen expert lies in one of topk_group groups
        groups = np.asarray(e) // (x // n_group)
        assert max(len(set(row)) for row in groups) <= topk_group


def test_group_choice_by_two_best_not_by_best():
    # group 0's best is the highest score, but group 1's two best sum higher: keep group 1;
    # group 2 holds a tie of its best, counted twice (as lax.top_k's two), and ranks second
    logits = np.full((1, 12), -6.0, np.float32)
    logits[0, [0, 4, 5, 8, 9]] = [4.0, 2.0, 2.0, 1.5, 1.5]
    bias = jnp.zeros((12,), jnp.float32)
    w, e = check(jnp.asarray(logits), top_k=3, scoring="sigmoid", bias=bias, n_group=3, topk_group=1)
    np.testing.assert_array_equal(np.asarray(e), [[4, 5, 6]])
    _, e = check(jnp.asarray(logits), top_k=4, scoring="sigmoid", bias=bias, n_group=3, topk_group=2)
    np.testing.assert_array_equal(np.asarray(e), [[4, 5, 8, 9]])


def test_bias_chooses_but_does_not_weigh():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]], jnp.float32)
    bias = jnp.asarray([5.0, 0.0, 0.0, -5.0], jnp.float32)
    w, e = check(logits, top_k=2, scoring="sigmoid", renormalize=False, bias=bias)
    np.testing.assert_array_equal(np.asarray(e), [[0, 2]])
    np.testing.assert_allclose(np.asarray(w), np.asarray(jax.nn.sigmoid(jnp.asarray([[0.0, 2.0]]))),
                               rtol=1e-6)


def test_bad_group_arguments_name_the_field():
    logits = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="n_group"):
        mr.moe_router(logits, top_k=2, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        mr.moe_router(logits, top_k=6, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="bias"):
        mr.moe_router(logits, top_k=2, bias=jnp.zeros((7,)))


def test_grouped_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    exported = export_for_cuda(
        lambda x, b: mr.moe_router(x, top_k=8, scoring="sigmoid", bias=b, n_group=8, topk_group=4,
                                   scaling=2.5, impl="pallas", interpret=False),
        sds((1, 256), jnp.float32), sds((256,), jnp.float32))
    assert triton_kernel_names(exported) == ["moe_router_sigmoid_grouped_k8"]
