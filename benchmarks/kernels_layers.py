"""The other layer kernels (kernels.py --only rmsnorm, rope, topk, linear, deltanet): add +
RMSNorm, QK-norm + RoPE + KV write, the sampler's top-k / top-p thresholds, one-row
projections (the fused stack's), Qwen3.5's linear-attention prefill; each against XLA's
form of the same ops."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernel_timing as kt
from kernel_timing import MODELS, gpu_time_ms, loop_time_ms, record, rel_err, time_ms, try_run


def bench_rmsnorm(rng, quick: bool, sweep: bool = False):
    from jaxserve.pallas_kernels import fused_add_rms_norm as farn
    d = kt.D_MODEL
    for t in ((128, 2048, 8192) if quick else (1, 128, 2048, 8192, 32768)):
        key = jax.random.key(int(rng.integers(1 << 30)))
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (t, d), jnp.bfloat16)
        r = jax.random.normal(k2, (t, d), jnp.bfloat16)
        w = jax.random.normal(k3, (d,), jnp.bfloat16)
        byts = 4 * t * d * 2 + d * 2
        fx = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=kt.RMS_EPS, impl="xla"))
        ref = fx(x, r, w)
        fp = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=kt.RMS_EPS, impl="pallas"))
        out = fp(x, r, w)
        err = max(rel_err(out[0], ref[0]), rel_err(out[1], ref[1]))
        record("rmsnorm", f"add+rmsnorm T={t} D={d}", "pallas", gpu_time_ms(fp, x, r, w),
               bytes_=byts, err=err)
        record("rmsnorm", f"add+rmsnorm T={t} D={d}", "xla (fused by XLA)",
               gpu_time_ms(fx, x, r, w), bytes_=byts)
        if sweep and t in (128, 2048, 8192):
            for br, nw in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16), (4, 32)):
                g = jax.jit(functools.partial(farn.fused_add_rms_norm, eps=kt.RMS_EPS, impl="pallas",
                                              rows_per_program=br, num_warps=nw))
                ms = try_run("rmsnorm sweep", lambda: gpu_time_ms(g, x, r, w))
                if ms is not None:
                    record("rms-sweep", f"add+rmsnorm T={t} D={d}", f"pallas br{br} w{nw}", ms,
                           bytes_=byts)


# ---------------------------------------------------------------------------------------------
# fused QK-norm + RoPE + KV write (Qwen3-style q/k norms; --model's head layout)
# ---------------------------------------------------------------------------------------------

def bench_rope(rng, quick: bool):
    from jaxserve.models import layers
    from jaxserve.pallas_kernels import qk_norm_rope_kv_write as qrk
    nb, p = 4096, 16
    inv = layers.rope_inv_freq(kt.E, kt.ROPE_THETA, None)
    for t in ((2048,) if quick else (32, 2048, 8192)):
        key = jax.random.key(int(rng.integers(1 << 30)))
        ks = jax.random.split(key, 6)
        q = jax.random.normal(ks[0], (t, kt.N, kt.E), jnp.bfloat16)
        k = jax.random.normal(ks[1], (t, kt.KH, kt.E), jnp.bfloat16)
        v = jax.random.normal(ks[2], (t, kt.KH, kt.E), jnp.bfloat16)
        qn = jax.random.normal(ks[3], (kt.E,), jnp.bfloat16)
        kn = jax.random.normal(ks[4], (kt.E,), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32) + 100
        slots = jnp.asarray(rng.permutation(np.arange(p, nb * p))[:t].astype(np.int32))
        kc = jnp.zeros((nb, p, kt.KH, kt.E), jnp.bfloat16)
        vc = jnp.zeros((nb, p, kt.KH, kt.E), jnp.bfloat16)
        byts = 2 * t * (kt.N + 2 * kt.KH) * kt.E * 2
        want = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, eps=kt.RMS_EPS,
                                         impl="xla")
        got = qrk.qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, eps=kt.RMS_EPS,
                                        impl="pallas")
        err = max(rel_err(got[0], want[0]), rel_err(got[1], want[1]), rel_err(got[2], want[2]))
        for impl in ("pallas", "xla"):
            def step(c, impl=impl):
                q_, kc_, vc_ = c
                return qrk.qk_norm_rope_kv_write(q_, k, v, pos, slots, kc_, vc_, inv, qn, kn,
                                                 eps=kt.RMS_EPS, impl=impl)
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
    v = kt.VOCAB
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
    layers, jaxserve/models/moe.py residual_moe)."""
    from jaxserve.pallas_kernels import fused_linear as fl
    moe = kt.D_MODEL == MODELS["qwen3-30b-a3b"]["d"]
    if moe:
        d, q_heads, kv_heads, hd = kt.D_MODEL, kt.N, kt.KH, kt.E
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
