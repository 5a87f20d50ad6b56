"""Random weights of a config's shapes, made on the device (`load_format="dummy"`).

For benchmarking 8B / 30B-A3B shapes without their files: each parameter is drawn by a
jitted function whose output sharding is that parameter's NamedSharding, so nothing passes
through host memory and every device materialises only its own slice.
Ready configs (public model cards) live in models/configs/: `dummy_config_path("Qwen3-8B")`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
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
def _drawer(shape: tuple, dtype: str, is_norm: bool, sharding):
    def draw(key):
        if is_norm:
            return jnp.ones(shape, dtype)
        return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(draw, out_shardings=sharding)


def dummy_params(cfg: ModelConfig, dtype: str = "float32", mesh=None, seed: int = 0) -> dict:
    """Random parameters for `cfg`; norm weights are ones, everything else N(0, INIT_STD^2)."""
    from jaxserve.models.llama import param_shapes
    from jaxserve.sharding import rules

    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    if mesh is not None:
        shardings = rules.param_shardings(cfg, mesh)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes, is_leaf=is_shape)
    paths_and_shapes, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    flat_shardings = treedef.flatten_up_to(shardings)
    root = jax.random.key(seed)
    leaves = []
    for i, ((path, shape), sharding) in enumerate(zip(paths_and_shapes, flat_shardings)):
        name = str(path[-1].key)
        draw = _drawer(tuple(shape), jnp.dtype(dtype).name, name.endswith("norm"), sharding)
        leaves.append(draw(jax.random.fold_in(root, i)))
    return treedef.unflatten(leaves)


def load_dummy(source: str | dict[str, Any], dtype: str = "float32", mesh=None,
               seed: int = 0) -> tuple[ModelConfig, dict]:
    from jaxserve.models.hf_loader import model_config_from_hf

    cfg = model_config_from_hf(read_config(source))
    return cfg, dummy_params(cfg, dtype, mesh, seed)
