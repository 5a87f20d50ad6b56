"""Random weights of a config's shapes, made on the device (`load_format="dummy"`).

For benchmarking 8B / 30B-A3B shapes without their files: each parameter is drawn by a
jitted function whose output sharding is that parameter's NamedSharding, so nothing passes
through host memory and every device materialises only its own slice, a layer at a time
(one draw's f32 scratch is one layer's, freed before the next: no model-sized temporary).
Ready configs (public model cards) live in models/configs/: `dummy_config_path("Qwen3-8B")`.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.loaders.progress import LayerProgress


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")   # models/configs
INIT_STD = 0.02          # HF's usual initializer_range: keeps activations finite over many layers


def known_configs() -> list[str]:
    return sorted(f[:-len(".json")] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def read_config(source: str | dict[str, Any]) -> dict[str, Any]:
    """A HF config dict from a dict, a config.json path, a HF directory or a ready config's name."""
    if isinstance(source, dict):
        return dict(source)
    candidates = [source, os.path.join(source, "config.json"), os.path.join(CONFIG_DIR, f"{source}.json")]
    for path in candidates:
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    raise FileNotFoundError(f"no model config at {source!r}: pass a config dict, a config.json, a HF "
                            f"directory, or one of the ready configs: {', '.join(known_configs())}")


@functools.lru_cache(maxsize=None)
def _dict_drawer(spec: tuple, dtype: str, shardings: tuple):
    """A jitted key -> {name: array} for one flat group of parameters (the top level, or a layer).

    Cached on shapes, so the layers of a model (all alike) share one compilation.
    """
    sizes = [math.prod(shape) for _, shape in spec]

    def draw(key):
        # NOTE: one normal draw for the whole group, then slices: each random op is a large
        # unrolled program to compile, so one per group compiles several times faster.
        flat = INIT_STD * jax.random.normal(key, (sum(sizes),), jnp.float32)
        out, at = {}, 0
        for (name, shape), size in zip(spec, sizes):
            if name.endswith("norm"):
                out[name] = jnp.ones(shape, dtype)
            else:
                out[name] = flat[at:at + size].reshape(shape).astype(dtype)
            at += size
        return out
    return jax.jit(draw, out_shardings={name: sh for (name, _), sh in zip(spec, shardings)})


# Past this many elements a group is drawn one array at a time: one f32 draw for a whole
# DeepSeek-V3 MoE layer (11.3G elements) would need a 45 GB scratch buffer on top of the
# weights. Every Llama / Qwen layer is far below it (Qwen3-30B-A3B's: 0.6G), so they keep the
# single draw.
BIG_GROUP_ELEMENTS = 1 << 30


def _draw(key, shapes: dict, shardings: dict, dtype: str) -> dict:
    names = sorted(shapes)
    if sum(math.prod(shapes[n]) for n in names) > BIG_GROUP_ELEMENTS:
        out = {}
        for j, n in enumerate(names):
            one = ((n, tuple(shapes[n])),)
            out.update(_dict_drawer(one, dtype, (shardings[n],))(jax.random.fold_in(key, j)))
        return out
    spec = tuple((n, tuple(shapes[n])) for n in names)
    return _dict_drawer(spec, dtype, tuple(shardings[n] for n in names))(key)


def draw_params(shapes: dict, shardings: dict, dtype: str, seed: int = 0) -> dict:
    """Random parameters of a {top-level..., "layers": [...]} shape tree, each array made
    with its sharding (a family's dummy_params: models/interface.py)."""
    dtype = jnp.dtype(dtype).name
    root = jax.random.key(seed)
    top = {k: v for k, v in shapes.items() if k != "layers"}
    progress = LayerProgress("dummy weights", len(shapes["layers"]))
    params = _draw(root, top, shardings, dtype)
    progress.done(params, layer=False)
    params["layers"] = []
    for i, (layer, layer_sh) in enumerate(zip(shapes["layers"], shardings["layers"])):
        params["layers"].append(_draw(jax.random.fold_in(root, i + 1), layer, layer_sh, dtype))
        progress.done(params["layers"][-1])
    return params
