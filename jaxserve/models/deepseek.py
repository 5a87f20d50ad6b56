"""DeepSeek V3 (DeepseekV3ForCausalLM) and V3.2 (DeepseekV32ForCausalLM): MLA over a paged
latent cache, group-limited sigmoid MoE with shared experts, V3.2's sparse attention.

    forward(cfg, params, caches, x: StepInput) -> (caches, hidden f[T, D])
    compute_logits(cfg, params, hidden f[S, D], kernels=None) -> f32[S, V]
    cache_specs(cfg) -> one PagedSpec per layer: "latent" f[W] (+ "index_k" f[J] for V3.2)

Parameters (weights [in, out]); per layer (a Python list: the loop is unrolled in jit):
    attn_norm f[D], mlp_norm f[D]
    q: wq_a f[D, Q], q_a_norm f[Q], wq_b f[Q, N*(E+R)]   (or wq f[D, N*(E+R)]: q_lora_rank null)
    wkv_a f[D, C+R] (latent | shared rope key), kv_a_norm f[C],
    w_uk f[N, E, C], w_uv f[N, C, O] (HF's kv_b_proj split per head, for the absorbed form),
    wo f[N*O, D]
    V3.2 indexer: wq_idx f[Q, I*J], wk_idx f[D, J], k_idx_norm f[J], k_idx_bias f[J],
        w_idx f[D, I]
    dense layers (i < first_k_dense_replace): w_gate f[D, F], w_up f[D, F], w_down f[F, D]
    MoE layers: router f[D, X], router_bias f32[X] (e_score_correction_bias),
        w_gate f[X, D, M], w_up f[X, D, M], w_down f[X, M, D],
        shared experts ws_gate f[D, M*Z], ws_up f[D, M*Z], ws_down f[M*Z, D]
    Rotary layout: always half-split; interleaved checkpoints are permuted at load.
MTP (params["mtp"], loaded when the checkpoint has it): see mtp_param_shapes; mtp_forward
runs a layer as a proposer over its own caches (mtp_cache_specs).

Legend: T tokens, S sequences, D model dim, V vocabulary, N heads, Q q_lora_rank,
C kv_lora_rank, E qk_nope_head_dim, R qk_rope_head_dim, O v_head_dim, W = C + R,
I indexer heads, J indexer head dim, X routed experts, G expert groups, M expert MLP dim,
Z shared experts, F dense MLP dim, k experts per token.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.models import deepseek_mla, layers, llama, moe
from jaxserve.models.layers import mla
from jaxserve.pallas_kernels.dispatch import resolve_impl
from jaxserve.pallas_kernels.indexer_scores import indexer_scores
from jaxserve.pallas_kernels.mla_attention import mla_attention
from jaxserve.pallas_kernels.mla_latent_write import mla_latent_write
from jaxserve.pallas_kernels.moe_router import moe_router
from jaxserve.pallas_kernels.policy import KernelPlan
from jaxserve.pallas_kernels.topk import topk
from jaxserve.sharding import kernels as sharded
from jaxserve.core.step_input import StepInput

LORA_NORM_EPS = 1e-6     # q_a / kv_a norms: DeepSeek builds them with the default eps
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    """ModelConfig plus MLA / MoE / indexer fields. The base's num_kv_heads = 1 and head_dim
    = W: the cache holds one W-wide row per token (what a per-token cache size reads)."""
    q_lora_rank: int | None = None       # Q; None: q straight from the hidden state
    kv_lora_rank: int = 512              # C
    qk_nope_head_dim: int = 128          # E
    qk_rope_head_dim: int = 64           # R
    v_head_dim: int = 128                # O
    n_shared_experts: int = 0            # Z
    n_group: int = 1                     # G: experts are chosen from topk_group of G groups
    topk_group: int = 1
    first_k_dense_replace: int = 0       # the first layers have a dense MLP
    moe_layer_freq: int = 1              # after those, every moe_layer_freq-th layer is MoE
    rope_interleave: bool = True         # checkpoint's rotary pairs are (x0, x1), (x2, x3), ...
    index_topk: int = 0                  # V3.2: positions each token attends to (0: dense, V3)
    index_n_heads: int = 0               # I
    index_head_dim: int = 0              # J
    num_mtp_layers: int = 0              # multi-token-prediction layers after the decoder

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "DeepseekConfig":
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"DeepseekConfig is for {', '.join(ARCHITECTURES)}; got {arch!r}")
        for key, allowed in (("hidden_act", ("silu",)), ("scoring_func", ("sigmoid",)),
                             ("topk_method", ("noaux_tc",))):
            if hf.get(key, allowed[0]) not in allowed:
                raise ValueError(f"{arch}: {key}={hf[key]!r} is not supported; supported: {allowed[0]}")
        base = ModelConfig.from_hf(hf)   # vocab, layers, rope_scaling (either HF format), eos ...
        kind = (base.rope_scaling_dict or {}).get("rope_type", (base.rope_scaling_dict or {}).get("type"))
        if kind not in (None, "default", "yarn", "linear", "llama3"):
            raise ValueError(f"{arch}: rope scaling {kind!r} is not supported; supported: yarn, linear, llama3")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        experts = hf.get("n_routed_experts") or 0
        is_v32 = arch == "DeepseekV32ForCausalLM"
        q_lora = hf.get("q_lora_rank")
        if is_v32 and not q_lora:
            raise ValueError(f"{arch}: the indexer reads the q latent, so q_lora_rank must be set")
        c, r = hf.get("kv_lora_rank", 512), hf.get("qk_rope_head_dim", 64)
        fields.update(
            num_kv_heads=1, head_dim=c + r, num_experts=experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", True), scoring_func="sigmoid",
            qk_norm=False, sliding_window=None)
        n_group = hf.get("n_group") or 1
        cfg = cls(**fields, q_lora_rank=q_lora, kv_lora_rank=c,
                  qk_nope_head_dim=hf.get("qk_nope_head_dim", 128), qk_rope_head_dim=r,
                  v_head_dim=hf.get("v_head_dim", 128), n_shared_experts=hf.get("n_shared_experts") or 0,
                  n_group=n_group, topk_group=hf.get("topk_group") or n_group,
                  first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
                  moe_layer_freq=hf.get("moe_layer_freq") or 1,
                  rope_interleave=True if is_v32 else bool(hf.get("rope_interleave", True)),
                  index_topk=hf.get("index_topk", 2048) if is_v32 else 0,
                  index_n_heads=hf.get("index_n_heads", 64) if is_v32 else 0,
                  index_head_dim=hf.get("index_head_dim", 128) if is_v32 else 0,
                  num_mtp_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0)
        if experts and (experts % n_group or experts // n_group < 2):
            raise ValueError(f"{arch}: n_routed_experts ({experts}) must split into n_group ({n_group}) "
                             f"groups of at least 2 experts (a group scores by its best two)")
        if is_v32 and cfg.index_head_dim < r:
            raise ValueError(f"{arch}: index_head_dim ({cfg.index_head_dim}) must be >= qk_rope_head_dim ({r})")
        return cfg


def config_from_hf(hf: dict[str, Any]) -> DeepseekConfig:
    return DeepseekConfig.from_hf(hf)


def cache_specs(cfg: DeepseekConfig) -> list[PagedSpec]:
    arrays = (("latent", (cfg.latent_dim,)),)
    if cfg.index_topk:
        arrays += (("index_k", (cfg.index_head_dim,)),)
    return [PagedSpec(arrays) for _ in range(cfg.num_layers)]


def _layer_shapes(cfg: DeepseekConfig, moe_layer: bool) -> dict:
    d, n, e, r, o = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    c, q = cfg.kv_lora_rank, cfg.q_lora_rank
    s = {"attn_norm": (d,), "mlp_norm": (d,), "wkv_a": (d, c + r), "kv_a_norm": (c,),
         "w_uk": (n, e, c), "w_uv": (n, c, o), "wo": (n * o, d)}
    if q:
        s.update(wq_a=(d, q), q_a_norm=(q,), wq_b=(q, n * (e + r)))
    else:
        s["wq"] = (d, n * (e + r))
    if cfg.index_topk:
        i, j = cfg.index_n_heads, cfg.index_head_dim
        s.update(wq_idx=(q, i * j), wk_idx=(d, j), k_idx_norm=(j,), k_idx_bias=(j,), w_idx=(d, i))
    if moe_layer:
        x, m = cfg.num_experts, cfg.moe_intermediate_size
        s.update(router=(d, x), router_bias=(x,), w_gate=(x, d, m), w_up=(x, d, m), w_down=(x, m, d))
        if cfg.n_shared_experts:
            ms = m * cfg.n_shared_experts
            s.update(ws_gate=(d, ms), ws_up=(d, ms), ws_down=(ms, d))
    else:
        f = cfg.intermediate_size
        s.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))
    return s


def param_shapes(cfg: DeepseekConfig) -> dict:
    """Shape of every decoder parameter (MTP layers apart: mtp_param_shapes)."""
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
              "layers": [_layer_shapes(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def mtp_param_shapes(cfg: DeepseekConfig) -> list[dict]:
    """One flat dict per MTP layer (HF model.layers.{num_layers + m}): enorm f[D] (for the next
    token's embedding), hnorm f[D] (for the previous hidden state), eh_proj f[2D, D] (their
    concatenation in that order), a decoder layer's parameters (MoE when the decoder's last
    layer is), head_norm f[D] and head f[D, V] (HF shared_head.norm / shared_head.head)."""
    d = cfg.hidden_size
    moe_layer = cfg.is_moe_layer(cfg.num_layers)
    return [dict(enorm=(d,), hnorm=(d,), eh_proj=(2 * d, d), head_norm=(d,), head=(d, cfg.vocab_size),
                 **_layer_shapes(cfg, moe_layer)) for _ in range(cfg.num_mtp_layers)]


def input_projections(cfg: DeepseekConfig) -> list[tuple[str, int]]:
    """(name, width) of the projections that read a layer's normed input, in their fused
    order: the q latent (or q itself when q_lora_rank is null), the kv latent | rope key, and
    V3.2's indexer key and head weights."""
    e, r, n = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_heads
    out = [("wq_a", cfg.q_lora_rank)] if cfg.q_lora_rank else [("wq", n * (e + r))]
    out.append(("wkv_a", cfg.latent_dim))
    if cfg.index_topk:
        out += [("wk_idx", cfg.index_head_dim), ("w_idx", cfg.index_n_heads)]
    return out


def q_latent_projections(cfg: DeepseekConfig) -> list[tuple[str, int]]:
    """(name, width) of the projections that read the normed q latent: the heads' q, and V3.2's
    indexer queries."""
    out = [("wq_b", cfg.num_heads * cfg.qk_head_dim)]
    if cfg.index_topk:
        out.append(("wq_idx", cfg.index_n_heads * cfg.index_head_dim))
    return out


FUSED_INPUT, FUSED_Q_LATENT = "w_in", "w_q_lat"
assert FUSED_INPUT == deepseek_mla.FUSED_INPUT


def fuse_projections(cfg: DeepseekConfig, params: dict) -> dict:
    """Concatenate, in place, the projections that read the same input (decoder and MTP
    layers): input_projections -> w_in, q_latent_projections -> w_q_lat, the dense MLP's and
    the shared experts' gate|up -> w_gate_up / ws_gate_up. Each is then one matmul a step
    instead of two to four (V3.2: 8 launches a layer become 3). The runner calls this for
    unsharded parameters (llama.fuse_projections says why); the forward takes either form.
    Routed experts stay as they are (split_expert_weights chunks them)."""
    fuse = layers.fuse_in_place
    for group in ("layers", "mtp"):
        for i, lp in enumerate(params.get(group) or []):
            lp = dict(lp)
            fuse(lp, FUSED_INPUT, [n for n, _ in input_projections(cfg)])
            fuse(lp, FUSED_Q_LATENT, [n for n, _ in q_latent_projections(cfg)])
            if getattr(lp.get("w_gate"), "ndim", 0) == 2:
                fuse(lp, "w_gate_up", ["w_gate", "w_up"])
            fuse(lp, "ws_gate_up", ["ws_gate", "ws_up"])
            params[group][i] = lp
    return params


def project(lp: dict, h_TD: jax.Array, fused: str, parts: list[tuple[str, int]]) -> dict:
    """{name: h_TD @ lp[name]} for each of `parts`: one matmul over lp[fused], split, when
    fuse_projections made it, else one matmul each."""
    if fused not in lp:
        return {name: layers.linear(h_TD, lp[name]) for name, _ in parts}
    y = layers.linear(h_TD, lp[fused])
    ends = list(itertools.accumulate(width for _, width in parts))
    return {name: y[:, end - width:end] for (name, width), end in zip(parts, ends)}


def route(cfg: DeepseekConfig, lp: dict, h_TD: jax.Array, impl: str = "xla"):
    """(weights f32[T, k], experts i32[T, k]): sigmoid scores; the choice uses scores + bias
    (e_score_correction_bias, DeepSeek's load balancing), restricted to the topk_group groups
    whose two best biased scores sum highest; the weights are the unbiased scores of the
    chosen experts, renormalised (norm_topk_prob) and times routed_scaling_factor. One kernel
    under "pallas" (pallas_kernels/moe_router.py), its jnp reference under "xla"."""
    logits_TX = h_TD.astype(jnp.float32) @ lp["router"].astype(jnp.float32)
    return moe_router(logits_TX, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                      renormalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                      bias=lp["router_bias"], n_group=cfg.n_group, topk_group=cfg.topk_group,
                      impl=impl)


def moe_mlp(cfg: DeepseekConfig, lp: dict, h_TD: jax.Array, impl: str = "xla") -> jax.Array:
    """Routed experts (tokens sorted by expert, one ragged matmul per projection, as
    moe.moe_mlp) plus the shared experts, a dense MLP every token goes through."""
    out_TD = moe.routed_experts(lambda p, h: route(cfg, p, h, moe.kernel_impl(impl)), lp, h_TD,
                                cfg.num_experts, impl)
    if "ws_down" in lp:
        shared = ({"w_gate_up": lp["ws_gate_up"]} if "ws_gate_up" in lp
                  else {"w_gate": lp["ws_gate"], "w_up": lp["ws_up"]})
        shared["w_down"] = lp["ws_down"]
        out_TD = out_TD + llama.dense_mlp(shared, h_TD)
    return out_TD


@dataclass(frozen=True)
class Rope:
    inv_freq: jax.Array      # f32[R/2]
    factor: float            # YaRN's attention factor on cos and sin
    sm_scale: float          # softmax scale with YaRN's mscale correction


def make_rope(cfg: DeepseekConfig) -> Rope:
    scaling = cfg.rope_scaling_dict
    inv_freq, factor = mla.rope_tables(cfg.qk_rope_head_dim, cfg.rope_theta, scaling,
                                       cfg.max_position_embeddings)
    return Rope(inv_freq, factor, mla.softmax_scale(cfg.qk_head_dim, scaling, cfg.max_position_embeddings))


def _rope_first(x_TNJ: jax.Array, r: int, positions_T, rope: Rope) -> jax.Array:
    """Rotary on the first r dims only (the indexer's layout: rope part first)."""
    roped = mla.rope(x_TNJ[..., :r], positions_T, rope.inv_freq, rope.factor)
    return jnp.concatenate([roped, x_TNJ[..., r:]], axis=-1)


def index_key(cfg: DeepseekConfig, lp: dict, k_TJ: jax.Array, x: StepInput, rope: Rope) -> jax.Array:
    """V3.2's indexer key of each token f[T, J] from its projection (wk x): LayerNorm, rotary on
    its first R dims."""
    k_TJ = mla.layer_norm(k_TJ, lp["k_idx_norm"], lp["k_idx_bias"])
    return _rope_first(k_TJ[:, None], cfg.qk_rope_head_dim, x.positions, rope)[:, 0]


def indexer(cfg: DeepseekConfig, q_TIJ, w_TI, index_k, x: StepInput, rope: Rope, impl: str):
    """V3.2's lightning indexer over its paged keys (this step's already written), from its
    queries' and head weights' projections: the positions each token attends to i32[T, k]
    (-1: none)."""
    i, j, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_TIJ = _rope_first(q_TIJ.reshape(-1, i, j), r, x.positions, rope)
    return select_positions(cfg, q_TIJ, w_TI.astype(jnp.float32) * i ** -0.5, index_k, x, impl)


def select_positions(cfg: DeepseekConfig, q_TIJ, w_TI, index_k, x: StepInput, impl: str):
    """The indexer's scores and TopK from its roped queries f[T, I, J] and scaled head weights
    f32[T, I] (the fused path's mla_q_absorb / mla_input_prep give them so): i32[T, k]."""
    j = cfg.index_head_dim
    args = (q_TIJ, w_TI, index_k, x.block_tables, x.token_seq_ids, x.positions)
    if impl == "xla":
        scores_TL = mla.index_scores_xla(*args, scale=j ** -0.5)
    else:   # the indexer is replicated (its weights and keys): every rank scores and selects alike
        score = functools.partial(indexer_scores, scale=j ** -0.5, impl=impl)
        scores_TL = sharded.replicated(score, len(args))(*args)
    if impl == "xla":
        return mla.select_topk(scores_TL, cfg.index_topk)
    # the kernel's indices are -1 past a row's finite scores already: no masking fusion after it
    k = min(cfg.index_topk, scores_TL.shape[1])
    return sharded.replicated(functools.partial(topk, k=k, impl=impl), 1, 2)(scores_TL)[1]


def write_caches(cfg: DeepseekConfig, lp: dict, cache: dict, kv_TW: jax.Array, index_TJ, x: StepInput,
                 rope: Rope, impl: str) -> dict:
    """This step's rows into the layer's paged caches, from the wkv_a (and V3.2's wk_idx)
    projections: the RMS-normed latent with the roped shared key, and the indexer key. Under
    "pallas" one kernel writes both (pallas_kernels/mla_latent_write.py, replicated under a
    mesh: so are the caches); under "xla" the model's own ops, which are that kernel's
    reference."""
    c = cfg.kv_lora_rank
    if impl == "xla":
        c_TC = layers.rms_norm(kv_TW[:, :c], lp["kv_a_norm"], LORA_NORM_EPS)
        k_rope_TR = mla.rope(kv_TW[:, None, c:], x.positions, rope.inv_freq, rope.factor)[:, 0]
        out = dict(cache, latent=mla.write_paged(cache["latent"], jnp.concatenate([c_TC, k_rope_TR], -1),
                                                 x.slot_mapping))
        if cfg.index_topk:
            out["index_k"] = mla.write_paged(cache["index_k"], index_key(cfg, lp, index_TJ, x, rope),
                                             x.slot_mapping)
        return out
    write = functools.partial(mla_latent_write, factor=rope.factor, eps=LORA_NORM_EPS, impl=impl)
    args = [kv_TW, lp["kv_a_norm"], x.positions, x.slot_mapping, cache["latent"], rope.inv_freq]
    if not cfg.index_topk:
        latent = sharded.replicated(lambda *a: write(*a)[0], len(args))(*args)
        return dict(cache, latent=latent)
    args += [index_TJ, lp["k_idx_norm"], lp["k_idx_bias"], cache["index_k"]]
    latent, index_k = sharded.replicated(write, len(args), 2)(*args)
    return dict(cache, latent=latent, index_k=index_k)


def attention_block(cfg: DeepseekConfig, lp: dict, cache: dict, h_TD: jax.Array, x: StepInput,
                    rope: Rope, impl: str = "xla", fused_mla: bool = False):
    """MLA sub-block on normed input: (new cache dict, output f[T, D]). fused_mla: the fused
    kernels (models/deepseek_mla.py) for the steps they take."""
    t = h_TD.shape[0]
    if fused_mla and impl == "pallas" and deepseek_mla.takes(lp, t):
        select = lambda q, w, keys: select_positions(cfg, q, w, keys, x, impl)  # noqa: E731
        return deepseek_mla.attention_block(cfg, lp, cache, h_TD, x, rope, select, LORA_NORM_EPS)
    n, e = cfg.num_heads, cfg.qk_nope_head_dim
    a = project(lp, h_TD, FUSED_INPUT, input_projections(cfg))
    if cfg.q_lora_rank:
        q_resid_TQ = layers.rms_norm(a["wq_a"], lp["q_a_norm"], LORA_NORM_EPS)
        b = project(lp, q_resid_TQ, FUSED_Q_LATENT, q_latent_projections(cfg))
        q = b["wq_b"]
    else:
        q = a["wq"]
    q_nope_TNE, q_rope_TNR = jnp.split(q.reshape(t, n, e + cfg.qk_rope_head_dim), [e], axis=-1)
    q_rope_TNR = mla.rope(q_rope_TNR, x.positions, rope.inv_freq, rope.factor)
    cache = write_caches(cfg, lp, cache, a["wkv_a"], a.get("wk_idx"), x, rope, impl)
    selected_Tk = None
    if cfg.index_topk:
        selected_Tk = indexer(cfg, b["wq_idx"], a["w_idx"], cache["index_k"], x, rope, impl)
    # absorbed: q_nope . (W_UK c) = (q_nope W_UK) . c, so scores need only the latent
    q_lat_TNC = jnp.einsum("tne,nec->tnc", q_nope_TNE, lp["w_uk"].astype(q_nope_TNE.dtype))
    q_TNW = jnp.concatenate([q_lat_TNC, q_rope_TNR], axis=-1)
    attend = functools.partial(mla_attention, sm_scale=rope.sm_scale, value_dim=cfg.kv_lora_rank,
                               impl=impl)
    if impl != "xla":   # the kernel per head shard under a mesh (sharding/kernels.py)
        attend = functools.partial(sharded.mla_attention, attend)
    o_TNC = attend(q_TNW, cache["latent"], x.block_tables, x.token_seq_ids, x.positions, selected_Tk)
    o_TNO = jnp.einsum("tnc,nco->tno", o_TNC, lp["w_uv"].astype(o_TNC.dtype))
    return cache, layers.linear(o_TNO.reshape(t, -1), lp["wo"])


def decoder_layer(cfg: DeepseekConfig, i: int, lp: dict, cache: dict, residual_TD, x: StepInput,
                  rope: Rope, impl: str, moe_impl: str | None = None, fused_mla: bool = False):
    """One pre-norm decoder layer on the residual stream: (cache, new residual). moe_impl: the
    MoE layer's (models/moe.py; "fused" takes its decode kernels), default `impl`; fused_mla:
    attention_block's."""
    eps = cfg.rms_norm_eps
    cache, attn_TD = attention_block(cfg, lp, cache, layers.rms_norm(residual_TD, lp["attn_norm"], eps),
                                     x, rope, impl, fused_mla)
    residual_TD = residual_TD + attn_TD
    normed_TD = layers.rms_norm(residual_TD, lp["mlp_norm"], eps)
    mlp_TD = (moe_mlp(cfg, lp, normed_TD, moe_impl or impl) if "router" in lp
              else llama.dense_mlp(lp, normed_TD))
    return cache, residual_TD + mlp_TD


@dataclass(frozen=True)
class Kernels:
    """make_kernels' choice for one compiled step: impl "xla" | "pallas" (the MLA, indexer, TopK
    and router kernels), moe (models/moe.py's impl: "fused" also takes moe_decode), fused_mla
    (models/deepseek_mla.py's kernels, "mla" in the kernel plan)."""
    impl: str = "xla"
    moe: str = "xla"
    fused_mla: bool = False

    @classmethod
    def named(cls, kernels: "str | Kernels") -> "Kernels":
        """A Kernels as given, or of an impl name: "xla", "pallas", "auto", or "fused" (pallas
        with moe_decode)."""
        if isinstance(kernels, Kernels):
            return kernels
        moe_impl = "fused" if kernels == "fused" else resolve_impl(kernels)[0]
        return cls(moe.kernel_impl(moe_impl), moe_impl)


def make_kernels(cfg: DeepseekConfig, backend, plan=None, kernel_plan: KernelPlan = KernelPlan()) -> Kernels:
    """The family interface's kernel choice (models/llama.py): the runner's requested attention
    impl ("auto" is Pallas on a GPU), with Pallas the MoE's fused decode kernels ("moe" in the
    kernel plan) and the fused MLA kernels ("mla"); the attention plan and llama's other
    fused-kernel switches are unused here."""
    impl = resolve_impl(backend if isinstance(backend, str) else backend.requested)[0]
    pallas = impl == "pallas"
    return Kernels(impl, "fused" if "moe" in kernel_plan.fused and pallas else impl,
                   "mla" in kernel_plan.fused and pallas)


def forward(cfg: DeepseekConfig, params: dict, caches: list[dict[str, jax.Array]], x: StepInput,
            kernels: "str | Kernels" = "xla", aux_layers: tuple[int, ...] = ()):
    """Run every layer on the step's tokens: (updated caches, final-normed hidden f[T, D], the
    residual stream after each layer in `aux_layers`).

    kernels: "xla" (plain jnp MLA, lax.top_k, lax.ragged_dot), "pallas" (the MLA and TopK
    kernels, interpreted on a CPU; the MoE grouped matmul picks its own kernel), "fused"
    (pallas, and small steps' routed experts through moe_decode) or "auto" (pallas on a GPU,
    else xla); or make_kernels' Kernels."""
    k = Kernels.named(kernels)
    rope = make_rope(cfg)
    residual_TD = params["embed"][x.token_ids]
    new_caches, aux = [], []
    for i, (lp, cache) in enumerate(zip(params["layers"], caches)):
        cache, residual_TD = decoder_layer(cfg, i, lp, cache, residual_TD, x, rope, k.impl, k.moe,
                                           k.fused_mla)
        new_caches.append(cache)
        if i in aux_layers:
            aux.append(residual_TD)
    return new_caches, layers.rms_norm(residual_TD, params["final_norm"], cfg.rms_norm_eps), tuple(aux)


def mtp_cache_specs(cfg: DeepseekConfig) -> list[PagedSpec]:
    """The MTP layers' caches (one latent array each, like a decoder layer's), apart from
    cache_specs so that only an engine that runs the proposer allocates them."""
    return cache_specs(dataclasses.replace(cfg, num_layers=cfg.num_mtp_layers))


def mtp_forward(cfg: DeepseekConfig, params: dict, caches: list[dict], x: StepInput,
                prev_hidden_TD: jax.Array, depth: int = 0, attention_impl: str = "xla"):
    """MTP layer `depth` as a proposer: token t of the step is the token AFTER the one whose
    final (normed) hidden state prev_hidden_TD[t] is, at that earlier token's position (rotary
    is relative, so every position shifted alike is the same attention). h = eh_proj(
    [enorm(embed(token)) | hnorm(prev_hidden)]), then a decoder layer over this layer's own
    latent cache, then head_norm and head: (caches, logits f32[T, V] of the token after
    `token`, the layer's output f[T, D] before head_norm: what a chained draft step reads as
    its prev_hidden, as vLLM's DeepSeek MTP feeds it back)."""
    impl, _ = resolve_impl(attention_impl)
    mp = params["mtp"][depth]
    eps = cfg.rms_norm_eps
    e_TD = layers.rms_norm(params["embed"][x.token_ids], mp["enorm"], eps)
    h_TD = layers.linear(jnp.concatenate([e_TD, layers.rms_norm(prev_hidden_TD, mp["hnorm"], eps)], -1),
                         mp["eh_proj"])
    cache, h_TD = decoder_layer(cfg, cfg.num_layers + depth, mp, caches[depth], h_TD, x, make_rope(cfg), impl)
    logits = jnp.dot(layers.rms_norm(h_TD, mp["head_norm"], eps), mp["head"],
                     preferred_element_type=jnp.float32)
    return caches[:depth] + [cache] + caches[depth + 1:], logits, h_TD


def compute_logits(cfg: DeepseekConfig, params: dict, hidden_SD: jax.Array, kernels=None) -> jax.Array:
    del kernels   # (the fused LM head is llama's Kernels.linear)
    return layers.lm_head(hidden_SD, params, cfg.tie_word_embeddings)
