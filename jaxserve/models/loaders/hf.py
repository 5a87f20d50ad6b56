"""Load a Hugging Face checkpoint directory: config.json + one or many *.safetensors.

HF stores a Linear weight as [out, in]; we keep [in, out] (llama.py), so 2-D projections are
transposed, and MoE experts, stored one tensor per expert, are stacked into [X, in, out].
Each parameter is built with `jax.make_array_from_callback`: every device asks only for its
own slice, which is read from the memory-mapped file with safetensors' `get_slice`, so a
model never passes whole through host memory (at most one parameter: a layer's experts
stacked) and loads a layer at a time, with a progress line every tenth of its layers.

Legend: X experts, D model dim, F MLP dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.loaders.progress import LayerProgress
from jaxserve.sharding import rules

# Per-layer HF name (after "model.layers.{i}.") -> (our name, stored [out, in] -> transpose).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# MoE layers: router and per-expert projections, by the family's naming.
_MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.",
                           {"w_gate": "w1.weight", "w_up": "w3.weight", "w_down": "w2.weight"}),
    "Qwen3MoeForCausalLM": ("mlp.gate.weight", "mlp.experts.{j}.",
                            {"w_gate": "gate_proj.weight", "w_up": "up_proj.weight",
                             "w_down": "down_proj.weight"}),
}


def read_hf_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} is not a HF model directory: no config.json in it")
    with open(cfg_path) as f:
        return json.load(f)


def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a llama-family architecture (models/families.py LLAMA); the variants its
    decoder does not build are refused by name."""
    arch = (hf.get("architectures") or ["?"])[0]
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{arch}: dense layers between MoE layers (mlp_only_layers="
                         f"{hf.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{hf.get('decoder_sparse_step')}) are not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {hf['hidden_act']!r} is not supported; supported: silu")
    cfg = ModelConfig.from_hf(hf)
    rope = cfg.rope_scaling_dict or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default", "linear", "llama3"):
        raise ValueError(f"{arch}: rope scaling {kind!r} is not supported; supported: linear, llama3")
    return cfg


def _weight_map(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file that holds it."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    out = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            out.update({name: file for name in f.keys()})
    return out


# A source reads the slice `index` (in OUR layout) of one parameter as a numpy array.
Source = Callable[[tuple], np.ndarray]


class _Checkpoint:
    """Lazily opened safetensors files and slice readers over them."""

    def __init__(self, path: str, stack: contextlib.ExitStack):
        self.where = _weight_map(path)
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def _slice(self, name: str):
        from safetensors import safe_open

        if name not in self.where:
            raise KeyError(name)
        file = self.where[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(file, framework="numpy"))
        return self.handles[file].get_slice(name)

    def shape(self, name: str, transpose: bool) -> tuple:
        shape = tuple(self._slice(name).get_shape())
        return shape[::-1] if transpose else shape

    def source(self, name: str, transpose: bool) -> Source:
        def read(index: tuple) -> np.ndarray:
            sl = self._slice(name)
            return sl[index[::-1]].T if transpose else sl[index]
        return read

    def stacked_source(self, names: list[str]) -> Source:
        """Experts stored [out, in] each, read as [X, in, out] (only the experts asked for)."""
        def read(index: tuple) -> np.ndarray:
            picked = range(len(names))[index[0]]
            return np.stack([self._slice(names[j])[index[1:][::-1]].T for j in picked])
        return read


def _plan(cfg: ModelConfig, shapes: dict, ckpt: _Checkpoint) -> dict:
    """Our parameter tree (of `shapes`) with (HF tensor name, source) at every leaf; checks
    names and shapes."""

    def leaf(hf_name: str, transpose: bool, want: tuple):
        if hf_name not in ckpt.where:
            raise ValueError(f"checkpoint is missing tensor {hf_name!r} (needed for a {want} parameter)")
        got = ckpt.shape(hf_name, transpose)
        if got != tuple(want):
            raise ValueError(f"tensor {hf_name!r} has shape {got} (after transposing to [in, out]: "
                             f"{transpose}); {cfg.architecture} with this config.json expects {tuple(want)}")
        return hf_name, ckpt.source(hf_name, transpose)

    plan: dict[str, Any] = {"embed": leaf("model.embed_tokens.weight", False, shapes["embed"]),
                            "final_norm": leaf("model.norm.weight", False, shapes["final_norm"])}
    if "lm_head" in shapes:
        plan["lm_head"] = leaf("lm_head.weight", True, shapes["lm_head"])
    moe = _MOE_NAMES.get(cfg.architecture) if cfg.is_moe else None
    if cfg.is_moe and moe is None:
        raise ValueError(f"{cfg.architecture}: no MoE tensor naming known; known: {', '.join(_MOE_NAMES)}")
    plan["layers"] = []
    for i, layer_shapes in enumerate(shapes["layers"]):
        prefix = f"model.layers.{i}."
        layer = {}
        for hf_suffix, (ours, transpose) in _LAYER_TENSORS.items():
            if ours in layer_shapes and not (cfg.is_moe and ours.startswith("w_")):
                layer[ours] = leaf(prefix + hf_suffix, transpose, layer_shapes[ours])
        if moe:
            router_name, expert_prefix, parts = moe
            layer["router"] = leaf(prefix + router_name, True, layer_shapes["router"])
            for ours, hf_suffix in parts.items():
                names = [prefix + expert_prefix.format(j=j) + hf_suffix for j in range(cfg.num_experts)]
                for name in names:
                    leaf(name, True, layer_shapes[ours][1:])      # presence and shape of each
                layer[ours] = (prefix + expert_prefix.format(j="*") + hf_suffix, ckpt.stacked_source(names))
        plan["layers"].append(layer)
    return plan


def load_llama_layout(family, path: str, cfg: ModelConfig, dtype: str = "float32", mesh=None) -> dict:
    """Params of llama's tensor names (the `family` object's shapes and placements) as jax
    arrays in `dtype`, sharded over `mesh` if given."""
    jdtype = jnp.dtype(dtype)
    shapes = family.param_shapes(cfg)
    shardings = rules.param_placements(family, cfg, mesh)
    with contextlib.ExitStack() as stack:
        plan = _plan(cfg, shapes, _Checkpoint(path, stack))

        def build(entry, shape, sharding):
            _, read = entry
            return jax.make_array_from_callback(
                tuple(shape), sharding, lambda index: np.asarray(read(index)).astype(jdtype))

        def build_tree(plans, tree_shapes, tree_shardings):
            return jax.tree.map(build, plans, tree_shapes, tree_shardings,
                                is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and callable(x[1]))

        # A layer at a time (a parameter at a time within it), with progress
        progress = LayerProgress(f"loading {os.path.basename(os.path.normpath(path))}", len(plan["layers"]))
        params = build_tree({k: v for k, v in plan.items() if k != "layers"},
                            {k: v for k, v in shapes.items() if k != "layers"},
                            {k: v for k, v in shardings.items() if k != "layers"})
        progress.done(params, layer=False)
        params["layers"] = []
        for layer_plan, layer_shapes, layer_shardings in zip(plan["layers"], shapes["layers"],
                                                             shardings["layers"]):
            params["layers"].append(build_tree(layer_plan, layer_shapes, layer_shardings))
            progress.done(params["layers"][-1])
    return params


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))

