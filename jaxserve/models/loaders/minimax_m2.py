"""Load MiniMax-M2 / M2.5 from a HF directory (one or many safetensors files, FP8 included),
and its dummy weights; both placed by the sharding rules when given a mesh.

Tensor names are the Hub's (what MiniMax publishes and transformers' save_pretrained
writes back): model.layers.{i}.self_attn.{q,k,v,o}_proj / q_norm / k_norm,
block_sparse_moe.gate (the router), block_sparse_moe.e_score_correction_bias and
block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down). FP8 (e4m3) weights with a
`weight_scale_inv` beside them are dequantized per 128 x 128 block by deepseek_loader's
reader (quantization_config.weight_block_size). The multi-token-prediction modules of the
published checkpoints are skipped.

Each parameter is made with jax.make_array_from_callback: every device asks for its own
slice, and only the tensors (for experts: only the experts) of that slice are read from the
memory-mapped files.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import minimax_m2 as mm
from jaxserve.models.loaders import dummy
from jaxserve.models.loaders.deepseek import SafetensorsDir
from jaxserve.sharding import rules

# our name -> Hub suffix after "model.layers.{i}." and whether it is a Linear ([out, in]: transposed)
_LAYER = {
    "attn_norm": ("input_layernorm.weight", False), "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "router": ("block_sparse_moe.gate.weight", True),
    "router_bias": ("block_sparse_moe.e_score_correction_bias", False),
}
_EXPERTS = {"w_gate": "w1.weight", "w_up": "w3.weight", "w_down": "w2.weight"}
# kept in f32 whatever the load dtype: the bias only ranks experts, and a bf16 one would
# round away differences the choice depends on (transformers keeps it f32 too)
F32_PARAMS = ("router_bias",)

Reader = Callable[[tuple], np.ndarray]     # the slice `index` (in our layout) of one parameter


def _reader(ck: SafetensorsDir, name: str, transpose: bool, want: tuple, block) -> Reader:
    if name not in ck:
        raise ValueError(f"checkpoint is missing tensor {name!r} (needed for a {want} parameter)")
    shape = tuple(ck.entries[name][2]["shape"])
    if (shape[::-1] if transpose else shape) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {shape} (transposed to [in, out]: {transpose}); "
                         f"{mm.ARCHITECTURE} with this config.json expects {tuple(want)}")

    def read(index: tuple) -> np.ndarray:
        w = ck.weight(name, block)
        return (w.T if transpose else w)[index]
    return read


def _experts_reader(ck: SafetensorsDir, names: list[str], want: tuple, block) -> Reader:
    """[X, in, out] from one [out, in] tensor per expert, reading only the experts asked for."""
    for name in names:
        _reader(ck, name, True, want[1:], block)          # presence and shape of each

    def read(index: tuple) -> np.ndarray:
        picked = range(len(names))[index[0]]
        return np.stack([ck.weight(names[j], block).T[index[1:]] for j in picked])
    return read


def _plan(cfg: mm.MiniMaxM2Config, ck: SafetensorsDir, block) -> dict:
    shapes = mm.param_shapes(cfg)
    plan = {"embed": _reader(ck, "model.embed_tokens.weight", False, shapes["embed"], block),
            "final_norm": _reader(ck, "model.norm.weight", False, shapes["final_norm"], block),
            "layers": []}
    if "lm_head" in shapes:
        plan["lm_head"] = _reader(ck, "lm_head.weight", True, shapes["lm_head"], block)
    for i, ls in enumerate(shapes["layers"]):
        prefix = f"model.layers.{i}."
        layer = {ours: _reader(ck, prefix + hf, t, ls[ours], block) for ours, (hf, t) in _LAYER.items()}
        for ours, hf in _EXPERTS.items():
            names = [f"{prefix}block_sparse_moe.experts.{j}.{hf}" for j in range(cfg.num_experts)]
            layer[ours] = _experts_reader(ck, names, ls[ours], block)
        plan["layers"].append(layer)
    return plan


def _dtypes(shapes: dict, dtype) -> dict:
    """The load dtype of every parameter (F32_PARAMS stay f32)."""
    def one(tree):
        return {k: jnp.dtype(jnp.float32 if k in F32_PARAMS else dtype) for k in tree}
    out = one({k: v for k, v in shapes.items() if k != "layers"})
    out["layers"] = [one(ls) for ls in shapes["layers"]]
    return out


def load_hf(family, path: str, cfg: mm.MiniMaxM2Config, dtype: str = "float32", mesh=None):
    """(cfg, params) placed by the sharding rules of `family` (models/families.py)."""
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or (128, 128))
    ck = SafetensorsDir(path)
    shapes = mm.param_shapes(cfg)
    plan = _plan(cfg, ck, block)

    def build(read, shape, sharding, dt):
        return jax.make_array_from_callback(tuple(shape), sharding,
                                            lambda index: np.asarray(read(index)).astype(dt))

    params = jax.tree.map(build, plan, shapes, rules.param_placements(family, cfg, mesh), _dtypes(shapes, dtype),
                          is_leaf=callable)
    return cfg, params


def dummy_params(family, cfg: mm.MiniMaxM2Config, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
    """models/dummy.py's draws (norms 1, the rest N(0, 0.02^2)), placed by the sharding rules;
    the router bias f32 (a random bias of that size barely moves the expert choice)."""
    params = dummy.draw_params(mm.param_shapes(cfg), rules.param_placements(family, cfg, mesh), dtype, seed)
    for lp in params["layers"]:
        lp["router_bias"] = lp["router_bias"].astype(jnp.float32)
    return params
