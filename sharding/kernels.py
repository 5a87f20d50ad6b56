"""Running a Pallas kernel under tensor parallelism: one shard_map over the `model` axis.

A pallas_call is opaque to jit's partitioner, so on head-sharded inputs it would be run on
gathered (replicated) arrays. Kernels whose work splits by heads (paged attention: q heads
and kv heads; the KV cache is already split by kv heads, sharding/rules.py) instead run
per shard inside `jax.shard_map`: each rank runs the unchanged kernel on its own heads, the
step's metadata replicated. The call sites read the ambient mesh (the one the caller set
with `jax.set_mesh`) through `jax.sharding.get_abstract_mesh()`; with no mesh, or a `model`
axis of size 1, the kernel is called as it is.

Only attention is wrapped here so far (models/attention.py); the other kernels are open.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxserve.sharding.mesh import MODEL_AXIS


def model_axis_size() -> int:
    """The ambient mesh's `model` axis size (1 with no mesh or no such axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL_AXIS]


def per_model_shard(fn, in_specs, out_specs):
    """fn, run per `model` shard of the ambient mesh when that axis has size > 1, else fn.

    in_specs / out_specs: PartitionSpecs (pytrees of them) naming MODEL_AXIS where an array
    is split; anything else is replicated. check_vma is off: a Pallas kernel's output has no
    varying-axes annotation the checker could verify."""
    if model_axis_size() == 1:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# Paged attention's specs: q [T, N, E] split on N, K/V caches [blocks, P, K, E] split on K,
# the step's metadata (start locations, lengths, block tables) replicated.
HEADS_TNE = P(None, MODEL_AXIS, None)
CACHE_NPKE = P(None, None, MODEL_AXIS, None)
REPLICATED = P()


def paged_attention(kernel, q_TNE, k_cache, v_cache, *metadata):
    """kernel(q, k_cache, v_cache, *metadata) -> o [T, N, E], per head shard under TP."""
    tp = model_axis_size()
    if tp == 1:
        return kernel(q_TNE, k_cache, v_cache, *metadata)
    n, k = q_TNE.shape[1], k_cache.shape[2]
    if n % tp or k % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the query heads ({n}) and "
                         f"kv heads ({k}) to run the attention kernel per head shard")
    wrapped = per_model_shard(
        kernel, (HEADS_TNE, CACHE_NPKE, CACHE_NPKE) + (REPLICATED,) * len(metadata), HEADS_TNE)
    return wrapped(q_TNE, k_cache, v_cache, *metadata)
