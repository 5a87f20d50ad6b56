"""The device mesh: one named axis per kind of parallelism.

Axes, outermost first: `expert` (expert parallelism: MoE experts split across it) and
`model` (tensor parallelism: heads, MLP columns and the vocabulary split across it).
Attention runs replicated across `expert` and split across `model`, so a mesh of
EP x TP devices serves one model.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

EXPERT_AXIS = "expert"
MODEL_AXIS = "model"
MESH_AXES = (EXPERT_AXIS, MODEL_AXIS)


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
              devices: list | None = None) -> Mesh:
    """A (expert, model) mesh over the first EP*TP devices (all local devices by default)."""
    for name, size in (("tensor_parallel_size", tensor_parallel_size),
                       ("expert_parallel_size", expert_parallel_size)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1; got {size}")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * expert_parallel_size
    if need > len(devices):
        raise ValueError(
            f"tensor_parallel_size * expert_parallel_size = {tensor_parallel_size} * "
            f"{expert_parallel_size} = {need} devices, but only {len(devices)} are available")
    grid = np.asarray(devices[:need], dtype=object).reshape(expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)


def mesh_from_parallel_config(parallel, devices: list | None = None) -> Mesh:
    """Mesh for a `jaxserve.config.ParallelConfig` (over `devices`: a data-parallel replica's)."""
    return make_mesh(parallel.tensor_parallel_size, parallel.expert_parallel_size, devices)
