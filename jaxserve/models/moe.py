"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): softmax or sigmoid router, top-k, optional
renormalisation and scaling.

Parameters of an MoE layer: router f[D, X], w_gate f[X, D, F], w_up f[X, D, F], w_down f[X, F, D].
Legend: T tokens, D model dim, X experts, F expert MLP dim, k experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import layers
from jaxserve.pallas_kernels import moe_decode
from jaxserve.pallas_kernels.grouped_matmul import grouped_matmul, quantize, split_experts
from jaxserve.pallas_kernels.moe_router import moe_router
from jaxserve.sharding import expert_parallel
from jaxserve.pallas_kernels.policy import moe_decode_takes


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "w_gate_up")


def map_expert_weights(params, fn):
    """In place: fn(array) for every MoE layer's expert arrays ([X, ...]: any family's layers
    and MTP layers, by name); returns params."""
    if isinstance(params, dict):
        for key, value in params.items():
            if key in EXPERT_WEIGHTS and getattr(value, "ndim", 0) == 3:
                params[key] = fn(value)
            else:
                map_expert_weights(value, fn)
    elif isinstance(params, list):
        for item in params:
            map_expert_weights(item, fn)
    return params


def split_expert_weights(params):
    """In place: every MoE layer's expert arrays past the grouped-matmul kernel's int32 reach
    become tuples of expert chunks (grouped_matmul takes them). Why: whole, they made each
    decode step read every expert through lax.ragged_dot (DeepSeek-V3: 5.29 ms a layer at
    batch 1, 5 % of its roofline; H200, session 20). For unsharded engines only (under a mesh
    each rank holds its own experts: sharding/expert_parallel.py)."""
    return map_expert_weights(params, split_experts)


def quantize_experts_fp8(params):
    """In place: every MoE layer's expert arrays as block-scaled FP8 (grouped_matmul.quantize),
    as an FP8 checkpoint's are kept (dummy weights of `--quantization fp8`): values and scales
    placed as the array was (split alike under a mesh, as the loader splits a checkpoint's)."""
    def kept(w):
        s = w.sharding
        q = quantize(w)
        expert_parallel.check_fp8_placement("an expert array", w.shape, s, q.block)
        return type(q)(jax.device_put(q.values, s), jax.device_put(q.scales, s), q.block)
    return map_expert_weights(params, kept)


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


def kernel_impl(impl: str) -> str:
    """The kernels' impl of an MoE impl: "fused" is "pallas" with moe_decode for small steps."""
    return "pallas" if impl == "fused" else impl


def moe_mlp(cfg: ModelConfig, lp: dict, h_TD: jax.Array, impl: str = "xla") -> jax.Array:
    """Grouped computation: tokens sorted by expert, one ragged matmul per projection.

    impl "xla" uses lax.ragged_dot and the plain-XLA router; "auto"/"pallas" the router kernel
    and lets pallas_kernels.grouped_matmul pick: on a GPU its expert-skipping Pallas kernel for
    few rows (decode: it reads only the chosen experts' weights), the Mosaic GPU ragged dot on
    Hopper for more (4-37x faster than lax.ragged_dot, measured); "fused" as "pallas", with
    the steps the kernel plan gives moe_decode (policy.moe_decode_takes) through it."""
    return routed_experts(lambda p, h: route(cfg, layers.project(h, p, "router"), kernel_impl(impl)),
                          lp, h_TD, cfg.num_experts, impl)


def residual_moe(cfg: ModelConfig, lp: dict, residual_TD: jax.Array, linear, impl: str) -> jax.Array:
    """The fused stack's MoE sub-block (models/llama.py fused_stack), residual +
    moe_mlp(RMSNorm(residual)): for the steps moe_decode takes (`decode_experts`) in five
    kernels: the router projection with the norm in it, which also writes the normalised rows
    (`linear`: fused_linear over lp["router_t"], normed_out), the router kernel, moe_decode's
    two, and the weighted sum with the residual add (one XLA fusion). Other steps: the norm,
    then moe_mlp."""
    experts = None if expert_parallel.splits_experts() else decode_experts(lp, residual_TD, impl)
    if experts is None:
        h_TD = layers.rms_norm(residual_TD, lp["mlp_norm"], cfg.rms_norm_eps)
        return residual_TD + moe_mlp(cfg, lp, h_TD, impl)
    logits_TX, h_TD = linear(residual_TD, lp["router_t"], norm_K=lp["mlp_norm"], normed_out=True)
    weights_Tk, experts_Tk = route(cfg, logits_TX, "pallas")
    y_TD = moe_decode.moe_decode(h_TD, weights_Tk, experts_Tk, *experts, lp["w_down"], impl="pallas")
    return residual_TD + y_TD.astype(residual_TD.dtype)


def decode_experts(lp: dict, h_TD: jax.Array, impl: str) -> tuple | None:
    """moe_decode's (gate, up) operands when it takes this step's routed experts (impl "fused",
    a step policy.moe_decode_takes, weights it can read), else None."""
    if impl != "fused" or not moe_decode_takes(h_TD.shape[0]):
        return None
    gate, up = (lp["w_gate_up"], None) if "w_gate_up" in lp else (lp["w_gate"], lp["w_up"])
    return (gate, up) if moe_decode.problem(h_TD, gate, up, lp["w_down"]) is None else None


def routed_experts(route_fn, lp: dict, h_TD: jax.Array, num_experts: int, impl: str) -> jax.Array:
    """The routed experts' output [T, D] of any family: route_fn(lp, h_TD) -> (weights f32[T, k],
    experts i32[T, k]) is the family's router. Under a mesh that splits the experts or their F
    (an ambient `expert` or `model` axis > 1) it runs per rank, sharding/expert_parallel.py."""
    if expert_parallel.splits_experts():
        return expert_parallel.moe_on_mesh(route_fn, EXPERT_MATHS, lp, h_TD, num_experts, kernel_impl(impl))
    weights_Tk, experts_Tk = route_fn(lp, h_TD)
    experts = decode_experts(lp, h_TD, impl)
    if experts is not None:
        return moe_decode.moe_decode(h_TD, weights_Tk, experts_Tk, *experts, lp["w_down"],
                                     impl="pallas").astype(h_TD.dtype)
    return expert_rows_sum(lp, h_TD, weights_Tk, experts_Tk, num_experts,
                           kernel_impl(impl)).astype(h_TD.dtype)


def expert_rows_sum(lp: dict, h_TD: jax.Array, weights_Tk: jax.Array, experts_Tk: jax.Array,
                    num_experts: int, impl: str, first_expert=0) -> jax.Array:
    """f32[T, D]: for each token, the sum over its k (expert, weight) choices of weight *
    expert(token), counting only the experts lp holds: all num_experts, or (under expert
    parallelism) the X_local = lp["w_down"].shape[0] experts first_expert.. (a traced index);
    rows routed elsewhere add 0.

    The rows are sorted by expert once over all experts; the local experts' rows are then one
    consecutive run of that order, rotated to the front for the grouped matmul (whose rows past
    its groups come out 0), so a rank computes only its own rows and reads only its own weights."""
    t, d = h_TD.shape
    k = experts_Tk.shape[1]
    m = t * k
    pos_M, row_of_M, sizes_X = group_by_expert(experts_Tk.reshape(-1), num_experts)
    w_down = lp["w_down"]       # whole, or chunks of experts (split_expert_weights)
    local = sum(w.shape[0] for w in w_down) if isinstance(w_down, (tuple, list)) else w_down.shape[0]
    mine_M = None
    if local != num_experts:
        ids_X = jnp.arange(num_experts, dtype=jnp.int32)
        first = jnp.sum(jnp.where(ids_X < first_expert, sizes_X, 0), dtype=jnp.int32)
        sizes_X = jax.lax.dynamic_slice(sizes_X, (first_expert,), (local,))
        rows_M = jnp.arange(m, dtype=jnp.int32)
        row_of_M = row_of_M[(rows_M + first) % m]           # the local run first
        pos_M = (pos_M - first) % m                           # each row's place in that order
        mine_M = pos_M < jnp.sum(sizes_X)
    y_sorted = expert_mlp(lp, h_TD[row_of_M // k], sizes_X, impl)
    # each token gathers its k rows back: a gather and an elementwise weighted sum (no
    # zero-filled scatter-add; no einsum either, which a GPU may run in TF32)
    y_TkD = y_sorted[pos_M].reshape(t, k, d).astype(jnp.float32)
    if mine_M is not None:      # (rows past the groups are 0 already: masked for any kernel)
        y_TkD = jnp.where(mine_M.reshape(t, k, 1), y_TkD, 0.0)
    return (y_TkD * weights_Tk[:, :, None]).sum(axis=1)


def expert_mlp(lp: dict, x_sorted: jax.Array, group_sizes: jax.Array, impl: str) -> jax.Array:
    """Rows sorted by expert (group_sizes rows each; rows past them come out 0) through their
    expert's SwiGLU MLP: one grouped matmul per projection."""
    mm_impl = "xla" if impl == "xla" else "auto"
    gate, up = layers.gate_up(lp, lambda w: grouped_matmul(x_sorted, w, group_sizes, impl=mm_impl))
    return grouped_matmul(jax.nn.silu(gate) * up, lp["w_down"], group_sizes, impl=mm_impl)


# what each rank runs under a mesh (sharding/expert_parallel.py)
EXPERT_MATHS = expert_parallel.ExpertMaths(expert_rows_sum, group_by_expert, expert_mlp)
