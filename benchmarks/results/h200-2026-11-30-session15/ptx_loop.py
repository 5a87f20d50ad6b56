"""Count the instructions of the decode key loop in Triton's PTX, read on CPU (session 15): the
committed kernel, session 15's probe kernel and sweeps.py's rpa_fmascale, at 16 x 1K decodes
with Llama-3.1-8B's heads (128-key steps, 5 stages, 4 warps: the committed tiling).

    python3 benchmarks/results/h200-2026-11-30-session15/ptx_loop.py dump /tmp/ir15
    /path/to/triton-env/python benchmarks/results/h200-2026-11-30-session15/ptx_loop.py count /tmp/ir15

`dump` runs in the project's environment (jax lowers each kernel for CUDA with an abstract
H200, as benchmarks/triton_ir.py does); `count` needs the `triton` wheel (3.9 here) and
compiles each .ttir with benchmarks/triton_ir.py's `compile_ir`. The counts are a reading of
Triton 3.9's output, not of the GPU's binary (XLA bundles its own Triton). Output of this
session: ptx-loop.txt beside this file."""
import functools, os, re, sys

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
KERNELS = ("committed", "probe", "fmascale")


def dump(outdir):
    import runpy
    import jax, jax.numpy as jnp
    from jaxserve.pallas_kernels import ragged_paged_attention as rpa
    from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda
    sweeps = runpy.run_path(os.path.join(_here, "sweeps.py"), run_name="ptx_loop")
    probe = sweeps["probe"]
    sds = jax.ShapeDtypeStruct
    s, ctx, p, kh, n, e = 16, 1024, 16, 8, 32, 128
    cache = sds((s * ctx // p + 1, p, kh, e), jnp.bfloat16)
    q, lens, bt = sds((s, n, e), jnp.bfloat16), sds((s,), jnp.int32), sds((s, ctx // p), jnp.int32)
    qsl = sds((s + 1,), jnp.int32)
    calls = {
        "committed": (functools.partial(rpa.ragged_paged_attention, sm_scale=e ** -0.5,
                                        impl="triton", interpret=False, busy_seqs=s),
                      (q, cache, cache, qsl, lens, bt)),
        "probe": (functools.partial(probe.probe, mode="attn", block_k=128, num_stages=5),
                  (q, cache, cache, lens, bt)),
        "fmascale": (functools.partial(sweeps["rpa_fmascale"].ragged_paged_attention,
                                       sm_scale=e ** -0.5, impl="triton", interpret=False,
                                       busy_seqs=s),
                     (q, cache, cache, qsl, lens, bt)),
    }
    os.makedirs(outdir, exist_ok=True)
    for name, (fn, args) in calls.items():
        modules = []
        export_for_cuda(fn, *args, triton_ir=modules)
        with open(os.path.join(outdir, f"{name}.ttir"), "w") as fh:
            fh.write(modules[0])
        print(os.path.join(outdir, f"{name}.ttir"))


def count(outdir):
    sys.path.insert(0, os.path.join(_root, "benchmarks"))
    import triton_ir
    for name in KERNELS:
        triton_ir.compile_ir(os.path.join(outdir, f"{name}.ttir"), 4, 5)
        ptx = open(os.path.join(outdir, f"{name}.w4s5.ptx")).read().splitlines()
        head = next(i for i, line in enumerate(ptx) if "Inner Loop Header" in line)
        end = next(i for i in range(head, len(ptx)) if "bra.uni" in ptx[i])
        ops = [line.split()[0] for line in ptx[head + 1:end]
               if line.strip() and not re.match(r"\s*(//|\.loc|\$L)", line)]
        ops = [o if not o.startswith("@") else "predicated" for o in ops]
        tally = {k: sum(o.startswith(k) for o in ops)
                 for k in ("mma", "ldmatrix", "cp.async.cg", "setp", "selp", "mul.f32",
                           "fma.rn.f32", "sub.f32", "bar.sync", "ex2")}
        print(f"{name}: key loop {len(ops)} instructions a thread and step; "
              + ", ".join(f"{k} {v}" for k, v in tally.items()), flush=True)


if __name__ == "__main__":
    {"dump": dump, "count": count}[sys.argv[1]](sys.argv[2])
