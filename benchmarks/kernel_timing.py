"""Shared helpers of the kernel benchmarks (kernels.py and its groups kernels_attention.py,
kernels_moe.py, kernels_layers.py; also deepseek_kernels.py, paged_cudnn.py,
minimax_m2_decode.py, reduced_depth_decode.py): CUPTI timing with inputs out of L2, the rows
every script prints and writes (time, fraction of the HBM or matmul ceiling, error against a
reference), and the attention shapes of the model chosen with --model (module globals that
use_model sets, so the group modules read them as kt.N, kt.E, ...)."""

from __future__ import annotations

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
# shapes (--model) and paged caches
# ---------------------------------------------------------------------------------------------

# per model: query heads, kv heads, head dim, hidden size, RoPE theta, vocabulary, RMSNorm eps
MODELS = {
    "llama3-8b": dict(n=32, kh=8, e=128, d=4096, theta=500000.0, vocab=128256, eps=1e-5),
    "qwen3-30b-a3b": dict(n=32, kh=4, e=128, d=2048, theta=1000000.0, vocab=151936, eps=1e-6),
}
N, KH, E = 32, 8, 128          # set by use_model (kernels.py --model); read as kt.N etc.
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


def loop_time_ms(step, carry, reps: int = 20) -> float:
    """Per-iteration time of `step` run `reps` times in one jitted loop (for kernels whose
    in-place cache update needs the buffer carried, not re-passed: donation)."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, reps, lambda i, c: step(c), c))
    return gpu_time_ms(run, carry, iters=10) / reps
