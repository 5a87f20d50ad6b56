"""Choosing a kernel implementation: the `impl=` argument every public kernel wrapper takes."""

from __future__ import annotations

import jax


def resolve_impl(impl: str, allowed: tuple[str, ...] = ("pallas", "xla")) -> tuple[str, bool]:
    """(concrete impl, on_gpu). "auto" is "pallas" on a GPU and "xla" elsewhere."""
    if impl != "auto" and impl not in allowed:
        raise ValueError(f"impl must be 'auto' or one of {', '.join(map(repr, allowed))}; "
                         f"got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        impl = "pallas" if on_gpu else "xla"
    return impl, on_gpu
