"""What every public kernel wrapper shares: choosing the implementation (the `impl=` argument),
the block spec of an operand every program sees whole, a kernel body called without some of
its optional refs, and the GPU the tiling rules were measured on."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

NUM_SMS = 132   # SMs of an H200: the grid sizes and split rules of the kernels aim at it


def resolve_impl(impl: str, allowed: tuple[str, ...] = ("pallas", "xla")) -> tuple[str, bool]:
    """(concrete impl, on_gpu). "auto" is "pallas" on a GPU and "xla" elsewhere."""
    if impl != "auto" and impl not in allowed:
        raise ValueError(f"impl must be 'auto' or one of {', '.join(map(repr, allowed))}; "
                         f"got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu else "xla"
    return impl, on_gpu


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
