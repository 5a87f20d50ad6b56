"""Read what Triton makes of our attention kernel without a GPU (how session 10 found that decode
K/V were single-buffered).

    # 1. in the project's environment: the Triton IR of the decode kernel at S x L decodes
    python benchmarks/triton_ir.py dump /tmp/ir 16 1024 [block_k=128 prefetch_slots=True ...]
    # 2. in an environment with the `triton` wheel (e.g. 3.9; XLA bundles its own Triton, so
    #    treat the result as a reading, not the GPU's binary)
    python benchmarks/triton_ir.py compile /tmp/ir/k0.ttir --num-warps 4 --num-stages 3

`dump` lowers ragged_paged_attention for CUDA (jax.export with an abstract H200, as the CUDA
lowering test does) and writes each Pallas kernel's Triton IR (k0.ttir: attention; k1.ttir: the
split merge, if any). `compile` runs Triton's pipeline for sm_90 and prints the shared memory,
the shared buffers it allocates (e.g. `2x64x128xbf16`: K double-buffered), its async copies and,
through Triton's bundled ptxas, the registers a thread.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    return int(text) if text.lstrip("-").isdigit() else text


def dump(outdir: str, seqs: int, context: int, options: list[str], *, heads: int = 32,
         kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> None:
    import jax
    import jax.numpy as jnp
    from jaxserve.pallas_kernels.ragged_paged_attention import wrapper
    from jaxserve.pallas_kernels.ragged_paged_attention.tuning import gather_tiling
    from jaxserve.pallas_kernels.cuda_lowering import export_for_cuda

    kw = dict(o.split("=", 1) for o in options)
    kw = {k: _value(v) for k, v in kw.items()}
    blocks = context // block_size
    modules: list[str] = []
    sds = jax.ShapeDtypeStruct
    cache = sds((seqs * blocks + 1, block_size, kv_heads, head_dim), jnp.bfloat16)
    args = (sds((seqs, heads, head_dim), jnp.bfloat16), cache, cache,
            sds((seqs + 1,), jnp.int32), sds((seqs,), jnp.int32), sds((seqs, blocks), jnp.int32))
    export_for_cuda(functools.partial(wrapper.ragged_paged_attention, sm_scale=head_dim ** -0.5,
                                      impl="triton", interpret=False, **gather_tiling(kw)), *args,
                    triton_ir=modules)
    os.makedirs(outdir, exist_ok=True)
    for i, text in enumerate(modules):
        path = os.path.join(outdir, f"k{i}.ttir")
        with open(path, "w") as fh:
            fh.write(text)
        print(path)


def compile_ir(path: str, num_warps: int, num_stages: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    stem = os.path.splitext(path)[0] + f".w{num_warps}s{num_stages}"
    for ext, text in ((".ttgir", ttgir), (".ptx", ptx)):
        with open(stem + ext, "w") as fh:
            fh.write(text)
    buffers = re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<([^,]+),", ttgir)
    print(f"shared memory {kernel.metadata.shared} B; shared buffers {buffers}")
    print(f"async copies {ttgir.count('async_copy_global_to_local')} (cp.async in PTX: "
          f"{ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}); mma.sync {ptx.count('mma.sync')}")
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for ptxas in ("ptxas-blackwell", "ptxas"):   # the newer one reads Triton 3.9's PTX version
        exe = os.path.join(bindir, ptxas)
        if not os.path.exists(exe):
            continue
        run = subprocess.run([exe, "-v", "--gpu-name", "sm_90a", stem + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True)
        found = re.search(r"Used (\d+) registers", run.stderr)
        if found:
            print(f"registers a thread {found.group(1)} ({ptxas})")
            break
    print(f"wrote {stem}.ttgir and {stem}.ptx")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the decode kernel's Triton IR (project environment)")
    d.add_argument("outdir")
    d.add_argument("seqs", type=int)
    d.add_argument("context", type=int)
    d.add_argument("options", nargs="*", help="ragged_paged_attention options, as name=value")
    d.add_argument("--kv-heads", type=int, default=8)
    c = sub.add_parser("compile", help="run Triton on a .ttir (environment with `triton`)")
    c.add_argument("path")
    c.add_argument("--num-warps", type=int, default=4)
    c.add_argument("--num-stages", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        dump(args.outdir, args.seqs, args.context, args.options, kv_heads=args.kv_heads)
    else:
        compile_ir(args.path, args.num_warps, args.num_stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
