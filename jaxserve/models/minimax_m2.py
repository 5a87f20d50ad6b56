"""MiniMax-M2 / M2.5 (MiniMaxM2ForCausalLM): GQA with a full-width q/k RMSNorm and partial
rotary in every layer, a sigmoid-routed MoE with a correction bias in every layer.

Numerics follow transformers' modeling_minimax_m2.py:
- q_norm / k_norm normalise the whole projection (all N*E query columns, all K*E key
  columns), not each head, before RoPE. Under tensor parallelism no device holds a whole
  row, so the sums of squares are a cross-device reduction: qk_norm makes q's and k's ONE
  reduction (both stacked on one small axis), so XLA emits one all-reduce of f32[T, 2];
- RoPE on the first rotary_dim dims of each head only (rotate-half within them), theta from
  the config (published configs write `rotary_dim` and a top-level `rope_theta`);
- router: sigmoid scores; e_score_correction_bias is added only to choose the top-k; the
  chosen experts are weighted by their unbiased scores renormalised to sum to 1 (no routed
  scaling factor, no shared experts, no group limit): deepseek.moe_mlp with one group;
- the multi-token-prediction modules of the published checkpoints are not loaded.

Parameters (weights [in, out]); per layer (a Python list: the loop is unrolled in jit):
    attn_norm f[D], wq f[D, N*E], wk f[D, K*E], wv f[D, K*E], wo f[N*E, D],
    q_norm f[N*E], k_norm f[K*E], mlp_norm f[D],
    router f[D, X], router_bias f32[X], w_gate f[X, D, F], w_up f[X, D, F], w_down f[X, F, D]
    The engine runs on fused copies (llama.fuse_projections): wqkv, w_gate_up.
Caches: llama's, one {"k", "v"} per layer, each f[num_blocks, P, K, E].

Legend: T tokens, S sequences, D model dim, N query heads, K kv heads, G = N // K, E head dim,
R rotary dims, X experts, F expert MLP dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import deepseek, layers, llama
from jaxserve.models.layers.full_qk_norm import rope_write_xla
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.core.step_input import StepInput

ARCHITECTURE = "MiniMaxM2ForCausalLM"


@dataclass(frozen=True)
class MiniMaxM2Config(ModelConfig):
    """ModelConfig plus the rotary width. n_group / topk_group are deepseek.route's group
    limit, always off here (one group of all experts)."""
    rotary_dim: int = 0                  # R: rotated dims at the start of each head
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MiniMaxM2Config":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"MiniMaxM2Config is for {ARCHITECTURE}; got {arch!r}")
        for key, allowed in (("hidden_act", "silu"), ("scoring_func", "sigmoid")):
            if hf.get(key, allowed) != allowed:
                raise ValueError(f"{arch}: {key}={hf[key]!r} is not supported; supported: {allowed}")
        if not hf.get("use_qk_norm", True) or hf.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError(f"{arch}: use_qk_norm={hf.get('use_qk_norm')!r}, qk_norm_type="
                             f"{hf.get('qk_norm_type')!r} is not supported; supported: true, 'per_layer' "
                             f"(one norm over all heads, as transformers implements)")
        if hf.get("shared_intermediate_size"):
            raise ValueError(f"{arch}: shared experts (shared_intermediate_size="
                             f"{hf['shared_intermediate_size']}) are not supported; supported: 0")
        if any(t != 1 for t in hf.get("attn_type_list") or ()):
            raise ValueError(f"{arch}: attn_type_list must be all 1 (full attention in every layer); "
                             f"linear-attention layers are MiniMax-Text-01's, not supported here")
        base = ModelConfig.from_hf(hf)
        rope = dict(hf.get("rope_parameters") or {})
        # partial_rotary_factor travels in rope_parameters beside the (absent) scaling
        scaling = {k: v for k, v in (base.rope_scaling or ()) if k != "partial_rotary_factor"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" or set(scaling) - {"rope_type", "type"}:
            raise ValueError(f"{arch}: rope scaling {kind!r} is not supported; supported: default")
        e = base.head_dim
        partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        rotary_dim = hf.get("rotary_dim") or int(e * partial)
        if not (0 < rotary_dim <= e and rotary_dim % 2 == 0):
            raise ValueError(f"{arch}: rotary_dim ({rotary_dim}) must be even and in [2, head_dim={e}]")
        num_experts = hf.get("num_local_experts") or 0
        if not num_experts or not 0 < hf.get("num_experts_per_tok", 0) <= num_experts:
            raise ValueError(f"{arch}: num_experts_per_tok must be in [1, num_local_experts="
                             f"{num_experts}]; got {hf.get('num_experts_per_tok')}")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields.update(num_experts=num_experts, moe_intermediate_size=hf["intermediate_size"],
                      norm_topk_prob=True, scoring_func="sigmoid", routed_scaling_factor=1.0,
                      qk_norm=False, sliding_window=None, attention_bias=False, rope_scaling=None)
        return cls(**fields, rotary_dim=rotary_dim)


def config_from_hf(hf: dict[str, Any]) -> MiniMaxM2Config:
    return MiniMaxM2Config.from_hf(hf)


def param_shapes(cfg: MiniMaxM2Config) -> dict:
    d, n, kh, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x, f = cfg.num_experts, cfg.moe_intermediate_size
    layer = {"attn_norm": (d,), "wq": (d, n * e), "wk": (d, kh * e), "wv": (d, kh * e),
             "wo": (n * e, d), "q_norm": (n * e,), "k_norm": (kh * e,), "mlp_norm": (d,),
             "router": (d, x), "router_bias": (x,), "w_gate": (x, d, f), "w_up": (x, d, f),
             "w_down": (x, f, d)}
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
              "layers": [dict(layer) for _ in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


cache_specs = llama.cache_specs
compute_logits = llama.compute_logits
fuse_projections = llama.fuse_projections


def make_kernels(cfg: MiniMaxM2Config, backend="xla", plan=None,
                 kernel_plan: KernelPlan = KernelPlan()) -> llama.Kernels:
    """llama's kernels (attention backend and plan, add+RMSNorm, the MoE impl) with this
    family's rope_write: the full-width q/k norm, partial rotary and KV write, in XLA, or
    with "rope" in the kernel plan (and the Pallas impl, a power-of-two head dim >= 32) the fused
    kernel pallas_kernels/full_qk_norm_rope_kv_write.py. Off by default, as llama's."""
    kw = {} if plan is None else {"plan": plan}
    kernels = llama.make_kernels(cfg, backend, kernel_plan=kernel_plan.without("rope"), **kw)
    eps, e = cfg.rms_norm_eps, cfg.head_dim
    rope_write = functools.partial(rope_write_xla, eps=eps)
    if "rope" in kernel_plan.fused and kernels.impl == "pallas" and e >= 32 and e & (e - 1) == 0:
        from jaxserve.pallas_kernels.full_qk_norm_rope_kv_write import full_qk_norm_rope_kv_write
        from jaxserve.sharding import kernels as sharded
        # under a mesh per head shard, the row norms' sums of squares psum'd across ranks
        rope_write = functools.partial(sharded.full_qk_norm_rope_kv_write,
                                       functools.partial(full_qk_norm_rope_kv_write, eps=eps, impl="pallas"))
    return dataclasses.replace(kernels, rope_write=rope_write)


def attention_block(cfg: MiniMaxM2Config, lp: dict, kv: dict, h_TD: jax.Array, x: StepInput,
                    inv_freq: jax.Array, kernels: llama.Kernels):
    """(the layer's new {"k", "v"} cache, attention output f[T, D]) of normed input."""
    t = h_TD.shape[0]
    n, kh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "wqkv" in lp:      # fused by fuse_projections
        q, k, v = jnp.split(layers.linear(h_TD, lp["wqkv"]), [n * e, (n + kh) * e], axis=-1)
    else:
        q, k, v = (layers.linear(h_TD, lp[w]) for w in ("wq", "wk", "wv"))
    q_TNE, k_cache, v_cache = kernels.rope_write(
        q.reshape(t, n, e), k.reshape(t, kh, e), v.reshape(t, kh, e), x.positions, x.slot_mapping,
        kv["k"], kv["v"], inv_freq, lp["q_norm"], lp["k_norm"])
    o_TNE = kernels.attention(q_TNE, k_cache, v_cache, x)
    return {"k": k_cache, "v": v_cache}, layers.linear(o_TNE.reshape(t, n * e), lp["wo"])


def forward(cfg: MiniMaxM2Config, params: dict, caches: list[dict], x: StepInput,
            kernels: "llama.Kernels | str" = "xla", aux_layers: tuple[int, ...] = ()):
    """(updated caches, final-normed hidden f[T, D], the residual stream after each layer in
    `aux_layers`); the residual stream as in llama.forward (add_norm)."""
    if isinstance(kernels, str):
        kernels = make_kernels(cfg, kernels)
    inv_freq = layers.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, None)
    return llama.decoder_stack(
        params, caches, x, kernels,
        attention=lambda lp, kv, h: attention_block(cfg, lp, kv, h, x, inv_freq, kernels),
        mlp=lambda lp, h: deepseek.moe_mlp(cfg, lp, h, kernels.moe_impl), aux_layers=aux_layers)
