"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): softmax or sigmoid router, top-k, optional
renormalisation and scaling.

Parameters of an MoE layer: router f[D, X], w_gate f[X, D, F], w_up f[X, D, F], w_down f[X, F, D].
Legend: T tokens, D model dim, X experts, F expert MLP dim, k experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.pallas_kernels.grouped_matmul import grouped_matmul


def moe_param_shapes(cfg: ModelConfig) -> dict:
    d, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {"router": (d, x), "w_gate": (x, d, f), "w_up": (x, d, f), "w_down": (x, f, d)}


def route(cfg: ModelConfig, router_logits_TX: jax.Array):
    """Top-k experts per token and their weights f32[T, k]: scores by softmax over the experts
    or by an independent sigmoid each (cfg.scoring_func), the k best, renormalised to sum to 1
    if cfg.norm_topk_prob, times cfg.routed_scaling_factor."""
    logits = router_logits_TX.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(scores, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:   # sigmoid scores can all be ~0: keep the division finite
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, experts


def moe_mlp(cfg: ModelConfig, lp: dict, h_TD: jax.Array, impl: str = "xla") -> jax.Array:
    """Grouped computation: tokens sorted by expert, one ragged matmul per projection.

    impl "xla" uses lax.ragged_dot; "auto"/"pallas" lets pallas_kernels.grouped_matmul pick:
    on a GPU its expert-skipping Pallas kernel for few rows (decode: it reads only the chosen
    experts' weights), the Mosaic GPU ragged dot on Hopper for more (4-37x faster than
    lax.ragged_dot, measured)."""
    t, d = h_TD.shape
    k = cfg.num_experts_per_tok
    weights_Tk, experts_Tk = route(cfg, h_TD @ lp["router"])
    flat_expert = experts_Tk.reshape(-1)                        # [T*k]
    order = jnp.argsort(flat_expert)
    token_of = order // k
    x_sorted = h_TD[token_of]                                   # [T*k, D]
    group_sizes = jnp.bincount(flat_expert, length=cfg.num_experts).astype(jnp.int32)
    mm_impl = "xla" if impl == "xla" else "auto"
    gate, up = llama.gate_up(lp, lambda w: grouped_matmul(x_sorted, w, group_sizes, impl=mm_impl))
    y_sorted = grouped_matmul(jax.nn.silu(gate) * up, lp["w_down"], group_sizes, impl=mm_impl)
    w_sorted = weights_Tk.reshape(-1)[order].astype(jnp.float32)
    y = jnp.zeros((t, d), jnp.float32).at[token_of].add(y_sorted.astype(jnp.float32) * w_sorted[:, None])
    return y.astype(h_TD.dtype)
