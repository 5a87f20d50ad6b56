"""Kernel benchmarks on the GPU: each Pallas kernel beside XLA, cuDNN and JAX's ops.gpu kernels.

    python benchmarks/kernels.py [--quick] [--only attention,rmsnorm,...] [--json out.json]

The groups live in kernels_attention.py, kernels_moe.py and kernels_layers.py, the timing and
rows in kernel_timing.py; this file is their command line.

Times are the median over many runs of the kernels' own GPU time (CUPTI, through
jax.experimental.mosaic.gpu.profiler.measure; wall clock around block_until_ready if CUPTI is
unavailable), after a warm-up. Decode attention is timed with its inputs out of L2 unless
`--warm`: the calls rotate through copies of K/V (and of the query when it is over 1 MB), at
least four times the L2 a round (64 copies at most: 2.2 times for Qwen3's lone 1K decode), as
in the engine, where a layer's K/V were last read a whole step ago; K/V of a few tens of MB (a
lone 8K decode: 34 MB; 16 x 1K: 67 MB) otherwise stay partly in the H200's 60 MB L2 between
runs, and the time measures the cache. Each line gives the time and the fraction of the
ceiling that bounds it: HBM bandwidth (4.24 TB/s, measured device copy on an H200) for
memory-bound kernels, the bf16 matmul rate (794 TFLOP/s measured) for compute-bound ones.
Shapes: `--model`'s attention heads (N, K, E), hidden size D (add+RMSNorm), RoPE theta and
vocabulary (top-k): Llama-3.1-8B (N=32, K=8, E=128, D=4096; the default) or Qwen3-30B-A3B
(N=32, K=4, E=128, D=2048); the MoE groups always use Qwen3-30B-A3B's experts (D=2048, F=768,
128 experts, top-8).

Legend: S sequences, T tokens, N query heads, K kv heads, E head dim, P block size, L context.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

import kernel_timing as kt
import kernels_attention as attention
import kernels_layers as layers
import kernels_moe as moe


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also sweep tuning options")
    ap.add_argument("--only", default="attention,rmsnorm,rope,topk,moe",
                    help="comma list of: attention, decode (the decode cases only: ours "
                         "and cuDNN), buckets (prefill-heavy engine steps), decode-buckets "
                         "(decode steps in partly filled buckets), rmsnorm, rope, "
                         "topk, moe, moe-fp8 (DeepSeek's experts kept in FP8 against bf16), moe-decode "
                         "(the fused MoE decode kernels against the grouped path), "
                         "router, linear, deltanet (Qwen3.5's linear-attention prefill)")
    ap.add_argument("--moe-auto-only", action="store_true",
                    help="MoE: no Mosaic tile shapes beside lax.ragged_dot, auto and pallas")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(kt.MODELS),
                    help="attention heads, hidden size, RoPE theta and vocabulary of this model")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    ap.add_argument("--warm", action="store_true",
                    help="time decode attention on one input set, partly in L2 between runs "
                         "(how sessions 1-9 timed it)")
    args = ap.parse_args()
    kt.COLD = not args.warm
    kt.use_model(args.model)
    print(f"# jax {jax.__version__}, devices {jax.devices()}; {args.model}: N={kt.N} K={kt.KH} E={kt.E} "
          f"D={kt.D_MODEL} V={kt.VOCAB}; decode inputs {'cold' if kt.COLD else 'warm'}", flush=True)
    rng = np.random.default_rng(0)
    groups = args.only.split(",")
    benches = dict(attention=lambda: attention.bench_attention(rng, args.quick, args.sweep),
                   decode=lambda: attention.bench_attention(rng, args.quick, args.sweep, decode_only=True),
                   buckets=lambda: attention.bench_prefill_buckets(rng),
                   **{"decode-buckets": lambda: attention.bench_decode_buckets(rng, args.sweep)},
                   rmsnorm=lambda: layers.bench_rmsnorm(rng, args.quick, args.sweep),
                   rope=lambda: layers.bench_rope(rng, args.quick),
                   router=lambda: moe.bench_router(rng, args.quick, args.sweep),
                   linear=lambda: layers.bench_linear(rng, args.quick, args.sweep),
                   deltanet=lambda: layers.bench_deltanet(rng, args.quick),
                   topk=lambda: layers.bench_topk(rng, args.quick, args.sweep),
                   moe=lambda: moe.bench_moe(rng, args.quick, args.moe_auto_only, args.sweep),
                   **{"moe-fp8": lambda: moe.bench_moe_fp8(rng, args.quick),
                      "moe-decode": lambda: moe.bench_moe_decode(rng, args.quick, args.sweep)})
    for name in groups:
        kt.try_run(name, benches[name])   # one failing group does not hide the others
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(kt.ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
