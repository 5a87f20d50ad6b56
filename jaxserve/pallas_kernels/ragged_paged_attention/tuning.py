"""Ragged paged attention's tuning data: what the tiling rules (tiling.py) need to know of each
device, keyed by device kind, and `Tiling`, the one frozen value through which a caller sets
any part of a tiling by hand and through which the wrapper hands the chosen tiling to the
Triton kernel.

The rules themselves are the same code for every device (they were measured on an H200, with
its 132 SMs); a device enters them only through its `DeviceTuning` entry here. Fallback rule:
a device kind not in TUNING (another GPU; "cpu", where the interpreted kernel traces the
tilings the H200 runs) takes H200's occupancy numbers, with the SM count its device reports
(dispatch.num_sms)."""

from __future__ import annotations

import dataclasses

from jaxserve.pallas_kernels.dispatch import device_kind, num_sms


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
    # SMs run pipelined (tiling.pipelined_decode).
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

# By device kind (dispatch.device_kind). An H100 (SXM) is the same SM design with 132 SMs, so
# the H200's occupancy numbers hold for it (its timings were not taken).
TUNING = {"H200": H200, "H100": H200}


def tuning() -> DeviceTuning:
    """The first device's entry (the fallback rule above), with the SM count it reports."""
    entry = TUNING.get(device_kind(), H200)
    return dataclasses.replace(entry, num_sms=num_sms())


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A Triton-kernel tiling; None fields are chosen by the rules (tiling.choose_tiling). A
    caller that sets any field but mask_all_steps, heavy_first and heads_inner turns the decode
    rules off (the rest is then the plain default)."""
    block_q: int | None = None          # tokens per query tile
    block_k: int | None = None          # keys per step
    num_splits: int | None = None       # key-range splits (with fill_splits: the most an item takes)
    num_warps: int | None = None
    num_stages: int | None = None
    # one key loop that masks every step, instead of three (window edge, unmasked middle,
    # causal edge; same result)
    mask_all_steps: bool | None = None
    heavy_first: bool | None = None     # launch the query tiles in reverse, longest causal range first
    prefetch_slots: bool | None = None  # look up the next key step's cache slots one step early
    heads_inner: bool | None = None     # grid (K, J, X): a query tile's kv heads side by side
    # split each busy (query tile, kv head) item by its key steps over fill_programs programs
    fill_splits: bool | None = None
    fill_programs: int | None = None

    def tuned(self) -> bool:
        """Whether the caller set a field that turns the decode rules off."""
        return (self.block_q, self.num_splits, self.block_k, self.num_warps, self.num_stages,
                self.prefetch_slots, self.fill_splits, self.fill_programs) != (None,) * 8


def gather_tiling(options: dict) -> dict:
    """Wrapper options given flat (a command line's key=value pairs, a test's keywords) with
    the Tiling fields among them gathered into one `tiling` value."""
    names = {field.name for field in dataclasses.fields(Tiling)}
    rest = {k: v for k, v in options.items() if k not in names}
    fields = {k: v for k, v in options.items() if k in names}
    return dict(rest, tiling=Tiling(**fields)) if fields else rest
