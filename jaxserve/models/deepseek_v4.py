"""DeepSeek V4 (DeepseekV4ForCausalLM): per-layer sliding-window, CSA or HCA attention over one
shared K=V head (models/deepseek_v4_attention.py), manifold-constrained hyper-connections
around every block, hash-routed MoE in the first layers and sqrtsoftplus top-k routing after.

What a layer does (transformers' modeling_deepseek_v4 is the reference):
- the residual is hc_mult streams f[T, hc, D]; before each block an mHC collapses them with
  weights `pre` and after it expands the block's output with `post` and mixes the streams with
  `comb`, a Sinkhorn-normalised (doubly stochastic) hc x hc matrix; all three come from one
  projection of the RMS-normed, flattened streams (f32);
- attention: q = q_b(RMSNorm(q_a(h))) per head (unweighted RMSNorm), kv = RMSNorm(wkv(h)),
  interleaved rotary on the trailing R dims (sliding layers at rope_theta, compressed ones at
  compress_rope_theta with its YaRN), the sink softmax, the output's rope part rotated back,
  then the grouped low-rank output projection (o_groups blocks to o_lora_rank, then wo_b);
- MoE: shared expert + routed experts whose SwiGLU clips (gate <= limit, |up| <= limit);
  scores sqrtsoftplus(h @ router); hash layers take the experts from tid2eid[token], others
  the top-k of scores + bias; weights the chosen scores renormalised, times the scaling.
- the end: a hyper head (sigmoid-weighted sum of the streams), RMSNorm, the LM head.

Legend: T tokens, D model dim, hc streams, H heads, E head dim, Q q_lora_rank, G o_groups,
O o_lora_rank, X experts, F expert dim, I / J indexer heads / head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.step_input import StepInput
from jaxserve.models import layers, moe
from jaxserve.models import deepseek_v4_attention as attn
from jaxserve.models.layers import mla
from jaxserve.pallas_kernels.dispatch import resolve_impl
from jaxserve.pallas_kernels.grouped_matmul import grouped_matmul
from jaxserve.pallas_kernels.policy import KernelPlan

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}       # the released configs' compress_ratios
SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class DeepseekV4Config(ModelConfig):
    """ModelConfig plus V4's fields. num_kv_heads = 1 and head_dim = E: the sliding cache holds
    one E-wide row per token."""
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64           # R
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()   # "hash_moe" | "moe"
    csa_rate: int = 4
    hca_rate: int = 128
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: tuple[tuple[str, Any], ...] | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    window: int = 128                    # sliding window (every layer's)
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    num_mtp_layers: int = 0
    # the MTP layers' attention: the entries of DeepSeek's compress_ratios past the decoder's
    # (sliding where there are none: models/deepseek_v4_mtp.py)
    mtp_layer_types: tuple[str, ...] = ()

    def rate(self, i: int) -> int:
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[i]]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DeepseekV4Config":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"DeepseekV4Config is for {', '.join(ARCHITECTURES)}; got {arch!r}")
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [_RATIO_TYPES[r] for r in hf.get("compress_ratios", [])]
        if not types:   # transformers' default: 2 HCA, then CSA / HCA alternating
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mtp_n = hf.get("num_nextn_predict_layers", 0) or 0
        mtp_types = [_RATIO_TYPES[r] for r in hf.get("compress_ratios", [])[n:n + mtp_n]]
        mtp_types = tuple(mtp_types + [SLIDING] * (mtp_n - len(mtp_types)))
        types = tuple(types[:n])
        mlp = hf.get("mlp_layer_types")
        if not mlp:
            hashed = hf.get("num_hash_layers", 3)
            mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        mlp = tuple(mlp[:n])
        for name, got, allowed in (("layer_types", types, (SLIDING, CSA, HCA)),
                                   ("mlp_layer_types", mlp, ("hash_moe", "moe"))):
            bad = [t for t in got if t not in allowed]
            if bad or len(got) != n:
                raise ValueError(f"{arch}: {name} must be {n} entries of {allowed}; got {list(got)}")
        score = hf.get("scoring_func", "sqrtsoftplus")
        if score not in SCORE_FUNCS:
            raise ValueError(f"{arch}: scoring_func={score!r} is not supported; supported: {SCORE_FUNCS}")
        rates = dict(hf.get("compress_rates") or {})
        head_dim = hf.get("head_dim", 512)
        r = hf.get("qk_rope_head_dim") or int(head_dim * (hf.get("partial_rotary_factor") or 64 / 512))
        rp = hf.get("rope_parameters") or {}
        main = rp.get("main") or {"rope_theta": hf.get("rope_theta", 10000.0)}
        comp = rp.get("compress") or {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                                      "rope_theta": hf.get("compress_rope_theta", 160000.0)}
        comp = {**(hf.get("rope_scaling") or {}), **comp}
        if comp.get("rope_type", comp.get("type", "default")) == "yarn":
            comp.setdefault("attention_factor", 1.0)   # V4 multiplies cos / sin by nothing
        kind = comp.get("rope_type", comp.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"{arch}: compressed rope type {kind!r} is not supported; supported: default, yarn")
        scaling = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
        eos = hf.get("eos_token_id")
        experts = hf.get("n_routed_experts", 256)
        cfg = cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("moe_intermediate_size", 2048), num_layers=n,
            num_heads=hf["num_attention_heads"], num_kv_heads=1, head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(main.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 1048576),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok", 6),
            moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
            norm_topk_prob=True, routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            q_lora_rank=hf.get("q_lora_rank", 1024), qk_rope_head_dim=r, layer_types=types,
            mlp_layer_types=mlp,
            csa_rate=rates.get(CSA, hf.get("compress_rate_csa", 4)),
            hca_rate=rates.get(HCA, hf.get("compress_rate_hca", 128)),
            compress_rope_theta=float(comp["rope_theta"]),
            compress_rope_scaling=tuple(sorted(scaling.items())) if kind == "yarn" else None,
            hc_mult=hf.get("hc_mult", 4), hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=hf.get("hc_eps", 1e-6), swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
            window=hf.get("sliding_window", 128), o_groups=hf.get("o_groups", 8),
            o_lora_rank=hf.get("o_lora_rank", 1024), index_n_heads=hf.get("index_n_heads", 64),
            index_head_dim=hf.get("index_head_dim", 128), index_topk=hf.get("index_topk", 512),
            n_shared_experts=hf.get("n_shared_experts", 1), score_func=score,
            num_mtp_layers=mtp_n, mtp_layer_types=mtp_types)
        if (cfg.num_heads * head_dim) % cfg.o_groups:
            raise ValueError(f"{arch}: num_attention_heads * head_dim must split into o_groups ({cfg.o_groups})")
        return cfg


def config_from_hf(hf: dict[str, Any]) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf(hf)


def cache_specs(cfg: DeepseekV4Config) -> list[PagedSpec]:
    """Per layer, its paged arrays (deepseek_v4_attention's module doc): the per-token rows
    ("kv", the compressors' "ckv" / "cgate" / "ikv" / "igate") in the sliding-window group,
    the compressed entries ("comp", "icomp") on the full group's block table."""
    e, j = cfg.head_dim, cfg.index_head_dim
    specs = []
    for t in cfg.layer_types:
        arrays, per_row, window = (("kv", (e,)),), (), ("kv",)
        if t != SLIDING:
            c = 2 if t == CSA else 1
            arrays += (("ckv", (c * e,)), ("cgate", (c * e,)), ("comp", (e,)))
            per_row += (("comp", cfg.csa_rate if t == CSA else cfg.hca_rate),)
            window += ("ckv", "cgate")
        if t == CSA:
            arrays += (("ikv", (2 * j,)), ("igate", (2 * j,)), ("icomp", (j,)))
            per_row += (("icomp", cfg.csa_rate),)
            window += ("ikv", "igate")
        specs.append(PagedSpec(arrays, sliding_window=tokens_back(cfg, t), tokens_per_row=per_row,
                               window_arrays=window))
    return specs


def tokens_back(cfg: DeepseekV4Config, layer_type: str) -> int:
    """Tokens a position of this layer type reads back in its per-token rows, itself included:
    the window's W K=V rows; a compressor completing a window at position p reads that
    window's rows p - m + 1 .. p, CSA's (and its indexer's) the previous window's Ca half too
    (2m rows back), HCA's m' rows. A step starting at s completes windows only at p >= s, so
    max(W, 2m) (CSA) or max(W, m') (HCA) back from s covers them, the carry of a window still
    open at s included (it began at most m - 1 tokens before s). V4-Flash: 128 for every type."""
    if layer_type == SLIDING:
        return cfg.window
    return max(cfg.window, 2 * cfg.csa_rate if layer_type == CSA else cfg.hca_rate)


def layer_shapes(cfg: DeepseekV4Config, i: int) -> dict:
    d, h, e, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, o, x, f, hc = cfg.o_groups, cfg.o_lora_rank, cfg.num_experts, cfg.moe_intermediate_size, cfg.hc_mult
    mix = (2 + hc) * hc
    s = {"attn_norm": (d,), "mlp_norm": (d,),
         "hc_attn_fn": (hc * d, mix), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
         "hc_ffn_fn": (hc * d, mix), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
         "wq_a": (d, q), "q_a_norm": (q,), "wq_b": (q, h * e), "wkv": (d, e), "kv_norm": (e,),
         "wo_a": (g, h * e // g, o), "wo_b": (g * o, d), "sinks": (h,),
         "router": (d, x), "w_gate": (x, d, f), "w_up": (x, d, f), "w_down": (x, f, d)}
    s["tid2eid" if cfg.mlp_layer_types[i] == "hash_moe" else "router_bias"] = (
        (cfg.vocab_size, cfg.num_experts_per_tok) if cfg.mlp_layer_types[i] == "hash_moe" else (x,))
    if cfg.n_shared_experts:
        fs = f * cfg.n_shared_experts
        s.update(ws_gate=(d, fs), ws_up=(d, fs), ws_down=(fs, d))
    t = cfg.layer_types[i]
    if t != SLIDING:
        c, m = (2, cfg.csa_rate) if t == CSA else (1, cfg.hca_rate)
        s.update(wc_kv=(d, c * e), wc_gate=(d, c * e), c_ape=(m, c * e), c_norm=(e,))
    if t == CSA:
        j, ih = cfg.index_head_dim, cfg.index_n_heads
        s.update(wi_kv=(d, 2 * j), wi_gate=(d, 2 * j), i_ape=(cfg.csa_rate, 2 * j), i_norm=(j,),
                 wi_q=(q, ih * j), wi_w=(d, ih))
    return s


def param_shapes(cfg: DeepseekV4Config) -> dict:
    d, hc = cfg.hidden_size, cfg.hc_mult
    return {"embed": (cfg.vocab_size, d), "lm_head": (d, cfg.vocab_size), "final_norm": (d,),
            "hc_head_fn": (hc * d, hc), "hc_head_base": (hc,), "hc_head_scale": (1,),
            "layers": [layer_shapes(cfg, i) for i in range(cfg.num_layers)]}


@dataclass(frozen=True)
class Ropes:
    main: jax.Array          # f32[R/2] the sliding layers' inverse frequencies
    compress: jax.Array      # f32[R/2] the compressed layers' and their compressors'


def make_ropes(cfg: DeepseekV4Config) -> Ropes:
    r = cfg.qk_rope_head_dim
    main = layers.rope_inv_freq(r, cfg.rope_theta, None)
    scaling = dict(cfg.compress_rope_scaling) if cfg.compress_rope_scaling else None
    comp, factor = mla.rope_tables(r, cfg.compress_rope_theta, scaling, cfg.max_position_embeddings)
    if factor != 1.0:
        raise ValueError(f"DeepSeek V4's compressed rotary takes no YaRN attention factor; got {factor}")
    return Ropes(main, comp)


# -- manifold-constrained hyper-connections ----------------------------------------------------
def hc_weights(cfg: DeepseekV4Config, fn, base, scale, streams_TND):
    """(pre f32[T, hc], post f32[T, hc], comb f32[T, hc, hc]) from the RMS-normed flattened
    streams: pre = sigmoid + eps, post = 2 sigmoid, comb = softmax + eps then Sinkhorn
    (columns first, then rows and columns hc_sinkhorn_iters - 1 times)."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    flat = attn.rms_norm(streams_TND.reshape(streams_TND.shape[0], -1).astype(jnp.float32), None,
                         cfg.rms_norm_eps)
    mix = flat @ fn.astype(jnp.float32)
    base, scale = base.astype(jnp.float32), scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * jax.nn.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mix[:, 2 * hc:].reshape(-1, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn(_, c):         # a loop, not unrolled: 2 x layers x iterations ops to compile
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return pre, post, jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)


def hc_block(cfg, lp: dict, which: str, streams_TND, block):
    """streams -> post * block(collapse(streams)) + comb^T streams."""
    pre, post, comb = hc_weights(cfg, lp[f"hc_{which}_fn"], lp[f"hc_{which}_base"],
                                 lp[f"hc_{which}_scale"], streams_TND)
    dtype = streams_TND.dtype
    collapsed = jnp.sum(pre[..., None] * streams_TND, axis=1).astype(dtype)
    out_TD = block(collapsed)
    mixed = jnp.einsum("tjk,tjd->tkd", comb.astype(dtype), streams_TND)
    return post.astype(dtype)[..., None] * out_TD[:, None, :].astype(dtype) + mixed


def hc_head(cfg, params, streams_TND):
    flat = attn.rms_norm(streams_TND.reshape(streams_TND.shape[0], -1).astype(jnp.float32), None,
                         cfg.rms_norm_eps)
    mix = flat @ params["hc_head_fn"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mix * params["hc_head_scale"].astype(jnp.float32)[0]
                         + params["hc_head_base"].astype(jnp.float32)) + cfg.hc_eps
    return jnp.sum(pre[..., None] * streams_TND, axis=1).astype(streams_TND.dtype)


# -- attention block ---------------------------------------------------------------------------
def attention(cfg: DeepseekV4Config, i: int, lp: dict, cache: dict, h_TD, x: StepInput, ropes: Ropes,
              impl: str = "xla"):
    t_kind, eps = cfg.layer_types[i], cfg.rms_norm_eps
    h, e = cfg.num_heads, cfg.head_dim
    inv = ropes.main if t_kind == SLIDING else ropes.compress
    q_res = attn.rms_norm(layers.linear(h_TD, lp["wq_a"]), lp["q_a_norm"], eps)
    q_THE = attn.rms_norm(layers.linear(q_res, lp["wq_b"]).reshape(-1, h, e), None, eps)
    q_THE = attn.rope_interleaved(q_THE, x.positions, inv)
    kv_TE = attn.rope_interleaved(attn.rms_norm(layers.linear(h_TD, lp["wkv"]), lp["kv_norm"], eps),
                                  x.positions, inv)
    p = cache["kv"].shape[1]
    xw = attn.window_view(x, p)       # the per-token rows' slots (the sliding-window group's)
    cache = {**cache, "kv": attn.write_rows(cache["kv"], kv_TE, xw.slot_mapping)}
    comp, selected, rate, entries = None, None, 0, 0
    if t_kind != SLIDING:
        rate = cfg.rate(i)
        entries = x.block_tables.shape[1] * p // rate
        cache.update(attn.compress(cache, ("ckv", "cgate", "comp"), layers.linear(h_TD, lp["wc_kv"]),
                                   layers.linear(h_TD, lp["wc_gate"]), lp["c_ape"], lp["c_norm"], x, xw,
                                   rate=rate, overlap=t_kind == CSA, inv_freq=inv, eps=eps, impl=impl))
        comp = cache["comp"]
    if t_kind == CSA:
        cache.update(attn.compress(cache, ("ikv", "igate", "icomp"), layers.linear(h_TD, lp["wi_kv"]),
                                   layers.linear(h_TD, lp["wi_gate"]), lp["i_ape"], lp["i_norm"], x, xw,
                                   rate=rate, overlap=True, inv_freq=inv, eps=eps, impl=impl))
        qi = layers.linear(q_res, lp["wi_q"]).reshape(-1, cfg.index_n_heads, cfg.index_head_dim)
        qi = attn.rope_interleaved(qi, x.positions, inv)
        w_TI = layers.linear(h_TD, lp["wi_w"]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
        selected = attn.index_select(qi, w_TI, cache["icomp"], x, rate=rate, block_size=cache["kv"].shape[1],
                                     num_entries=entries, top_k=cfg.index_topk, impl=impl)
    o_THE = attn.attend(q_THE, cache["kv"], comp, x, xw, lp["sinks"], window=cfg.window, rate=rate,
                        num_entries=entries, selected=selected, impl=impl)
    o_THE = attn.rope_interleaved(o_THE, x.positions, -inv).astype(h_TD.dtype)
    g = cfg.o_groups
    # (no f32 result type: XLA:CPU's batched dot has no bf16 x bf16 -> f32)
    o_TGO = jnp.einsum("tgc,gco->tgo", o_THE.reshape(-1, g, h * e // g), lp["wo_a"])
    return cache, layers.linear(o_TGO.reshape(o_TGO.shape[0], -1), lp["wo_b"])


# -- MoE --------------------------------------------------------------------------------------
def scores(cfg: DeepseekV4Config, logits_TX):
    if cfg.score_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits_TX))
    return jax.nn.softmax(logits_TX, -1) if cfg.score_func == "softmax" else jax.nn.sigmoid(logits_TX)


def route(cfg: DeepseekV4Config, lp: dict, h_TD, token_ids_T):
    """(weights f32[T, k], experts i32[T, k])."""
    s_TX = scores(cfg, h_TD.astype(jnp.float32) @ lp["router"].astype(jnp.float32))
    if "tid2eid" in lp:
        experts = lp["tid2eid"][token_ids_T].astype(jnp.int32)
    else:
        _, experts = jax.lax.top_k(s_TX + lp["router_bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    w = jnp.take_along_axis(s_TX, experts, axis=1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, experts


def clipped_swiglu(gate, up, limit: float):
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def moe_block(cfg: DeepseekV4Config, lp: dict, h_TD, token_ids_T, impl: str):
    """Routed experts (rows sorted by expert, one grouped matmul per projection) + shared."""
    weights_Tk, experts_Tk = route(cfg, lp, h_TD, token_ids_T)
    t, d = h_TD.shape
    k = experts_Tk.shape[1]
    pos_M, row_of_M, sizes_X = moe.group_by_expert(experts_Tk.reshape(-1), cfg.num_experts)
    x_sorted = h_TD[row_of_M // k]
    mm = "xla" if impl == "xla" else "auto"
    act = clipped_swiglu(grouped_matmul(x_sorted, lp["w_gate"], sizes_X, impl=mm),
                         grouped_matmul(x_sorted, lp["w_up"], sizes_X, impl=mm), cfg.swiglu_limit)
    y_sorted = grouped_matmul(act.astype(h_TD.dtype), lp["w_down"], sizes_X, impl=mm)
    out = jnp.sum(y_sorted[pos_M].reshape(t, k, d).astype(jnp.float32) * weights_Tk[..., None], axis=1)
    if "ws_down" in lp:
        act = clipped_swiglu(layers.linear(h_TD, lp["ws_gate"]), layers.linear(h_TD, lp["ws_up"]),
                             cfg.swiglu_limit)
        out = out + layers.linear(act.astype(h_TD.dtype), lp["ws_down"]).astype(jnp.float32)
    return out.astype(h_TD.dtype)


# -- the step ---------------------------------------------------------------------------------
def decoder_layer(cfg, i, lp, cache, streams_TND, x: StepInput, ropes: Ropes, impl: str):
    eps = cfg.rms_norm_eps
    box = {}

    def attn_block(c_TD):
        box["cache"], out = attention(cfg, i, lp, cache, layers.rms_norm(c_TD, lp["attn_norm"], eps), x,
                                      ropes, impl)
        return out

    streams_TND = hc_block(cfg, lp, "attn", streams_TND, attn_block)
    streams_TND = hc_block(cfg, lp, "ffn", streams_TND, lambda c_TD: moe_block(
        cfg, lp, layers.rms_norm(c_TD, lp["mlp_norm"], eps), x.token_ids, impl))
    return box["cache"], streams_TND


def make_kernels(cfg: DeepseekV4Config, backend, plan=None, kernel_plan: KernelPlan = KernelPlan()) -> str:
    """One impl name, the runner's requested attention impl ("auto" is Pallas on a GPU): under
    "pallas" the attention's gathers and sink softmax are sparse_sink_attention's kernel, CSA's
    indexer V3.2's indexer_scores and TopK kernels, the compressors of windows up to 32 rows
    window_compress's, the routed experts the grouped matmul's."""
    del cfg, plan, kernel_plan
    return resolve_impl(backend if isinstance(backend, str) else backend.requested)[0]


def forward(cfg: DeepseekV4Config, params: dict, caches: list[dict], x: StepInput, kernels: str = "xla",
            aux_layers: tuple[int, ...] = ()):
    """(updated caches, final hidden f[T, D] (hyper head, then the norm), the streams' mean
    after each layer in aux_layers; aux layer num_layers: the last layer's hc streams before
    the hyper head, flattened f[T, hc * D], what the MTP layer reads: deepseek_v4_mtp.py)."""
    impl = resolve_impl(kernels)[0]
    ropes = make_ropes(cfg)
    e_TD = params["embed"][x.token_ids]
    streams = jnp.broadcast_to(e_TD[:, None, :], (e_TD.shape[0], cfg.hc_mult, e_TD.shape[1]))
    new_caches, aux = [], []
    for i, (lp, cache) in enumerate(zip(params["layers"], caches)):
        cache, streams = decoder_layer(cfg, i, lp, cache, streams, x, ropes, impl)
        new_caches.append(cache)
        if i in aux_layers:
            aux.append(jnp.mean(streams, axis=1))
    if cfg.num_layers in aux_layers:
        aux.append(streams.reshape(streams.shape[0], -1))
    hidden = layers.rms_norm(hc_head(cfg, params, streams), params["final_norm"], cfg.rms_norm_eps)
    return new_caches, hidden, tuple(aux)


def compute_logits(cfg: DeepseekV4Config, params: dict, hidden_SD, kernels=None):
    del kernels
    return layers.lm_head(hidden_SD, params, cfg.tie_word_embeddings)

