"""The eleventh session's decode sweeps on the H200 (runs 1-4 and 7 of README.md), kernel timings with
inputs out of L2 through benchmarks/kernels.py's helpers, two timings a variant:

    python3 benchmarks/results/h200-2026-11-30-session11/sweeps.py run1|run2|run3|run4|run7

"default" is the code of the moment (see README.md for the code each run had)."""
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels as kb  # noqa: E402
from jaxserve.pallas_kernels import ragged_paged_attention as rpa  # noqa: E402
from jaxserve.pallas_kernels.dispatch import NUM_SMS  # noqa: E402

PIPELINED = dict(prefetch_slots=True, num_stages=3)


def time_case(group, model, slots, qlens, ctx, variants, rng, *, cudnn=2, busy_label=False,
              cudnn_label="cudnn"):
    """Time each variant (ragged_paged_attention options) on a bucket of `slots` sequence slots
    (T = slots tokens) whose first len(qlens) sequences have `ctx` keys, then cuDNN `cudnn`
    times on the busy sequences alone. `variants` maps a name to options, or to a function of
    the unit count (busy sequences x kv heads) giving them."""
    kb.use_model(model)
    pad = slots - len(qlens)
    c = kb.paged_case(rng, list(qlens) + [0] * pad, [ctx] * len(qlens) + [0] * pad)
    if sum(qlens) != slots:   # padding tokens past the busy ones
        c["q"] = jax.random.normal(jax.random.key(2), (slots, kb.N, kb.E), jnp.bfloat16)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    busy, tokens = len(qlens), sum(qlens)
    case = f"{model} S={slots} {busy} busy L={ctx}" if busy_label else \
        f"{model} S={slots} L={ctx}"
    if tokens > busy:
        case += f" +{tokens - busy + 1}-token chunk"
    byts = 2 * busy * ctx * kb.KH * kb.E * 2 + 2 * tokens * kb.N * kb.E * 2
    scale = kb.E ** -0.5
    ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=scale))(*args)
    for name, opts in variants.items():
        opts = opts(busy * kb.KH) if callable(opts) else opts
        f = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale, impl="triton",
                                      **opts))

        def go(f=f, name=name):
            out = f(*args)
            for _ in range(2):
                kb.record(group, case, name, kb.time_ms(f, *args, bytes_=byts), bytes_=byts,
                          err=kb.rel_err(out[:tokens], ref[:tokens]))
        kb.try_run(name, go)
    if cudnn and tokens == busy:
        k_d, v_d = kb.dense_kv(dict(c, bt=c["bt"][:busy]))
        q4 = c["q"][:busy].reshape(busy, 1, kb.N, kb.E)
        for _ in range(cudnn):
            kb.record_cudnn(group, case, cudnn_label, q4, k_d, v_d, ref[:busy], scale=scale,
                            cold_inputs=True, bytes_=byts)


def fill(units):
    """Splits that bring `units` programs up to about one an SM."""
    return max(1, NUM_SMS // units)


def run1(rng):
    """Pipelined tiling: stages, warps, one masked loop."""
    def piped(**kw):
        return lambda units: dict(block_k=128, num_splits=fill(units), **PIPELINED, **kw)
    variants = {"default": {}, "s3 w4": piped(num_warps=4), "s4 w4": piped(num_warps=4,
                num_stages=4), "s3 w8": piped(num_warps=8), "s4 w8": piped(num_warps=8,
                num_stages=4), "s3 w4 onemask": piped(num_warps=4, mask_all_steps=True),
                "s4 w4 onemask": piped(num_warps=4, num_stages=4, mask_all_steps=True)}
    for model, s, ctx in [("llama3-8b", 16, 1024), ("llama3-8b", 16, 1000),
                          ("llama3-8b", 15, 1024), ("llama3-8b", 16, 4096),
                          ("llama3-8b", 16, 8192), ("llama3-8b", 13, 1000),
                          ("llama3-8b", 4, 4096), ("llama3-8b", 1, 8192), ("llama3-8b", 8, 2048),
                          ("qwen3-30b-a3b", 32, 1024), ("qwen3-30b-a3b", 32, 1000),
                          ("qwen3-30b-a3b", 32, 8192)]:
        time_case("sw11", model, s, [1] * s, ctx, variants, rng)


def run2(rng):
    """One loop on the default tiling; small grids filled; 256-program grids pipelined."""
    def extra(units, ctx):
        if units < NUM_SMS:
            x = fill(units)
            bk = min(128, 1 << max(4, (ctx // x - 1).bit_length()))
            return f"fill x{x} bk{bk} pf s3 onemask", dict(
                num_splits=x, block_k=bk, mask_all_steps=True, **PIPELINED)
        return "x1 bk64 pf s3 onemask", dict(num_splits=1, block_k=64, mask_all_steps=True,
                                             **PIPELINED)
    cases = [("llama3-8b", s, c) for s, c in
             [(1, 1024), (1, 2048), (1, 8192), (1, 32768), (2, 4096), (4, 1024), (4, 4096),
              (8, 1024), (8, 2048), (12, 1024), (16, 1024), (32, 1024), (32, 8192), (64, 1024),
              (64, 2048), (128, 1024)]] + \
            [("qwen3-30b-a3b", s, c) for s, c in
             [(1, 1024), (1, 8192), (4, 4096), (8, 1024), (16, 1024), (32, 1024), (64, 1024),
              (128, 1024)]]
    for model, s, ctx in cases:
        name, opts = extra(s * kb.MODELS[model]["kh"], ctx)
        time_case("sw12", model, s, [1] * s, ctx, {"default": {}, "default onemask": dict(
            mask_all_steps=True), name: opts}, rng)


def run3(rng):
    """256-program buckets by busy slots: pipelined 64-key steps against the default."""
    variants = {"default": {}, "x1 bk64 pf s3": dict(num_splits=1, block_k=64, **PIPELINED)}
    for model, slots, busy, ctx in [("llama3-8b", 32, r, c) for r, c in
                                    [(32, 1024), (28, 1024), (24, 1024), (20, 1024), (32, 2048),
                                     (24, 2048), (32, 8192), (24, 8192)]] + \
            [("qwen3-30b-a3b", 64, r, c) for r, c in [(64, 1024), (48, 1024), (64, 4096),
                                                      (48, 4096)]]:
        time_case("sw13", model, slots, [1] * busy, ctx, variants, rng, cudnn=1,
                  busy_label=True, cudnn_label="cudnn (real)")


def run4(rng):
    """Sparsely busy 256-program buckets: the default against the previous 128-key 2-stage."""
    variants = {"default (new)": {}, "previous: x1 bk128 s2": dict(num_splits=1, block_k=128)}
    for model, slots, qlens, ctx in [("llama3-8b", 32, [1] * r, c) for r, c in
                                     [(17, 1024), (12, 1024), (6, 1024), (3, 1024), (17, 8192),
                                      (6, 8192)]] + \
            [("llama3-8b", 32, [1] * 24 + [6], 1024)] + \
            [("qwen3-30b-a3b", 64, [1] * r, 1024) for r in (33, 20, 8)]:
        time_case("sw14", model, slots, qlens, ctx, variants, rng, cudnn=0, busy_label=True)


def run7(rng):
    """The engine's decode buckets in run 5 (16 and 32 slots, contexts 1000-1032, 65 blocks a
    sequence, the busy variant's busy_seqs=13): this session's tiling against the previous one
    (three key loops; 32 slots unpipelined), alternated twice."""
    variants = {16: {"new": dict(busy_seqs=13), "old": dict(busy_seqs=13, mask_all_steps=False)},
                32: {"new": dict(busy_seqs=13), "old": dict(num_splits=1, block_k=128,
                                                            mask_all_steps=False)}}
    for slots in (16, 32):
        kb.use_model("llama3-8b")
        ctxs = [int(c) for c in rng.integers(1000, 1033, slots)]
        c = kb.paged_case(rng, [1] * slots, ctxs)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        byts = 2 * sum(ctxs) * kb.KH * kb.E * 2 + 2 * slots * kb.N * kb.E * 2
        scale = kb.E ** -0.5
        ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=scale))(*args)
        fns = {name: jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale,
                                               impl="pallas", **opts))
               for name, opts in variants[slots].items()}
        for _ in range(2):
            for name, f in fns.items():
                kb.record("engine-shape", f"S={slots} L=1000-1032", name,
                          kb.time_ms(f, *args, bytes_=byts), bytes_=byts,
                          err=kb.rel_err(f(*args), ref))


if __name__ == "__main__":
    run = {"run1": (run1, 0), "run2": (run2, 1), "run3": (run3, 2), "run4": (run4, 3),
           "run7": (run7, 7)}
    fn, seed = run[sys.argv[1]]
    fn(np.random.default_rng(seed))
