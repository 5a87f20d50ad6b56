"""MiniMax-M2 decode on the GPU, reduced depth at full width (jaxserve/models/configs/MiniMax-M2-4L.json,
dummy bf16 weights): the model's decode step per layer at batch 1 / 16 / 64 against its HBM
roofline, with the XLA QK-norm + RoPE + KV write and with the fused Pallas kernel inside the
step; and that kernel alone against XLA.

    python benchmarks/minimax_m2_decode.py [--batch 1 16 64] [--context 1024] [--json out.json]
    python benchmarks/minimax_m2_decode.py --smoke     # tiny shapes, any backend (a CPU interprets)

On the H200, one device call each (a step figure compiles 4 programs per batch size):
    python benchmarks/minimax_m2_decode.py --only kernel --json $OUT/m2_kernel.json
    python benchmarks/minimax_m2_decode.py --only step --batch 1 16 --json $OUT/m2_step_1_16.json
    python benchmarks/minimax_m2_decode.py --only step --batch 64 --json $OUT/m2_step_64.json

The step is the model's forward + logits (no sampler, no host): one jitted program looping the
step over its caches, timed by benchmarks/kernel_timing.py gpu_time_ms (CUPTI kernel time). Per
layer = (step with 4 layers - step with 2 layers) / 2, which removes the embedding and the
200K-vocabulary head. Roofline per layer: the attention and router weights, the experts the
batch reaches (expected distinct of 256 with top-8 under uniform routing: 8 at batch 1, ~102
at 16, ~222 at 64) and the batch's K/V context, over 4.24 TB/s.
Measured on the H200 in session 20 (BENCHMARKS.md, "Reduced-depth MoE decode").

Legend: B batch (decode sequences), L context per sequence, X experts, k chosen per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing as kb  # noqa: E402  (benchmarks/kernel_timing.py: timing and rows)
from reduced_depth_decode import decode_input  # noqa: E402

from jaxserve.models import loader, minimax_m2  # noqa: E402
from jaxserve.models.loaders import dummy  # noqa: E402
from jaxserve.models.attention import AttentionBackend  # noqa: E402
from jaxserve.pallas_kernels import full_qk_norm_rope_kv_write as fqr  # noqa: E402

BLOCK = 16
SMOKE = {"architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16, "num_local_experts": 8,
         "num_experts_per_tok": 2}


def expected_experts(batch: int, x: int, k: int) -> float:
    return x * (1 - (1 - k / x) ** batch)


def layer_roofline_bytes(cfg, batch: int, context: int) -> float:
    d, n, kh, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x, f, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    attn = d * (n + 2 * kh) * e + n * e * d + (n + kh) * e + 2 * d      # wq|wk|wv, wo, norms
    experts = expected_experts(batch, x, k) * 3 * d * f
    kv = batch * context * 2 * kh * e
    return 2.0 * (attn + d * x + experts + kv)                          # bf16


def step_ms(cfg, params, num_layers: int, batch: int, context: int, fused: tuple, impl: str) -> float:
    cfg = dataclasses.replace(cfg, num_layers=num_layers)
    params = dict(params, layers=params["layers"][:num_layers])
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = batch * per_seq + 1
    backend = AttentionBackend(cfg, impl, context=per_seq * BLOCK, itemsize=2)
    plan = backend.plan(batch, batch, batch, np.full(batch, context + 1))
    kernels = minimax_m2.make_kernels(cfg, backend, plan, frozenset(fused))
    x = decode_input(batch, context, per_seq, with_state=False)
    shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [{"k": jnp.zeros(shape, jnp.bfloat16), "v": jnp.zeros(shape, jnp.bfloat16)}
              for _ in range(num_layers)]

    reps = 5 if jax.default_backend() == "cpu" else 20

    def run(p, kv):
        """`reps` decode steps over the carried caches; only a scalar comes out, so the
        parameters are read in place (a carried or returned copy would add 30 GB a call),
        and the caches are copied once a call (under 1 % of the step at batch 64)."""
        def body(_, carry):
            kv, acc = carry
            kv, hidden, _ = minimax_m2.forward(cfg, p, kv, x, kernels)
            return kv, acc + minimax_m2.compute_logits(cfg, p, hidden)[0, 0]
        return jax.lax.fori_loop(0, reps, body, (kv, jnp.float32(0)))[1]

    return kb.gpu_time_ms(jax.jit(run), params, caches, iters=5) / reps


def bench_steps(cfg, params, batches, context: int, impl: str):
    for b in batches:
        for fused in ((), ("rope",)):
            label = "fused rope" if fused else "xla rope"
            t4, t2 = (step_ms(cfg, params, n, b, context, fused, impl) for n in (4, 2))
            per_layer = (t4 - t2) / 2
            byts = layer_roofline_bytes(cfg, b, context)
            kb.record("m2-step", f"B={b} L={context} per layer", label, per_layer, bytes_=byts,
                      note=f"step 4L {t4 * 1e3:.0f} us, 2L {t2 * 1e3:.0f} us; "
                           f"roofline {byts / kb.HBM_BYTES_PER_S * 1e6:.0f} us/layer")


def bench_kernel(cfg, rng, tokens):
    n, kh, e, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
    nb = 4096
    inv = jnp.asarray(1.0 / (cfg.rope_theta ** (np.arange(0, r, 2) / r)), jnp.float32)
    for t in tokens:
        ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 5)
        q = jax.random.normal(ks[0], (t, n, e), jnp.bfloat16)
        k = jax.random.normal(ks[1], (t, kh, e), jnp.bfloat16)
        v = jax.random.normal(ks[2], (t, kh, e), jnp.bfloat16)
        qn = 1 + 0.1 * jax.random.normal(ks[3], (n * e,), jnp.bfloat16)
        kn = 1 + 0.1 * jax.random.normal(ks[4], (kh * e,), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32) + 100
        slots = jnp.asarray(rng.permutation(np.arange(BLOCK, nb * BLOCK))[:t].astype(np.int32))
        kc = jnp.zeros((nb, BLOCK, kh, e), jnp.bfloat16)
        vc = jnp.zeros((nb, BLOCK, kh, e), jnp.bfloat16)
        byts = 2 * t * (n + 2 * kh) * e * 2
        want = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, impl="xla")
        got = fqr.full_qk_norm_rope_kv_write(q, k, v, pos, slots, kc, vc, inv, qn, kn, impl="pallas")
        err = max(kb.rel_err(g, w) for g, w in zip(got, want))
        for impl in ("pallas", "xla"):
            def step(c, impl=impl):
                q_, kc_, vc_ = c
                return fqr.full_qk_norm_rope_kv_write(q_, k, v, pos, slots, kc_, vc_, inv, qn, kn, impl=impl)
            kb.record("m2-qk-rope", f"full qk-norm+rope+kv T={t}", impl, kb.loop_time_ms(step, (q, kc, vc)),
                      bytes_=byts, err=err if impl == "pallas" else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="MiniMax-M2-4L")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--only", default="kernel,step")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any backend)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hf = SMOKE if args.smoke else dummy.read_config(args.config)
    cfg = loader.model_config_from_hf(hf)
    if cfg.num_layers < 4:
        sys.exit(f"{args.config}: needs at least 4 layers (the per-layer figure is 4L - 2L)")
    rng = np.random.default_rng(0)
    kb.COLD = False
    if "kernel" in args.only:
        bench_kernel(cfg, rng, (1, 16) if args.smoke else (1, 16, 64, 2048))
    if "step" in args.only:
        params = loader.dummy_params(dataclasses.replace(cfg, num_layers=4), "bfloat16")
        bench_steps(cfg, params, (1, 4) if args.smoke else args.batch, 32 if args.smoke else args.context,
                    "pallas")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "context": args.context, "rows": kb.ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
