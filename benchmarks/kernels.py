"""Kernel benchmarks on the GPU: each Pallas kernel beside XLA, cuDNN and JAX's ops.gpu kernels.

    python benchmarks/kernels.py [--quick] [--only attention,rmsnorm,...] [--json out.json]

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
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.roofline import device_hbm_bytes_per_s

HBM_BYTES_PER_S = device_hbm_bytes_per_s()   # measured copy rate: H200 4.24e12, H100 3.0e12
MATMUL_FLOP_PER_S = 794e12
L2_BYTES = 60e6             # the H200's L2, as PyTorch reads the device
COLD_ROUND_BYTES = 4 * L2_BYTES
MAX_INPUT_SETS = 64
ROWS: list[dict] = []
COLD = True                 # decode timings with inputs out of L2 (--warm turns it off)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def gpu_time_ms(fn, *args, iters: int = 30) -> float:
    """Median GPU time of fn(*args) in ms (kernels only, via CUPTI), after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, times = profiler.measure(fn, iterations=iters)(*args)
        if times:
            return float(statistics.median(times))
    except Exception as err:  # noqa: BLE001 - fall back to wall clock, say so once
        print(f"# CUPTI timing unavailable ({type(err).__name__}: {err}); using wall clock",
              file=sys.stderr)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(samples))


def input_sets(args, bytes_: float) -> list[tuple]:
    """`args` and copies of its large arrays (over 1 MB; small ones shared), enough copies that
    a round through them reads COLD_ROUND_BYTES: each call's K/V were then evicted from L2 by
    the calls between (at most MAX_INPUT_SETS)."""
    n = min(MAX_INPUT_SETS, max(1, math.ceil(COLD_ROUND_BYTES / max(bytes_, 1.0))))
    big = [isinstance(a, jax.Array) and a.nbytes > 1e6 for a in args]
    return [tuple(args)] + [tuple(jnp.copy(a) if b else a for a, b in zip(args, big))
                            for _ in range(n - 1)]


def time_ms(fn, *args, bytes_: float, iters: int = 30) -> float:
    """gpu_time_ms of fn(*args); when COLD, per call over a round of calls that rotate through
    input_sets (one jitted program calling fn on each set in turn, its time divided by the
    number of sets), so that fn finds its inputs out of L2."""
    if not COLD:
        return gpu_time_ms(fn, *args, iters=iters)
    sets = input_sets(args, bytes_)
    if len(sets) == 1:
        return gpu_time_ms(fn, *args, iters=iters)
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    return gpu_time_ms(many, sets, iters=iters) / len(sets)


def record(group: str, case: str, impl: str, ms: float, *, bytes_: float = 0.0,
           flops: float = 0.0, err: float | None = None, note: str = ""):
    mem_frac = bytes_ / (ms * 1e-3) / HBM_BYTES_PER_S if bytes_ else 0.0
    mm_frac = flops / (ms * 1e-3) / MATMUL_FLOP_PER_S if flops else 0.0
    row = dict(group=group, case=case, impl=impl, ms=ms, hbm_frac=mem_frac, mxu_frac=mm_frac,
               err=err, note=note)
    ROWS.append(row)
    frac = (f"{100 * mem_frac:5.1f}% HBM" if bytes_ else "") + \
           (f" {100 * mm_frac:5.1f}% MMA" if flops else "")
    e = "" if err is None else f" err={err:.1e}"
    print(f"{group:10s} {case:34s} {impl:22s} {ms * 1e3:10.1f} us  {frac}{e} {note}", flush=True)


def rel_err(x, ref) -> float:
    x = np.asarray(x, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.isfinite(x).all():
        return float("nan")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def try_run(label, fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        msg = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        print(f"# {label}: failed: {type(err).__name__}: {msg}", flush=True)
        return None


def record_cudnn(group: str, case: str, label: str, q4, k_d, v_d, ref, *, scale: float,
                 is_causal: bool = False, cold_inputs: bool = False, kv_lens=None, **metrics):
    """cuDNN's attention (jax.nn.dot_product_attention) on dense q [S, L, N, E] and K/V
    [S, L, K, E] (each sequence's first kv_lens[s] keys if given), timed and checked against
    `ref` beside ours (with time_ms, inputs out of L2, if `cold_inputs`); reported, not fatal,
    if it cannot run."""
    fc = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
        q4, k_d, v_d, scale=scale, is_causal=is_causal, implementation="cudnn",
        key_value_seq_lengths=kv_lens))
    out = try_run(f"cudnn ({case})", lambda: fc(q4, k_d, v_d))
    if out is not None:
        byts = metrics.get("bytes_") or sum(a.nbytes for a in (q4, k_d, v_d))
        ms = (time_ms(fc, q4, k_d, v_d, bytes_=byts) if cold_inputs else
              gpu_time_ms(fc, q4, k_d, v_d))
        record(group, case, label, ms, err=rel_err(out.reshape(ref.shape), ref), **metrics)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

# per model: query heads, kv heads, head dim, hidden size, RoPE theta, vocabulary, RMSNorm eps
MODELS = {
    "llama3-8b": dict(n=32, kh=8, e=128, d=4096, theta=500000.0, vocab=128256, eps=1e-5),
    "qwen3-30b-a3b": dict(n=32, kh=4, e=128, d=2048, theta=1000000.0, vocab=151936, eps=1e-6),
}
N, KH, E = 32, 8, 128          # set from --model in main()
D_MODEL, ROPE_THETA, VOCAB, RMS_EPS = 4096, 500000.0, 128256, 1e-5


def use_model(name: str) -> None:
    """Point the shape globals above at one model of MODELS."""
    global N, KH, E, D_MODEL, ROPE_THETA, VOCAB, RMS_EPS
    m = MODELS[name]
    N, KH, E = m["n"], m["kh"], m["e"]
    D_MODEL, ROPE_THETA, VOCAB, RMS_EPS = m["d"], m["theta"], m["vocab"], m["eps"]


def paged_case(rng, qlens, ctxs, p=16, dtype=jnp.bfloat16):
    """Random q and a paged cache whose blocks are scattered (a shuffled block pool)."""
    s = len(qlens)
    b = max(-(-c // p) for c in ctxs)
    nb = sum(-(-c // p) for c in ctxs) + 1
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    t = sum(qlens)
    q = jax.random.normal(kq, (t, N, E), dtype)
    k_cache = jax.random.normal(kk, (nb, p, KH, E), dtype)
    v_cache = jax.random.normal(kv, (nb, p, KH, E), dtype)
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    bt = np.zeros((s, b), np.int32)
    i = 0
    for si, c in enumerate(ctxs):
        nblk = -(-c // p)
        bt[si, :nblk] = perm[i:i + nblk]
        i += nblk
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    return dict(q=q, k=k_cache, v=v_cache, qsl=jnp.asarray(qsl),
                seq_lens=jnp.asarray(np.asarray(ctxs, np.int32)), bt=jnp.asarray(bt))


def dense_kv(c):
    """The paged cache gathered into [S, L, K, E] (what cuDNN and the dense paths read)."""
    s, b = c["bt"].shape
    p = c["k"].shape[1]
    k = c["k"][c["bt"]].reshape(s, b * p, KH, E)
    v = c["v"][c["bt"]].reshape(s, b * p, KH, E)
    return k, v


def bench_attention(rng, quick: bool, sweep: bool, decode_only: bool = False):
    from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper
    from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling
    from jaxserve.pallas_kernels.dispatch import num_sms
    scale = E ** -0.5
    decode_cases = [(1, 1024), (1, 8192), (4, 4096), (16, 1024), (32, 1024), (32, 8192),
                    (64, 1024), (64, 2048), (128, 1024), (128, 8192)]
    if quick:
        decode_cases = [(1, 8192), (32, 1024), (128, 1024)]
    for s, ctx in decode_cases:
        c = paged_case(rng, [1] * s, [ctx] * s)
        case = f"decode S={s} L={ctx}"
        kv_bytes = 2 * s * ctx * KH * E * 2
        byts = kv_bytes + 2 * s * N * E * 2
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale, impl="pallas"))
        out = f(*args)
        record("attention", case, "pallas (default)", time_ms(f, *args, bytes_=byts),
               bytes_=byts, err=rel_err(out, ref))
        if sweep:   # Triton: key-range splits (merged by a second kernel) x keys per step,
            # then pipelined, split to about one program an SM: slots looked up one step early
            # with 3 stages (pipelined_decode's tiling until session 12), or in their step with
            # 5 (Triton then copies the block-table entries asynchronously: its tiling since)
            variants = [(f"x{xs} bk{bk}", dict(block_k=bk, num_splits=xs))
                        for xs in (1, 2, 4, 8, 16, 32, 64) for bk in (64, 128)
                        if ctx // xs >= bk and s * KH * xs <= 2048]
            fill = max(1, num_sms() // (s * KH))
            variants += [(f"x{fill} bk{bk} {label}", dict(block_k=bk, num_splits=fill, **kw))
                         for bk in (64, 128)
                         for label, kw in (("pf s3", dict(prefetch_slots=True, num_stages=3)),
                                           ("s5 async slots", dict(prefetch_slots=False,
                                                                   num_stages=5)))]
            for label, kw in variants:
                g = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale,
                                              impl="triton", tiling=Tiling(**kw)))
                ms = try_run("decode sweep", lambda: time_ms(g, *args, bytes_=byts, iters=10))
                if ms is not None:
                    record("attn-sweep", case, f"pallas {label}", ms, bytes_=byts)
        try_run("mosaic decode", lambda: bench_decode_mgpu(case, args, ref, byts, sweep))
        if not decode_only:
            fx = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))
            record("attention", case, "xla fallback",
                   time_ms(fx, *args, bytes_=byts, iters=5), bytes_=byts)
        k_d, v_d = dense_kv(c)
        q4 = c["q"].reshape(s, 1, N, E)
        record_cudnn("attention", case, "cudnn (dense kv)", q4, k_d, v_d, ref, scale=scale,
                     cold_inputs=True, bytes_=byts)
        if decode_only:
            continue
        fxd = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
            q4, k_d, v_d, scale=scale, implementation="xla"))
        record("attention", case, "xla dense", time_ms(fxd, q4, k_d, v_d, bytes_=byts),
               bytes_=byts)

        def jax_paged():
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from jax.experimental.pallas.ops.gpu import paged_attention as jpa
            kp = jnp.transpose(c["k"], (2, 0, 1, 3))
            vp = jnp.transpose(c["v"], (2, 0, 1, 3))
            pages = c["bt"].shape[1]
            splits = 16 if pages % 16 == 0 else 1
            fj = jax.jit(functools.partial(jpa.paged_attention, k_splits=splits,
                                           pages_per_compute_block=min(8, pages // splits)))
            qs = c["q"] * jnp.asarray(scale, c["q"].dtype)
            oj = fj(qs, kp, vp, c["bt"], c["seq_lens"])
            record("attention", case, "jax ops.gpu paged",
                   time_ms(fj, qs, kp, vp, c["bt"], c["seq_lens"], bytes_=byts),
                   bytes_=byts, err=rel_err(oj, ref))
        try_run("jax ops.gpu paged_attention", jax_paged)
        del c, k_d, v_d
    if decode_only:
        return

    prefill_cases = [([2048], [2048]), ([512] * 4, [2048] * 4)]
    if not quick:
        prefill_cases.append(([512] + [1] * 64, [4096] + [4096] * 64))  # mixed
    for qlens, ctxs in prefill_cases:
        c = paged_case(rng, qlens, ctxs)
        s = len(qlens)
        kind = "mixed" if len(set(qlens)) > 1 else "prefill"
        case = f"{kind} S={s} T={sum(qlens)} L={max(ctxs)}"
        flops = sum(4 * N * E * sum(range(cx - ql + 1, cx + 1)) for ql, cx in zip(qlens, ctxs))
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        fx = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))
        ref = fx(*args)
        f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale, impl="pallas"))
        out = f(*args)
        record("attention", case, "pallas (default)", gpu_time_ms(f, *args), flops=flops,
               err=rel_err(out, ref))
        ft = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale, impl="triton"))
        record("attention", case, "triton", gpu_time_ms(ft, *args), flops=flops,
               err=rel_err(ft(*args), ref))
        if sweep and kind == "prefill":
            # launch order (heavy_first) and slot lookups one step ahead (prefetch_slots), on
            # the default tile and on larger ones
            for bq, bk, nw, ns in ((16, 64, 4, 1), (16, 64, 4, 2), (32, 64, 8, 1), (16, 128, 4, 1),
                                   (32, 128, 8, 1), (16, 32, 4, 1), (32, 32, 4, 1)):
                g = jax.jit(functools.partial(
                    wrapper.ragged_paged_attention, sm_scale=scale, impl="triton",
                    tiling=Tiling(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns,
                                  heavy_first=True, prefetch_slots=True)))
                ms = try_run("sweep", lambda: gpu_time_ms(g, *args, iters=10))
                if ms is not None:
                    record("attn-sweep", case, f"pallas bq{bq} bk{bk} w{nw} s{ns} heavy-first "
                           f"prefetch", ms, flops=flops)
        if kind == "prefill" and len(set(ctxs)) == 1 and qlens[0] == ctxs[0]:
            L = ctxs[0]
            q4 = c["q"].reshape(s, L, N, E)
            k_d, v_d = dense_kv(c)
            record_cudnn("attention", case, "cudnn (dense, causal)", q4, k_d, v_d, ref,
                         scale=scale, is_causal=True, flops=flops)
            try_run("jax ops.gpu attention_mgpu", lambda: bench_attention_mgpu(case, q4, k_d, v_d,
                                                                           flops))
        record("attention", case, "xla fallback", gpu_time_ms(fx, *args, iters=5), flops=flops)


def bench_decode_mgpu(case, args, ref, byts, sweep: bool):
    """Our Mosaic GPU kernel in its decode configuration (one compute warpgroup, key-range
    splits); with --sweep, the ring depth, key step and split count around it."""
    from jaxserve.pallas_kernels.ragged_paged_attention import mgpu as mg
    scale = E ** -0.5
    t, s, b, p = args[0].shape[0], args[4].shape[0], args[5].shape[1], args[1].shape[1]

    def run(label, **cfg):
        cfg = {**mg.DECODE_CONFIG, **cfg}
        f = jax.jit(functools.partial(mg.ragged_paged_attention_mgpu, sm_scale=scale, **cfg))
        out = f(*args)
        record("attention" if label == "default" else "attn-sweep", case,
               f"mgpu decode {label} bkv{cfg['block_kv']} w{cfg['num_stages']} "
               f"x{cfg['num_splits'] or 'auto'}",
               time_ms(f, *args, bytes_=byts, iters=30 if label == "default" else 10),
               bytes_=byts, err=rel_err(out, ref))

    run("default")
    if not sweep:
        return
    x0 = mg.default_num_splits(t, s, KH, b * p, mg.DECODE_CONFIG["block_kv"])
    for bkv, w, x in ((64, 2, None), (64, 3, None), (64, 5, None), (128, 2, None),
                      (64, 4, max(1, x0 // 2)), (64, 4, 2 * x0), (64, 4, 4 * x0)):
        try_run("mosaic decode sweep", lambda: run("sweep", block_kv=bkv, num_stages=w,
                                                   num_splits=x))


def bench_attention_mgpu(case, q4, k_d, v_d, flops):
    """JAX's own Hopper attention (Mosaic GPU, warp-specialised, TMA): dense causal, no scale
    argument (timing only), as the bar a Mosaic paged kernel could reach. In float16: its bf16
    path fails in jax 0.11.2 (a float16 cast inside)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    for bkv in (64, 128):
        cfg = am.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=True)
        f = jax.jit(functools.partial(am.attention, config=cfg))
        h = [x.astype(jnp.float16) for x in (q4, k_d, v_d)]
        ms = try_run(f"attention_mgpu bkv{bkv}", lambda: gpu_time_ms(f, *h))
        if ms is not None:
            record("attention", case, f"jax attention_mgpu (dense causal f16 bkv{bkv})", ms,
                   flops=flops)


# ---------------------------------------------------------------------------------------------
# fused add + RMSNorm
# ---------------------------------------------------------------------------------------------


def bench_rmsnorm(rng, quick: bool, sweep: bool = False):
    from jaxserve.pallas_kernels import fused_add_rms_norm as farn
    d = D_MODEL
    for t in ((128, 2048, 8192) if quick else (1, 128, 2048, 8192, 32768)):
        key = jax.random.key(int(rng.integers(1 << 30)))
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (t, d), jnp.bfloat16)
        r = jax.random.normal(k2, (t, d), jnp.bfloat16)
        w = jax.random.normal(k3, (d,), jnp.bfloat16)
        byts = 4 * t * d * 2 + d * 2
        fx = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=RMS_EPS, impl="xla"))
        ref = fx(x, r, w)
        fp = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=RMS_EPS, impl="pallas"))
        out = fp(x, r, w)
        err = max(rel_err(out[0], ref[0]), rel_err(out[1], ref[1]))
        record("rmsnorm", f"add+rmsnorm T={t} D={d}", "pallas", gpu_time_ms(fp, x, r, w),
               bytes_=byts, err=err)
        record("rmsnorm", f"add+rmsnorm T={t} D={d}", "xla (fused by XLA)",
               gpu_time_ms(fx, x, r, w), bytes_=byts)
        if sweep and t in (128, 2048, 8192):
            for br, nw in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16), (4, 32)):
                g = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=RMS_EPS, impl="pallas",
                                              rows_per_program=br, num_warps=nw))
                ms = try_run("rmsnorm sweep", lambda: gpu_time_ms(g, x, r, w))
                if ms is not None:
                    record("rms-sweep", f"add+rmsnorm T={t} D={d}", f"pallas br{br} w{nw}", ms,
                           bytes_=byts)


# ---------------------------------------------------------------------------------------------
# MoE grouped matmul (Qwen3-30B-A3B experts: 128 experts, top-8, D=2048, F=768)
# ---------------------------------------------------------------------------------------------

SPARSE_MAX_BENCH_ROWS = 1024   # the expert-skipping kernel is for decode; larger M is Mosaic's


def bench_moe(rng, quick: bool, only_auto: bool = False, sweep: bool = False):
    from jaxserve.pallas_kernels import grouped_matmul as gm
    d, f, n_exp, top = 2048, 768, 128, 8
    key = jax.random.key(int(rng.integers(1 << 30)))
    kw, kd, kx = jax.random.split(key, 3)
    w_gu = jax.random.normal(kw, (n_exp, d, 2 * f), jnp.bfloat16) * 0.02
    w_down = jax.random.normal(kd, (n_exp, f, d), jnp.bfloat16) * 0.02
    # quick: the decode sizes where "auto" chooses between the expert-skipping kernel and Mosaic
    for t in ((1, 4, 16, 64) if quick else (1, 16, 128, 2048, 8192)):
        m = t * top
        counts = np.bincount(rng.integers(0, n_exp, m), minlength=n_exp).astype(np.int32)
        gs = jnp.asarray(counts)
        used = int((counts > 0).sum())
        for proj, w in (("gate_up", w_gu), ("down", w_down)):
            k, n = w.shape[1:]
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            byts = used * k * n * 2 + m * k * 2 + m * n * 2
            flops = 2 * m * k * n
            case = f"{proj} T={t} rows={m}"
            fr = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, group_sizes=gs))
            ref = fr(x, w, gs)
            record("moe", case, "lax.ragged_dot", gpu_time_ms(fr, x, w, gs), bytes_=byts,
                   flops=flops)
            fa = jax.jit(functools.partial(gm.grouped_matmul, impl="auto"))
            out = fa(x, w, gs)
            record("moe", case, "grouped_matmul auto", gpu_time_ms(fa, x, w, gs), bytes_=byts,
                   flops=flops, err=rel_err(out, ref))
            if m <= SPARSE_MAX_BENCH_ROWS:
                tunings = [{}]
                if sweep and t in (1, 16):
                    tunings += [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                                for bn in (32, 64, 128) for bk in (128, 256)
                                for nw, ns in ((4, 3), (4, 4), (8, 4))]
                for tuning in tunings:
                    fs = jax.jit(functools.partial(gm.grouped_matmul, impl="pallas", **tuning))
                    label = ("pallas bn{block_n} bk{block_k} w{num_warps} s{num_stages}"
                             .format(**tuning) if tuning else "pallas (skips experts)")
                    out = try_run(label, lambda: fs(x, w, gs))
                    if out is not None:
                        record("moe", case, label, gpu_time_ms(fs, x, w, gs), bytes_=byts,
                               flops=flops, err=rel_err(out, ref))
            if only_auto:
                continue
            try_run("ragged_dot_mgpu", lambda: bench_mgpu(case, x, w, gs, ref, byts, flops))


def bench_moe_fp8(rng, quick: bool, n_exp: int = 256, shapes=((7168, 2048), (2048, 7168))):
    """Issue 30's choice for DeepSeek's FP8 checkpoints: experts kept in FP8 (e4m3 + 128 x 128
    block scales, the "pallas" kernel) against dequantized to bf16 at load (the same kernel),
    at DeepSeek-V3's expert shapes (256 experts, top-8; chunked as the engine splits them)."""
    from jaxserve.pallas_kernels import grouped_matmul as gm
    top = 8
    key = jax.random.key(int(rng.integers(1 << 30)))
    for proj, (k, n) in zip(("gate", "down"), shapes):
        kw, kx, key = jax.random.split(key, 3)
        w8 = gm.BlockScaledFp8(
            (jax.random.normal(kw, (n_exp, k, n), jnp.bfloat16) * 10).astype(jnp.float8_e4m3fn),
            jnp.full((n_exp, k // 128, n // 128), 0.002, jnp.float32))
        w16 = gm.dequantize(w8, jnp.bfloat16)          # the same values both ways
        c16, c8 = gm.split_experts(w16), gm.split_experts(w8)
        for t in ((1, 16) if quick else (1, 16, 64)):
            m = t * top
            counts = np.bincount(rng.integers(0, n_exp, m), minlength=n_exp).astype(np.int32)
            gs = jnp.asarray(counts)
            used = int((counts > 0).sum())
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            case = f"deepseek {proj} T={t} rows={m}"
            f16 = jax.jit(functools.partial(gm.grouped_matmul, impl="pallas"))
            ref = f16(x, c16, gs)
            record("moe_fp8", case, "bf16 weights (dequantized at load)", gpu_time_ms(f16, x, c16, gs),
                   bytes_=used * k * n * 2 + m * (k + n) * 2, flops=2 * m * k * n)
            out = try_run("fp8", lambda: f16(x, c8, gs))
            if out is not None:
                record("moe_fp8", case, "fp8 weights + block scales (kept)", gpu_time_ms(f16, x, c8, gs),
                       bytes_=used * k * n + m * (k + n) * 2, flops=2 * m * k * n, err=rel_err(out, ref))


def bench_moe_decode(rng, quick: bool, sweep: bool = False):
    """Issue 33's fused MoE decode (--fused-kernels moe) against the grouped path the engine
    takes by default (moe.expert_rows_sum under "pallas": the sort by expert, gathers and
    grouped matmuls), the routed experts of 1 (and 4) tokens at Qwen3-30B-A3B's and
    DeepSeek-V3's expert shapes (gate|up fused, chunked as the engine holds them)."""
    from jaxserve.models import moe
    from jaxserve.pallas_kernels import moe_decode as md
    from jaxserve.pallas_kernels.grouped_matmul import split_experts
    key = jax.random.key(int(rng.integers(1 << 30)))
    for name, (x, d, f, top) in (("qwen3-30b-a3b", (128, 2048, 768, 8)), ("deepseek-v3", (256, 7168, 2048, 8))):
        kg, kd, kh, key = jax.random.split(key, 4)
        gate_up = split_experts(jax.random.normal(kg, (x, d, 2 * f), jnp.bfloat16) * d ** -0.5)
        down = split_experts(jax.random.normal(kd, (x, f, d), jnp.bfloat16) * f ** -0.5)
        lp = {"w_gate_up": gate_up, "w_down": down}
        for t in ((1,) if quick else (1, 4)):
            e = jnp.asarray(np.stack([rng.choice(x, top, replace=False) for _ in range(t)]), jnp.int32)
            w = jnp.asarray(rng.random((t, top)), jnp.float32)
            h = jax.random.normal(kh, (t, d), jnp.bfloat16)
            byts = len(set(np.asarray(e).ravel().tolist())) * 3 * d * f * 2
            grouped = jax.jit(lambda h, w, e, lp: moe.expert_rows_sum(lp, h, w, e, x, "pallas"))
            fused = jax.jit(lambda h, w, e, lp: md.moe_decode(h, w, e, lp["w_gate_up"], None, lp["w_down"],
                                                              impl="pallas"))
            ref = grouped(h, w, e, lp)
            case = f"{name} T={t} routed experts"
            record("moe_decode", case, "grouped path (default)", gpu_time_ms(grouped, h, w, e, lp), bytes_=byts)
            out = try_run("moe_decode", lambda: fused(h, w, e, lp))
            if out is not None:
                record("moe_decode", case, "moe_decode (--fused-kernels moe)", gpu_time_ms(fused, h, w, e, lp),
                       bytes_=byts, err=rel_err(out, ref))
            for bf, bd, ns in (((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 3)) if sweep else ()):
                tuned = jax.jit(functools.partial(md.moe_decode, up=None, impl="pallas", block_f=bf,
                                                  block_d=bd, num_stages=ns))
                g = lambda h, w, e, lp, tuned=tuned: tuned(h, w, e, lp["w_gate_up"], down=lp["w_down"])  # noqa: E731
                if try_run("moe_decode sweep", lambda: g(h, w, e, lp)) is not None:
                    record("moe_decode", case, f"moe_decode bf{bf} bd{bd} s{ns}",
                           gpu_time_ms(jax.jit(g), h, w, e, lp), bytes_=byts)
            if name == "deepseek-v3":   # FP8 experts (--quantization fp8): half the bytes
                bench_moe_decode_fp8(lp, h, w, e, x, case, byts // 2, ref)
        del lp, gate_up, down


def bench_moe_decode_fp8(lp, h, w, e, x, case, byts, ref):
    """The same routed experts as block-scaled FP8 (grouped_matmul.quantize, 128 x 128 scale
    blocks): the grouped path's FP8 kernel against moe_decode's FP8 path (BF 64, the default,
    and 128). Errors against the bf16 experts' result (the quantization's own error included)."""
    from jaxserve.models import moe
    from jaxserve.pallas_kernels import moe_decode as md
    from jaxserve.pallas_kernels.grouped_matmul import quantize
    q = {n: tuple(quantize(c) for c in lp[n]) for n in ("w_gate_up", "w_down")}
    grouped = jax.jit(lambda h, w, e, q: moe.expert_rows_sum(q, h, w, e, x, "pallas"))
    record("moe_decode", case + " fp8", "grouped path", gpu_time_ms(grouped, h, w, e, q), bytes_=byts,
           err=rel_err(grouped(h, w, e, q), ref))
    for bf in (64, 128):
        fused = jax.jit(lambda h, w, e, q, bf=bf: md.moe_decode(h, w, e, q["w_gate_up"], None, q["w_down"],
                                                                impl="pallas", block_f=bf))
        out = try_run("moe_decode fp8", lambda: fused(h, w, e, q))
        if out is not None:
            record("moe_decode", case + " fp8", f"moe_decode bf{bf}" + (" (default)" if bf == 64 else ""),
                   gpu_time_ms(fused, h, w, e, q), bytes_=byts, err=rel_err(out, ref))
    del q


def bench_mgpu(case, x, w, gs, ref, byts, flops):
    """JAX's Mosaic GPU ragged dot at a few tile shapes."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm
    for bm, bn, steps in ((64, 128, 4), (128, 128, 4), (64, 256, 3), (128, 256, 3)):
        fm = jax.jit(functools.partial(rdm.ragged_dot, block_m=bm, block_n=bn, block_k=64,
                                       max_concurrent_steps=steps, grid_block_n=1))
        out = try_run(f"mgpu bm{bm} bn{bn}", lambda: fm(x, w, group_sizes=gs))
        if out is None:
            continue
        ms = gpu_time_ms(lambda x, w, gs: fm(x, w, group_sizes=gs), x, w, gs)
        record("moe", case, f"ops.gpu ragged_dot_mgpu {bm}x{bn}", ms, bytes_=byts,
               flops=flops, err=rel_err(out, ref))


# ---------------------------------------------------------------------------------------------
# fused QK-norm + RoPE + KV write (Qwen3-style q/k norms; --model's head layout)
# ---------------------------------------------------------------------------------------------


def loop_time_ms(step, carry, reps: int = 20) -> float:
    """Per-iteration time of `step` run `reps` times in one jitted loop (for kernels whose
    in-place cache update needs the buffer carried, not re-passed: donation)."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, reps, lambda i, c: step(c), c))
    return gpu_time_ms(run, carry, iters=10) / reps


def bench_rope(rng, quick: bool):
    from jaxserve.models import layers
    from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
    nb, p = 4096, 16
    inv = layers.rope_inv_freq(E, ROPE_THETA, None)
    for t in ((2048,) if quick else (32, 2048, 8192)):
        key = jax.random.key(int(rng.integers(1 << 30)))
        ks = jax.random.split(key, 6)
        q = jax.random.normal(ks[0], (t, N, E), jnp.bfloat16)
        k = jax.random.normal(ks[1], (t, KH, E), jnp.bfloat16)
        v = jax.random.normal(ks[2], (t, KH, E), jnp.bfloat16)
        qn = jax.random.normal(ks[3], (E,), jnp.bfloat16)
        kn = jax.random.normal(ks[4], (E,), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32) + 100
        slots = jnp.asarray(rng.permutation(np.arange(p, nb * p))[:t].astype(np.int32))
        kc = jnp.zeros((nb, p, KH, E), jnp.bfloat16)
        vc = jnp.zeros((nb, p, KH, E), jnp.bfloat16)
        byts = 2 * t * (N + 2 * KH) * E * 2
        want = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, eps=RMS_EPS,
                                         impl="xla")
        got = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, eps=RMS_EPS,
                                        impl="pallas")
        err = max(rel_err(got[0], want[0]), rel_err(got[1], want[1]), rel_err(got[2], want[2]))
        for impl in ("pallas", "xla"):
            def step(c, impl=impl):
                q_, kc_, vc_ = c
                return qrk.qk_norm_rope_kv_write(q_, k, v, pos, slots, kc_, vc_, inv, qn, kn,
                                                 eps=RMS_EPS, impl=impl)
            ms = loop_time_ms(step, (q, kc, vc))
            record("qk-rope-kv", f"qknorm+rope+kv write T={t}", impl, ms, bytes_=byts,
                   err=err if impl == "pallas" else None)


# ---------------------------------------------------------------------------------------------
# top-k / top-p thresholds (sampling) over --model's vocabulary
# ---------------------------------------------------------------------------------------------


def bench_topk(rng, quick: bool, sweep: bool = False):
    """Top-k and top-p thresholds (our radix-select kernels) beside a full sort and
    lax.top_k(2048), and the sampler's truncation (min_p, top_k, top_p) by the kernels and by
    one sort of each row."""
    from jaxserve.sample import sampler
    from jaxserve.pallas_kernels import topk_threshold as tk
    from jaxserve.sampling_params import SamplingParams
    v = VOCAB
    for s in ((32,) if quick else (1, 32, 128, 256)):
        x = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (s, v), jnp.float32)
        for kk in (50, 2048):
            k = jnp.full((s,), kk, jnp.int32)
            want = tk.topk_threshold(x, k, impl="sort")
            case = f"top-k S={s} V={v} k={kk}"
            for impl in ("pallas", "xla", "sort"):
                f = jax.jit(functools.partial(tk.topk_threshold, impl=impl))
                err = float(np.abs(np.asarray(f(x, k)) - np.asarray(want)).max())
                record("topk", case, impl if impl != "xla" else "lax.top_k(2048)",
                       gpu_time_ms(f, x, k), bytes_=s * v * 4, err=err)
        p = jnp.full((s,), 0.9, jnp.float32)
        floor = tk.topk_threshold(x, jnp.full((s,), 2048, jnp.int32), impl="sort")
        want = tk.topp_threshold(x, p, floor, impl="sort")
        for impl in ("pallas", "sort"):
            f = jax.jit(functools.partial(tk.topp_threshold, impl=impl))
            err = float(np.abs(np.asarray(f(x, p, floor)) - np.asarray(want)).max())
            record("topk", f"top-p S={s} V={v} p=0.9", impl, gpu_time_ms(f, x, p, floor),
                   bytes_=s * v * 4, err=err)
        if sweep:
            for bv, nw, progs in ((1024, 4, 264), (1024, 4, 1056), (2048, 4, 528), (2048, 8, 528),
                                  (4096, 8, 528), (512, 4, 528), (1024, 8, 528)):
                k = jnp.full((s,), 50, jnp.int32)
                f = jax.jit(functools.partial(tk.topk_threshold, impl="pallas", block_v=bv,
                                              num_warps=nw, programs=progs))
                ms = try_run("topk sweep", lambda: gpu_time_ms(f, x, k, iters=10))
                if ms is not None:
                    record("topk-sweep", f"top-k S={s} V={v} k=50", f"pallas bv{bv} w{nw} "
                           f"programs{progs}", ms, bytes_=s * v * 4)
        # the sampler's min_p / top_k / top_p truncation by the two kernels and by one sort
        # (what it does past THRESHOLD_KERNEL_MAX_ROWS rows, and did everywhere before)
        params = [SamplingParams(top_k=50, top_p=0.9)] * s
        t = sampler.make_sampling_tensors(
            [sampler.SamplingRow(prm, [1], [], seed=i, offset=0) for i, prm in enumerate(params)],
            s, v, 16, with_extras=False)
        t = jax.tree.map(jnp.asarray, t)
        limit = sampler.THRESHOLD_KERNEL_MAX_ROWS
        for label, max_rows in (("sampler truncation (kernels)", s), ("sampler truncation "
                                                                      "(one sort)", 0)):
            sampler.THRESHOLD_KERNEL_MAX_ROWS = max_rows      # read when the jit traces
            try:
                f = jax.jit(lambda x, t: sampler._truncate(x, t))
                jax.block_until_ready(f(x, t))
            finally:
                sampler.THRESHOLD_KERNEL_MAX_ROWS = limit
            record("topk", f"truncate S={s} V={v} top_k=50 top_p=0.9", label, gpu_time_ms(f, x, t),
                   bytes_=s * v * 4)


def bench_router(rng, quick: bool, sweep: bool = False):
    """The MoE router (Qwen3-30B-A3B: 128 experts, top-8, softmax, renormalised): our kernel
    against the same steps in XLA (softmax fusion, lax.top_k, normalisation)."""
    from jaxserve.pallas_kernels import moe_router as mr
    for t in ((1, 16, 2048) if quick else (1, 16, 128, 2048)):
        x = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (t, 128), jnp.bfloat16)
        ref = mr.ref_moe_router(x, top_k=8)
        for impl in ("pallas", "xla"):
            f = jax.jit(functools.partial(mr.moe_router, top_k=8, impl=impl))
            w, e = f(x)
            same = float(np.mean(np.asarray(e) == np.asarray(ref[1])))
            record("router", f"T={t} X=128 k=8", impl, gpu_time_ms(f, x), bytes_=t * 128 * 2,
                   err=float(np.abs(np.asarray(w) - np.asarray(ref[0])).max()),
                   note=f"same experts {same:.3f}")
        for bt, nw in (((1, 1), (4, 1), (16, 1), (16, 2), (32, 4)) if sweep else ()):
            g = jax.jit(functools.partial(mr.moe_router, top_k=8, impl="pallas", block_t=bt,
                                          num_warps=nw))
            g(x)
            record("router-sweep", f"T={t} X=128 k=8", f"pallas bt{bt} w{nw}", gpu_time_ms(g, x))


def bench_linear(rng, quick: bool, sweep: bool = False):
    """One token times a weight: plain `x @ w` (XLA rewrites it into multiply + reduce below 10M
    elements) against models.layers.linear (two rows, kept a matrix product); then the fused
    stack's projections at the default model's shapes (fused_linear, [out, in] weights, one
    row), and with --sweep its tiling: column block, K step, warps (issue 33: latency-bound at
    ~10 % of HBM with the default tiling)."""
    from jaxserve.models import layers
    for d, f in ((4096, 2048), (2048, 3072), (2048, 2048), (4096, 4096)):
        kx, kw = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
        x = jax.random.normal(kx, (1, d), jnp.bfloat16)
        w = jax.random.normal(kw, (d, f), jnp.bfloat16)
        want = x.astype(jnp.float32) @ w.astype(jnp.float32)
        for name, fn in (("x @ w", lambda x, w: x @ w), ("layers.linear", layers.linear)):
            g = jax.jit(fn)
            out = g(x, w)
            record("linear", f"T=1 {d}x{f}", name, gpu_time_ms(g, x, w), bytes_=d * f * 2,
                   err=rel_err(out, want))
    bench_fused_linear(rng, sweep)


def bench_fused_linear(rng, sweep: bool):
    """The fused stack's projections, one row: the default model's (SmolLM2-135M), or with
    --model qwen3-30b-a3b an MoE layer's (q|k|v, o and the router: the fused stack's MoE
    layers, models/moe.py residual_moe)."""
    from jaxserve.pallas_kernels import fused_linear as fl
    moe = D_MODEL == MODELS["qwen3-30b-a3b"]["d"]
    if moe:
        d, q_heads, kv_heads, hd = D_MODEL, N, KH, E
        shapes = {"q|k|v": (d, (q_heads + 2 * kv_heads) * hd, False, True, False),
                  "o": (q_heads * hd, d, False, False, True),
                  "router": (d, 128, False, True, False)}
    else:
        d, f, q_heads, kv_heads, hd = 576, 1536, 9, 3, 64            # SmolLM2-135M
        shapes = {"q|k|v": (d, (q_heads + 2 * kv_heads) * hd, False, True, False),
                  "o": (q_heads * hd, d, False, False, True),
                  "gate|up": (d, 2 * f, True, True, False),
                  "down": (f, d, False, False, True)}
    for name, (k, n, gated, norm, res) in shapes.items():
        kx, kw = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
        x = jax.random.normal(kx, (1, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        n_out = n // 2 if gated else n
        norm_k = jnp.ones((k,), jnp.bfloat16) if norm else None
        res_tn = jnp.ones((1, n_out), jnp.bfloat16) if res else None
        want = fl.ref_fused_linear(x, w, norm_K=norm_k, residual_TN=res_tn, gated=gated, w_layout="NK")
        single = fl.one_row(1, w.size, "NK")
        bn0, bk0 = fl.one_row_tiling(k) if single else fl.dot_tiling(1, k, n_out, "NK")[1:]
        warps0 = fl.decode_warps(1, w.size, single)
        tilings = [(single, bn0, bk0, warps0)]
        if sweep and moe:     # the one-row program at these larger weights, against the dot
            tilings += [(False, *fl.dot_tiling(1, k, n_out, "NK")[1:], warps0)] + [
                (True, bn, bk, warps) for bn in (4, 8) for bk in (1024, 2048) for warps in (4, 8)]
        elif sweep:     # the dot program's tilings, then the one-row program's
            full_k = 1 << (k - 1).bit_length()
            tilings += [(False, bn, bk, warps) for bn in (16, 32, 64) if n_out % bn == 0
                        for bk in sorted({128, 256, 512, full_k}) if bk <= full_k
                        for warps in (2, 4, 8)]
            tilings += [(True, bn, bk, warps) for bn in (2, 4, 8, 16) if n_out % bn == 0
                        for bk in sorted({256, 512, min(1024, full_k), full_k}) if bk <= full_k
                        for warps in (1, 2, 4)]
        for i, (one, bn, bk, warps) in enumerate(tilings):
            if i and (one, bn, bk, warps) == tilings[0]:
                continue
            fn = jax.jit(lambda x, w, nk, r, one=one, bn=bn, bk=bk, warps=warps: fl.fused_linear(
                x, w, norm_K=nk, residual_TN=r, gated=gated, w_layout="NK", impl="pallas",
                tiling=fl.LinearTiling(one_row_program=one, block_n=bn, block_k=bk,
                                       num_warps=warps)))
            label = f"{'row' if one else 'dot'} bn{bn} bk{bk} w{warps}" + (" (default)" if not i else "")
            try_run(f"fused_linear {name} {label}", lambda: record(
                "linear", f"fused {name} T=1 {k}->{n}", label,
                time_ms(fn, x, w, norm_k, res_tn, bytes_=w.nbytes), bytes_=w.nbytes,
                err=rel_err(fn(x, w, norm_k, res_tn), want)))


# ---------------------------------------------------------------------------------------------


def bench_deltanet(rng, quick: bool, heads=(16, 64, 128, 128), lengths=None, start=4096):
    """Qwen3.5-397B-A17B's linear-attention core in prefill (16 key / 64 value heads of 128):
    the fused post-conv kernel and the chunked gated delta rule against their jnp references
    (the XLA path of the same layer), one sequence of T tokens: fresh (a prompt's first chunk)
    and continuing from a state (a later chunk of a long prompt). Bytes: what each must read
    and write once (the rule's f32 q/k/v/g/beta and state, the post-conv's conv output)."""
    from jaxserve.models.layers import deltanet as gdn
    from jaxserve.pallas_kernels import gated_delta_chunked as gdc
    from jaxserve.pallas_kernels import gdn_post_conv as gpc
    g, h, kd, vd = heads
    for t in lengths or ((2048,) if quick else (2048, 8192)):
        kq, kk, kv, kc = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
        conv = jax.random.normal(kc, (t, 2 * g * kd + h * vd), jnp.bfloat16)
        a_th = jax.random.normal(kq, (t, h), jnp.bfloat16)
        b_th = jax.random.normal(kk, (t, h), jnp.bfloat16)
        a_log = jnp.zeros((h,), jnp.float32)
        dt_bias = jnp.ones((h,), jnp.float32)
        kw = dict(num_k_heads=g, k_dim=kd, v_dim=vd)
        post_bytes = conv.nbytes + t * (2 * g * kd + h * vd + 2 * h) * 4
        want = jax.jit(functools.partial(gpc.ref_gdn_post_conv, **kw))
        got = jax.jit(functools.partial(gpc.gdn_post_conv, **kw, impl="pallas"))
        ref_out = want(conv, a_th, b_th, a_log, dt_bias)
        err = max(rel_err(o, r) for o, r in zip(got(conv, a_th, b_th, a_log, dt_bias), ref_out))
        for name, fn in (("jnp (XLA)", want), ("pallas", got)):
            record("deltanet", f"post-conv T={t}", name, gpu_time_ms(fn, conv, a_th, b_th, a_log, dt_bias),
                   bytes_=post_bytes, err=err if name == "pallas" else None)
        q, k, v, g_th, beta = ref_out
        q = gdn.l2norm(jax.random.normal(kq, (t, g, kd), jnp.float32)) * kd ** -0.5  # realistic norms
        k = gdn.l2norm(jax.random.normal(kk, (t, g, kd), jnp.float32))
        g_th = -jnp.abs(g_th.astype(jnp.float32)) * 0.1
        qsl = jnp.array([0, t], jnp.int32)
        slots = jnp.array([1], jnp.int32)
        state = jax.random.normal(kv, (2, h, vd, kd), jnp.float32) * 0.3
        rule_bytes = (q.nbytes + k.nbytes + v.nbytes + g_th.nbytes + beta.nbytes + t * h * vd * 4
                      + 2 * state.nbytes // 2)
        for label, done in (("fresh", 0), ("continuing", start)):
            seq_lens = jnp.array([done + t], jnp.int32)
            args = (q, k, v, g_th, beta, qsl, seq_lens, slots, state)
            want = jax.jit(gdc.ref_gated_delta_chunked)
            got = jax.jit(functools.partial(gdc.gated_delta_chunked, impl="pallas"))
            with jax.default_matmul_precision("highest"):
                want_o, _ = want(*args)
            err = rel_err(got(*args)[0], want_o)
            for name, fn in (("jnp chunked (XLA)", want), ("pallas", got)):
                record("deltanet", f"delta rule T={t} {label}", name, gpu_time_ms(fn, *args),
                       bytes_=rule_bytes, err=err if name == "pallas" else None)


def bench_prefill_buckets(rng):
    """Prefill-heavy steps as the engine runs them: T tokens in a bucket of 256 sequence slots,
    most of them empty (max_num_seqs = 256 on a GPU); ours (the Mosaic GPU kernel for these)
    beside the Triton kernel. Times include the small XLA ops before each kernel."""
    from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper
    scale = E ** -0.5
    cases = [("2K prompt", 2048, [2048], [2048]), ("1K prompt", 1024, [1024], [1024]),
             ("8 x 256-token chunks at 2K", 2048, [256] * 8, [2048] * 8),
             ("32 decodes + 1K chunk at 2K", 2048, [1] * 32 + [1024], [2048] * 33)]
    for name, t, qlens, ctxs in cases:
        pad = 256 - len(qlens)
        c = paged_case(rng, qlens + [0] * pad, ctxs + [0] * pad)
        c["q"] = jax.random.normal(jax.random.key(1), (t, N, E), jnp.bfloat16)  # padding tokens
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        flops = sum(4 * N * E * sum(range(cx - ql + 1, cx + 1)) for ql, cx in zip(qlens, ctxs))
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        for impl in ("pallas", "triton"):
            f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale, impl=impl))
            out = f(*args)
            record("bucket", f"T={t} S=256 {name}", "pallas (default)" if impl == "pallas"
                   else impl, gpu_time_ms(f, *args), flops=flops, err=rel_err(out, ref))
        del c


def engine_hint(slots: int, ctxs: list[int], context: int) -> tuple[int, bool]:
    """The (busy_seqs, skewed) the engine passes the attention kernel (models/attention.py
    AttentionBackend.plan) for a bucket of `slots` one-token slots whose first len(ctxs) hold
    decodes of ctxs keys, in a cache of `context` keys a sequence."""
    import types
    from jaxserve.models.attention import AttentionBackend
    cfg = types.SimpleNamespace(num_heads=N, num_kv_heads=KH, head_dim=E, sliding_window=None)
    backend = AttentionBackend(cfg, "pallas", context=context, itemsize=2)
    plan = backend.plan(slots, slots, len(ctxs), np.asarray(ctxs))
    return plan.busy_seqs, plan.skewed


def bench_decode_buckets(rng, sweep: bool):
    """Decode steps as the engine runs them: a bucket of T = S sequence slots of which only
    some hold a decode, the rest padding sequences, or whose contexts are skewed (one much
    longer than the rest), busy_seqs as the engine says it. Ours (the default tiling) beside
    cuDNN on the real sequences (padded to the longest with their lengths where they differ);
    with --sweep also 128- and 64-key steps forced (the Triton kernel) on the even ones."""
    from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper
    from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling
    scale = E ** -0.5
    for slots, ctxs in ((16, [8192] + [1024] * 15), (16, [2048] + [1024] * 15),
                        (32, [16384] + [1024] * 31), (32, [8192] * 2), (16, [32768] + [1024] * 3),
                        (64, [16384] + [1024] * 63)):
        real = len(ctxs)
        c = paged_case(rng, [1] * real + [0] * (slots - real), ctxs + [0] * (slots - real))
        c["q"] = jax.random.normal(jax.random.key(2), (slots, N, E), jnp.bfloat16)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        busy, skewed = engine_hint(slots, ctxs, c["bt"].shape[1] * 16)
        case = (f"S={slots} {real} decodes L={max(ctxs)}" + (f" + {min(ctxs)}" if
                len(set(ctxs)) > 1 else "") + f" (busy_seqs {busy}" +
                (", skewed)" if skewed else ")"))
        byts = sum(2 * L * KH * E * 2 + 2 * N * E * 2 for L in ctxs)
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale,
                                      impl="pallas", busy_seqs=busy, skewed=skewed))
        record("dec-bucket", case, "pallas (default)", time_ms(f, *args, bytes_=byts),
               bytes_=byts, err=rel_err(f(*args), ref))
        k_d, v_d = dense_kv(dict(c, bt=c["bt"][:real]))
        ragged = len(set(ctxs)) > 1
        record_cudnn("dec-bucket", case, "cudnn (dense kv, real" + (", lengths)" if ragged
                                                                    else ")"),
                     c["q"][:real].reshape(real, 1, N, E), k_d, v_d, ref[:real], scale=scale,
                     cold_inputs=True, bytes_=byts,
                     kv_lens=jnp.asarray(ctxs, jnp.int32) if ragged else None)
        del c, k_d, v_d
    for slots, real, ctx in ((64, 64, 1024), (64, 56, 1024), (64, 48, 1024), (64, 40, 1024),
                             (64, 64, 2048), (64, 48, 2048), (128, 128, 1024), (128, 96, 1024)):
        pad = slots - real
        c = paged_case(rng, [1] * real + [0] * pad, [ctx] * real + [0] * pad)
        c["q"] = jax.random.normal(jax.random.key(2), (slots, N, E), jnp.bfloat16)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        case = f"S={slots} {real} decodes L={ctx}"
        byts = 2 * real * ctx * KH * E * 2 + 2 * real * N * E * 2
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        variants = [("pallas (default)", {})]
        if sweep:
            variants += [(f"triton bk{bk}", dict(impl="triton", tiling=Tiling(block_k=bk)))
                         for bk in (128, 64)]
        for label, kw in variants:
            f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale,
                                          **{"impl": "pallas", **kw}))
            out = f(*args)
            record("dec-bucket", case, label, time_ms(f, *args, bytes_=byts), bytes_=byts,
                   err=rel_err(out, ref))   # padding tokens included: both give zeros there
        k_d, v_d = dense_kv(dict(c, bt=c["bt"][:real]))
        q4 = c["q"][:real].reshape(real, 1, N, E)
        record_cudnn("dec-bucket", case, "cudnn (dense kv, real)", q4, k_d, v_d, ref[:real],
                     scale=scale, cold_inputs=True, bytes_=byts)
        del c, k_d, v_d


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
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS),
                    help="attention heads, hidden size, RoPE theta and vocabulary of this model")
    ap.add_argument("--json", default=None, help="write all rows to this JSON file")
    ap.add_argument("--warm", action="store_true",
                    help="time decode attention on one input set, partly in L2 between runs "
                         "(how sessions 1-9 timed it)")
    args = ap.parse_args()
    global COLD
    COLD = not args.warm
    use_model(args.model)
    print(f"# jax {jax.__version__}, devices {jax.devices()}; {args.model}: N={N} K={KH} E={E} "
          f"D={D_MODEL} V={VOCAB}; decode inputs {'cold' if COLD else 'warm'}", flush=True)
    rng = np.random.default_rng(0)
    groups = args.only.split(",")
    benches = dict(attention=lambda: bench_attention(rng, args.quick, args.sweep),
                   decode=lambda: bench_attention(rng, args.quick, args.sweep, decode_only=True),
                   buckets=lambda: bench_prefill_buckets(rng),
                   **{"decode-buckets": lambda: bench_decode_buckets(rng, args.sweep)},
                   rmsnorm=lambda: bench_rmsnorm(rng, args.quick, args.sweep),
                   rope=lambda: bench_rope(rng, args.quick),
                   router=lambda: bench_router(rng, args.quick, args.sweep),
                   linear=lambda: bench_linear(rng, args.quick, args.sweep),
                   deltanet=lambda: bench_deltanet(rng, args.quick),
                   topk=lambda: bench_topk(rng, args.quick, args.sweep),
                   moe=lambda: bench_moe(rng, args.quick, args.moe_auto_only, args.sweep),
                   **{"moe-fp8": lambda: bench_moe_fp8(rng, args.quick),
                      "moe-decode": lambda: bench_moe_decode(rng, args.quick, args.sweep)})
    for name in groups:
        try_run(name, benches[name])   # one failing group does not hide the others
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
