"""The EAGLE3 proposer: an HF-format `LlamaForCausalLMEagle3` head drafts k tokens per
request from three of the target's hidden states.

The head: `fc` maps the residual streams after the target's aux layers (the head config's
`eagle_config.eagle_aux_hidden_state_layer_ids`, else (2, L/2, L-3)), concatenated, to its
width; one decoder layer (`midlayer`) attends over [input_layernorm(embed(token)) |
hidden_norm(h)] (q/k/v take twice the width) with h as the residual; then `norm` and an
`lm_head` over `draft_vocab_size` tokens, mapped to the target's ids by `d2t` (target id =
draft id + d2t[draft id]). The embedding is the target's unless the head has its own.

Like MTP (hidden_steps.py), it runs on the device after each target step over that step's
positions, its K/V paged on the target's block tables; a sampling chunk's last kept position
proposes the request's first draft. Drafts 2..k chain, as EAGLE3 does at inference:
the head runs again on the draft before, with its own pre-norm output in place of fc(aux).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax.numpy as jnp
import numpy as np

from jaxserve.models import layers, llama
from jaxserve.spec_decode import hidden_steps
from jaxserve.worker.cache_sizing import allocate_caches
from jaxserve.worker.target_view import TargetView

# HF names of the head (after "midlayer.", the decoder layer's, as a Llama layer's).
_HEAD_TENSORS = {"fc.weight": ("fc", True), "norm.weight": ("norm", False),
                 "lm_head.weight": ("lm_head", True), "embed_tokens.weight": ("embed", False)}


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def head_config(path: str, target_cfg):
    """(head ModelConfig, its HF config dict) of an HF EAGLE3 head directory, checked against
    the target (the runner sizes the cache with it before the head's weights load)."""
    from jaxserve.models.loader import model_config_from_hf

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    arch = (hf.get("architectures") or ["?"])[0]
    if arch != "LlamaForCausalLMEagle3":
        raise ValueError(f"speculative_config['model'] must be an EAGLE3 head "
                         f"(LlamaForCausalLMEagle3) with method 'eagle3'; {path!r} is {arch}")
    if hf["vocab_size"] != target_cfg.vocab_size:
        raise ValueError(f"speculative_config['model'] must have the target's vocabulary "
                         f"({target_cfg.vocab_size} tokens); the EAGLE3 head has {hf['vocab_size']}")
    return model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}), hf


def cache_specs(path: str, target_cfg):
    """The head's cache specs (one layer's K/V, on the target's block tables)."""
    return llama.cache_specs(head_config(path, target_cfg)[0])


def weight_bytes(path: str) -> int:
    """The head's safetensors bytes on disk: an upper bound of its weights in the engine's
    dtype when that is no wider than the files'."""
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def aux_layers(hf: dict, target_cfg) -> tuple[int, ...]:
    """The target layers whose residual streams the head reads (its HF config dict's, checked)."""
    aux = tuple((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or default_aux_layers(target_cfg.num_layers))
    if len(aux) != 3 or not all(0 <= i < target_cfg.num_layers for i in aux):
        raise ValueError(f"the EAGLE3 head's aux layer ids must be three layers of the target "
                         f"(0 to {target_cfg.num_layers - 1}); got {list(aux)}")
    return aux


def load_head(path: str, target_cfg, dtype: str):
    """(head ModelConfig, params, aux layer ids) of an HF EAGLE3 head directory."""
    from safetensors.numpy import load_file

    from jaxserve.models.loaders.hf import _LAYER_TENSORS

    cfg, hf = head_config(path, target_cfg)
    aux = aux_layers(hf, target_cfg)
    raw = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            raw.update(load_file(os.path.join(path, name)))
    to = lambda a, t: jnp.asarray(a.T if t else a, dtype)
    params = {ours: to(raw[n], t) for n, (ours, t) in _HEAD_TENSORS.items() if n in raw}
    layer = {ours: to(raw["midlayer." + n], t) for n, (ours, t) in _LAYER_TENSORS.items()
             if "midlayer." + n in raw}
    layer["hidden_norm"] = to(raw["midlayer.hidden_norm.weight"], False)
    params["layer"] = layer
    draft_vocab = hf.get("draft_vocab_size") or hf["vocab_size"]
    d2t = np.asarray(raw["d2t"], np.int64) if "d2t" in raw else np.zeros(draft_vocab, np.int64)
    params["draft_to_target"] = jnp.asarray(np.arange(draft_vocab) + d2t, jnp.int32)
    return cfg, params, aux


def head_forward(cfg, hp, kv, x, embed_VD, aux_TH, kernels, rows=None):
    """(the head's {"k", "v"} cache, target ids of its greedy drafts i32[T], pre-norm hidden)
    over the target's aux streams (rows: only those tokens' drafts and hidden)."""
    return head_layer(cfg, hp, kv, x, embed_VD, layers.linear(aux_TH.astype(hp["fc"].dtype), hp["fc"]),
                      kernels, rows)


def head_layer(cfg, hp, kv, x, embed_VD, h_TD, kernels, rows=None):
    """head_forward's decoder layer and lm_head over h_TD: fc(aux), or in a chained step the
    head's own pre-norm output at the position before. The lm_head runs on `rows` only when
    given (a pass over a prompt chunk wants one draft, not T)."""
    lp, eps = hp["layer"], cfg.rms_norm_eps
    e_TD = layers.rms_norm(embed_VD[x.token_ids], lp["attn_norm"], eps)
    both = jnp.concatenate([e_TD, layers.rms_norm(h_TD, lp["hidden_norm"], eps)], -1)
    inv_freq = layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    kv, attn_TD = llama.attention_block(cfg, lp, kv, both, x, inv_freq, kernels)
    residual_TD = h_TD + attn_TD
    out_TD = residual_TD + llama.dense_mlp(lp, layers.rms_norm(residual_TD, lp["mlp_norm"], eps))
    if rows is not None:
        out_TD = out_TD[rows]
    logits = jnp.dot(layers.rms_norm(out_TD, hp["norm"], eps), hp["lm_head"],
                     preferred_element_type=jnp.float32)
    return kv, hp["draft_to_target"][jnp.argmax(logits, axis=-1)], out_TD


def _eagle_step(weights, kv, x, aux_TH, sample_S, *, cfg, attention_impl, k, block_size):
    """(the head's cache, drafts i32[S, k]): the pass over x, then k - 1 chained steps.
    weights: (the head's params, the embedding)."""
    hp, embed_VD = weights
    kernels = llama.make_kernels(cfg, attention_impl)

    def first(kv):
        return head_forward(cfg, hp, kv, x, embed_VD, aux_TH, kernels, x.logits_indices)

    def chained(kv, x_j, ids_S, h_SD):
        return head_layer(cfg, hp, kv, dataclasses.replace(x_j, token_ids=ids_S), embed_VD, h_SD, kernels)

    return hidden_steps.chain_drafts(first, chained, kv, x, sample_S, k, block_size)


class Eagle3Proposer(hidden_steps.AfterStepProposer):
    method = "eagle3"

    def __init__(self, spec_config, engine_config):
        """Reads the head's config (its cache on the target's block tables, the target layers
        it reads, its weights' bytes: the target's runner is built with them); its weights
        load when bound, after the target's caches are sized."""
        super().__init__(spec_config.num_speculative_tokens)
        self.path, self.dtype = spec_config.model, engine_config.dtype
        self.cfg, hf = head_config(self.path, engine_config.model)
        self.aux_layers = aux_layers(hf, engine_config.model)
        self.target_cache_specs = tuple(llama.cache_specs(self.cfg))
        self.target_weight_bytes = weight_bytes(self.path)

    def bind(self, target: TargetView) -> None:
        self.target = target
        self.cfg, self.params, _ = load_head(self.path, target.cfg, self.dtype)
        self.embed = self.params.pop("embed", None)
        if self.embed is None:            # the usual head: the target's embedding, its width
            if self.cfg.hidden_size != target.cfg.hidden_size:
                raise ValueError(f"speculative_config['model']: an EAGLE3 head without its own "
                                 f"embed_tokens must have the target's hidden_size "
                                 f"({target.cfg.hidden_size}); got {self.cfg.hidden_size}")
            self.embed = target.params["embed"]
        self.weights = (self.params, self.embed)
        self.cache = allocate_caches(list(self.target_cache_specs), target.num_blocks, 0,
                                     target.block_size, target.dtype)[0]
        self.forward = functools.partial(_eagle_step, cfg=self.cfg, attention_impl=target.attention_impl,
                                         k=self.k, block_size=target.block_size)
