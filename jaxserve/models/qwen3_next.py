"""Qwen3-Next and Qwen3.5 (MoE and dense text models): hybrid gated DeltaNet + gated attention.

Layers alternate (cfg.layer_types) between gated DeltaNet linear attention, which keeps a
fixed-size state per sequence, and gated full attention over the paged K/V cache; each is
followed by an MoE with a sigmoid-gated shared expert (or a dense MLP: Qwen3-Next's
mlp_only_layers, the dense Qwen3.5 models).

    forward(cfg, params, caches, x: StepInput, kernels, aux_layers) -> (caches, hidden f[T, D], aux)
    compute_logits(cfg, params, hidden f[S, D], kernels=None) -> f32[S, V]
    cache_specs(cfg): per layer a PagedSpec (k, v) or a StateSpec (conv, ssm)

Parameters (weights [in, out]; norms zero-centred, applied as (1 + w), except gdn_norm):
    embed f[V, D]; final_norm f[D]; lm_head f[D, V] (absent when tied); mtp (optional: the
    multi-token-prediction head: fc f[2D, D], pre_fc_norm_embedding / pre_fc_norm_hidden /
    norm f[D], layers (full-attention layers as below); models/qwen3_next_loader.py);
    layers: a list of
    attn_norm f[D], mlp_norm f[D], and
    linear layers: w_qkv f[D, C] (conv channels q | k | v), w_z f[D, H*B], w_b f[D, H],
        w_a f[D, H], conv_w f[C, W], dt_bias f[H], a_log f[H], gdn_norm f[B], w_out f[H*B, D]
        (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba are split at load time; on a mesh
        w_qkv / conv_w are w_qkv_grouped / conv_w_grouped: channels per key head, see
        qwen3_next_loader.group_conv_channels)
    full layers: wq f[D, N*2E] (per head: E query columns, then E output-gate columns, as HF
        lays out q_proj), wk f[D, K*E], wv f[D, K*E], wo f[N*E, D], q_norm f[E], k_norm f[E]
    MoE layers: router, w_gate, w_up, w_down (models/moe.py), ws_gate f[D, Fs], ws_up f[D, Fs],
        ws_down f[Fs, D], w_shared_gate f[D, 1]; dense layers: w_gate, w_up, w_down
    The runner fuses projections that share an input (fuse_projections): w_in, wqkv,
    w_gate_up, ws_gate_up.
Caches: a list with one dict per layer: full {"k", "v": f[num_blocks, P, K, E]}; linear
{"conv": f[num_slots, C, W-1], "ssm": f32[num_slots, H, B, A]} read and written at
x.state_slots (slot 0: the null slot that padding sequences point at).

Legend: T tokens, S sequences, D model dim, N query heads, K kv heads, E head dim, R rotary
dims, F MLP dim, Fs shared-expert dim, V vocabulary; linear attention: H value heads, G key
heads, A key head dim, B value head dim, C = 2*G*A + H*B conv channels, W conv width.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache.specs import PagedSpec, StateSpec
from jaxserve.models.layers import deltanet as gdn
from jaxserve.models import layers, llama, moe
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.sharding import kernels as sharded
from jaxserve.core.step_input import StepInput

LINEAR, FULL = "linear_attention", "full_attention"
SPLIT_PROJECTION_ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                          "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()        # LINEAR | FULL per layer
    linear_num_key_heads: int = 16           # G
    linear_num_value_heads: int = 32         # H
    linear_key_head_dim: int = 128           # A
    linear_value_head_dim: int = 128         # B
    linear_conv_kernel_dim: int = 4          # W
    partial_rotary_factor: float = 0.25      # R = E * factor rotary dims
    shared_expert_intermediate_size: int = 0  # Fs (0: no shared expert)
    mlp_only_layers: tuple[int, ...] = ()     # dense-MLP layers among MoE ones (Qwen3-Next)
    decoder_sparse_step: int = 1
    split_projections: bool = False          # Qwen3.5: in_proj_qkv / z / b / a checkpoints
    mtp_num_hidden_layers: int = 0           # Qwen3.5's multi-token-prediction layers

    def __post_init__(self):
        super().__post_init__()
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must name {LINEAR} or {FULL} for each of the "
                             f"{self.num_layers} layers; got {self.layer_types}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen3NextConfig":
        """From a config.json: Qwen3-Next's flat one, or Qwen3.5's (text_config nested in a
        ForConditionalGeneration config; its vision tower is not loaded)."""
        arch = (hf.get("architectures") or ["Qwen3NextForCausalLM"])[0]
        text = dict(hf.get("text_config") or hf)
        text["architectures"] = [arch]
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            if key not in text and key in hf:
                text[key] = hf[key]
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act {text['hidden_act']!r} is not supported")
        rope = dict(text.get("rope_parameters") or {})
        kind = (text.get("rope_scaling") or rope).get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"{arch}: rope type {kind!r} is not supported; supported: default")
        base = ModelConfig.from_hf({k: v for k, v in text.items() if k != "rope_scaling"})
        n = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(n)]
        split = arch in SPLIT_PROJECTION_ARCHS
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields.update(
            rope_scaling=None, qk_norm=True,
            # Qwen3.5's router always renormalises the top-k weights (no config field)
            norm_topk_prob=True if split else text.get("norm_topk_prob", True),
            layer_types=tuple(types),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 text.get("partial_rotary_factor", 0.25))),
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0)
            if base.num_experts else 0,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            decoder_sparse_step=text.get("decoder_sparse_step", 1),
            split_projections=split,
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
        )
        return cls(**fields)


# ---------------------------------------------------------------------------------------------
# Shapes and cache specs
# ---------------------------------------------------------------------------------------------


def layer_shapes(cfg: Qwen3NextConfig, i: int) -> dict:
    return _layer_shapes(cfg, cfg.layer_types[i], cfg.is_moe_layer(i))


def mtp_layer_shapes(cfg: Qwen3NextConfig) -> dict:
    """A multi-token-prediction layer: full attention, and an MoE when the model has experts."""
    return _layer_shapes(cfg, FULL, cfg.num_experts > 0)


def _layer_shapes(cfg: Qwen3NextConfig, kind: str, is_moe: bool) -> dict:
    d, n, kh, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h, b = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes = {"attn_norm": (d,), "mlp_norm": (d,)}
    if kind == LINEAR:
        c = cfg.conv_dim
        shapes.update(w_qkv=(d, c), w_z=(d, h * b), w_b=(d, h), w_a=(d, h),
                      conv_w=(c, cfg.linear_conv_kernel_dim), dt_bias=(h,), a_log=(h,),
                      gdn_norm=(b,), w_out=(h * b, d))
    else:
        shapes.update(wq=(d, n * 2 * e), wk=(d, kh * e), wv=(d, kh * e), wo=(n * e, d),
                      q_norm=(e,), k_norm=(e,))
    if is_moe:
        shapes.update(moe.moe_param_shapes(cfg))
        fs = cfg.shared_expert_intermediate_size
        if fs:
            shapes.update(ws_gate=(d, fs), ws_up=(d, fs), ws_down=(fs, d), w_shared_gate=(d, 1))
    else:
        f = cfg.intermediate_size
        shapes.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return shapes


def param_shapes(cfg: Qwen3NextConfig) -> dict:
    """Shape of every parameter (without the optional mtp subtree)."""
    d = cfg.hidden_size
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,),
              "layers": [layer_shapes(cfg, i) for i in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


def cache_specs(cfg: Qwen3NextConfig) -> list:
    """Per layer: the paged K/V of a full-attention layer, or the conv and recurrent state of a
    linear one (the recurrent state wants f32: it accumulates over the whole sequence)."""
    kv = PagedSpec((("k", (cfg.num_kv_heads, cfg.head_dim)), ("v", (cfg.num_kv_heads, cfg.head_dim))))
    state = StateSpec((("conv", (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)),
                       ("ssm", (cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                cfg.linear_key_head_dim))), float32=("ssm",))
    return [state if t == LINEAR else kv for t in cfg.layer_types]


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


def zc_rms_norm(x, w, eps: float):
    """Zero-centred RMSNorm: RMSNorm(x) * (1 + w), in f32 (HF's Qwen3NextRMSNorm)."""
    return layers.rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


def partial_rope(x_TNE, positions_T, inv_freq, rot: int):
    """RoPE ("rotate half") on the first `rot` dims of each head; the rest pass through."""
    return jnp.concatenate([layers.apply_rope(x_TNE[..., :rot], positions_T, inv_freq),
                            x_TNE[..., rot:]], axis=-1)


def attention_block(cfg, lp, cache, h_TD, x: StepInput, inv_freq, attention):
    """Gated full attention: q/k zero-centred norm, partial RoPE, paged attention, output times
    sigmoid(gate) (the gate: the second half of each head's q_proj columns)."""
    t = h_TD.shape[0]
    n, kh, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "wqkv" in lp:        # fused by fuse_projections
        qg, k, v = jnp.split(layers.linear(h_TD, lp["wqkv"]), [2 * n * e, (2 * n + kh) * e], axis=-1)
    else:
        qg, k, v = (layers.linear(h_TD, lp[w]) for w in ("wq", "wk", "wv"))
    q, gate = jnp.split(qg.reshape(t, n, 2 * e), 2, axis=-1)
    k, v = k.reshape(t, kh, e), v.reshape(t, kh, e)
    q = partial_rope(zc_rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), x.positions, inv_freq, cfg.rotary_dim)
    k = partial_rope(zc_rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), x.positions, inv_freq, cfg.rotary_dim)
    k_cache, v_cache = layers.write_kv(cache["k"], cache["v"], k, v, x.slot_mapping)
    o_TNE = attention(q, k_cache, v_cache, x)
    o_TF = o_TNE.reshape(t, n * e) * jax.nn.sigmoid(gate.reshape(t, n * e))
    return {"k": k_cache, "v": v_cache}, layers.linear(o_TF, lp["wo"])


def linear_block(cfg, lp, cache, h_TD, x: StepInput, impl: str = "xla"):
    """Gated DeltaNet: projections, causal conv (state carried), post-conv, the delta rule
    (state carried), gated RMSNorm, out_proj. A sequence whose chunk starts at position 0
    starts from zero states; every sequence writes its states back at its slot."""
    t = h_TD.shape[0]
    h, b, a = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
    if "w_in" in lp:        # fused by fuse_projections
        c = cfg.conv_dim
        qkv_TC, z, beta_in, a_in = jnp.split(layers.linear(h_TD, lp["w_in"]),
                                             [c, c + h * b, c + h * b + h], axis=-1)
    else:
        # on a mesh the conv channels may be grouped per key head (qwen3_next_loader.group_conv_channels)
        qkv = "w_qkv_grouped" if "w_qkv_grouped" in lp else "w_qkv"
        qkv_TC, z, beta_in, a_in = (layers.linear(h_TD, lp[w]) for w in (qkv, "w_z", "w_b", "w_a"))
    grouped = "w_qkv_grouped" in lp
    z_THB = z.reshape(t, h, b)
    slots_S, qsl = x.state_slots, x.query_start_loc
    fresh_S = (x.seq_lens - jnp.diff(qsl)) == 0
    zero_fresh = lambda s: jnp.where(fresh_S.reshape((-1,) + (1,) * (s.ndim - 1)), 0, s)  # noqa: E731
    conv_w = lp["conv_w_grouped" if grouped else "conv_w"]
    conv_TC, conv_state = gdn.causal_conv(qkv_TC, conv_w, zero_fresh(cache["conv"][slots_S]), qsl)
    conv_cache = cache["conv"].at[slots_S].set(conv_state.astype(cache["conv"].dtype))
    if impl == "pallas" and pallas_fits(cfg) and (grouped or sharded.model_axis_size() == 1):
        # per value-head shard under a mesh (sharding/kernels.gated_delta); that needs each
        # rank's channel block to be its own heads: the grouped layout (else XLA below)
        o_THB, ssm_cache = sharded.gated_delta(
            functools.partial(pallas_delta_rule, cfg, grouped=grouped), conv_TC, a_in, beta_in,
            lp["a_log"], lp["dt_bias"], cache["ssm"], x.query_start_loc, x.seq_lens, x.state_slots)
    else:
        q, k, v, g, beta = gdn.post_conv(conv_TC, a_in, beta_in, lp["a_log"], lp["dt_bias"],
                                         num_k_heads=cfg.linear_num_key_heads, k_dim=a, v_dim=b,
                                         grouped=grouped)
        o_THB, ssm = gdn.gated_delta_rule(gdn.expand_heads(q, h), gdn.expand_heads(k, h), v, g, beta,
                                          zero_fresh(cache["ssm"][slots_S]), qsl)
        ssm_cache = cache["ssm"].at[slots_S].set(ssm.astype(cache["ssm"].dtype))
    new_cache = {"conv": conv_cache, "ssm": ssm_cache}
    y_THB = gdn.gated_rms_norm(o_THB, z_THB, lp["gdn_norm"], cfg.rms_norm_eps).astype(h_TD.dtype)
    return new_cache, layers.linear(y_THB.reshape(t, h * b), lp["w_out"])


def pallas_fits(cfg) -> bool:
    """The Triton kernels' shape rules: power-of-two head dims, K >= 16 and V >= 16 (Triton's
    dot), a power-of-two number of value heads per key head."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return pow2(cfg.linear_key_head_dim) and pow2(cfg.linear_value_head_dim) and r & (r - 1) == 0


def ungroup_channels(conv_TC, num_k_heads: int, k_dim: int):
    """The grouped conv layout ([q_j | k_j | v of its value heads] per key head j) back to q | k | v,
    the Pallas post-conv's order; a local permutation of each rank's own channels."""
    t = conv_TC.shape[0]
    x = conv_TC.reshape(t, num_k_heads, -1)
    return jnp.concatenate([p.reshape(t, -1) for p in jnp.split(x, [k_dim, 2 * k_dim], axis=-1)], -1)


# The chunked rule of steps with prompt chunks: pallas_kernels/gated_delta_chunked.py (every
# chunk's WY factors in parallel, then a sequential pass of matmuls over the state), 0.98 ms for
# one 2,048-token prompt at Qwen3.5-397B's heads against its jnp form's 2.95 (chunked_gated_delta;
# H100, BENCHMARKS.md). "xla" takes the jnp form instead.
CHUNKED_IMPL = "pallas"


def pallas_delta_rule(cfg, conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, ssm_NHBA, query_start_loc,
                      seq_lens, state_slots, *, grouped: bool = False):
    """The Pallas path: fused post-conv, then the recurrent decode kernel when no sequence has
    more than one token, else the chunked rule (CHUNKED_IMPL); both update the state cache in
    place. Runs on whatever heads it is given (one rank's under a mesh: H / TP value heads and
    their key heads). Returns (o f32[T, H, B], ssm cache)."""
    from jaxserve.pallas_kernels.gated_delta_chunked import gated_delta_chunked
    from jaxserve.pallas_kernels.gated_delta_decode import gated_delta_decode
    from jaxserve.pallas_kernels.gdn_post_conv import gdn_post_conv

    key_heads = a_TH.shape[1] * cfg.linear_num_key_heads // cfg.linear_num_value_heads   # here
    if grouped:
        conv_TC = ungroup_channels(conv_TC, key_heads, cfg.linear_key_head_dim)
    q, k, v, g, beta = gdn_post_conv(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, num_k_heads=key_heads,
                                     k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
                                     impl="pallas")
    args = (q, k, v, g, beta, query_start_loc, seq_lens, state_slots)
    seq_T, _, _, real_T = gdn.ragged_index(query_start_loc, conv_TC.shape[0])

    def decode(ssm):
        o_SHB, ssm = gated_delta_decode(*args, ssm, impl="pallas")
        return jnp.where(real_T[:, None, None], o_SHB[seq_T], 0.0), ssm

    def chunked(ssm):
        return gated_delta_chunked(*args, ssm, impl=CHUNKED_IMPL)

    return jax.lax.cond(jnp.max(jnp.diff(query_start_loc)) <= 1, decode, chunked, ssm_NHBA)


def mlp_block(cfg, lp, h_TD, impl: str):
    if "router" not in lp:
        return llama.dense_mlp(lp, h_TD)
    y_TD = moe.moe_mlp(cfg, lp, h_TD, impl)
    if "ws_down" in lp:
        if "ws_gate_up" in lp:
            gate, up = jnp.split(layers.linear(h_TD, lp["ws_gate_up"]), 2, axis=-1)
        else:
            gate, up = layers.linear(h_TD, lp["ws_gate"]), layers.linear(h_TD, lp["ws_up"])
        shared = layers.linear(jax.nn.silu(gate) * up, lp["ws_down"])
        y_TD = y_TD + jax.nn.sigmoid(layers.linear(h_TD, lp["w_shared_gate"])) * shared
    return y_TD


def fuse_projections(cfg: Qwen3NextConfig, params: dict) -> dict:
    """Concatenate the projections that read the same input, in place, layer by layer (the
    runner calls this for unsharded parameters; llama.fuse_projections says why):
    w_qkv|w_z|w_b|w_a -> w_in f[D, C + H*B + 2H] (a decode step's linear layer: one GEMM
    instead of four, two of them [D, H] slivers), wq|wk|wv -> wqkv, w_gate|w_up -> w_gate_up
    (dense f[D, 2F], experts f[X, D, 2F]), ws_gate|ws_up -> ws_gate_up."""
    groups = (("w_in", ("w_qkv", "w_z", "w_b", "w_a")), ("wqkv", ("wq", "wk", "wv")),
              ("w_gate_up", ("w_gate", "w_up")), ("ws_gate_up", ("ws_gate", "ws_up")))
    for i, lp in enumerate(params["layers"]):
        lp = dict(lp)
        for fused, parts in groups:
            layers.fuse_in_place(lp, fused, parts)
        params["layers"][i] = lp
    return params


def make_kernels(cfg: Qwen3NextConfig, backend="xla", plan=None, kernel_plan: KernelPlan = KernelPlan()):
    """The family interface's kernels (models/llama.py): llama's, for the paged attention of the
    full-attention layers (its plan and backend); `impl` also picks the linear layers' and the
    MoE's kernels."""
    if plan is None:
        return llama.make_kernels(cfg, backend, kernel_plan=kernel_plan)
    return llama.make_kernels(cfg, backend, plan, kernel_plan)


def forward(cfg: Qwen3NextConfig, params: dict, caches: list, x: StepInput,
            kernels="xla", aux_layers: tuple[int, ...] = ()):
    """Every layer on the step's tokens: (updated caches, final-normed hidden f[T, D], the
    residual stream after each layer in `aux_layers`).
    kernels: a make_kernels result or an impl name, "xla" | "pallas" | "auto", for the paged
    attention, the MoE and the linear layers' post-conv and delta rule (Pallas kernels when
    their shape rules hold: pallas_fits; on a CPU they are interpreted: slow, for tests)."""
    if isinstance(kernels, str):
        kernels = make_kernels(cfg, kernels)
    impl, attention = kernels.impl, kernels.attention
    inv_freq = layers.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, None)
    eps = cfg.rms_norm_eps
    h_TD = params["embed"][x.token_ids]
    new_caches, aux = [], []
    for i, (lp, cache) in enumerate(zip(params["layers"], caches)):
        normed = zc_rms_norm(h_TD, lp["attn_norm"], eps)
        if cfg.layer_types[i] == LINEAR:
            cache, mix_TD = linear_block(cfg, lp, cache, normed, x, impl)
        else:
            cache, mix_TD = attention_block(cfg, lp, cache, normed, x, inv_freq, attention)
        new_caches.append(cache)
        h_TD = h_TD + mix_TD
        h_TD = h_TD + mlp_block(cfg, lp, zc_rms_norm(h_TD, lp["mlp_norm"], eps), kernels.moe_impl)
        if i in aux_layers:
            aux.append(h_TD)
    return new_caches, zc_rms_norm(h_TD, params["final_norm"], eps), tuple(aux)


def compute_logits(cfg: Qwen3NextConfig, params: dict, hidden_SD: jax.Array, kernels=None) -> jax.Array:
    del kernels   # (the fused LM head is llama's Kernels.linear)
    return llama.compute_logits(cfg, params, hidden_SD)


def config_from_hf(hf: dict) -> Qwen3NextConfig:
    return Qwen3NextConfig.from_hf(hf)
