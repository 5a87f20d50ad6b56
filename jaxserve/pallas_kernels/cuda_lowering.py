"""Lower a function that calls Pallas (Triton) kernels for CUDA on a machine without a GPU.

The Triton lowering asks "which GPU?" to pick the compute capability; on a CPU-only machine
we answer through an abstract mesh whose abstract device is an H200 (sm_90). The result is
the StableHLO module with each kernel's Triton IR embedded in a custom call. Each Triton
module is also run through the MLIR verifier here, which the GPU runs first when it parses
it (an `scf.for` with mixed bound types once passed lowering and failed only there). Turning
the IR into PTX/cubin happens only inside XLA on a real GPU, so this proves the kernels
trace, lower and verify, not that Triton's backend compiles them.
"""

from __future__ import annotations

import contextlib

import jax
from jax._src.mesh import AbstractDevice  # NOTE: no public alias for it in jax 0.11.2

from jaxserve.pallas_kernels.dispatch import DEFAULT_NUM_SMS

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def export_for_cuda(fn, *args, device_kind: str = "NVIDIA H200", num_cores: int = DEFAULT_NUM_SMS,
                    triton_ir: list[str] | None = None):
    """jax.export the jitted `fn` at `args` (ShapeDtypeStructs) for platform "cuda"; each
    Triton module's IR text is appended to `triton_ir` if given (benchmarks/triton_ir.py)."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh), _verifying_triton_modules(triton_ir):
        return jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
        )(*args)


def triton_kernel_names(exported) -> list[str]:
    """Names of the Triton kernels embedded in an exported module (one per pallas_call)."""
    import re
    return re.findall(r'name = "([^"]+)", num_stages', exported.mlir_module())


@contextlib.contextmanager
def _verifying_triton_modules(texts: list[str] | None = None):
    """Verify every Triton module the Pallas lowering builds (as the GPU will, before PTX),
    keeping its IR text in `texts` if given."""
    # NOTE: private jax API (jax 0.11.2); the public lowering does not verify these modules.
    from jax._src.pallas.triton import lowering

    original = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = original(*args, **kwargs)
        if not result.module.operation.verify():
            raise ValueError("the Triton module failed MLIR verification")
        if texts is not None:
            texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original
