"""The Llama family: Llama 2/3/3.x, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm).

A model family is a module of pure functions over a parameter pytree (models/registry.py):
    cache_specs(cfg) -> a spec per layer (jaxserve/kv_cache/specs.py)
    param_shapes(cfg) -> shape of every parameter
    forward(cfg, params, caches, x: StepInput, kernels, aux_layers) -> (caches, hidden f[T, D], aux)
    compute_logits(cfg, params, hidden f[S, D], kernels=None) -> f32[S, V]

Parameters (weights stored as [in, out] so activations multiply on the left):
    embed f[V, D]; final_norm f[D]; lm_head f[D, V] (absent when tied to embed)
    layers: a Python list (the layer loop is unrolled inside jit: DESIGN.md §6), each
        attn_norm f[D], wq f[D, N*E], wk f[D, K*E], wv f[D, K*E], wo f[N*E, D],
        bq/bk/bv (Qwen2), q_norm/k_norm f[E] (Qwen3), mlp_norm f[D],
        w_gate f[D, F], w_up f[D, F], w_down f[F, D]   (dense MLP; MoE layers: see moe.py)
    The engine runs on fused copies (fuse_projections): wqkv, bqkv, w_gate_up.
Caches: a list with one {"k", "v"} dict per layer, each f[num_blocks, P, K, E].

Legend: T tokens, S sequences, D model dim, N query heads, K kv heads, E head dim, F MLP dim,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.models import layers, moe
from jaxserve.models.attention import AttentionBackend, AttentionPlan
from jaxserve.pallas_kernels.grouped_matmul import MAX_WEIGHT_ELEMENTS
from jaxserve.pallas_kernels.lora_sgmv import lora_delta
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.core.step_input import StepInput

Caches = list[dict[str, jax.Array]]   # one {"k", "v"} per layer, each f[num_blocks, P, K, E]


def attention_block(cfg: ModelConfig, lp: dict, kv: dict, h_TD: jax.Array, x: StepInput,
                    inv_freq: jax.Array, kernels: "Kernels"):
    """Pre-norm attention sub-block; returns (the layer's new {"k", "v"} cache, attention
    output f[T, D])."""
    t = h_TD.shape[0]
    n, kh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "wqkv" in lp or "wqkv_t" in lp:      # fused by fuse_projections
        qkv = layers.project(h_TD, lp, "wqkv")
        if cfg.attention_bias:
            qkv = qkv + lp["bqkv"]
        qkv = adapted(kernels, lp, "wqkv", h_TD, qkv, x)
        q, k, v = jnp.split(qkv, [n * e, (n + kh) * e], axis=-1)
    else:
        q, k, v = (layers.linear(h_TD, lp[w]) for w in ("wq", "wk", "wv"))
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q_TNE, k_cache, v_cache = kernels.rope_write(
        q.reshape(t, n, e), k.reshape(t, kh, e), v.reshape(t, kh, e), x.positions, x.slot_mapping,
        kv["k"], kv["v"], inv_freq, lp.get("q_norm"), lp.get("k_norm"))
    o_TNE = kernels.attention(q_TNE, k_cache, v_cache, x)
    o_TD = o_TNE.reshape(t, n * e)
    return {"k": k_cache, "v": v_cache}, adapted(kernels, lp, "wo", o_TD, layers.project(o_TD, lp, "wo"), x)


def adapted(kernels: "Kernels", lp: dict, name: str, in_TK: jax.Array, out_TN: jax.Array,
            x: StepInput) -> jax.Array:
    """A fused projection's output plus each token's LoRA update (Kernels.lora_impl set: the
    layers carry the adapters' slot arrays, lp["lora"][name], lora/weights.py)."""
    if kernels.lora_impl is None:
        return out_TN
    w = lp["lora"][name]
    return out_TN + lora_delta(in_TK, w["a"], w["b"], x.lora_slots, impl=kernels.lora_impl).astype(out_TN.dtype)


def dense_mlp(lp: dict, h_TD: jax.Array, kernels: "Kernels | None" = None, x: StepInput | None = None) -> jax.Array:
    if kernels is not None and kernels.lora_impl is not None:    # fused gate|up (fuse_projections)
        gate_up = adapted(kernels, lp, "w_gate_up", h_TD, layers.project(h_TD, lp, "w_gate_up"), x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        act = jax.nn.silu(gate) * up
        return adapted(kernels, lp, "w_down", act, layers.project(act, lp, "w_down"), x)
    if "w_gate_up_t" in lp:
        gate, up = jnp.split(layers.project(h_TD, lp, "w_gate_up"), 2, axis=-1)
    else:
        gate, up = layers.gate_up(lp, lambda w: layers.linear(h_TD, w))
    return layers.project(jax.nn.silu(gate) * up, lp, "w_down")


def fuse_projections(cfg: ModelConfig, params: dict) -> dict:
    """Concatenate the projections that read the same input, in place, layer by layer:
    wq|wk|wv -> wqkv f[D, (N+2K)*E] (biases likewise -> bqkv) and w_gate|w_up -> w_gate_up
    (f[D, 2F]; MoE layers f[X, D, 2F]), so each is one matmul over contiguous weights.

    Why: measured on the H200 (8B shape, batch 1), XLA already merges the three q/k/v dots
    into one GEMM but reads the weights through a concatenate inside it, at 70 % of the HBM
    rate (16.9 us for 50 MB) against 93 % for the MLP's plain GEMMs; gate and up stay two
    GEMMs. Done in place so the unfused arrays are freed as we go (no second copy of the
    weights). Only for unsharded parameters: the sharding rules (sharding/rules.py) name the
    unfused weights, and a column-sharded concatenation would mix q, k and v columns."""
    for i, lp in enumerate(params["layers"]):
        lp = dict(lp)
        layers.fuse_in_place(lp, "wqkv", ("wq", "wk", "wv"))
        layers.fuse_in_place(lp, "bqkv", ("bq", "bk", "bv"))
        if "w_gate" in lp and (lp["w_gate"].ndim < 3 or 2 * lp["w_gate"].size <= MAX_WEIGHT_ELEMENTS):
            layers.fuse_in_place(lp, "w_gate_up", ("w_gate", "w_up"))
        # (experts whose fused gate|up would be over the grouped-matmul kernel's reach stay two
        # arrays: fused, each decode step would read every expert through lax.ragged_dot)
        params["layers"][i] = lp
    return params


STACK_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
MOE_STACK_WEIGHTS = ("wqkv", "wo", "router")   # the experts keep the grouped path's layout


def stack_weights(lp: dict) -> tuple[str, ...]:
    """The projections fused_stack reads [out, in] in this layer, a dense or an MoE one."""
    return MOE_STACK_WEIGHTS if "router" in lp or "router_t" in lp else STACK_WEIGHTS


def transpose_for_fused_stack(cfg: ModelConfig, params: dict) -> dict:
    """The fused projections of each layer stored [out, in] (as name + "_t"), in place: what
    fused_stack reads (an MoE layer's attention and router; its experts stay [X, in, out], as
    moe_decode and the grouped path read them). Why: a decode program of fused_linear reads a
    block of 16 output columns; over [in, out] weights that is 32 contiguous bytes a row
    (H200: the gate|up projection at ~10 % of HBM), over [out, in] ones whole rows (the LM
    head over the tied [V, D] embedding: ~85 %). Measured, the projections gained only ~10 %
    from it: they are latency-bound. The XLA path (steps the plan keeps off the fused stack)
    multiplies by the transpose, which XLA folds into the GEMM."""
    del cfg
    for i, lp in enumerate(params["layers"]):
        names = stack_weights(lp)
        if all(name in lp and lp[name].ndim == 2 for name in names):
            lp = dict(lp)
            for name in names:
                lp[name + "_t"] = lp.pop(name).T      # (a new array: jax arrays are row-major)
            params["layers"][i] = lp
    return params


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The step's building blocks, plain XLA or Pallas, chosen once per compiled step."""
    attention: Callable        # (q_TNE, k_cache, v_cache, x) -> o_TNE
    add_norm: Callable         # (x_TD, residual_TD | None, w_D) -> (x + residual, RMSNorm(x + residual) * w)
    rope_write: Callable       # (q, k, v, positions, slots, k_cache, v_cache, inv_freq, q_norm, k_norm)
                               #   -> (q', k_cache, v_cache): q/k norm, RoPE, KV write
    impl: str                  # "xla" | "pallas": also picks the MoE grouped matmul
    linear: bool = False       # dense layers and the LM head through fused_linear (fused_stack)
    fused_moe: bool = False    # small steps' routed experts through pallas_kernels/moe_decode.py
    kernel_plan: KernelPlan = KernelPlan()   # the engine's plan (which steps and projections fuse)
    lora_impl: str | None = None   # LoRA adapters' updates through lora_sgmv with this impl
                                   # (KernelPlan.lora); None: the layers carry no adapters

    @property
    def moe_impl(self) -> str:
        """The MoE layers' impl (models/moe.py): "fused" is "pallas" with the decode kernels."""
        return "fused" if self.fused_moe else self.impl


def make_kernels(cfg: ModelConfig, backend: "AttentionBackend | str" = "xla",
                 plan: AttentionPlan = AttentionPlan(),
                 kernel_plan: KernelPlan = KernelPlan()) -> Kernels:
    """The kernels of one compiled step: `backend` (an AttentionBackend, or its impl name
    "xla" | "pallas" | "auto") runs the attention with this step's `plan`; `kernel_plan` says
    which fused kernels to swap in (pallas_kernels/policy.py)."""
    if isinstance(backend, str):
        backend = AttentionBackend(cfg, backend, context=cfg.max_position_embeddings, itemsize=2)
    kernels = _make_kernels(cfg, backend, plan, kernel_plan)
    if kernel_plan.lora:
        # "pallas" engines let lora_sgmv choose between its kernels by the slot count ("auto")
        return dataclasses.replace(kernels, lora_impl="auto" if backend.impl == "pallas" else "xla")
    return kernels


def _make_kernels(cfg: ModelConfig, backend: AttentionBackend, plan: AttentionPlan,
                  kernel_plan: KernelPlan) -> Kernels:
    fused = frozenset(kernel_plan.fused)
    impl = backend.impl
    fused_moe = "moe" in fused and impl == "pallas"

    def attention(q_TNE, k_cache, v_cache, x):
        return backend.attention(q_TNE, k_cache, v_cache, x, plan)

    eps = cfg.rms_norm_eps

    def add_norm(x_TD, res_TD, w_D):
        h_TD = x_TD if res_TD is None else x_TD + res_TD
        return h_TD, layers.rms_norm(h_TD, w_D, eps)

    rope_write = functools.partial(layers.qk_norm_rope_write, eps=eps)
    if impl == "xla" or not fused:
        return Kernels(attention, add_norm, rope_write, impl, fused_moe=fused_moe,
                       kernel_plan=kernel_plan)
    if kernel_plan.fused_stack:
        return Kernels(attention, add_norm, rope_write, impl, linear=True, fused_moe=fused_moe,
                       kernel_plan=kernel_plan)

    from jaxserve.pallas_kernels.fused_add_rms_norm import fused_add_rms_norm
    from jaxserve.pallas_kernels.qk_norm_rope_kv_write import qk_norm_rope_kv_write
    from jaxserve.sharding import kernels as sharded

    # Under a mesh (sharding/kernels.py): the norm runs on the replicated activations, the
    # rope/KV-write kernel per head shard.
    def fused_add_norm(x_TD, res_TD, w_D):
        if res_TD is None:
            norm = sharded.replicated(lambda x, w: fused_add_rms_norm(x, None, w, eps=eps, impl="pallas"), 2)
            return x_TD, norm(x_TD, w_D)
        add_norm = sharded.replicated(
            lambda x, r, w: fused_add_rms_norm(x, r, w, eps=eps, impl="pallas"), 3, num_outs=2)
        return add_norm(x_TD, res_TD, w_D)

    def fused_rope_write(*args):
        return sharded.qk_norm_rope_kv_write(
            functools.partial(qk_norm_rope_kv_write, eps=eps, impl="pallas"), *args)

    # The fused rope/KV-write kernel tiles the head dim: it needs a power of two >= 32.
    e = cfg.head_dim
    use_rope = "rope" in fused and e >= 32 and e & (e - 1) == 0
    return Kernels(attention, fused_add_norm if "norm" in fused else add_norm,
                   fused_rope_write if use_rope else rope_write, "pallas", fused_moe=fused_moe,
                   kernel_plan=kernel_plan)


def fused_stack(cfg: ModelConfig, params: dict, caches: Caches, x: StepInput, kernels: Kernels,
                inv_freq: jax.Array, aux_layers: tuple[int, ...] = ()):
    """decoder_stack in a few fused kernels a layer plus attention (Kernels.linear): the
    residual stream is written only by the kernels that add into it (o and down, or the MoE
    layer's weighted sum), and each norm is computed by the kernel that reads it (qkv, gate|up,
    the router and the experts). Dense layers: five kernels plus attention; MoE layers:
    models/moe.py residual_moe. Same results as decoder_stack in f32 up to the order of sums;
    in bf16 an ulp here and there (fused_linear rounds x * norm before the row's scale, not
    after), which may flip a near-tied top-k choice of the router. Needs the fused projections
    stored [out, in] (fuse_projections, then transpose_for_fused_stack)."""
    from jaxserve.pallas_kernels.fused_linear import LinearTiling, fused_linear
    from jaxserve.pallas_kernels.qk_norm_rope_kv_write import qkv_norm_rope_kv_write
    t = x.token_ids.shape[0]
    n, kh, e, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps

    def linear(x_TK, w, **kw):
        # the plan's choice: fused_linear's one-row or dot program, or the same ops in XLA
        how = kernels.kernel_plan.projection(x_TK.shape[0], w.size)
        return fused_linear(x_TK, w, eps=eps, w_layout="NK", impl="xla" if how == "xla" else kernels.impl,
                            tiling=LinearTiling(one_row_program=how == "one_row"), **kw)
    residual_TD = params["embed"][x.token_ids]
    new_caches, aux = [], []
    for i, (lp, kv) in enumerate(zip(params["layers"], caches)):
        qkv = linear(residual_TD, lp["wqkv_t"], norm_K=lp["attn_norm"], bias_N=lp.get("bqkv"))
        q_TNE, k_cache, v_cache = qkv_norm_rope_kv_write(
            qkv.reshape(t, n + 2 * kh, e), x.positions, x.slot_mapping, kv["k"], kv["v"],
            inv_freq, lp.get("q_norm"), lp.get("k_norm"), num_heads=n, eps=eps, impl=kernels.impl)
        new_caches.append({"k": k_cache, "v": v_cache})
        o_TNE = kernels.attention(q_TNE, k_cache, v_cache, x)
        residual_TD = linear(o_TNE.reshape(t, n * e), lp["wo_t"], residual_TN=residual_TD)
        if "router_t" in lp:
            residual_TD = moe.residual_moe(cfg, lp, residual_TD, linear, kernels.moe_impl)
        else:
            act_TF = linear(residual_TD, lp["w_gate_up_t"], norm_K=lp["mlp_norm"], gated=True)
            residual_TD = linear(act_TF, lp["w_down_t"], residual_TN=residual_TD)
        if i in aux_layers:
            aux.append(residual_TD)
    return new_caches, layers.rms_norm(residual_TD, params["final_norm"], eps), tuple(aux)


def cache_specs(cfg: ModelConfig) -> list[PagedSpec]:
    """Every layer caches paged K and V, [num_blocks, P, K, E] each."""
    kv = (cfg.num_kv_heads, cfg.head_dim)
    return [PagedSpec((("k", kv), ("v", kv)), cfg.sliding_window)] * cfg.num_layers


def forward(cfg: ModelConfig, params: dict, caches: Caches, x: StepInput,
            kernels: Kernels | str = "xla", aux_layers: tuple[int, ...] = ()):
    """Run every layer on the step's tokens: (updated caches, final hidden states f[T, D],
    the residual stream after each layer in `aux_layers`, for proposers such as EAGLE3).

    `kernels`: a make_kernels result, or an attention impl name. The residual stream: each
    sub-block's output is added to the residual and the sum is normalised for the next
    sub-block in one step (`add_norm`), which a fused kernel can do reading and writing each
    activation once (make_kernels)."""
    if isinstance(kernels, str):
        kernels = make_kernels(cfg, kernels)
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    first = params["layers"][0] if params["layers"] else {}
    if (kernels.linear and all(name + "_t" in first for name in stack_weights(first))
            and kernels.kernel_plan.stack_takes(x.token_ids.shape[0])):
        return fused_stack(cfg, params, caches, x, kernels, inv_freq, aux_layers)
    return decoder_stack(
        params, caches, x, kernels,
        attention=lambda lp, kv, h: attention_block(cfg, lp, kv, h, x, inv_freq, kernels),
        mlp=lambda lp, h: moe.moe_mlp(cfg, lp, h, kernels.moe_impl) if cfg.is_moe else dense_mlp(lp, h, kernels, x),
        aux_layers=aux_layers)


def decoder_stack(params: dict, caches: Caches, x: StepInput, kernels: Kernels, *, attention,
                  mlp, aux_layers: tuple[int, ...] = ()):
    """The residual stream over every layer (attention then MLP, each through `add_norm`):
    `attention(lp, kv, normed) -> (kv, out)` and `mlp(lp, normed) -> out` are a family's
    sub-blocks. Returns (updated caches, final-normed hidden, residuals after `aux_layers`)."""
    layers_p = params["layers"]
    residual_TD, normed_TD = kernels.add_norm(params["embed"][x.token_ids], None, layers_p[0]["attn_norm"])
    new_caches, aux = [], []
    for i, (lp, kv) in enumerate(zip(layers_p, caches)):
        kv, attn_TD = attention(lp, kv, normed_TD)
        new_caches.append(kv)
        residual_TD, normed_TD = kernels.add_norm(attn_TD, residual_TD, lp["mlp_norm"])
        mlp_TD = mlp(lp, normed_TD)
        next_norm = layers_p[i + 1]["attn_norm"] if i + 1 < len(layers_p) else params["final_norm"]
        residual_TD, normed_TD = kernels.add_norm(mlp_TD, residual_TD, next_norm)
        if i in aux_layers:
            aux.append(residual_TD)
    return new_caches, normed_TD, tuple(aux)


def compute_logits(cfg: ModelConfig, params: dict, hidden_SD: jax.Array,
                   kernels: Kernels | None = None) -> jax.Array:
    """f32 logits; a tied embedding through fused_linear with Kernels.linear (read as [V, D],
    without the transpose XLA's dot reads it through). An untied [D, V] head stays XLA's GEMM,
    which reads Qwen3-30B-A3B's 622 MB head at ~93 % of HBM (H100, BENCHMARKS.md)."""
    if kernels is not None and kernels.linear and cfg.tie_word_embeddings:
        from jaxserve.pallas_kernels.fused_linear import fused_linear
        return fused_linear(hidden_SD, params["embed"], w_layout="NK", out_dtype=jnp.float32,
                            impl=kernels.impl)
    return layers.lm_head(hidden_SD, params, cfg.tie_word_embeddings)


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter (the dummy loader and shape checks use it)."""
    d, n, kh, e, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    layer = {"attn_norm": (d,), "wq": (d, n * e), "wk": (d, kh * e), "wv": (d, kh * e),
             "wo": (n * e, d), "mlp_norm": (d,)}
    if cfg.attention_bias:
        layer.update(bq=(n * e,), bk=(kh * e,), bv=(kh * e,))
    if cfg.qk_norm:
        layer.update(q_norm=(e,), k_norm=(e,))
    if cfg.is_moe:
        layer.update(moe.moe_param_shapes(cfg))
    else:
        layer.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
              "layers": [dict(layer) for _ in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes
