"""Attention kernels (kernels.py --only attention, decode, buckets, decode-buckets): the paged
attention kernels (Triton, Mosaic GPU) against XLA, cuDNN on dense K/V and JAX's ops.gpu
kernels, at --model's heads; decode and prefill alone, and steps as the engine runs them in
partly filled buckets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernel_timing as kt
from kernel_timing import dense_kv, gpu_time_ms, paged_case, record, record_cudnn, rel_err, time_ms, try_run


def bench_attention(rng, quick: bool, sweep: bool, decode_only: bool = False):
    from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper
    from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling
    from jaxserve.pallas_kernels.dispatch import num_sms
    scale = kt.E ** -0.5
    decode_cases = [(1, 1024), (1, 8192), (4, 4096), (16, 1024), (32, 1024), (32, 8192),
                    (64, 1024), (64, 2048), (128, 1024), (128, 8192)]
    if quick:
        decode_cases = [(1, 8192), (32, 1024), (128, 1024)]
    for s, ctx in decode_cases:
        c = paged_case(rng, [1] * s, [ctx] * s)
        case = f"decode S={s} L={ctx}"
        kv_bytes = 2 * s * ctx * kt.KH * kt.E * 2
        byts = kv_bytes + 2 * s * kt.N * kt.E * 2
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
                        if ctx // xs >= bk and s * kt.KH * xs <= 2048]
            fill = max(1, num_sms() // (s * kt.KH))
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
        q4 = c["q"].reshape(s, 1, kt.N, kt.E)
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
        flops = sum(4 * kt.N * kt.E * sum(range(cx - ql + 1, cx + 1)) for ql, cx in zip(qlens, ctxs))
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
            q4 = c["q"].reshape(s, L, kt.N, kt.E)
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
    scale = kt.E ** -0.5
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
    x0 = mg.default_num_splits(t, s, kt.KH, b * p, mg.DECODE_CONFIG["block_kv"])
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


def bench_prefill_buckets(rng):
    """Prefill-heavy steps as the engine runs them: T tokens in a bucket of 256 sequence slots,
    most of them empty (max_num_seqs = 256 on a GPU); ours (the Mosaic GPU kernel for these)
    beside the Triton kernel. Times include the small XLA ops before each kernel."""
    from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper
    from jaxserve.pallas_kernels.ragged_paged_attention.tuning import Tiling
    scale = kt.E ** -0.5
    cases = [("2K prompt", 2048, [2048], [2048]), ("1K prompt", 1024, [1024], [1024]),
             ("8 x 256-token chunks at 2K", 2048, [256] * 8, [2048] * 8),
             ("32 decodes + 1K chunk at 2K", 2048, [1] * 32 + [1024], [2048] * 33)]
    for name, t, qlens, ctxs in cases:
        pad = 256 - len(qlens)
        c = paged_case(rng, qlens + [0] * pad, ctxs + [0] * pad)
        c["q"] = jax.random.normal(jax.random.key(1), (t, kt.N, kt.E), jnp.bfloat16)  # padding tokens
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        flops = sum(4 * kt.N * kt.E * sum(range(cx - ql + 1, cx + 1)) for ql, cx in zip(qlens, ctxs))
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        for impl in ("pallas", "triton"):
            f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale, impl=impl))
            out = f(*args)
            record("bucket", f"T={t} S=256 {name}", "pallas (default)" if impl == "pallas"
                   else impl, gpu_time_ms(f, *args), flops=flops, err=rel_err(out, ref))
        del c


def engine_hint(slots: int, ctxs: list[int], context: int) -> tuple[int, bool]:
    """The (busy_seqs, skewed) the engine passes the attention kernel (the runner's
    AttentionBackend.plan) for a bucket of `slots` one-token slots whose first len(ctxs) hold
    decodes of ctxs keys, in a cache of `context` keys a sequence (bf16)."""
    import types
    from jaxserve.models.attention import AttentionBackend
    cfg = types.SimpleNamespace(num_heads=kt.N, num_kv_heads=kt.KH, head_dim=kt.E)
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
    scale = kt.E ** -0.5
    for slots, ctxs in ((16, [8192] + [1024] * 15), (16, [2048] + [1024] * 15),
                        (32, [16384] + [1024] * 31), (32, [8192] * 2), (16, [32768] + [1024] * 3),
                        (64, [16384] + [1024] * 63)):
        real = len(ctxs)
        c = paged_case(rng, [1] * real + [0] * (slots - real), ctxs + [0] * (slots - real))
        c["q"] = jax.random.normal(jax.random.key(2), (slots, kt.N, kt.E), jnp.bfloat16)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        busy, skewed = engine_hint(slots, ctxs, c["bt"].shape[1] * 16)
        case = (f"S={slots} {real} decodes L={max(ctxs)}" + (f" + {min(ctxs)}" if
                len(set(ctxs)) > 1 else "") + f" (busy_seqs {busy}" +
                (", skewed)" if skewed else ")"))
        byts = sum(2 * L * kt.KH * kt.E * 2 + 2 * kt.N * kt.E * 2 for L in ctxs)
        ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
        f = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale,
                                      impl="pallas", busy_seqs=busy, skewed=skewed))
        record("dec-bucket", case, "pallas (default)", time_ms(f, *args, bytes_=byts),
               bytes_=byts, err=rel_err(f(*args), ref))
        k_d, v_d = dense_kv(dict(c, bt=c["bt"][:real]))
        ragged = len(set(ctxs)) > 1
        record_cudnn("dec-bucket", case, "cudnn (dense kv, real" + (", lengths)" if ragged
                                                                    else ")"),
                     c["q"][:real].reshape(real, 1, kt.N, kt.E), k_d, v_d, ref[:real], scale=scale,
                     cold_inputs=True, bytes_=byts,
                     kv_lens=jnp.asarray(ctxs, jnp.int32) if ragged else None)
        del c, k_d, v_d
    for slots, real, ctx in ((64, 64, 1024), (64, 56, 1024), (64, 48, 1024), (64, 40, 1024),
                             (64, 64, 2048), (64, 48, 2048), (128, 128, 1024), (128, 96, 1024)):
        pad = slots - real
        c = paged_case(rng, [1] * real + [0] * pad, [ctx] * real + [0] * pad)
        c["q"] = jax.random.normal(jax.random.key(2), (slots, kt.N, kt.E), jnp.bfloat16)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        case = f"S={slots} {real} decodes L={ctx}"
        byts = 2 * real * ctx * kt.KH * kt.E * 2 + 2 * real * kt.N * kt.E * 2
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
        q4 = c["q"][:real].reshape(real, 1, kt.N, kt.E)
        record_cudnn("dec-bucket", case, "cudnn (dense kv, real)", q4, k_d, v_d, ref[:real],
                     scale=scale, cold_inputs=True, bytes_=byts)
        del c, k_d, v_d
