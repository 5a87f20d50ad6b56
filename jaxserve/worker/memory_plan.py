"""Memory planning on a GPU (vLLM's `determine_available_memory`): profile, then size.

`--gpu-memory-utilization` (default 0.9) is, as in vLLM, the share of the device's TOTAL memory
the engine may use: the weights, the step programs' peak and the caches together. So the
runner loads the weights, compiles its largest step program and reads its peak
(`program_peak_bytes`), and only then sizes the caches from

    cache = utilization x total - weights (in use) - step programs' peak - headroom

(`cache_budget`). The caches are allocated once warm-up's plain programs are compiled (XLA's
GEMM autotuner allocates operands of its own while compiling: runner.py). A configuration
whose budget cannot hold one request of max_model_len fails
with one line naming the numbers and what to change (`CacheDoesNotFit`), before warm-up, and
before even the profiling compile when the weights alone leave too little.

JAX's allocator (`configure_allocator`): by default it reserves 75 % of the device, less than
the default budget, so the engine gives it the utilization plus POOL_SLACK
(XLA_PYTHON_CLIENT_MEM_FRACTION) before JAX initialises its backend, unless the user set the
allocator's variables. The plan keeps to the budget; the slack is room the allocator cannot
hand out anyway: its pool fragments (H100, 8B, issue 62: the caches and the first step needed
69.1 of a 71.26 GiB pool, and an 853 MiB array found no place).

The CPU reports no memory to take a share of: it keeps its fixed byte budget
(CacheConfig.kv_cache_cpu_bytes); `--kv-cache-memory-bytes` fixes the cache's size anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

logger = logging.getLogger(__name__)

# Kept free inside the budget beyond the measured peak, plus the largest weight array
# (`headroom_bytes`). Why: programs compiled once the caches exist (warm-up's background
# variants, the state-copy programs, a prompt-logprobs step on first use) run XLA's GEMM
# autotuner where its results are not cached yet, and it allocates fresh operands and outputs
# to time candidate kernels: at
# the 8B shape on an H100 it could not get 1018 MiB for the LM head's GEMM once the cache had
# taken the rest (issue 62), and 609.5 MiB (the LM head's copy) for Qwen3-30B-A3B. The fixed
# GiB covers the GEMM's output and the sampler's [rows, V] f32 buffers of programs bigger
# than the one profiled (full variants with logprobs, prompt logprobs).
HEADROOM_BYTES = 1 << 30

# JAX's allocator's variables (its GPU memory documentation); a user's own values are kept.
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ALLOCATOR_ENVS = (MEM_FRACTION_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
JAX_DEFAULT_MEM_FRACTION = 0.75     # what JAX's GPU allocator reserves when not told


# The allocator's pool beyond the budget (module doc), capped at MAX_POOL_FRACTION of the device
# (the CUDA context, cuBLAS's workspaces and the kernels' code live outside the pool).
POOL_SLACK = 0.04
MAX_POOL_FRACTION = 0.97


def pool_fraction(utilization: float) -> float:
    """The share of the device JAX's allocator gets for a --gpu-memory-utilization budget."""
    return round(max(utilization, min(utilization + POOL_SLACK, MAX_POOL_FRACTION)), 4)


class CacheDoesNotFit(ValueError):
    """The memory budget cannot hold one request of max_model_len; the message says what to
    change (one line: the CLI prints it as a start-up error)."""


_configured: str | None = None    # the fraction this process set
_note = ""                        # configure_allocator's line


def configure_allocator(utilization: float) -> str:
    """Give JAX's allocator `utilization` of the device (XLA_PYTHON_CLIENT_MEM_FRACTION)
    before its backend starts, so that the budget is usable (JAX's default, 75 %, is less
    than the default budget of 90 %); preallocation stays JAX's default (on), which reserves
    the budget at once, as vLLM's engine holds its share. Kept as they are: a user's own
    allocator variables, and a backend already initialised (the variables are read once).
    Returns what it did, in a line that the memory report shows (allocator_note)."""
    from jax._src import xla_bridge   # NOTE: the one way to ask without starting a backend

    global _configured, _note
    given = {name: os.environ[name] for name in ALLOCATOR_ENVS if name in os.environ}
    if _configured is not None and given == {MEM_FRACTION_ENV: _configured}:
        return _note                 # set here before (the CLI, then the engine)
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        line = "JAX allocator: not configured (JAX_PLATFORMS=cpu)"
    elif given:
        line = ("JAX allocator: kept as set by the environment ("
                + ", ".join(f"{k}={v}" for k, v in given.items()) + ")")
    elif xla_bridge.backends_are_initialized():
        line = (f"JAX allocator: the backend was already initialised, so "
                f"{MEM_FRACTION_ENV}={allocator_fraction()} stands (set it before anything uses "
                f"jax for the --gpu-memory-utilization {utilization:g} budget to be usable)")
    else:
        pool = pool_fraction(utilization)
        os.environ[MEM_FRACTION_ENV] = f"{pool:g}"
        line = (f"JAX allocator: {MEM_FRACTION_ENV}={pool:g} (--gpu-memory-utilization "
                f"{utilization:g} plus {POOL_SLACK:g} for the pool's fragmentation; set the "
                f"variable yourself to override)")
        _configured = f"{pool:g}"
    # NOTE: not logged here (the CPU has no such allocator): the GPU's memory report says it
    logger.debug("%s", line)
    _note = line
    return line


def allocator_note() -> str:
    """What configure_allocator did, or the allocator's variables if it never ran."""
    if _note:
        return _note
    given = {name: os.environ[name] for name in ALLOCATOR_ENVS if name in os.environ}
    return ("JAX allocator: not configured by the engine (" + (", ".join(
        f"{k}={v}" for k, v in given.items()) or f"JAX's default fraction {JAX_DEFAULT_MEM_FRACTION}")
        + ")")


def allocator_fraction() -> float:
    """The share of the device JAX's allocator was given (its variable, else its default)."""
    value = os.environ.get(MEM_FRACTION_ENV)
    try:
        return float(value) if value else JAX_DEFAULT_MEM_FRACTION
    except ValueError:
        return JAX_DEFAULT_MEM_FRACTION


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's memory, in bytes."""
    total: int     # the device's own memory
    limit: int     # what JAX's allocator may hand out (its pool)
    in_use: int    # live arrays now: the weights, once loaded


def measure(device) -> DeviceMemory | None:
    """`device`'s memory from JAX's allocator (None where it reports none: the CPU). The
    allocator's limit is total x its fraction (XLA's BFC allocator takes a share of the
    device's total memory), so the total is read back from the two."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    total = int(limit / allocator_fraction())
    return DeviceMemory(total=total, limit=limit, in_use=int(stats.get("bytes_in_use", 0)))


def program_peak_bytes(compiled) -> int | None:
    """Device bytes a compiled step program needs beyond its arguments (the weights and
    caches, already counted): its temporaries, its outputs not aliased to a donated argument,
    and its code. None if XLA gives no memory analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
               + stats.generated_code_size_in_bytes)


def headroom_bytes(params) -> int:
    """HEADROOM_BYTES plus the largest weight array on one device (the autotuner's copy of a
    GEMM operand: HEADROOM_BYTES' note)."""
    largest = max((max(s.data.nbytes for s in a.addressable_shards) for a in jax.tree.leaves(params)
                   if isinstance(a, jax.Array)), default=0)
    return HEADROOM_BYTES + largest


def cache_budget(utilization: float, memory: DeviceMemory, peak: int, headroom: int) -> int:
    """Bytes left for the caches on one device: the budget (utilization x total, no more than
    the allocator's pool) less what is in use, the step programs' peak and the headroom."""
    return min(int(utilization * memory.total), memory.limit) - memory.in_use - peak - headroom


def _gib(n: int | float) -> str:
    """GiB, or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """How the caches were sized (the start-up block; `bench` JSON's "memory")."""
    source: str                      # gpu_memory_utilization | kv_cache_memory_bytes | num_kv_blocks | cpu
    cache_bytes: int                 # per device, the proposer's caches and state slots included
    num_blocks: int
    block_size: int
    max_model_len: int
    device_total_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    weights_bytes: int | None = None     # in use on the device once the weights were loaded
    peak_bytes: int | None = None        # the largest step program's (program_peak_bytes)
    headroom_bytes: int | None = None
    allocator: str = ""                  # allocator_note()

    @property
    def on_device(self) -> bool:
        """Whether the device's memory was measured (a GPU), not a CPU's byte budget."""
        return self.device_total_bytes is not None

    @property
    def tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size     # block 0: the null block

    @property
    def max_concurrency(self) -> float:
        return self.tokens / self.max_model_len

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(tokens=self.tokens, max_concurrency=self.max_concurrency)
        return out

    def lines(self) -> list[str]:
        """The memory plan in a few lines (none on the CPU: its budget has its own line)."""
        if self.device_total_bytes is None:
            return []
        budget = self.gpu_memory_utilization * self.device_total_bytes
        out = [f"memory: device total {_gib(self.device_total_bytes)}, budget "
               f"{self.gpu_memory_utilization:g} x total = {_gib(budget)} (--gpu-memory-utilization)",
               f"memory: weights {_gib(self.weights_bytes)}, step programs' peak "
               + (_gib(self.peak_bytes) if self.peak_bytes is not None else "not measured")
               + f", headroom {_gib(self.headroom_bytes or 0)}, KV cache {_gib(self.cache_bytes)}"
               + (" (--kv-cache-memory-bytes)" if self.source == "kv_cache_memory_bytes" else "")]
        used = (self.weights_bytes or 0) + (self.peak_bytes or 0) + self.cache_bytes
        out.append(f"memory: weights + peak + KV cache = {_gib(used)} = "
                   f"{used / self.device_total_bytes:.3f} of the device")
        if self.allocator:
            out.append(f"memory: {self.allocator}")
        return out


def does_not_fit(*, max_model_len: int, need: int, left: int, memory: DeviceMemory,
                 utilization: float, peak: int | None, headroom: int, fits_tokens: int,
                 tensor_parallel_size: int) -> CacheDoesNotFit:
    """The one-line error of a budget that cannot hold one request of max_model_len."""
    measured = _gib(peak) if peak is not None else "not measured yet"
    change = (f"lower --max-model-len (at most {fits_tokens} tokens fit)" if fits_tokens > 0
              else "lower --max-model-len")
    return CacheDoesNotFit(
        f"not enough GPU memory for one request of max_model_len {max_model_len}: its KV cache "
        f"needs {_gib(need)} per device, but {_gib(max(left, 0))} is left of the budget "
        f"({utilization:g} x {_gib(memory.total)} total = {_gib(utilization * memory.total)}; "
        f"weights {_gib(memory.in_use)}, step programs' peak {measured}, headroom {_gib(headroom)}): "
        f"{change}, raise --gpu-memory-utilization (now {utilization:g}), or spread the weights "
        f"over more GPUs (--tensor-parallel-size, now {tensor_parallel_size})")
