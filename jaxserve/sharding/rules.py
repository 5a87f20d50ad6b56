"""Logical axes -> mesh axes, and the partition spec of every parameter and KV-cache array.

Model code never names mesh axes. Each parameter dimension gets a logical name (`vocab`,
`heads`, ...); `LOGICAL_AXIS_RULES` — the one table — says which mesh axis splits it.
Dimensions that must split evenly (heads, kv heads, MLP columns, experts) raise a ValueError
naming the dimension when they don't; the vocabulary is replicated instead (an uneven vocab
is common and only costs memory).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.sharding.family_axes import CACHE_AXES, FAMILY_AXES, divisible_dims, family
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
    # the families of sharding/family_axes.py (which says why)
    "lora": None,           # MLA's q / kv latents and the latent cache: read by every head
    "v_heads": MODEL_AXIS,  # gated DeltaNet value heads (and its recurrent state)
    "conv_channels": MODEL_AXIS,  # gated DeltaNet conv channels, in contiguous blocks
    "conv_width": None,
    "state_slots": None,
    "one": None,
}

# Our parameter name -> logical axis of each dimension (see models/llama.py, models/moe.py).
_DENSE_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}
_MOE_AXES = {
    "router": ("embed", "router"),
    "w_gate": ("experts", "embed", "mlp"), "w_up": ("experts", "embed", "mlp"),
    "w_down": ("experts", "mlp", "embed"),
}
KV_CACHE_AXES = CACHE_AXES["k"]


def _axes_of(tree, table: dict, where: str):
    """Logical axes at every shape leaf of a parameter shape tree; a dict holding a router is an
    MoE layer (its w_gate / w_up / w_down are experts), any other a dense one."""
    if isinstance(tree, list):
        return [_axes_of(t, table, f"{where}[{i}]") for i, t in enumerate(tree)]
    if "router" in tree:
        table = {**table, **_MOE_AXES}
    out = {}
    for name, sub in tree.items():
        if isinstance(sub, tuple):
            if name not in table:
                raise ValueError(f"no sharding rule for parameter {where}{name} (sharding/rules.py)")
            out[name] = table[name]
        else:
            out[name] = _axes_of(sub, table, f"{where}{name}.")
    return out


def param_logical_axes(cfg: ModelConfig, shapes: dict | None = None) -> dict:
    """The parameter tree (`shapes`, default the family's param_shapes; an "mtp" subtree too)
    with a tuple of logical axis names at every leaf."""
    from jaxserve.models.registry import param_shapes

    table = {**_DENSE_AXES, **FAMILY_AXES.get(family(cfg.architecture), {})}
    return _axes_of(param_shapes(cfg) if shapes is None else shapes, table, "")


def _mesh_size(mesh: Mesh, axis: str | None) -> int:
    return 1 if axis is None else mesh.shape[axis]


def check_divisible(cfg: ModelConfig, mesh: Mesh) -> None:
    """Raise a ValueError naming the first dimension that cannot be split over its mesh axis."""
    dims = divisible_dims(cfg)
    if dims is None:        # llama's families (and MiniMax-M2)
        dims = [("num_heads", cfg.num_heads, "heads"), ("num_kv_heads", cfg.num_kv_heads, "kv_heads")]
        if cfg.is_moe:
            dims += [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                     ("num_experts", cfg.num_experts, "experts")]
        else:
            dims += [("intermediate_size", cfg.intermediate_size, "mlp")]
    for field, size, logical in dims:
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


def param_shardings(cfg: ModelConfig, mesh: Mesh, shapes: dict | None = None) -> dict:
    """NamedSharding for every parameter, in the tree layout of `shapes` (default: the family's
    param_shapes; pass a tree with an "mtp" subtree to place those too)."""
    from jaxserve.models.registry import param_shapes

    check_divisible(cfg, mesh)
    shapes = param_shapes(cfg) if shapes is None else shapes
    return jax.tree.map(lambda axes, shape: NamedSharding(mesh, logical_to_spec(axes, shape, mesh)),
                        param_logical_axes(cfg, shapes), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def param_placements(cfg: ModelConfig, mesh: Mesh | None, shapes: dict | None = None) -> dict:
    """Where each parameter goes: its mesh sharding, or the first device when there is no mesh."""
    from jaxserve.models.registry import param_shapes

    if mesh is not None:
        return param_shardings(cfg, mesh, shapes)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, param_shapes(cfg) if shapes is None else shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of each k / v cache array f[num_blocks, P, K, E]: split by kv heads."""
    check_divisible(cfg, mesh)
    return NamedSharding(mesh, PartitionSpec(*(LOGICAL_AXIS_RULES[a] for a in KV_CACHE_AXES)))


def cache_array_sharding(cfg: ModelConfig, mesh: Mesh, name: str, shape: tuple) -> NamedSharding:
    """Sharding of one cache array by its spec name (family_axes.CACHE_AXES): k / v split by kv
    heads, MLA latents and index keys replicated, DeltaNet states by value head / channel."""
    if name not in CACHE_AXES:
        raise ValueError(f"no sharding rule for cache array {name!r}; known: {', '.join(CACHE_AXES)}")
    check_divisible(cfg, mesh)
    return NamedSharding(mesh, logical_to_spec(CACHE_AXES[name], shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    """For step inputs and anything else every device needs whole."""
    return NamedSharding(mesh, PartitionSpec())


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, dtype=None) -> dict:
    """device_put an existing (numpy or jax) parameter tree onto the mesh, array by array."""
    import jax.numpy as jnp
    import numpy as np

    def put(a, sharding):
        a = np.asarray(a) if not isinstance(a, jax.Array) else a
        if dtype is not None:
            a = a.astype(jnp.dtype(dtype))
        return jax.device_put(a, sharding)

    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    return jax.tree.map(put, params, param_shardings(cfg, mesh, shapes))
