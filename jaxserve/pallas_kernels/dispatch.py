"""What every public kernel wrapper shares: choosing the implementation (the `impl=` argument),
the block spec of an operand every program sees whole, a kernel body called without some of
its optional refs, and the device (its kind, which keys the kernels' tuning tables, and its
SM count, which their tiling rules aim grids at)."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


# SMs of an H100 (SXM) and an H200, and what the tiling rules assume without a GPU
# (interpret mode, lowering for export), so that CPU tests trace the tilings an H200 runs.
DEFAULT_NUM_SMS = 132


@functools.cache
def device_info() -> tuple[str, int]:
    """(kind, SMs) of the first device: kind "cpu" without a GPU, else the GPU's model ("H100",
    "H200": `device_kind` as jax reports it, less "NVIDIA " and anything after the model's
    name); SMs as the device reports them (DEFAULT_NUM_SMS where it does not, or without a
    GPU)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return "cpu", DEFAULT_NUM_SMS
    kind = device.device_kind.removeprefix("NVIDIA ").split(" ")[0]
    sms = int(getattr(device, "core_count", 0) or 0)
    return kind, sms if 0 < sms <= 1024 else DEFAULT_NUM_SMS


def device_kind() -> str:
    """The key of the kernels' tuning tables: "cpu", "H100", "H200", ... (device_info)."""
    return device_info()[0]


def num_sms() -> int:
    return device_info()[1]


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


def per_token_call(kernel, t: int, ins: list, in_specs: list, outs: list, out_specs: list,
                   aliases: dict, *, num_warps: int, interpret: bool, name: str):
    """`kernel` as a Triton pallas_call with one program per token (grid (t,)), single-stage
    (the MLA cache-write kernels: each program's loads are one token's rows, nothing to
    pipeline); `aliases` update caches in place where the caller donates them."""
    return pl.pallas_call(
        kernel, grid=(t,), in_specs=in_specs, out_specs=out_specs, out_shape=outs,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name=name)(*ins)
