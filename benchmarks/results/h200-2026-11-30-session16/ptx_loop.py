"""Session 15's ptx_loop.py (the decode key loop's instructions in Triton 3.9's PTX, 16 x 1K
decodes at Llama-3.1-8B's heads) on this session's variants:

    python3 benchmarks/results/h200-2026-11-30-session16/ptx_loop.py dump /tmp/ir16
    /path/to/triton-env/python benchmarks/results/h200-2026-11-30-session16/ptx_loop.py count /tmp/ir16

twoloops has two key loops: the count is of the first in the PTX."""
import functools, importlib.util, os, runpy, sys
_here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "ptx_loop15", os.path.join(os.path.dirname(_here), "h200-2026-11-30-session15", "ptx_loop.py"))
ptx15 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptx15)
VARIANTS = ("committed", "fmascale", "kbias", "kbias_fma", "twoloops", "twoloops_fma")


def dump(outdir):
    import jax, jax.numpy as jnp
    from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda
    sweeps = runpy.run_path(os.path.join(_here, "sweeps.py"), run_name="ptx_loop")
    sds = jax.ShapeDtypeStruct
    s, ctx, p, kh, n, e = 16, 1024, 16, 8, 32, 128
    cache = sds((s * ctx // p + 1, p, kh, e), jnp.bfloat16)
    args = (sds((s, n, e), jnp.bfloat16), cache, cache, sds((s + 1,), jnp.int32),
            sds((s,), jnp.int32), sds((s, ctx // p), jnp.int32))
    os.makedirs(outdir, exist_ok=True)
    for name in VARIANTS:
        mod = sweeps["rpa"] if name == "committed" else sweeps[f"rpa_{name}"]
        modules = []
        export_for_cuda(functools.partial(mod.ragged_paged_attention, sm_scale=e ** -0.5,
                                          impl="triton", interpret=False, busy_seqs=s),
                        *args, triton_ir=modules)
        with open(os.path.join(outdir, f"{name}.ttir"), "w") as fh:
            fh.write(modules[0])
        print(os.path.join(outdir, f"{name}.ttir"))


if __name__ == "__main__":
    if sys.argv[1] == "count":
        ptx15.KERNELS = VARIANTS
        ptx15.count(sys.argv[2])
    else:
        dump(sys.argv[2])
