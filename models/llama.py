"""The Llama family: Llama 2/3/3.x, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm).

A model is a set of pure functions over a parameter pytree:
    forward(cfg, params, kv_cache, x: StepInput) -> (kv_cache, hidden f[T, D])
    compute_logits(cfg, params, hidden f[S, D]) -> f32[S, V]

Parameters (weights stored as [in, out] so activations multiply on the left):
    embed f[V, D]; final_norm f[D]; lm_head f[D, V] (absent when tied to embed)
    layers: a Python list (the layer loop is unrolled inside jit: DESIGN.md §6), each
        attn_norm f[D], wq f[D, N*E], wk f[D, K*E], wv f[D, K*E], wo f[N*E, D],
        bq/bk/bv (Qwen2), q_norm/k_norm f[E] (Qwen3), mlp_norm f[D],
        w_gate f[D, F], w_up f[D, F], w_down f[F, D]   (dense MLP; MoE layers: see moe.py)
KV cache: a list with one (k, v) pair per layer, each f[num_blocks, P, K, E].

Legend: T tokens, S sequences, D model dim, N query heads, K kv heads, E head dim, F MLP dim,
V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import layers
from jaxserve.step_input import StepInput

KVCache = list[tuple[jax.Array, jax.Array]]


def attention_block(cfg: ModelConfig, lp: dict, kv: tuple, h_TD: jax.Array, x: StepInput,
                    inv_freq: jax.Array, attention_fn):
    """Pre-norm attention sub-block; returns (new (k, v) cache, attention output f[T, D])."""
    t = h_TD.shape[0]
    n, kh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = h_TD @ lp["wq"]
    k = h_TD @ lp["wk"]
    v = h_TD @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q_TNE, k_TKE, v_TKE = q.reshape(t, n, e), k.reshape(t, kh, e), v.reshape(t, kh, e)
    if cfg.qk_norm:
        q_TNE = layers.rms_norm(q_TNE, lp["q_norm"], cfg.rms_norm_eps)
        k_TKE = layers.rms_norm(k_TKE, lp["k_norm"], cfg.rms_norm_eps)
    q_TNE = layers.apply_rope(q_TNE, x.positions, inv_freq)
    k_TKE = layers.apply_rope(k_TKE, x.positions, inv_freq)
    k_cache, v_cache = layers.write_kv(kv[0], kv[1], k_TKE, v_TKE, x.slot_mapping)
    o_TNE = attention_fn(q_TNE, k_cache, v_cache, x)
    return (k_cache, v_cache), o_TNE.reshape(t, n * e) @ lp["wo"]


def dense_mlp(lp: dict, h_TD: jax.Array) -> jax.Array:
    return (jax.nn.silu(h_TD @ lp["w_gate"]) * (h_TD @ lp["w_up"])) @ lp["w_down"]


def make_attention_fn(cfg: ModelConfig, impl: str = "xla"):
    """The paged attention used by the step.

    impl: "xla" (plain XLA per-token reference), "pallas" (the ragged paged attention kernel;
    interpreted on CPU: slow, for tests) or "auto" (pallas on a GPU when the head dim is a
    power of two, else xla). The Pallas path reads x.query_start_loc, x.seq_lens and
    x.block_tables (x.token_seq_ids and x.positions are not needed by it).
    """
    if impl not in ("xla", "pallas", "auto"):
        raise ValueError(f"attention_impl must be 'xla', 'pallas' or 'auto'; got {impl!r}")
    scale = cfg.head_dim ** -0.5

    def xla(q_TNE, k_cache, v_cache, x: StepInput):
        return layers.paged_attention_xla(
            q_TNE, k_cache, v_cache, x.block_tables, x.token_seq_ids, x.positions,
            sm_scale=scale, sliding_window=cfg.sliding_window)

    pow2_head = cfg.head_dim >= 16 and cfg.head_dim & (cfg.head_dim - 1) == 0
    if impl == "xla" or (impl == "auto" and not (jax.default_backend() == "gpu" and pow2_head)):
        return xla
    from jaxserve.pallas_kernels import ragged_paged_attention as rpa

    def pallas(q_TNE, k_cache, v_cache, x: StepInput):
        return rpa.ragged_paged_attention(
            q_TNE, k_cache, v_cache, x.query_start_loc, x.seq_lens, x.block_tables,
            sm_scale=scale, sliding_window=cfg.sliding_window, impl="pallas")

    return pallas


def forward(cfg: ModelConfig, params: dict, kv_cache: KVCache, x: StepInput,
            attention_impl: str = "xla", mlp_fn=None):
    """Run every layer on the step's tokens; returns the updated cache and final hidden states."""
    from jaxserve.models import moe  # local: moe builds on this module
    attention_fn = make_attention_fn(cfg, attention_impl)
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    h_TD = params["embed"][x.token_ids]
    new_cache = []
    for lp, kv in zip(params["layers"], kv_cache):
        kv, attn_TD = attention_block(cfg, lp, kv,
                                      layers.rms_norm(h_TD, lp["attn_norm"], cfg.rms_norm_eps),
                                      x, inv_freq, attention_fn)
        new_cache.append(kv)
        h_TD = h_TD + attn_TD
        normed = layers.rms_norm(h_TD, lp["mlp_norm"], cfg.rms_norm_eps)
        h_TD = h_TD + (moe.moe_mlp(cfg, lp, normed, attention_impl) if cfg.is_moe else dense_mlp(lp, normed))
    return new_cache, layers.rms_norm(h_TD, params["final_norm"], cfg.rms_norm_eps)


def compute_logits(cfg: ModelConfig, params: dict, hidden_SD: jax.Array) -> jax.Array:
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden_SD, head, preferred_element_type=jnp.float32)


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
        from jaxserve.models import moe
        layer.update(moe.moe_param_shapes(cfg))
    else:
        layer.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
              "layers": [dict(layer) for _ in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes
