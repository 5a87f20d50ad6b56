"""Decode attention against cuDNN reading the same paged cache (a like-for-like baseline),
beside cuDNN on the K/V gathered dense (the bar of BENCHMARKS.md's decode table). cuDNN's paged
mode is reached through jax._src.cudnn.fused_attention_stablehlo.paged_attention (jax.nn's
dot_product_attention takes no page table in jax 0.11.2); it needs exactly batch x
blocks-per-sequence cache blocks, so here the cache holds only the batch's blocks, scattered (a
shuffled pool), and our kernel reads the same cache through the same tables. Timed as
benchmarks/kernels.py (kernel_timing.py) times decode (CUPTI, inputs out of L2), two timings each, interleaved.

    python3 benchmarks/paged_cudnn.py
"""
import functools, os, sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing as kb   # noqa: E402  (benchmarks/kernel_timing.py)

from jaxserve.pallas_kernels.ragged_paged_attention import reference, wrapper   # noqa: E402

CASES = [("llama3-8b", 12, 1024), ("llama3-8b", 16, 1024), ("llama3-8b", 32, 1024),
         ("llama3-8b", 4, 4096), ("llama3-8b", 32, 8192), ("qwen3-30b-a3b", 24, 1024),
         ("qwen3-30b-a3b", 32, 1024)]


def case(rng, s, ctx, p):
    blocks = ctx // p
    nb = s * blocks
    key = jax.random.key(int(rng.integers(1 << 30)))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (s, kb.N, kb.E), jnp.bfloat16)
    k = jax.random.normal(kk, (nb, p, kb.KH, kb.E), jnp.bfloat16)
    v = jax.random.normal(kv, (nb, p, kb.KH, kb.E), jnp.bfloat16)
    bt = jnp.asarray(rng.permutation(nb).astype(np.int32).reshape(s, blocks))
    qsl = jnp.arange(s + 1, dtype=jnp.int32)
    lens = jnp.full((s,), ctx, jnp.int32)
    return q, k, v, qsl, lens, bt


def main():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    print(jax.devices())
    rng = np.random.default_rng(0)
    for model, s, ctx in CASES:
        kb.use_model(model)
        scale = kb.E ** -0.5
        byts = 2 * s * ctx * kb.KH * kb.E * 2 + 2 * s * kb.N * kb.E * 2
        for p in (16, 64):
            q, k, v, qsl, lens, bt = case(rng, s, ctx, p)
            args = (q, k, v, qsl, lens, bt)
            ref = jax.jit(functools.partial(reference.xla_ragged_paged_attention, sm_scale=scale))(*args)
            ours = jax.jit(functools.partial(wrapper.ragged_paged_attention, sm_scale=scale,
                                             impl="pallas"))
            pt = bt[:, None, :, None]
            ones = jnp.ones((s,), jnp.int32)
            paged = jax.jit(lambda q4, k, v, lens, pt: fa.paged_attention(
                q4, k, v, ones, lens, pt, pt, scale=scale, mask_type=fa.MaskType.PADDING))
            pargs = (q.reshape(s, 1, kb.N, kb.E), k, v, lens, pt)
            k_d = k[bt].reshape(s, ctx, kb.KH, kb.E)
            v_d = v[bt].reshape(s, ctx, kb.KH, kb.E)
            dense = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
                q4, k_d, v_d, scale=scale, implementation="cudnn"))
            dargs = (q.reshape(s, 1, kb.N, kb.E), k_d, v_d)
            name = f"{model} {s} x {ctx} P={p}"
            runs = {"ours": (ours, args), "cudnn paged": (paged, pargs),
                    "cudnn dense": (dense, dargs)}
            for again in ("", " again"):
                for label, (f, a) in runs.items():
                    out = kb.try_run(f"{label} ({name})", lambda: f(*a))
                    if out is None:
                        continue
                    kb.record("paged", name, label + again, kb.time_ms(f, *a, bytes_=byts),
                              bytes_=byts, err=kb.rel_err(out.reshape(ref.shape), ref))
            del k, v, k_d, v_d


if __name__ == "__main__":
    main()
