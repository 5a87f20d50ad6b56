"""MoE router: softmax or sigmoid scores, top-k, renormalisation and scaling, against numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.models import moe

BASE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=8)


def numpy_route(logits, k, *, sigmoid, renorm, scale):
    scores = 1 / (1 + np.exp(-logits)) if sigmoid else \
        np.exp(logits - logits.max(-1, keepdims=True)) / np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
    experts = np.argsort(-scores, axis=-1)[:, :k]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if renorm:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * scale, experts


@pytest.mark.parametrize("scoring,renorm,scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                                  ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)])
def test_route_matches_numpy(scoring, renorm, scale):
    cfg = ModelConfig.from_hf({**BASE, "scoring_func": scoring, "norm_topk_prob": renorm,
                               "routed_scaling_factor": scale})
    assert (cfg.scoring_func, cfg.routed_scaling_factor) == (scoring, scale)
    logits = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32) * 3
    weights, experts = moe.route(cfg, logits)
    want_w, want_e = numpy_route(logits, 2, sigmoid=scoring == "sigmoid", renorm=renorm, scale=scale)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)


def test_sigmoid_scores_are_independent_of_the_other_experts():
    # with softmax, raising one expert's logit lowers every other weight; with sigmoid it does not
    cfg = ModelConfig.from_hf({**BASE, "scoring_func": "sigmoid", "norm_topk_prob": False})
    logits = np.array([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]], np.float32)
    w1, _ = moe.route(cfg, logits)
    logits[0, 5] = 0.5         # a third expert gets close but stays outside the top 2
    w2, _ = moe.route(cfg, logits)
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w2))


def test_unknown_scoring_func_names_the_field():
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_hf({**BASE, "scoring_func": "relu"})


@pytest.mark.parametrize("m,x", [(8, 128), (40, 6), (600, 16)])   # 600: the argsort path
def test_group_by_expert_is_a_stable_sort_by_expert(m, x):
    experts = np.random.default_rng(m).integers(0, x, size=m).astype(np.int32)
    pos, row_of, sizes = (np.asarray(a) for a in moe.group_by_expert(jnp.asarray(experts), x))
    order = np.argsort(experts, kind="stable")
    np.testing.assert_array_equal(row_of, order)                 # sorted position -> row
    np.testing.assert_array_equal(pos[order], np.arange(m))      # row -> sorted position
    np.testing.assert_array_equal(sizes, np.bincount(experts, minlength=x))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_moe_layer_with_the_router_kernel_matches_xla(scoring):
    # the whole MoE layer with impl="pallas" (the router kernel, interpreted on a CPU; the
    # grouped matmul's "auto" is lax.ragged_dot here) against impl="xla"
    import jax
    cfg = ModelConfig.from_hf({**BASE, "scoring_func": scoring})
    rng = np.random.default_rng(3)
    shapes = moe.moe_param_shapes(cfg)
    lp = {n: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for n, s in shapes.items()}
    h = jnp.asarray(rng.normal(size=(7, cfg.hidden_size)), jnp.float32)
    want = jax.jit(lambda h: moe.moe_mlp(cfg, lp, h, impl="xla"))(h)
    got = jax.jit(lambda h: moe.moe_mlp(cfg, lp, h, impl="pallas"))(h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(want).max()) > 0.1
