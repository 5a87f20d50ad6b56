"""The runner's caches: how many blocks and state slots, and their device arrays.

One place sizes them (`plan_caches`) and one allocates them (`allocate_caches`): the
target's paged blocks and a proposer's caches on the same block tables (MTP, EAGLE3) are
paid from one budget, the state slots of a hybrid model first (live ones, saved states for
prefix hits, snapshots for speculation's rollback), then a sliding-window group's blocks
(kv_cache/manager.py window_blocks: what the running requests' windows need, and as much
again for prefix hits), the full group taking the rest. The budget is what --gpu-memory-
utilization x the device's total memory leaves after the weights, the step programs' measured
peak and a headroom (memory_plan.py), or --kv-cache-memory-bytes, or on the CPU a fixed byte
count; a proposer's weights that load after the sizing are paid from it first.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache import manager as cache_manager
from jaxserve.core.kv_cache.specs import PagedSpec
from jaxserve.worker import hosts, memory_plan
from jaxserve.worker.memory_plan import DeviceMemory, MemoryReport

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    num_blocks: int           # paged blocks (block 0 the null block)
    num_slots: int            # state slots the scheduler hands out: live ones + saved states
    num_cached_states: int    # of those, the saved states for hybrid prefix hits
    num_state_snapshots: int  # slots past those: a request's state before its verifying step
    bytes_per_block: int      # one block on each device, the proposer's caches included
    memory: MemoryReport | None = None    # how they were sized (the start-up block)
    num_window_blocks: int = 0  # the sliding-window group's blocks (0: the model has none)
    bytes_per_window_block: int = 0   # one of those on each device


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the profile measured on the device (memory_plan.py): its memory once the weights
    are loaded, the step programs' peak (None: not measured yet) and the headroom kept."""
    memory: DeviceMemory
    peak_bytes: int | None
    headroom_bytes: int


def plan_caches(config: EngineConfig, specs: list, proposer_specs: list, proposer_weight_bytes: int,
                max_blocks_per_seq: int, measured: Measured | None = None,
                num_blocks: int | None = None) -> CachePlan:
    """The cache plan: `num_blocks` given or configured; else from --kv-cache-memory-bytes,
    from the budget the device `measured` leaves (memory_plan.cache_budget: it pays for the
    snapshot slots too), or, with nothing measured (the CPU), from kv_cache_cpu_bytes.
    Raises CacheDoesNotFit when a measured or given budget cannot hold one request of
    max_model_len (measured.peak_bytes None: the check before the profiling compile)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    kinds = cache_manager.group_kinds(specs)
    max_seqs = config.scheduler.max_num_seqs
    tp = config.parallel.tensor_parallel_size
    # Speculating with recurrent state: a snapshot slot per live slot, past the scheduler's
    # slots, holds a request's state from before its verifying step (scheduler.py: rollback)
    snapshots = max_seqs if config.speculative is not None and cache_manager.STATE in kinds else 0
    all_specs = specs + proposer_specs
    per_block = cache_manager.bytes_per_block(all_specs, config.cache.block_size, itemsize) // tp
    per_slot = cache_manager.bytes_per_slot(all_specs, itemsize) // tp
    per_window = cache_manager.bytes_per_block(all_specs, config.cache.block_size, itemsize, window=True) // tp
    num_blocks = num_blocks or config.cache.num_kv_blocks
    window = functools.partial(
        cache_manager.window_blocks, all_specs, block_size=config.cache.block_size, max_num_seqs=max_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        lookahead=2 * config.num_speculative_tokens + config.scheduler.num_scheduler_steps)
    budget, source = None, "num_kv_blocks"
    if not num_blocks:
        if config.cache.kv_cache_memory_bytes:
            budget, source = config.cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif measured is not None:
            budget = memory_plan.cache_budget(config.cache.gpu_memory_utilization, measured.memory,
                                              measured.peak_bytes or 0, measured.headroom_bytes)
            source = "gpu_memory_utilization"
        else:
            budget, source = config.cache.kv_cache_cpu_bytes, "cpu"
        # a proposer's weights (an EAGLE3 head) load after the sizing: their bytes first
        if source != "kv_cache_memory_bytes":
            budget -= proposer_weight_bytes
        budget = hosts.agree_min(budget)     # every host sizes the same cache
        if source != "cpu":
            window_bytes = window() * per_window
            _check_windows_fit(config, budget, window_bytes)
            _check_one_request_fits(config, budget - window_bytes, per_block, per_slot,
                                    max_blocks_per_seq,
                                    (max_seqs + 1 + snapshots) if cache_manager.STATE in kinds else 0,
                                    measured)
        budget *= tp
    cached = _num_cached_states(config, specs, kinds, itemsize, budget)
    if num_blocks:
        num_slots = max_seqs + 1 + cached if cache_manager.STATE in kinds else 0
        windows = window(num_blocks=num_blocks)
        return CachePlan(num_blocks, num_slots, cached, snapshots, per_block,
                         _report(config, source, num_blocks, num_slots + snapshots, per_block, per_slot,
                                 measured, windows * per_window), windows, per_window)
    # No use holding more than every sequence at full length.
    useful = max_seqs * max_blocks_per_seq + 1
    blocks, slots = cache_manager.size_caches(
        all_specs, block_size=config.cache.block_size, itemsize=itemsize,
        budget_bytes=budget, max_num_seqs=max_seqs, useful_blocks=useful,
        cached_states=cached + snapshots, num_window_blocks=window())
    windows = window(num_blocks=blocks)
    return CachePlan(blocks, slots - snapshots, cached, snapshots, per_block,
                     _report(config, source, blocks, slots, per_block, per_slot, measured,
                             windows * per_window), windows, per_window)


def _check_one_request_fits(config: EngineConfig, budget: int, per_block: int, per_slot: int,
                            max_blocks_per_seq: int, min_slots: int, measured: Measured | None) -> None:
    """CacheDoesNotFit unless `budget` (one device's) holds the state slots and one request of
    max_model_len (its blocks and the null block). `measured` is set unless
    --kv-cache-memory-bytes was given on a device that reports no memory."""
    need = (max_blocks_per_seq + 1) * per_block + min_slots * per_slot
    if budget >= need:
        return
    block_size = config.cache.block_size
    fits_tokens = ((budget - min_slots * per_slot) // per_block - 1) * block_size if per_block else 0
    if config.cache.kv_cache_memory_bytes:
        raise memory_plan.CacheDoesNotFit(
            f"--kv-cache-memory-bytes {config.cache.kv_cache_memory_bytes} holds less than one "
            f"request of max_model_len {config.scheduler.max_model_len} ({need} bytes per device): "
            f"raise it to at least {need}, or lower --max-model-len"
            + (f" (at most {fits_tokens} tokens fit)" if fits_tokens > 0 else ""))
    raise memory_plan.does_not_fit(
        max_model_len=config.scheduler.max_model_len, need=need, left=budget, memory=measured.memory,
        utilization=config.cache.gpu_memory_utilization, peak=measured.peak_bytes,
        headroom=measured.headroom_bytes, fits_tokens=fits_tokens,
        tensor_parallel_size=config.parallel.tensor_parallel_size)


def _check_windows_fit(config: EngineConfig, budget: int, window_bytes: int) -> None:
    """CacheDoesNotFit when the sliding-window group's blocks alone take the budget (one
    device's): their count follows max_num_seqs and the step's token budget, not the memory."""
    if window_bytes and window_bytes >= budget:
        s = config.scheduler
        raise memory_plan.CacheDoesNotFit(
            f"the sliding-window cache ({window_bytes} bytes per device: the windows of max_num_seqs "
            f"{s.max_num_seqs} requests and two steps of max_num_batched_tokens "
            f"{s.max_num_batched_tokens}, and a window a sequence for prefix hits) takes all of the KV "
            f"cache budget ({budget} bytes per device): lower --max-num-seqs or "
            f"--max-num-batched-tokens, or give the cache more memory")


def _report(config: EngineConfig, source: str, num_blocks: int, num_slots: int, per_block: int,
            per_slot: int, measured: Measured | None, window_bytes: int = 0) -> MemoryReport:
    memory = measured.memory if measured is not None else None
    return MemoryReport(
        source=source, cache_bytes=num_blocks * per_block + num_slots * per_slot + window_bytes,
        num_blocks=num_blocks, block_size=config.cache.block_size,
        max_model_len=config.scheduler.max_model_len,
        device_total_bytes=memory.total if memory else None,
        gpu_memory_utilization=config.cache.gpu_memory_utilization if memory else None,
        weights_bytes=memory.in_use if memory else None,
        peak_bytes=measured.peak_bytes if measured else None,
        headroom_bytes=measured.headroom_bytes if measured else None,
        allocator=memory_plan.allocator_note() if memory else "")


def _num_cached_states(config: EngineConfig, specs, kinds, itemsize: int, budget: int | None) -> int:
    """Saved states for hybrid prefix caching: configured, or cache_manager's default."""
    cache = config.cache
    if not cache.enable_prefix_caching or cache_manager.STATE not in kinds:
        return 0
    if cache.num_cached_states is not None:
        return cache.num_cached_states
    return cache_manager.auto_cached_states(specs, itemsize=itemsize, budget_bytes=budget,
                                            max_num_seqs=config.scheduler.max_num_seqs)


def _cache_arrays(specs, num_blocks: int, num_slots: int, block_size: int, dtype, sharding_of,
                  num_window_blocks: int):
    """(layer index, name, shape, dtype, sharding) of every cache array."""
    for i, spec in enumerate(specs):
        paged = isinstance(spec, PagedSpec)
        for name, shape in spec.arrays:
            n = num_window_blocks if paged and name in spec.window_arrays else num_blocks
            full = ((n, spec.rows(name, block_size)) if paged else (num_slots,)) + tuple(shape)
            kind = jnp.float32 if name in getattr(spec, "float32", ()) else dtype
            yield i, name, full, jnp.dtype(kind), sharding_of(name, full) if sharding_of else None


def abstract_caches(specs, num_blocks: int, num_slots: int, block_size: int, dtype,
                    sharding_of=None, num_window_blocks: int = 0) -> list[dict[str, jax.ShapeDtypeStruct]]:
    """allocate_caches' arrays as shapes only (what a program is compiled against)."""
    caches = [{} for _ in specs]
    for i, name, full, kind, out in _cache_arrays(specs, num_blocks, num_slots, block_size, dtype,
                                                  sharding_of, num_window_blocks):
        caches[i][name] = jax.ShapeDtypeStruct(full, kind, sharding=out)
    return caches


def allocate_caches(specs, num_blocks: int, num_slots: int, block_size: int, dtype,
                    sharding_of=None, num_window_blocks: int = 0) -> list[dict[str, jax.Array]]:
    """Zeroed device arrays of every layer's cache spec: paged arrays [num_blocks, P, *shape]
    ([num_window_blocks, P, *shape] for a spec's window_arrays), state arrays [num_slots,
    *shape]; `sharding_of(name, shape)` places them (None: default)."""
    caches, makers = [{} for _ in specs], {}
    for i, name, full, kind, out in _cache_arrays(specs, num_blocks, num_slots, block_size, dtype,
                                                  sharding_of, num_window_blocks):
        # One compiled zeros per distinct array (not per layer: 4 s of start-up at 8B)
        key = (full, kind.name, out)
        if key not in makers:
            makers[key] = jax.jit(lambda s=full, d=kind: jnp.zeros(s, d), out_shardings=out)
        caches[i][name] = makers[key]()
    return caches


class CacheReservation:
    """The caches' memory, held from the weights' load until the caches take it (GPU only).

    Why: the runner sizes the caches after profiling a step program and allocates them once
    warm-up's plain programs are compiled (runner.py). Each compile's GEMM autotuner
    allocates and frees operands while executables' small constants stay, and the free memory
    ends in pieces: on an H100 at the 8B shape the largest free block was 52.4 of 59.5 GiB
    free after the compiles, and the 64th of the KV cache's 853.6 MiB arrays found no place
    (issue 62). So `hold` allocates the caches of a plan that may only shrink (the budget
    with a peak of 0, or a fixed size) before any compile, and `release` frees them just
    before the real ones, which are no larger array by array, are allocated into their place.
    The compiles meanwhile use the memory outside: the headroom and the allocator's slack
    (memory_plan.py)."""

    def __init__(self, specs, block_size: int, dtype, sharding_of=None):
        self._layout = (specs, block_size, dtype, sharding_of)
        self._held: list | None = None

    def hold(self, plan: CachePlan) -> CachePlan:
        """Allocate `plan`'s caches (a failure to is logged, not raised: the caches are then
        allocated into whatever is free later); returns the plan."""
        specs, block_size, dtype, sharding_of = self._layout
        self.release()
        try:
            self._held = allocate_caches(specs, plan.num_blocks, plan.num_slots + plan.num_state_snapshots,
                                         block_size, dtype, sharding_of, plan.num_window_blocks)
            jax.block_until_ready(self._held)
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            self._held = None
            logger.warning("could not hold the caches' memory before warm-up's compiles (%s); "
                           "they are allocated after them", str(error).splitlines()[0])
        return plan

    @property
    def held(self) -> bool:
        return self._held is not None

    def release(self) -> None:
        """Free the held arrays now (not when Python collects them)."""
        for array in jax.tree.leaves(self._held or []):
            array.delete()
        self._held = None
