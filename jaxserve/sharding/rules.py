"""Logical axes -> mesh axes, and the partition spec of every parameter and KV-cache array.

Model code never names mesh axes. Each parameter dimension gets a logical name (`vocab`,
`heads`, ...) from its model family (models/interface.py: `param_logical_axes`,
`cache_axes`, `divisible_dims`; the family object is passed in, so this module imports no
model code); `LOGICAL_AXIS_RULES` — the one table — says which mesh axis splits it.
Dimensions that must split evenly (heads, kv heads, MLP columns, experts) raise a ValueError
naming the dimension when they don't; the vocabulary is replicated instead (an uneven vocab
is common and only costs memory).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.sharding.mesh import EXPERT_AXIS, MODEL_AXIS

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": MODEL_AXIS,
    "embed": None,          # D stays whole: activations between blocks are replicated
    "heads": MODEL_AXIS,    # N*E columns of wq / rows of wo, in whole heads
    "kv_heads": MODEL_AXIS,  # K*E columns of wk, wv; K of the KV cache
    "head_dim": None,
    "mlp": MODEL_AXIS,      # F columns of w_gate / w_up, rows of w_down (expert F too)
    "experts": EXPERT_AXIS,
    "router": None,         # router output columns: every device scores every expert
    "kv_blocks": None,
    "block_tokens": None,
    # the other families' dimensions (models/families.py says why)
    "lora": None,           # MLA's q / kv latents and the latent cache: read by every head
    "v_heads": MODEL_AXIS,  # gated DeltaNet value heads (and its recurrent state)
    "conv_channels": MODEL_AXIS,  # gated DeltaNet conv channels, in contiguous blocks
    "conv_width": None,
    "state_slots": None,
    "one": None,
}

def _mesh_size(mesh: Mesh, axis: str | None) -> int:
    return 1 if axis is None else mesh.shape[axis]


def check_divisible(family, cfg: ModelConfig, mesh: Mesh) -> None:
    """Raise a ValueError naming the first dimension of `family` (a models.interface.ModelFamily)
    that cannot be split over its mesh axis."""
    for field, size, logical in family.divisible_dims(cfg):
        axis = LOGICAL_AXIS_RULES[logical]
        n = _mesh_size(mesh, axis)
        if size % n:
            knob = "expert_parallel_size" if axis == EXPERT_AXIS else "tensor_parallel_size"
            raise ValueError(f"{field} = {size} must be divisible by the {axis!r} mesh axis size {n} "
                             f"({knob}); choose a {knob} that divides {size}")


def logical_to_spec(axes: tuple, shape: tuple, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of one array from its logical axes (uneven vocab splits fall back to None)."""
    out = []
    for name, size in zip(axes, shape):
        axis = LOGICAL_AXIS_RULES[name]
        if axis is not None and size % _mesh_size(mesh, axis):
            if name != "vocab":
                raise ValueError(f"dimension {name!r} of size {size} does not divide mesh axis "
                                 f"{axis!r} of size {_mesh_size(mesh, axis)}")
            axis = None
        out.append(axis)
    return PartitionSpec(*out)


def param_shardings(family, cfg: ModelConfig, mesh: Mesh, shapes: dict | None = None) -> dict:
    """NamedSharding for every parameter, in the tree layout of `shapes` (default: the family's
    param_shapes; pass a tree with an "mtp" subtree to place those too)."""
    check_divisible(family, cfg, mesh)
    shapes = family.param_shapes(cfg) if shapes is None else shapes
    return jax.tree.map(lambda axes, shape: NamedSharding(mesh, logical_to_spec(axes, shape, mesh)),
                        family.param_logical_axes(cfg, shapes), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def param_placements(family, cfg: ModelConfig, mesh: Mesh | None, shapes: dict | None = None) -> dict:
    """Where each parameter goes: its mesh sharding, or the first device when there is no mesh."""
    if mesh is not None:
        return param_shardings(family, cfg, mesh, shapes)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, family.param_shapes(cfg) if shapes is None else shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def kv_cache_sharding(family, cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of each k / v cache array f[num_blocks, P, K, E]: split by kv heads."""
    check_divisible(family, cfg, mesh)
    return NamedSharding(mesh, PartitionSpec(*(LOGICAL_AXIS_RULES[a] for a in family.cache_axes["k"])))


def cache_array_sharding(family, cfg: ModelConfig, mesh: Mesh, name: str, shape: tuple) -> NamedSharding:
    """Sharding of one cache array by its spec name (the family's cache_axes): k / v split by kv
    heads, MLA latents and index keys replicated, DeltaNet states by value head / channel."""
    axes = family.cache_axes
    if name not in axes:
        raise ValueError(f"no sharding rule for cache array {name!r}; known: {', '.join(axes)}")
    check_divisible(family, cfg, mesh)
    return NamedSharding(mesh, logical_to_spec(axes[name], shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """For step inputs and anything else every device needs whole."""
    return NamedSharding(mesh, PartitionSpec())


def shard_params(family, params: dict, cfg: ModelConfig, mesh: Mesh, dtype=None) -> dict:
    """device_put an existing (numpy or jax) parameter tree onto the mesh, array by array."""
    def put(a, sharding):
        a = np.asarray(a) if not isinstance(a, jax.Array) else a
        if dtype is not None:
            a = a.astype(jnp.dtype(dtype))
        return jax.device_put(a, sharding)

    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    return jax.tree.map(put, params, param_shardings(family, cfg, mesh, shapes))
