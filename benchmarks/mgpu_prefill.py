"""Prefill attention over the paged KV cache on one H200: Mosaic GPU kernel vs cuDNN vs Triton.

    python benchmarks/mgpu_prefill.py [--json out.json] [--iters 30] [--sweep]
                                      [--only check,prefill,chunked,mixed]

Shapes: Llama-3.1-8B attention (bf16, N=32 query heads, K=8 kv heads, E=128), cache blocks of
P=16 slots scattered over the pool. Cases:
  check     small ragged batches (decode rows, unaligned sequence starts, padding sequences and
            tokens, G = 1, 2, 4, 8) against the reference, both tilings
  prefill   S=1, T=2048 new tokens, context 2048 (causal)
  chunked   S=4 x 512 new tokens, context 2048 each (tokens at positions 1536..2047)
  mixed     an engine step: 32 decode rows (context 2048) beside a 1024-token prompt chunk
Rows: ours (ragged_paged_attention_mgpu, tiling "sequence" and "flat"; --sweep adds a few
tunings), our Triton kernel (ragged_paged_attention(impl="triton")), cuDNN on already-gathered
dense K/V (causal for `prefill`; jax.nn exposes only a top-left causal mask, wrong for chunks
that start mid-context, so on `chunked` cuDNN runs without a mask and does ~14% more work than
needed), and JAX's FA3-style Mosaic kernel (attention_mgpu: float16 only in jax 0.11.2, dense,
causal) on the `prefill` problem as a bar. Times: median kernel time over `iters` runs (CUPTI
via jax.experimental.mosaic.gpu.profiler.measure) after two warm-up calls. % = useful causal
FLOPs (4 * N * E * sum of visible keys) / time / 794 TFLOP/s (measured bf16 matmul rate).
Errors: relative L2 error against ref_ragged_paged_attention (f32).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels import ragged_paged_attention as rpa
from jaxserve.pallas_kernels import ragged_paged_attention_mgpu as mg
from kernels import dense_kv, gpu_time_ms, rel_err   # benchmarks/kernels.py (this script's folder)

N, K, E, P = 32, 8, 128, 16
PEAK = 794e12
ROWS: list[dict] = []


def record(case, impl, ms, flops, err=None, note=""):
    pct = 100 * flops / (ms * 1e-3) / PEAK
    ROWS.append(dict(case=case, impl=impl, us=ms * 1e3, pct_peak=pct, err=err, note=note))
    e = "" if err is None else f" err={err:.1e}"
    print(f"{case:9s} {impl:44s} {ms * 1e3:8.1f} us {pct:5.1f}% of 794 TF/s{e} {note}",
          flush=True)


def attempt(label, fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - report and go on with the other rows
        msg = f"{type(err).__name__}: {err}"
        print(f"# {label} FAILED: {msg[:3000]}", flush=True)
        traceback.print_exc(limit=4)
        ROWS.append(dict(impl=label, error=msg[:3000]))
        return None


def make_batch(qlens, ctxs, seed=0, dtype=jnp.bfloat16):
    """Sequences with the given new-token counts and contexts; cache blocks scattered."""
    rng = np.random.default_rng(seed)
    s = len(qlens)
    b = max(ctxs) // P
    nb = s * b + 1 + 64
    t = sum(qlens)
    q = jnp.asarray(rng.standard_normal((t, N, E), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal((nb, P, K, E), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal((nb, P, K, E), np.float32), dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    seq_lens = jnp.asarray(ctxs, jnp.int32)
    bt = jnp.asarray(rng.permutation(np.arange(1, nb))[:s * b].reshape(s, b), jnp.int32)
    visible = sum(c - ql + i + 1 for ql, c in zip(qlens, ctxs) for i in range(ql))
    flops = 4.0 * N * E * visible
    return (q, k, v, qsl, seq_lens, bt), flops


def run_case(case, qlens, ctxs, iters, sweep):
    args, flops = make_batch(qlens, ctxs)
    s, qlen, ctx = len(qlens), qlens[-1], ctxs[-1]
    uniform = len(set(qlens)) == 1 and len(set(ctxs)) == 1
    scale = 1.0 / np.sqrt(E)
    ref = jax.jit(functools.partial(rpa.ref_ragged_paged_attention, sm_scale=scale))(*args)
    ref = np.asarray(ref, np.float32)
    print(f"# {case}: S={s} T={sum(qlens)} last qlen={qlen} ctx={ctx} "
          f"useful GFLOP={flops / 1e9:.1f}", flush=True)

    tunings = [dict(tiling="sequence"), dict(tiling="flat")]
    if sweep:
        tunings += [dict(tiling="sequence", block_kv=64, num_stages=3),
                    dict(tiling="flat", schedule_barrier=False)]
    for tune in tunings:
        label = "mgpu " + " ".join(f"{k}={v}" for k, v in tune.items())
        f = jax.jit(functools.partial(mg.ragged_paged_attention_mgpu, sm_scale=scale, **tune))

        def go(f=f, label=label):
            out = f(*args)
            err = rel_err(out, ref)
            record(case, label, gpu_time_ms(f, *args, iters=iters), flops, err)
        attempt(label, go)

    ft = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale, impl="triton"))

    def triton():
        out = ft(*args)
        record(case, "triton ragged_paged_attention", gpu_time_ms(ft, *args, iters=iters), flops,
               rel_err(out, ref))
    attempt("triton", triton)

    if not uniform:
        return
    q, k, v, _, _, bt = args
    k_d, v_d = dense_kv(dict(k=k, v=v, bt=bt))
    q4 = q.reshape(s, qlen, N, E)
    causal = qlen == ctx

    def cudnn_fn(q4, k_d, v_d):
        return jax.nn.dot_product_attention(q4, k_d, v_d, scale=scale, is_causal=causal,
                                            implementation="cudnn")
    fc = jax.jit(cudnn_fn)

    def cudnn():
        out = fc(q4, k_d, v_d)
        err = rel_err(out.reshape(s * qlen, N, E), ref) if causal else None
        record(case, f"cudnn dense ({'causal' if causal else 'NON-causal'})",
               gpu_time_ms(fc, q4, k_d, v_d, iters=iters), flops, err,
               note="" if causal else "(does all 2048 keys per token)")
    attempt("cudnn", cudnn)

    if causal:
        def jax_mgpu():
            from jax.experimental.pallas.ops.gpu import attention_mgpu as am
            q16, k16, v16 = (x.astype(jnp.float16) for x in (q4 * scale, k_d, v_d))
            for bkv in (128,):
                cfg = am.TuningConfig(block_q=64, block_kv=bkv, max_concurrent_steps=2,
                                      causal=True)
                fa = jax.jit(functools.partial(am.attention, config=cfg))
                out = fa(q16, k16, v16)
                record(case, f"jax attention_mgpu f16 dense bkv={bkv}",
                       gpu_time_ms(fa, q16, k16, v16, iters=iters), flops,
                       rel_err(out.reshape(s * qlen, N, E), ref))
        attempt("attention_mgpu", jax_mgpu)


def check_ragged():
    """Small ragged batches on the GPU (decode rows, straddling tiles, padding) vs the reference."""
    sys.path.insert(0, "tests/pallas_kernels")
    from kernel_batches import paged_batch
    cases = [([9, 1, 0, 1, 17, 0], [25, 33, 0, 8, 17, 0], 32, 8),
             ([13, 29, 7, 100], [77, 29, 40, 300], 32, 8),
             ([70, 3], [70, 90], 8, 8), ([70, 3], [70, 90], 64, 8),
             ([1] * 20 + [45], [300] * 20 + [45], 16, 8)]
    for qlens, ctxs, n, kh in cases:
        args = paged_batch(qlens, ctxs, n=n, kh=kh, e=E, p=P, dtype=jnp.bfloat16, seed=len(qlens))
        ref = np.asarray(rpa.ref_ragged_paged_attention(*args, sm_scale=0.1), np.float32)
        real = int(args[3][-1])
        for tune in (dict(tiling="sequence"), dict(tiling="sequence", block_kv=64, num_stages=3),
                     dict(tiling="flat")):
            def go(tune=tune):
                out = np.asarray(mg.ragged_paged_attention_mgpu(*args, sm_scale=0.1, **tune),
                                 np.float32)
                pad_ok = bool((out[real:] == 0).all())
                print(f"check qlens={qlens} G={n // kh} {tune}: rel err "
                      f"{rel_err(out[:real], ref[:real]):.2e} padding zeros={pad_ok}", flush=True)
            attempt(f"check {qlens} {n}/{kh} {tune}", go)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="check,prefill,chunked,mixed")
    a = ap.parse_args()
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    only = a.only.split(",")
    if "check" in only:
        check_ragged()
    if "prefill" in only:
        run_case("prefill", [2048], [2048], a.iters, a.sweep)
    if "chunked" in only:
        run_case("chunked", [512] * 4, [2048] * 4, a.iters, a.sweep)
    if "mixed" in only:   # an engine step: 32 decodes beside a 1024-token prompt chunk
        run_case("mixed", [1] * 32 + [1024], [2048] * 33, a.iters, a.sweep)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
