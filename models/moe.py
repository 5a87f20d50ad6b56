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
from jaxserve.pallas_kernels.grouped_matmul import grouped_matmul, split_experts
from jaxserve.pallas_kernels.moe_router import moe_router


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "w_gate_up")


def split_expert_weights(params):
    """In place: every MoE layer's expert arrays past the grouped-matmul kernel's int32 reach
    become tuples of expert chunks (grouped_matmul takes them), in any family's layers and MTP
    layers. Why: whole, they made each decode step read every expert through lax.ragged_dot
    (DeepSeek-V3: 5.29 ms a layer at batch 1, 5 % of its roofline; H200, session 20). For
    unsharded engines only (a mesh runs the XLA path)."""
    if isinstance(params, dict):
        for key, value in params.items():
            if key in EXPERT_WEIGHTS and getattr(value, "ndim", 0) == 3:
                params[key] = split_experts(value)
            else:
                split_expert_weights(value)
    elif isinstance(params, list):
        for item in params:
            split_expert_weights(item)
    return params


def moe_param_shapes(cfg: ModelConfig) -> dict:
    d, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {"router": (d, x), "w_gate": (x, d, f), "w_up": (x, d, f), "w_down": (x, f, d)}


def route(cfg: ModelConfig, router_logits_TX: jax.Array, impl: str = "xla"):
    """Top-k experts per token and their weights f32[T, k]: scores by softmax over the experts
    or by an independent sigmoid each (cfg.scoring_func), the k best, renormalised to sum to 1
    if cfg.norm_topk_prob, times cfg.routed_scaling_factor (pallas_kernels.moe_router: one
    kernel; impl "xla" | "pallas" (interpreted on a CPU) | "auto")."""
    return moe_router(router_logits_TX, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
                      renormalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                      impl=impl)


def group_by_expert(experts_M: jax.Array, num_experts: int):
    """Rows m (token m // k, its (m % k)-th expert) sorted stably by expert, for the grouped
    matmul: (sorted position of each row i32[M], row of each sorted position i32[M], rows per
    expert i32[X]).

    Up to SORT_FREE_MAX_ROWS rows this is counting on [M, M] and [M, X] comparisons, a few
    fusions with no sort, scatter or cumulative sum (each of which is a kernel of its own on
    a GPU, and a decode step runs this once per MoE layer); above, an argsort."""
    m = experts_M.shape[0]
    rows = jnp.arange(m, dtype=jnp.int32)
    sizes_X = jnp.sum(experts_M[:, None] == jnp.arange(num_experts)[None, :], axis=0,
                      dtype=jnp.int32)
    if m > SORT_FREE_MAX_ROWS:
        order_M = jnp.argsort(experts_M, stable=True).astype(jnp.int32)
        return jnp.argsort(order_M).astype(jnp.int32), order_M, sizes_X
    e_row, e_col = experts_M[:, None], experts_M[None, :]
    before_MM = (e_col < e_row) | ((e_col == e_row) & (rows[None, :] < rows[:, None]))
    pos_M = jnp.sum(before_MM, axis=1, dtype=jnp.int32)
    row_of_M = jnp.sum(jnp.where(pos_M[None, :] == rows[:, None], rows[None, :], 0), axis=1,
                       dtype=jnp.int32)
    return pos_M, row_of_M, sizes_X


SORT_FREE_MAX_ROWS = 512   # [M, M] comparisons: 256K elements at most


def moe_mlp(cfg: ModelConfig, lp: dict, h_TD: jax.Array, impl: str = "xla") -> jax.Array:
    """Grouped computation: tokens sorted by expert, one ragged matmul per projection.

    impl "xla" uses lax.ragged_dot and the plain-XLA router; "auto"/"pallas" the router kernel
    and lets pallas_kernels.grouped_matmul pick: on a GPU its expert-skipping Pallas kernel for
    few rows (decode: it reads only the chosen experts' weights), the Mosaic GPU ragged dot on
    Hopper for more (4-37x faster than lax.ragged_dot, measured)."""
    t, d = h_TD.shape
    k = cfg.num_experts_per_tok
    weights_Tk, experts_Tk = route(cfg, h_TD @ lp["router"], impl)
    pos_M, row_of_M, group_sizes = group_by_expert(experts_Tk.reshape(-1), cfg.num_experts)
    x_sorted = h_TD[row_of_M // k]                              # [T*k, D]
    mm_impl = "xla" if impl == "xla" else "auto"
    gate, up = llama.gate_up(lp, lambda w: grouped_matmul(x_sorted, w, group_sizes, impl=mm_impl))
    y_sorted = grouped_matmul(jax.nn.silu(gate) * up, lp["w_down"], group_sizes, impl=mm_impl)
    # each token gathers its k rows back: a gather and an elementwise weighted sum (no
    # zero-filled scatter-add; no einsum either, which a GPU may run in TF32)
    y_TkD = y_sorted[pos_M].reshape(t, k, d).astype(jnp.float32)
    return (y_TkD * weights_Tk[:, :, None]).sum(axis=1).astype(h_TD.dtype)
