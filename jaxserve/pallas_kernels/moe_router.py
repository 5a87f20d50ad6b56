"""MoE router: expert scores, the top k per token, renormalisation and scaling, in one kernel.

    weights_Tk, experts_Tk = moe_router(logits_TX, top_k=k, scoring="softmax" | "sigmoid",
                                        renormalize=..., scaling=...,
                                        bias=None, n_group=1, topk_group=1)

scores = softmax over the experts (Mixtral, Qwen-MoE) or an independent sigmoid per expert
(DeepSeek-V3 style); the k best per token, highest first (ties: lowest expert index first, as
lax.top_k); with `renormalize` the k weights are divided by their sum (kept finite when sigmoid
scores are all ~0); then multiplied by `scaling` (HF's routed_scaling_factor).

DeepSeek V3's choice ("noaux_tc", also MiniMax-M2's with one group): with `bias` f32[X]
(e_score_correction_bias) the experts are CHOSEN by score + bias but WEIGHTED by their unbiased
scores; with n_group > 1 the X experts form n_group consecutive groups, each scored by the sum
of its two best biased scores, and only the topk_group best groups may be chosen from (ties:
the lowest group first).

Layouts: logits_TX f32/bf16[T, X] -> (weights f32[T, k], experts i32[T, k]).
Legend: T tokens, X experts, k experts per token, BT tokens per program, Xp = X rounded up to
a power of two.

Why a kernel: in XLA this is a softmax fusion, a sort (lax.top_k) with its copies and a
normalising fusion: four small kernels per MoE layer (DeepSeek's grouped choice: two more
sorts, a scatter and a gather), 48 layers deep in Qwen3-30B-A3B, where
a batch-1 decode step is mostly such small kernels (BENCHMARKS.md, Qwen3-30B-A3B). Here one
program holds BT tokens' scores and picks the k best by k rounds of max + lowest arg-max
(k <= 16 rounds over <= a few hundred experts: cheaper than any sort). One token per program
and one warp, so every reduction stays inside the warp (larger programs were slower: their
reductions go through shared memory). H200, 128 experts, top-8: 2.0 us at one token against
6.5 for XLA (BENCHMARKS.md, "Kernels").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, resolve_impl, whole

SCORINGS = ("softmax", "sigmoid")

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def ref_moe_router(logits_TX, *, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                   scaling: float = 1.0, bias=None, n_group: int = 1, topk_group: int = 1):
    """Plain jnp: scores in f32, the group limit (lax.top_k of each group's two best), lax.top_k
    of the biased scores, the unbiased scores of the chosen, renormalise, scale."""
    logits = logits_TX.astype(jnp.float32)
    t, x = logits.shape
    scores = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if topk_group < n_group:
        group_TG = jax.lax.top_k(choice.reshape(t, n_group, x // n_group), 2)[0].sum(-1)
        _, best_Tg = jax.lax.top_k(group_TG, topk_group)
        keep_TG = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best_Tg].set(True)
        choice = jnp.where(jnp.repeat(keep_TG, x // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if renormalize:   # sigmoid scores can all be ~0: keep the division finite
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, experts.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _validate(logits_TX, top_k, scoring, bias, n_group, topk_group):
    if logits_TX.ndim != 2:
        raise ValueError(f"logits_TX must be [T, X]; got shape {logits_TX.shape}")
    x = logits_TX.shape[1]
    if not 1 <= top_k <= x:
        raise ValueError(f"top_k must be in [1, X={x}]; got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}; got {scoring!r}")
    if bias is not None and bias.shape != (x,):
        raise ValueError(f"bias must be f32[X={x}]; got shape {bias.shape}")
    if n_group < 1 or x % n_group or x // n_group < 2:
        raise ValueError(f"n_group must divide X={x} into groups of at least 2 experts; got {n_group}")
    if not 1 <= topk_group <= n_group or topk_group * (x // n_group) < top_k:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}] and leave at least top_k="
                         f"{top_k} experts; got {topk_group}")


# ---------------------------------------------------------------------------------------------
# Kernel body: program i routes tokens i*BT .. (i+1)*BT - 1
# ---------------------------------------------------------------------------------------------


def _router_kernel(logits_ref, bias_ref, w_ref, e_ref, *, num_tokens, num_experts, top_k,
                   block_t, experts_p, k_p, sigmoid, renormalize, scaling, n_group, topk_group):
    rows_R = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    cols_X = jnp.arange(experts_p, dtype=jnp.int32)
    real_X = cols_X < num_experts
    real_R = rows_R < num_tokens
    logits = plgpu.load(logits_ref.at[jnp.minimum(rows_R, num_tokens - 1)[:, None],
                                      jnp.minimum(cols_X, num_experts - 1)[None, :]])
    logits = logits.astype(jnp.float32)
    if sigmoid:
        scores = 1.0 / (1.0 + jnp.exp(-logits))
    else:
        shifted = jnp.exp(logits - jnp.max(jnp.where(real_X[None, :], logits, -jnp.inf), axis=1,
                                           keepdims=True))
        shifted = jnp.where(real_X[None, :], shifted, 0.0)
        scores = shifted / jnp.sum(shifted, axis=1, keepdims=True)
    # NOTE: a NaN score (from a NaN logit) would match no max, so it ranks first, as in
    # lax.top_k, and every expert id stays in range
    scores = jnp.where(jnp.isnan(scores), 2.0, scores)
    choice = scores
    if bias_ref is not None:
        choice = choice + plgpu.load(bias_ref.at[jnp.minimum(cols_X, num_experts - 1)])[None, :]
    # `open` marks the experts still to be chosen from: real ones, in a kept group, not taken
    open_RX = jnp.broadcast_to(real_X[None, :], (block_t, experts_p))
    if topk_group < n_group:
        open_RX = open_RX & _kept_groups(choice, cols_X, num_experts // n_group, n_group,
                                         topk_group, block_t)
    slot_K = jnp.arange(k_p, dtype=jnp.int32)
    weights = jnp.zeros((block_t, k_p), jnp.float32)
    experts = jnp.zeros((block_t, k_p), jnp.int32)
    for j in range(top_k):
        pick_R, _ = _best(choice, open_RX, cols_X, experts_p)
        pick_R = jnp.minimum(pick_R, num_experts - 1)       # (only if fewer than k were open)
        chosen_RX = cols_X[None, :] == pick_R[:, None]
        weight_R = jnp.sum(jnp.where(chosen_RX, scores, 0.0), axis=1)   # the UNBIASED score
        weights = jnp.where(slot_K[None, :] == j, weight_R[:, None], weights)
        experts = jnp.where(slot_K[None, :] == j, pick_R[:, None], experts)
        open_RX = open_RX & ~chosen_RX
    if renormalize:
        total_R = jnp.sum(weights, axis=1)        # unused slots hold 0
        weights = weights / jnp.maximum(total_R, 1e-20)[:, None]
    if scaling != 1.0:
        weights = weights * scaling
    mask = real_R[:, None] & (slot_K < top_k)[None, :]
    plgpu.store(w_ref.at[rows_R[:, None], slot_K[None, :]], weights, mask=mask)
    plgpu.store(e_ref.at[rows_R[:, None], slot_K[None, :]], experts, mask=mask)


def _best(values_RX, open_RX, cols_X, cols_p):
    """(lowest column holding each row's largest open value i32[R], that value f32[R]); cols_p
    (out of range) where a row has no open column."""
    best_R = jnp.max(jnp.where(open_RX, values_RX, -jnp.inf), axis=1)
    pick_R = jnp.min(jnp.where(open_RX & (values_RX == best_R[:, None]), cols_X[None, :], cols_p),
                     axis=1)
    return pick_R, best_R


def _kept_groups(choice_RX, cols_X, group_size, n_group, topk_group, block_t):
    """bool[R, Xp]: the experts of each row's topk_group best groups, a group scored by the sum
    of its two best choice values (a tie of the best counts twice, as lax.top_k's two)."""
    group_X = cols_X // group_size               # padding columns fall in groups >= n_group
    g_p = pl.next_power_of_2(n_group)
    slot_G = jnp.arange(g_p, dtype=jnp.int32)
    group_RG = jnp.full((block_t, g_p), -jnp.inf, jnp.float32)
    for g in range(n_group):                    # a few groups (DeepSeek-V3: 8): unrolled
        in_g = jnp.broadcast_to((group_X == g)[None, :], choice_RX.shape)
        first_R, top1_R = _best(choice_RX, in_g, cols_X, cols_X.shape[0])
        _, top2_R = _best(choice_RX, in_g & (cols_X[None, :] != first_R[:, None]), cols_X,
                          cols_X.shape[0])
        group_RG = jnp.where(slot_G[None, :] == g, (top1_R + top2_R)[:, None], group_RG)
    kept_RX = jnp.zeros(choice_RX.shape, jnp.bool_)
    open_RG = jnp.broadcast_to((slot_G < n_group)[None, :], group_RG.shape)
    for _ in range(topk_group):
        g_R, _ = _best(group_RG, open_RG, slot_G, g_p)
        kept_RX = kept_RX | (group_X[None, :] == g_R[:, None])
        open_RG = open_RG & (slot_G[None, :] != g_R[:, None])
    return kept_RX


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("top_k", "scoring", "renormalize", "scaling",
                                             "n_group", "topk_group", "impl", "block_t",
                                             "num_warps", "interpret"))
def moe_router(logits_TX, *, top_k: int, scoring: str = "softmax", renormalize: bool = True,
               scaling: float = 1.0, bias=None, n_group: int = 1, topk_group: int = 1,
               impl: str = "auto", block_t: int = 1, num_warps: int = 1,
               interpret: bool | None = None):
    """(weights f32[T, k], experts i32[T, k]) of each token; see the module docstring.

    impl: "pallas" (this kernel; interpreted on CPU), "xla" (ref_moe_router) or "auto" (pallas
    on a GPU). block_t: tokens per program (a power of two); num_warps: warps per program.
    """
    _validate(logits_TX, top_k, scoring, bias, n_group, topk_group)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_moe_router(logits_TX, top_k=top_k, scoring=scoring, renormalize=renormalize,
                              scaling=scaling, bias=bias, n_group=n_group, topk_group=topk_group)
    t, x = logits_TX.shape
    kernel = functools.partial(
        _router_kernel, num_tokens=t, num_experts=x, top_k=top_k, block_t=block_t,
        experts_p=pl.next_power_of_2(x), k_p=pl.next_power_of_2(top_k),
        sigmoid=scoring == "sigmoid", renormalize=renormalize, scaling=float(scaling),
        n_group=n_group, topk_group=topk_group)
    operands, in_specs = [logits_TX], [whole(t, x)]
    if bias is None:
        kernel = absent_refs(kernel, 1)
    else:
        operands.append(bias.astype(jnp.float32))
        in_specs.append(whole(x))
    grouped = "_grouped" if topk_group < n_group else ""
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_t),),
        in_specs=in_specs,
        out_specs=(whole(t, top_k), whole(t, top_k)),
        out_shape=(jax.ShapeDtypeStruct((t, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((t, top_k), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=(not on_gpu) if interpret is None else interpret,
        name=f"moe_router_{scoring}{grouped}_k{top_k}",
    )(*operands)
