"""Load DeepSeek V4 from a HF directory (sharded safetensors), and its dummy weights.

The tensor names are the released checkpoints' (DeepSeek's own: `layers.{i}.attn.wq_a.weight`,
`layers.{i}.ffn.experts.{j}.w1.weight`, `hc_head_fn`, ...), which transformers also writes
back on save_pretrained (its conversion mapping reversed), with or without a leading
`model.`. Linear weights [out, in] are transposed to [in, out]; the grouped output projection
wo_a [G*O, H*E/G] becomes [G, H*E/G, O]; experts are stacked [X, in, out] (read lazily per
device, loaders/deepseek._ExpertStack). Quantized tensors are dequantized on load, one at a
time, by their stored dtype (loaders/quantized.QuantizedSafetensorsDir): the released
checkpoints' FP8 weights with UE8M0 (or f32) block scales in `<module>.scale` and packed FP4
routed experts with UE8M0 scales per 32 inputs, and FP8 with a `weight_scale_inv` beside it
(f32 scales); FP8 blocks are 128 x 128 or the config's weight_block_size. Any other quantized
format raises naming the tensor.

Kept in f32 whatever the load dtype, as transformers keeps them: the mHC projections, the
sinks, the compressors' position biases, the router bias (they feed softmaxes, sigmoids and
the Sinkhorn normalisation). tid2eid stays int32.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import deepseek_v4 as v4
from jaxserve.models import deepseek_v4_mtp as mtp
from jaxserve.models.loaders import dummy
from jaxserve.models.loaders.deepseek import SafetensorsDir, _ExpertStack
from jaxserve.models.loaders.progress import LayerProgress
from jaxserve.models.loaders.quantized import QuantizedSafetensorsDir
from jaxserve.sharding import rules

F32_PARAMS = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
              "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale", "sinks", "c_ape",
              "i_ape", "router_bias")

# ours -> the checkpoint's name inside "layers.{i}." ("T": stored [out, in], transposed)
_LAYER_NAMES = {
    "attn_norm": ("attn_norm.weight", ""), "mlp_norm": ("ffn_norm.weight", ""),
    "hc_attn_fn": ("hc_attn_fn", "T"), "hc_attn_base": ("hc_attn_base", ""),
    "hc_attn_scale": ("hc_attn_scale", ""), "hc_ffn_fn": ("hc_ffn_fn", "T"),
    "hc_ffn_base": ("hc_ffn_base", ""), "hc_ffn_scale": ("hc_ffn_scale", ""),
    "wq_a": ("attn.wq_a.weight", "T"), "q_a_norm": ("attn.q_norm.weight", ""),
    "wq_b": ("attn.wq_b.weight", "T"), "wkv": ("attn.wkv.weight", "T"),
    "kv_norm": ("attn.norm.weight", ""), "wo_b": ("attn.wo_b.weight", "T"),
    "sinks": ("attn.attn_sink", ""),
    "wc_kv": ("attn.compressor.wkv.weight", "T"), "wc_gate": ("attn.compressor.wgate.weight", "T"),
    "c_ape": ("attn.compressor.ape", ""), "c_norm": ("attn.compressor.norm.weight", ""),
    "wi_kv": ("attn.indexer.compressor.wkv.weight", "T"),
    "wi_gate": ("attn.indexer.compressor.wgate.weight", "T"),
    "i_ape": ("attn.indexer.compressor.ape", ""), "i_norm": ("attn.indexer.compressor.norm.weight", ""),
    "wi_q": ("attn.indexer.wq_b.weight", "T"), "wi_w": ("attn.indexer.weights_proj.weight", "T"),
    "router": ("ffn.gate.weight", "T"), "router_bias": ("ffn.gate.bias", ""),
    "ws_gate": ("ffn.shared_experts.w1.weight", "T"), "ws_up": ("ffn.shared_experts.w3.weight", "T"),
    "ws_down": ("ffn.shared_experts.w2.weight", "T"),
}
# an MTP layer's own, besides a decoder layer's (models/deepseek_v4_mtp.py)
_MTP_NAMES = {
    "enorm": ("enorm.weight", ""), "hnorm": ("hnorm.weight", ""), "head_norm": ("norm.weight", ""),
    "e_proj": ("e_proj.weight", "T"), "h_proj": ("h_proj.weight", "T"),
    "hc_head_fn": ("hc_head_fn", "T"), "hc_head_base": ("hc_head_base", ""),
    "hc_head_scale": ("hc_head_scale", ""),
}
_EXPERTS = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
_TOP = {"embed": ("embed.weight", "embed_tokens.weight"), "lm_head": ("head.weight", "lm_head.weight"),
        "final_norm": ("norm.weight",), "hc_head_fn": ("hc_head_fn", "hc_head.hc_fn"),
        "hc_head_base": ("hc_head_base", "hc_head.hc_base"),
        "hc_head_scale": ("hc_head_scale", "hc_head.hc_scale")}


def _dtype_of(name: str, dtype):
    if name == "tid2eid":
        return jnp.int32
    return jnp.float32 if name in F32_PARAMS else jnp.dtype(dtype)


def _first(ck: SafetensorsDir, prefix: str, names: tuple[str, ...]) -> str:
    """The first of `names` the checkpoint holds, with the prefix or without (transformers
    writes the LM head outside `model.`)."""
    for n in names:
        for full in (prefix + n, n):
            if full in ck:
                return full
    raise ValueError(f"checkpoint has none of {[prefix + n for n in names]}")


def load_hf(family, path: str, cfg: v4.DeepseekV4Config, dtype: str = "float32", mesh=None):
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or (128, 128))
    ck = QuantizedSafetensorsDir(path)
    prefix = "model." if any(n.startswith("model.") for n in ck.entries) else ""
    shapes = v4.param_shapes(cfg)
    place = rules.param_placements(family, cfg, mesh, shapes)

    def put(name, arr, where, placement, want):
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"{where}{name}: checkpoint gives shape {tuple(arr.shape)}; the "
                             f"config.json expects {tuple(want)}")
        dt = _dtype_of(name, dtype)
        if isinstance(arr, _ExpertStack):
            return jax.make_array_from_callback(arr.shape, placement,
                                                lambda index, a=arr, dt=dt: a[index].astype(dt))
        return jax.device_put(np.asarray(arr, dt), placement)

    def load_layer(where, ls, placements):
        tree = _layer_tree(ck, cfg, where, ls, block)
        return {k: put(k, a, where, placements[k], ls[k]) for k, a in tree.items()}

    params = {}
    for name, names in _TOP.items():
        w = ck.weight(_first(ck, prefix, names), block)
        params[name] = put(name, w.T if name in ("lm_head", "hc_head_fn") else w, "", place[name],
                           shapes[name])
    progress = LayerProgress(f"loading {os.path.basename(os.path.normpath(path))}", cfg.num_layers)
    progress.done(params, layer=False)
    params["layers"] = []
    for i, ls in enumerate(shapes["layers"]):
        params["layers"].append(load_layer(f"{prefix}layers.{i}.", ls, place["layers"][i]))
        progress.done(params["layers"][-1])
    # the MTP layers (DeepSeek's `mtp.{m}.`) up to the first one missing (transformers' saves
    # drop them)
    mtp_shapes = mtp.mtp_param_shapes(cfg)
    wheres = [next((p for p in (f"{prefix}mtp.{m}.", f"mtp.{m}.") if p + "enorm.weight" in ck), None)
              for m in range(len(mtp_shapes))]
    found = wheres.index(None) if None in wheres else len(wheres)
    if found:
        mtp_place = rules.param_placements(family, cfg, mesh, {"mtp": mtp_shapes[:found]})["mtp"]
        params["mtp"] = [load_layer(wheres[m], mtp_shapes[m], mtp_place[m]) for m in range(found)]
    return cfg, params


def _layer_tree(ck: SafetensorsDir, cfg: v4.DeepseekV4Config, where: str, ls: dict, block) -> dict:
    """The checkpoint's arrays of one decoder (or MTP) layer `where` ("layers.{i}." or
    "mtp.{m}."), in our names and layouts, for the names in ls."""
    g, o = cfg.o_groups, cfg.o_lora_rank
    tree = {}
    for ours in ls:
        if ours in _LAYER_NAMES or ours in _MTP_NAMES:
            theirs, how = _LAYER_NAMES.get(ours) or _MTP_NAMES[ours]
            w = ck.weight(where + theirs, block)
            tree[ours] = w.T if how == "T" else w
        elif ours in _EXPERTS:
            tree[ours] = _ExpertStack(ck, [f"{where}ffn.experts.{j}.{_EXPERTS[ours]}.weight"
                                           for j in range(cfg.num_experts)], block)
        elif ours == "tid2eid":
            tree[ours] = np.asarray(ck.raw(where + "ffn.gate.tid2eid"), np.int32)
        elif ours == "wo_a":
            w = ck.weight(where + "attn.wo_a.weight", block)      # [G*O, H*E/G]
            tree[ours] = w.reshape(g, o, -1).transpose(0, 2, 1)
    return tree


def dummy_params(family, cfg: v4.DeepseekV4Config, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
    """Random weights at the config's shapes (dummy.draw_params), the mHC / sinks / biases in
    f32 as loaded, tid2eid a random table of distinct experts per token."""
    shapes = v4.param_shapes(cfg)
    place = rules.param_placements(family, cfg, mesh, shapes)
    params = dummy.draw_params(shapes, place, dtype, seed)
    rng = np.random.default_rng(seed)
    for i, lp in enumerate(params["layers"]):
        for name in list(lp):
            if name == "tid2eid":
                v, k = shapes["layers"][i][name]
                table = np.argsort(rng.random((v, cfg.num_experts)), axis=1)[:, :k].astype(np.int32)
                lp[name] = jax.device_put(table, place["layers"][i][name])
            elif name in F32_PARAMS:
                lp[name] = lp[name].astype(jnp.float32)
    for name in F32_PARAMS:
        if name in params:
            params[name] = params[name].astype(jnp.float32)
    return params
