"""DeepSeek V4's multi-token-prediction layers (checkpoint `mtp.{m}.*`, DeepSeek's own
inference/model.py MTPBlock is the reference; transformers skips these weights): as a proposer
(spec_decode/mtp.py) over their own caches on the target's block tables.

MTP layer m at a token whose previous token's hidden state is h (the target's hc streams after
its last layer, before the hyper head: f[hc, D]):
  x = e_proj(enorm(embed(token))) + h_proj(hnorm(h))   (hnorm per stream, e_proj's row added
                                                        to every stream)
  x = one V4 block (mHC, attention of mtp_layer_types[m] (sliding if none), score-routed MoE)
      on those streams
  logits = lm_head(head_norm(hyper head with the layer's own hc_head_* weights(x)))
The embedding and the LM head are the target's (the checkpoint has none of its own).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.core.step_input import StepInput
from jaxserve.models import deepseek_v4 as v4
from jaxserve.models import layers
from jaxserve.pallas_kernels.dispatch import resolve_impl


def _mtp_types(cfg: v4.DeepseekV4Config) -> tuple[str, ...]:
    """Each MTP layer's attention: mtp_layer_types', sliding past them."""
    m = cfg.num_mtp_layers
    return (cfg.mtp_layer_types + (v4.SLIDING,) * m)[:m]


def _with_mtp_layers(cfg: v4.DeepseekV4Config) -> v4.DeepseekV4Config:
    """cfg with the MTP layers appended as layers num_layers + m (DeepSeek numbers them so;
    never hash-routed: its hash layers are the first ones)."""
    return dataclasses.replace(cfg, layer_types=cfg.layer_types + _mtp_types(cfg),
                               mlp_layer_types=cfg.mlp_layer_types + ("moe",) * cfg.num_mtp_layers)


def mtp_param_shapes(cfg: v4.DeepseekV4Config) -> list[dict]:
    """One flat dict per MTP layer: a decoder layer's parameters (deepseek_v4.layer_shapes), and
    enorm / hnorm / head_norm f[D], e_proj / h_proj f[D, D], hc_head_fn f[hc * D, hc],
    hc_head_base f[hc], hc_head_scale f[1]."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    ext = _with_mtp_layers(cfg)
    return [{**v4.layer_shapes(ext, cfg.num_layers + m), "enorm": (d,), "hnorm": (d,), "head_norm": (d,),
             "e_proj": (d, d), "h_proj": (d, d), "hc_head_fn": (hc * d, hc), "hc_head_base": (hc,),
             "hc_head_scale": (1,)} for m in range(cfg.num_mtp_layers)]


def mtp_cache_specs(cfg: v4.DeepseekV4Config) -> list[PagedSpec]:
    """The MTP layers' caches, each as a decoder layer's of its type (apart from cache_specs so
    that only an engine that runs the proposer allocates them)."""
    return v4.cache_specs(dataclasses.replace(cfg, layer_types=_mtp_types(cfg)))


def mtp_forward(cfg: v4.DeepseekV4Config, params: dict, caches: list[dict], x: StepInput,
                prev_hidden_TH: jax.Array, depth: int = 0, attention_impl: str = "xla"):
    """MTP layer `depth` as a proposer: token t of the step is the token AFTER the one whose
    streams prev_hidden_TH[t] (f[T, hc * D], the target's forward aux layer num_layers) are, at
    that earlier token's position. (caches, logits f32[T, V] of the token after `token`, the
    layer's output streams f[T, hc * D] before its hyper head: what a chained draft step reads
    as its prev_hidden.)"""
    impl, _ = resolve_impl(attention_impl)
    mp = params["mtp"][depth]
    eps, hc, d = cfg.rms_norm_eps, cfg.hc_mult, cfg.hidden_size
    e_TD = layers.rms_norm(params["embed"][x.token_ids], mp["enorm"], eps)
    h_ND = layers.rms_norm(prev_hidden_TH.reshape(-1, d), mp["hnorm"], eps)    # per stream
    streams = (layers.linear(e_TD, mp["e_proj"])[:, None, :]
               + layers.linear(h_ND, mp["h_proj"]).reshape(-1, hc, d))
    cache, streams = v4.decoder_layer(_with_mtp_layers(cfg), cfg.num_layers + depth, mp, caches[depth],
                                      streams.astype(e_TD.dtype), x, v4.make_ropes(cfg), impl)
    out_TD = layers.rms_norm(v4.hc_head(cfg, mp, streams), mp["head_norm"], eps)
    logits = layers.lm_head(out_TD, params, cfg.tie_word_embeddings).astype(jnp.float32)
    return caches[:depth] + [cache] + caches[depth + 1:], logits, streams.reshape(streams.shape[0], -1)
