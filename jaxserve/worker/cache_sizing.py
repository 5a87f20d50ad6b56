"""The runner's caches: how many blocks and state slots, and their device arrays.

One place sizes them (`plan_caches`) and one allocates them (`allocate_caches`): the
target's paged blocks and a proposer's caches on the same block tables (MTP, EAGLE3) are
paid from one budget, the state slots of a hybrid model first (live ones, saved states for
prefix hits, snapshots for speculation's rollback). The budget is a share of the device's
free memory (the CPU: a fixed byte count), less a proposer's weights that load after it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.worker import hosts


@dataclasses.dataclass(frozen=True)
class CachePlan:
    num_blocks: int           # paged blocks (block 0 the null block)
    num_slots: int            # state slots the scheduler hands out: live ones + saved states
    num_cached_states: int    # of those, the saved states for hybrid prefix hits
    num_state_snapshots: int  # slots past those: a request's state before its verifying step
    bytes_per_block: int      # one block on each device, the proposer's caches included


def plan_caches(config: EngineConfig, specs: list, proposer_specs: list, proposer_weight_bytes: int,
                max_blocks_per_seq: int, device=None, num_blocks: int | None = None) -> CachePlan:
    """The cache plan: `num_blocks` given, configured, or from the memory budget (which pays
    for the snapshot slots too). device: the one whose memory is measured (default: the
    first local one)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    kinds = cache_manager.group_kinds(specs)
    max_seqs = config.scheduler.max_num_seqs
    # Speculating with recurrent state: a snapshot slot per live slot, past the scheduler's
    # slots, holds a request's state from before its verifying step (scheduler.py: rollback)
    snapshots = max_seqs if config.speculative is not None and cache_manager.STATE in kinds else 0
    per_block = cache_manager.bytes_per_block(specs + proposer_specs, config.cache.block_size, itemsize) \
        // config.parallel.tensor_parallel_size
    num_blocks = num_blocks or config.cache.num_kv_blocks
    budget = None
    if not num_blocks:
        first = device or jax.local_devices()[0]
        stats = first.memory_stats() if jax.default_backend() != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = int(free * config.cache.kv_cache_memory_fraction)
        else:
            budget = config.cache.kv_cache_cpu_bytes
        # a proposer's weights (an EAGLE3 head) load after the sizing: their bytes first
        budget = (budget - proposer_weight_bytes) * config.parallel.tensor_parallel_size
        budget = hosts.agree_min(budget)     # every host sizes the same cache
    cached = _num_cached_states(config, specs, kinds, itemsize, budget)
    if num_blocks:
        num_slots = max_seqs + 1 + cached if cache_manager.STATE in kinds else 0
        return CachePlan(num_blocks, num_slots, cached, snapshots, per_block)
    # No use holding more than every sequence at full length.
    useful = max_seqs * max_blocks_per_seq + 1
    blocks, slots = cache_manager.size_caches(
        specs + proposer_specs, block_size=config.cache.block_size, itemsize=itemsize,
        budget_bytes=budget, max_num_seqs=max_seqs, useful_blocks=useful,
        cached_states=cached + snapshots)
    return CachePlan(blocks, slots - snapshots, cached, snapshots, per_block)


def _num_cached_states(config: EngineConfig, specs, kinds, itemsize: int, budget: int | None) -> int:
    """Saved states for hybrid prefix caching: configured, or cache_manager's default."""
    cache = config.cache
    if not cache.enable_prefix_caching or cache_manager.STATE not in kinds:
        return 0
    if cache.num_cached_states is not None:
        return cache.num_cached_states
    return cache_manager.auto_cached_states(specs, itemsize=itemsize, budget_bytes=budget,
                                            max_num_seqs=config.scheduler.max_num_seqs)


def allocate_caches(specs, num_blocks: int, num_slots: int, block_size: int, dtype,
                    sharding_of=None) -> list[dict[str, jax.Array]]:
    """Zeroed device arrays of every layer's cache spec: paged arrays [num_blocks, P, *shape],
    state arrays [num_slots, *shape]; `sharding_of(name, shape)` places them (None: default)."""
    caches, makers = [], {}
    for spec in specs:
        lead = (num_blocks, block_size) if isinstance(spec, PagedSpec) else (num_slots,)
        layer = {}
        for name, shape in spec.arrays:
            full = lead + tuple(shape)
            out = sharding_of(name, full) if sharding_of else None
            kind = jnp.float32 if name in getattr(spec, "float32", ()) else dtype
            # One compiled zeros per distinct array (not per layer: 4 s of start-up at 8B)
            key = (full, jnp.dtype(kind).name, out)
            if key not in makers:
                makers[key] = jax.jit(lambda s=full, d=kind: jnp.zeros(s, d), out_shardings=out)
            layer[name] = makers[key]()
        caches.append(layer)
    return caches
