"""The device side of multi-LoRA: per layer and fused projection, slot arrays

    a f[max_loras + 1, in, P*R]   b f[max_loras + 1, P*R, out]

(adapter.py's layout; slot 0 stays zero: tokens without an adapter), kept in each layer's
parameter dict under "lora" so the step reads them as parameters. Writing an adapter into a
slot makes new arrays of the same shapes: the compiled steps take them as they are, and a
step already launched keeps reading the arrays it was given.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.lora.adapter import FUSED_PARTS, LoRAAdapter, projection_dims, slot_rank


def slot_shapes(cfg: ModelConfig, config: LoRAConfig) -> dict[str, tuple[tuple, tuple]]:
    """fused projection -> (a's shape, b's shape) of one layer's slot arrays."""
    r, n = slot_rank(config.max_lora_rank), config.max_loras + 1
    return {name: ((n, din, len(outs) * r), (n, len(outs) * r, sum(outs)))
            for name, (din, outs) in projection_dims(cfg).items()}


def slot_bytes(cfg: ModelConfig, config: LoRAConfig, dtype) -> int:
    """Device bytes of every layer's slot arrays (cache sizing pays for them)."""
    per_layer = sum(int(np.prod(a)) + int(np.prod(b)) for a, b in slot_shapes(cfg, config).values())
    return per_layer * cfg.num_layers * jnp.dtype(dtype).itemsize


def attach(params: dict, cfg: ModelConfig, config: LoRAConfig, dtype, device=None) -> dict:
    """params with zeroed slot arrays under each layer's "lora" (new layer dicts)."""
    shapes = slot_shapes(cfg, config)
    layers = []
    for lp in params["layers"]:
        lora = {name: {"a": jax.device_put(jnp.zeros(a, dtype), device),
                       "b": jax.device_put(jnp.zeros(b, dtype), device)}
                for name, (a, b) in shapes.items()}
        layers.append({**lp, "lora": lora})
    return {**params, "layers": layers}


@functools.partial(jax.jit, static_argnames=())
def _write(slots_tree, slot, new_tree):
    return jax.tree.map(lambda arr, new: arr.at[slot].set(new.astype(arr.dtype)), slots_tree, new_tree)


def write_slot(params: dict, slot: int, adapter: LoRAAdapter | None) -> dict:
    """params with slot `slot` holding `adapter` (None: zeros) in every layer."""
    old = [lp["lora"] for lp in params["layers"]]
    if adapter is None:
        new = jax.tree.map(lambda arr: np.zeros(arr.shape[1:], np.float32), old)
    else:
        new = [{name: {"a": adapter.layers[i][name][0], "b": adapter.layers[i][name][1]}
                for name in FUSED_PARTS} for i in range(len(old))]
    written = _write(old, jnp.int32(slot), new)
    layers = [{**lp, "lora": w} for lp, w in zip(params["layers"], written)]
    return {**params, "layers": layers}
