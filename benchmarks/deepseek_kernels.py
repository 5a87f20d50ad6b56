"""DeepSeek V3 / V3.2 kernels on the GPU: the TopK kernel against lax.top_k and a sort, and
MLA paged attention (dense and sparse) against its jnp reference, at DeepSeek-V3's shapes.

    python benchmarks/deepseek_kernels.py [--only topk,mla] [--json out.json]
    python benchmarks/deepseek_kernels.py --smoke     # tiny shapes, any backend (a CPU interprets)

Timing, rows and HBM fractions as benchmarks/kernel_timing.py (whose helpers this uses; MLA decode
inputs rotate out of L2 the same way). TopK: S rows of L keys (the indexer's scores of S query
tokens), k = 2048, at L = 8K, 32K, 128K. MLA: 128 heads, a 512 + 64 latent in bf16, decode at
batch 1, 16, 64 over a 4K context (bytes: the latent rows read + q + o), and the sparse form
over 2,048 selected positions of a 32K context.
Measured on an H100 in session 33 (BENCHMARKS.md, "Kernels").

Legend: S rows / sequences, L keys per row / context, k chosen, N heads, W = 576 latent width.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing as kb  # noqa: E402  (benchmarks/kernel_timing.py: timing and rows)

from jaxserve.pallas_kernels import mla_attention as mk  # noqa: E402
from jaxserve.pallas_kernels import topk as tk  # noqa: E402


def bench_topk(rng, smoke: bool):
    k = 16 if smoke else 2048
    for s, l in ([(2, 300)] if smoke else [(16, 8192), (16, 32768), (16, 131072), (1, 131072)]):
        x = jnp.asarray(rng.standard_normal((s, l)), jnp.float32)
        want = tk.ref_topk(x, k)
        case = f"S={s} L={l} k={k}"
        got = jax.jit(functools.partial(tk.topk, k=k, impl="pallas"))
        vals = got(x)[0]
        err = float(np.abs(np.sort(np.asarray(vals), 1) - np.sort(np.asarray(want[0]), 1)).max())
        kb.record("ds-topk", case, "pallas", kb.gpu_time_ms(got, x), bytes_=x.nbytes, err=err)
        kb.record("ds-topk", case, "lax.top_k", kb.gpu_time_ms(jax.jit(lambda a: jax.lax.top_k(a, k)), x),
                  bytes_=x.nbytes)
        sort = jax.jit(lambda a: jax.lax.sort((-a, jnp.broadcast_to(jnp.arange(l), a.shape)), num_keys=1))
        kb.record("ds-topk", case, "sort", kb.gpu_time_ms(sort, x), bytes_=x.nbytes)


def _mla_case(rng, s, ctx, n, c, r, p, k, dtype):
    nb = s * (-(-ctx // p)) + 1
    bt = (1 + np.arange(s * (-(-ctx // p)))).reshape(s, -1).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((s, n, c + r)), dtype)
    lat = jnp.asarray(rng.standard_normal((nb, p, c + r)), dtype)
    pos = jnp.full((s,), ctx - 1, jnp.int32)
    sel = None
    if k:
        sel = jnp.asarray(np.stack([rng.permutation(ctx)[:k] for _ in range(s)]).astype(np.int32))
    return q, lat, jnp.asarray(bt), jnp.arange(s, dtype=jnp.int32), pos, sel


def bench_mla(rng, smoke: bool):
    n, c, r, p = (4, 32, 16, 8) if smoke else (128, 512, 64, 64)
    cases = [(1, 40, 0), (2, 40, 8)] if smoke else [(1, 4096, 0), (16, 4096, 0), (64, 4096, 0),
                                                    (1, 32768, 2048), (16, 32768, 2048)]
    for s, ctx, k in cases:
        q, lat, bt, seq, pos, sel = _mla_case(rng, s, ctx, n, c, r, p, k, jnp.bfloat16)
        keys = k or ctx
        bytes_ = s * keys * (c + r) * 2 + q.nbytes + s * n * c * 2
        kw = dict(sm_scale=0.135, value_dim=c)
        ref = mk.ref_mla_attention(q, lat, bt, seq, pos, selected_Tk=sel, **kw)
        case = f"S={s} ctx={ctx}" + (f" k={k}" if k else "")
        for impl in ("pallas", "xla"):
            fn = jax.jit(functools.partial(mk.mla_attention, impl=impl, **kw))
            args = (q, lat, bt, seq, pos) + ((sel,) if k else ())
            out = kb.try_run(f"mla {impl}", lambda: fn(*args))
            if out is None:
                continue
            kb.record("ds-mla", case, impl, kb.time_ms(fn, *args, bytes_=bytes_), bytes_=bytes_,
                      err=kb.rel_err(out, ref))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="topk,mla", help="comma list of: topk, mla")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script runs)")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    args = ap.parse_args()
    print(f"# jax {jax.__version__}, devices {jax.devices()}", flush=True)
    rng = np.random.default_rng(0)
    benches = dict(topk=lambda: bench_topk(rng, args.smoke), mla=lambda: bench_mla(rng, args.smoke))
    for name in args.only.split(","):
        kb.try_run(name, benches[name])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(kb.ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
