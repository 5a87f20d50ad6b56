"""What every public kernel wrapper shares: choosing the implementation (the `impl=` argument),
the block spec of an operand every program sees whole, a kernel body called without some of
its optional refs, and the tuning table: the measured numbers of each GPU that the kernels'
tiling rules read."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class DeviceTuning:
    """What the tiling rules need to know of one GPU model (data: the rules are the same code
    for every GPU; a new GPU gets an entry of its own measurements)."""
    # SMs: grid sizes and split counts aim at whole waves of them.
    num_sms: int
    # Programs of a decode tile (16 rows, 4 warps, 2 stages, E = 128 in 2-byte K/V) that one SM
    # holds at once, by keys per step.
    decode_programs_per_sm: dict[int, int]
    # Programs an SM holds of that tile at 64 keys a step with slots looked up in their step
    # and 3 stages (K/V and the block-table entries copied asynchronously, one buffer each).
    async_64_programs_per_sm: int
    # Decode grids of up to two programs per SM with more busy programs than this share of the
    # SMs run pipelined (ragged_paged_attention.pipelined_decode).
    pipelined_min_fill: float


# The H200, where every rule was measured. decode_programs_per_sm: Nsight Compute's occupancy
# limits, by registers and by shared memory alike (162-165 registers a thread and 72 KiB at 128
# keys, 96 and 38 KiB at 64), read from the kernels of jax 0.11.2's Triton; a compiler that
# used ~4 more registers at 128 keys would make it 2. async_64: Triton 3.9's reading
# (benchmarks/triton_ir.py) gives 124 registers a thread and 38 KiB; timings at 768-2,048
# programs fit 4 an SM, not 3. pipelined_min_fill 0.78 (103 of 132): timed with three key
# loops, from 104 busy programs faster in every case, at 96 mixed, below that slower; with
# today's one loop 96 gained too, so it may be conservative.
H200 = DeviceTuning(num_sms=132, decode_programs_per_sm={128: 3, 64: 5},
                    async_64_programs_per_sm=4, pipelined_min_fill=0.78)

# By `device_kind` as jax reports it. An H100 (SXM) is the same SM design with 132 SMs, so the
# H200's occupancy numbers hold for it (its timings were not taken).
TUNING = {"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H200}


@functools.cache
def tuning() -> DeviceTuning:
    """The tuning of the first device: its table entry (H200's numbers for a GPU not in the
    table), with the SM count read from the device; H200's without a GPU (interpret mode,
    lowering for export), so CPU tests trace the tilings the H200 runs."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H200
    entry = TUNING.get(device.device_kind, H200)
    sms = int(getattr(device, "core_count", 0) or 0)
    return dataclasses.replace(entry, num_sms=sms) if 0 < sms <= 1024 else entry


def num_sms() -> int:
    return tuning().num_sms


def resolve_impl(impl: str, allowed: tuple[str, ...] = ("pallas", "xla")) -> tuple[str, bool]:
    """(concrete impl, on_gpu). "auto" is "pallas" on a GPU and "xla" elsewhere."""
    if impl != "auto" and impl not in allowed:
        raise ValueError(f"impl must be 'auto' or one of {', '.join(map(repr, allowed))}; "
                         f"got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu else "xla"
    return impl, on_gpu


def checked_block(requested: int, name: str, dim: int | None = None, dim_name: str = "",
                  least: int = 16) -> int:
    """A caller's block size: a power of two >= `least` (16: Triton's dot needs 16; a block
    no dot reads may be smaller), and dividing `dim` when given (a kernel that masks no load)."""
    if requested < least or requested & (requested - 1) or (dim is not None and dim % requested):
        divides = f" dividing {dim_name}={dim}" if dim is not None else ""
        raise ValueError(f"{name} must be a power of two >= {least}{divides}; got {requested}")
    return requested


def whole(*shape: int) -> pl.BlockSpec:
    """BlockSpec of an array every program of the grid (of any rank) sees whole: the kernels
    index it themselves."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def absent_refs(kernel, *positions: int):
    """`kernel` called with None at `positions` (ascending indices into its full list of refs):
    the optional inputs or outputs that this pallas_call / plgpu.kernel does not pass."""
    def call(*refs):
        refs = list(refs)
        for i in positions:
            refs.insert(i, None)
        return kernel(*refs)
    return call
