"""MoE kernels (kernels.py --only moe, moe-fp8, moe-decode, router): the grouped matmul against
lax.ragged_dot and JAX's Mosaic ragged dot at Qwen3-30B-A3B's experts, DeepSeek's FP8 experts
kept against dequantized, the fused MoE decode kernels against the grouped path, the router."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernel_timing import gpu_time_ms, record, rel_err, try_run


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
