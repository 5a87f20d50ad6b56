"""Lower a function that calls Pallas (Triton) kernels for CUDA on a machine without a GPU.

The Triton lowering asks "which GPU?" to pick the compute capability; on a CPU-only machine
we answer through an abstract mesh whose abstract device is an H200 (sm_90). The result is
the StableHLO module with each kernel's Triton IR embedded in a custom call; turning that IR
into PTX/cubin happens only inside XLA on a real GPU, so this proves the kernels trace and
lower, not that Triton's backend compiles them.
"""

from __future__ import annotations

import jax
from jax._src.mesh import AbstractDevice  # NOTE: no public alias for it in jax 0.11.2

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def export_for_cuda(fn, *args, device_kind: str = "NVIDIA H200", num_cores: int = 132):
    """jax.export the jitted `fn` at `args` (ShapeDtypeStructs) for platform "cuda"."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)


def triton_kernel_names(exported) -> list[str]:
    """Names of the Triton kernels embedded in an exported module (one per pallas_call)."""
    import re
    return re.findall(r'name = "([^"]+)", num_stages', exported.mlir_module())
