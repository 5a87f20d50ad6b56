"""The twelfth session's decode sweeps on the H200, kernel timings with inputs out of L2 through
benchmarks/kernels.py's helpers:

    git show 1389bef:pallas_kernels/ragged_paged_attention.py \
        > benchmarks/results/h200-2026-11-30-session12/rpa_old.py
    python3 benchmarks/results/h200-2026-11-30-session12/sweeps.py run1|run2|run3|run4|run5|run6|run7|run8

"old" is rpa_old.py beside this file (the eleventh session's final kernel, 1389bef; not kept in
the repository, a copy of committed code); "new"/"default" is the code of the moment (README.md
says which code each run had: rerun today, it is the committed default)."""
import functools, os, sys
_root = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(_root, "benchmarks", "kernels.py")):
    _root = os.path.dirname(_root)
sys.path.insert(0, os.path.join(_root, "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
from jaxserve.pallas_kernels import ragged_paged_attention as rpa
try:
    import rpa_old
except ImportError:
    sys.exit("write the old kernel beside this script first: git show 1389bef:pallas_kernels/"
             "ragged_paged_attention.py > " + os.path.join(os.path.dirname(__file__), "rpa_old.py"))

CASES = [(1, 1024), (1, 8192), (4, 4096), (16, 1024), (32, 1024), (32, 8192), (64, 1024),
         (64, 2048), (128, 1024), (128, 8192)]
ASYNC = dict(num_splits=1, prefetch_slots=False)


def time_case(model, slots, busy, ctx, variants, rng, *, reps=2, cudnn=2):
    """Time each variant name -> (module, options) `reps` times, alternating, on a bucket of
    `slots` one-token slots whose first `busy` hold decodes of `ctx` keys; then cuDNN on them."""
    kb.use_model(model)
    c = kb.paged_case(rng, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy))
    if busy < slots:   # padding tokens past the busy ones
        c["q"] = jax.random.normal(jax.random.key(2), (slots, kb.N, kb.E), jnp.bfloat16)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    case = f"{model} S={slots} L={ctx}" + (f" {busy} busy" if busy < slots else "")
    byts = 2 * busy * ctx * kb.KH * kb.E * 2 + 2 * busy * kb.N * kb.E * 2
    scale = kb.E ** -0.5
    ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=scale))(*args)
    fs = {name: jax.jit(functools.partial(mod.ragged_paged_attention, sm_scale=scale,
                                          impl="pallas" if not opts else "triton", **opts))
          for name, (mod, opts) in variants.items()}
    for _ in range(reps):
        for name, f in fs.items():
            def go(f=f, name=name):
                out = f(*args)
                kb.record("decode", case, name, kb.time_ms(f, *args, bytes_=byts),
                          bytes_=byts, err=kb.rel_err(out[:busy], ref[:busy]))
            kb.try_run(name, go)
    if cudnn:
        k_d, v_d = kb.dense_kv(dict(c, bt=c["bt"][:busy]))
        q4 = c["q"][:busy].reshape(busy, 1, kb.N, kb.E)
        for _ in range(cudnn):
            kb.record_cudnn("decode", case, "cudnn", q4, k_d, v_d, ref[:busy], scale=scale,
                            cold_inputs=True, bytes_=byts)


def run1(rng):
    """Old against new (one round of start loads, first block-table entries guessed), and the
    async-slot lead (5 stages, slots looked up in their step) on the pipelined grids."""
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        kb.use_model(model)
        for s, ctx in CASES:
            variants = {"old": (rpa_old, {}), "new": (rpa, {})}
            pk = rpa.pipelined_decode(s, s, kb.N, kb.KH, None)
            if pk:
                variants["new s5 async slots"] = (rpa, dict(ASYNC, block_k=pk, num_stages=5))
            time_case(model, s, s, ctx, variants, rng)


def run2(rng):
    """(a) old against the new default (async slots, 5 stages, pipelined grids) on every case;
    (b) sparsely busy buckets: the default against pipelined async slots below the busy bound;
    (c) multi-wave grids and 16 x 1K: stages and key-step sizes with async slots."""
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        kb.use_model(model)
        for s, ctx in CASES:
            variants = {"old": (rpa_old, {}), "new": (rpa, {})}
            if (model, s) in (("llama3-8b", 16), ("qwen3-30b-a3b", 32)):
                variants.update({f"bk{bk} s{st}": (rpa, dict(ASYNC, block_k=bk, num_stages=st))
                                 for bk, st in ((128, 4), (128, 6), (64, 5), (64, 8))})
            if s * kb.KH > 2 * 132:   # multi-wave: async slots at both step sizes
                variants.update({f"bk{bk} s{st}": (rpa, dict(ASYNC, block_k=bk, num_stages=st))
                                 for bk, st in ((128, 3), (128, 4), (64, 3), (64, 4), (64, 5))})
            time_case(model, s, s, ctx, variants, rng)
    for model, slots, busies in (("llama3-8b", 16, (8, 10, 12, 13)),
                                 ("qwen3-30b-a3b", 32, (16, 20, 24, 26))):
        kb.use_model(model)
        for busy in busies:
            for ctx in (1024, 4096):
                time_case(model, slots, busy, ctx, {
                    "default": (rpa, {}), "piped async": (rpa, dict(ASYNC, block_k=128,
                                                                    num_stages=5))},
                    rng, cudnn=1)


def run3(rng):
    """(a) sparsely busy buckets: the default told how many slots are busy (busy_seqs; split
    below the busy bound) against pipelined async slots; (b) grids past two programs an SM:
    the default against 64-key async-slot steps; (c) 16 x 1K step sizes and stages, 4 times."""
    piped = {128: dict(ASYNC, block_k=128, num_stages=5), 64: dict(ASYNC, block_k=64,
                                                                     num_stages=5)}
    for model, slots, busies, step in (("llama3-8b", 16, (8, 10, 12, 13), 128),
                                       ("qwen3-30b-a3b", 32, (16, 20, 24, 26), 128),
                                       ("llama3-8b", 32, (10, 11, 12, 13), 64)):
        kb.use_model(model)
        for busy in busies:
            for ctx in (1024, 4096):
                time_case(model, slots, busy, ctx, {
                    "default": (rpa, dict(busy_seqs=busy)), "piped async": (rpa, piped[step])},
                    rng, cudnn=1)
    for model, cases in (("llama3-8b", ((96, 1024), (96, 4096), (128, 2048), (128, 4096),
                                        (256, 1024))),
                         ("qwen3-30b-a3b", ((256, 1024), (256, 4096)))):
        kb.use_model(model)
        for s, ctx in cases:
            time_case(model, s, s, ctx, {"default": (rpa, {})} | {
                f"bk64 s{st}": (rpa, dict(ASYNC, block_k=64, num_stages=st)) for st in (3, 4)},
                rng, cudnn=1)
    kb.use_model("llama3-8b")
    time_case("llama3-8b", 16, 16, 1024, {"default": (rpa, {})} | {
        f"bk{bk} s{st}": (rpa, dict(ASYNC, block_k=bk, num_stages=st))
        for bk, st in ((64, 6), (64, 8), (128, 6))}, rng, reps=4)


def run4(rng):
    """Launch order: the default grid (query tiles, kv heads, splits) against kv heads inner
    (heads_inner=True), (a) on full buckets, (b) on sparsely busy ones (the default told how
    many slots are busy), (c) with 64-key async-slot steps on grids of several waves."""
    inner = dict(heads_inner=True)
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        kb.use_model(model)
        for s, ctx in CASES:
            time_case(model, s, s, ctx, {"default": (rpa, {}), "heads inner": (rpa, inner)},
                      rng, cudnn=1)
    for model, slots, busies in (("llama3-8b", 32, (10, 13, 16, 20, 24)),
                                 ("llama3-8b", 16, (8, 12)),
                                 ("qwen3-30b-a3b", 64, (20, 32, 40))):
        kb.use_model(model)
        for busy in busies:
            for ctx in (1024, 4096):
                time_case(model, slots, busy, ctx, {
                    "default": (rpa, dict(busy_seqs=busy)),
                    "heads inner": (rpa, dict(busy_seqs=busy, heads_inner=True))}, rng, cudnn=1)
    kb.use_model("llama3-8b")
    for s, ctx in ((96, 1024), (128, 8192), (256, 1024)):
        time_case("llama3-8b", s, s, ctx, {
            "default": (rpa, {}), "heads inner": (rpa, inner),
            "bk64 s3": (rpa, dict(ASYNC, block_k=64, num_stages=3)),
            "bk64 s3 heads inner": (rpa, dict(ASYNC, block_k=64, num_stages=3, **inner))},
            rng, cudnn=1)


def run5(rng):
    """The final code ("new") against the eleventh session's ("old"), alternated: every decode
    case at both models' heads; sparsely busy buckets with busy_seqs as the engine passes it
    (the count from pipelined_busy_floor up, else 0); grids of several waves."""
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        kb.use_model(model)
        for s, ctx in CASES:
            time_case(model, s, s, ctx, {"old": (rpa_old, {}), "new": (rpa, {})}, rng)
    for model, slots, busies in (("llama3-8b", 32, (10, 13, 16, 20)),
                                 ("llama3-8b", 16, (8, 12)),
                                 ("qwen3-30b-a3b", 64, (20, 32))):
        kb.use_model(model)
        for busy in busies:
            hint = busy if busy >= rpa.pipelined_busy_floor(kb.KH) else 0
            for ctx in (1024, 4096):
                time_case(model, slots, busy, ctx, {
                    "old": (rpa_old, dict(busy_seqs=hint)), "new": (rpa, dict(busy_seqs=hint))},
                    rng, cudnn=1)
    for model, s, ctx in (("llama3-8b", 96, 1024), ("llama3-8b", 128, 8192),
                          ("llama3-8b", 256, 1024), ("qwen3-30b-a3b", 256, 1024)):
        kb.use_model(model)
        time_case(model, s, s, ctx, {"old": (rpa_old, {}), "new": (rpa, {})}, rng, cudnn=1)


def run6(rng):
    """(a) Sparsely busy buckets of 512-1,024 programs (busy_seqs 0, as the engine passes it
    there), old against new; (b) 16 decodes at 8 kv heads over 128-2K keys, ours against
    cuDNN: where the 16 x 1K gap lies, in the fixed cost (intercept) or the rate (slope)."""
    for model, slots, busies in (("llama3-8b", 64, (33, 40, 48, 56)),
                                 ("llama3-8b", 128, (65, 80, 96, 112)),
                                 ("qwen3-30b-a3b", 128, (66, 80, 96))):
        kb.use_model(model)
        for busy in busies:
            time_case(model, slots, busy, 1024, {
                "old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))},
                rng, cudnn=1)
    kb.use_model("llama3-8b")
    for ctx in (128, 256, 512, 1024, 2048):
        time_case("llama3-8b", 16, 16, ctx, {"new": (rpa, {})}, rng)


def run7(rng):
    """128 slots at 8 kv heads (1,024 programs) with 65-112 busy, busy_seqs as the engine
    passes it (tiling_busy_floor: 100 from 100 busy up, else 0), old against new."""
    kb.use_model("llama3-8b")
    floor = rpa.tiling_busy_floor(128, 128, kb.N, kb.KH)
    for busy in (65, 80, 96, 100, 112):
        hint = floor if busy >= floor else 0
        time_case("llama3-8b", 128, busy, 1024, {
            "old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=hint))},
            rng, cudnn=1)


def run8(rng):
    """Deeper K/V pipelines for the pipelined grids (Triton 3.9 keeps (stages - 1) // 2 K/V
    buffers with slots in their step): 64-key steps with 8, 10, 12 stages (3-5 buffers),
    128-key with 8 (3), 32-key with 16 (7), against the default; three timings each."""
    deep = {f"bk{bk} s{st}": (rpa, dict(ASYNC, block_k=bk, num_stages=st))
            for bk, st in ((64, 8), (64, 10), (64, 12), (128, 8), (32, 16))}
    for model, s, ctx in (("llama3-8b", 16, 1024), ("llama3-8b", 16, 4096),
                          ("qwen3-30b-a3b", 32, 1024), ("qwen3-30b-a3b", 32, 8192)):
        kb.use_model(model)
        time_case(model, s, s, ctx, {"default": (rpa, {})} | deep, rng, reps=3, cudnn=1)
    kb.use_model("llama3-8b")
    time_case("llama3-8b", 32, 32, 1024, {"default": (rpa, {}), "bk64 s8": deep["bk64 s8"]},
              rng, reps=3, cudnn=1)


if __name__ == "__main__":
    globals()[sys.argv[1]](np.random.default_rng(0))
