"""Session 17: deeper K/V pipelines for full decode buckets of at most one program per SM
(96-128 (sequence, kv head) programs of 1K or 4K keys), where a program was thought to be
bound by the bytes it keeps in flight rather than by HBM (24 x 1K at Qwen3-30B-A3B's heads, 96
programs: 2.7 TB/s, 1.10 x cuDNN in session 15, run 4). The committed tiling there (pipelined_decode: unsplit,
128-key steps, 5 stages, slots looked up in their step) against more stages at 128 and at
64 keys, two timings each, interleaved, beside cuDNN on the same K/V gathered dense. Timed
as benchmarks/kernels.py times decode (CUPTI, inputs out of L2).

    python3 benchmarks/results/h200-2026-11-30-session17/stages.py [check]

`check` (CPU): every variant in interpret mode on a small case against the reference."""
import functools, os, sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import kernels as kb   # noqa: E402  (benchmarks/kernels.py)

from jaxserve.pallas_kernels import ragged_paged_attention as rpa   # noqa: E402

VARIANTS = {"default": {}}
for bk, stages in ((128, 5), (128, 6), (128, 7), (64, 5), (64, 7), (64, 9)):
    VARIANTS[f"bk{bk} s{stages}"] = dict(block_k=bk, num_stages=stages, num_splits=1,
                                         prefetch_slots=False)
CASES = [("llama3-8b", 12, 1024), ("llama3-8b", 16, 1024), ("qwen3-30b-a3b", 24, 1024),
         ("qwen3-30b-a3b", 32, 1024), ("llama3-8b", 12, 4096), ("qwen3-30b-a3b", 24, 4096)]


def case_args(rng, s, ctx):
    c = kb.paged_case(rng, [1] * s, [ctx] * s)
    return c, (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])


def main(stage):
    rng = np.random.default_rng(0)
    if stage == "check":
        kb.use_model("qwen3-30b-a3b")
        _, args = case_args(rng, 3, 200)
        ref = rpa.ref_ragged_paged_attention(*args, sm_scale=kb.E ** -0.5)
        for label, kw in VARIANTS.items():
            out = rpa.ragged_paged_attention(*args, sm_scale=kb.E ** -0.5, impl="triton",
                                             interpret=True, **kw)
            print(label, f"{kb.rel_err(out, ref):.1e}")
        return
    print(jax.devices())
    for model, s, ctx in CASES:
        kb.use_model(model)
        c, args = case_args(rng, s, ctx)
        scale = kb.E ** -0.5
        byts = 2 * s * ctx * kb.KH * kb.E * 2 + 2 * s * kb.N * kb.E * 2
        ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=scale))(*args)
        fns = {label: jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale,
                                                impl="triton", busy_seqs=s, **kw))
               for label, kw in VARIANTS.items()}
        name = f"{model} {s} x {ctx}"
        for again in ("", " again"):
            for label, f in fns.items():
                out = kb.try_run(label, lambda: f(*args))
                if out is None:
                    continue
                kb.record("stages", name, label + again, kb.time_ms(f, *args, bytes_=byts),
                          bytes_=byts, err=kb.rel_err(out, ref))
        k_d, v_d = kb.dense_kv(c)
        kb.record_cudnn("stages", name, "cudnn", c["q"].reshape(s, 1, kb.N, kb.E), k_d, v_d,
                        ref, scale=scale, cold_inputs=True, bytes_=byts)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
