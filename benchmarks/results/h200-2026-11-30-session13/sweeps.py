"""The thirteenth session's decode sweeps on the H200: kernel timings with inputs out of L2,
split by kernel (attention, merge) from CUPTI, through benchmarks/kernels.py's helpers:

    git show 052ccf2:pallas_kernels/ragged_paged_attention.py \
        > benchmarks/results/h200-2026-11-30-session13/rpa_old.py
    python3 benchmarks/results/h200-2026-11-30-session13/sweeps.py run1|run2|...|run8

"old" is rpa_old.py beside this file (the twelfth session's final kernel, 052ccf2; not kept in
the repository, a copy of committed code); "new" is the code of the moment: README.md says
which code each run had (rerun today, it is the committed default)."""
import functools, os, statistics, sys
_root = os.path.dirname(os.path.abspath(__file__))
while not os.path.exists(os.path.join(_root, "benchmarks", "kernels.py")):
    _root = os.path.dirname(_root)
sys.path.insert(0, os.path.join(_root, "benchmarks"))
import jax, jax.numpy as jnp, numpy as np
import kernels as kb
from jax.experimental.mosaic.gpu import profiler
from jaxserve.pallas_kernels import ragged_paged_attention as rpa


def breakdown(fn, args, bytes_, iters=30):
    """Median per-call CUPTI time by kernel kind ('attn', 'merge', 'other'), inputs cold."""
    sets = kb.input_sets(args, bytes_)
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(many(sets)); jax.block_until_ready(many(sets))
    _, timings = profiler.measure(many, aggregate=False, iterations=iters)(sets)
    per = {}
    for it in timings:
        acc = {}
        for name, t in it:
            kind = "merge" if "merge" in name else "attn" if "ragged" in name else "other"
            acc[kind] = acc.get(kind, 0.0) + t
        for k, v in acc.items():
            per.setdefault(k, []).append(v)
    return {k: statistics.median(v) / len(sets) * 1e3 for k, v in per.items()}


def case(model, s, ctx, variants, rng, reps=2):
    kb.use_model(model)
    c = kb.paged_case(rng, [1] * s, [ctx] * s)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    byts = 2 * s * ctx * kb.KH * kb.E * 2 + 2 * s * kb.N * kb.E * 2
    scale = kb.E ** -0.5
    ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=scale))(*args)
    fs = {name: jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale,
                                          impl="triton" if opts else "pallas", **opts))
          for name, opts in variants.items()}
    for _ in range(reps):
        for name, f in fs.items():
            try:
                err = kb.rel_err(f(*args), ref)
                b = breakdown(f, args, byts)
                tot = sum(b.values())
                print(f"decode {model} S={s} L={ctx}  {name:24s} {tot:8.2f} us  "
                      + "  ".join(f"{k}={v:.2f}" for k, v in sorted(b.items()))
                      + f"  err={err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"# {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    k_d, v_d = kb.dense_kv(c)
    q4 = c["q"].reshape(s, 1, kb.N, kb.E)
    fc = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
        q4, k_d, v_d, scale=scale, implementation="cudnn"))
    for _ in range(reps):
        b = breakdown(fc, (q4, k_d, v_d), byts)
        print(f"decode {model} S={s} L={ctx}  {'cudnn':24s} {sum(b.values()):8.2f} us  "
              + "  ".join(f"{k}={v:.2f}" for k, v in sorted(b.items())), flush=True)


def A(x, bk, st):
    return dict(num_splits=x, block_k=bk, num_stages=st, prefetch_slots=False)


def run1(rng):
    split_vars = {"x2 bk64 s5": A(2, 64, 5), "x2 bk64 s3": A(2, 64, 3),
                  "x2 bk128 s2": dict(num_splits=2, block_k=128, num_stages=2),
                  "x3 bk64 s4": A(3, 64, 4), "x4 bk64 s3": A(4, 64, 3)}
    for model, s, ctx in (("llama3-8b", 16, 1024), ("qwen3-30b-a3b", 32, 1024),
                          ("llama3-8b", 16, 4096)):
        case(model, s, ctx, {"default": {}} | split_vars, rng)
    for model, s, ctx in (("llama3-8b", 4, 4096), ("llama3-8b", 32, 1024)):
        case(model, s, ctx, {"default": {}, "x2 bk64 s5": A(2, 64, 5), "x2 bk64 s3": A(2, 64, 3)}
             | ({"x8 bk64 s5": A(8, 64, 5), "x16 bk64 s3": A(16, 64, 3)} if s == 4 else {}), rng)


def split_variants(s, kh, ctx):
    """Async-slot split tilings around the default's: splits that give about 1-4 programs an
    SM, 64-key steps with 3 or 5 stages, 128-key with 5 where a split has >= 256 keys."""
    work = s * kh
    xs = sorted({min(32, ctx // 64, p // work) for p in (132, 264, 396, 528)})
    out = {}
    for x in xs:
        if x < 2:
            continue
        for bk, st in ((64, 5), (64, 3), (128, 5)):
            if bk == 128 and ctx // x < 256:
                continue
            out[f"x{x} bk{bk} s{st}"] = A(x, bk, st)
    return out


def run2(rng):
    for model, cases in (("llama3-8b", ((1, 1024), (1, 4096), (1, 8192), (1, 32768), (2, 8192),
                                        (4, 1024), (4, 4096), (8, 1024), (8, 4096), (12, 1024))),
                         ("qwen3-30b-a3b", ((1, 8192), (4, 4096), (16, 1024), (16, 4096),
                                            (24, 1024)))):
        kb.use_model(model)
        for s, ctx in cases:
            case(model, s, ctx, {"default": {}} | split_variants(s, kb.KH, ctx), rng, reps=1)


def run3(rng):
    """(a) 67-131 busy programs: unsplit pipelined against 2-4 splits of 64 keys; (b) fewer
    programs: one wave at 1, 2 or 3 programs an SM; (c) the engine's padded 16-slot bucket with
    2-8 busy (busy_seqs 0, its split count from the slots) against cuDNN on the busy ones."""
    for model, cases in (("llama3-8b", ((10, 1024), (12, 1024), (12, 4096), (12, 8192))),
                         ("qwen3-30b-a3b", ((20, 1024), (24, 1024), (24, 8192)))):
        kb.use_model(model)
        for s, ctx in cases:
            case(model, s, ctx, {"default": {}, "x1 bk128 s5": A(1, 128, 5),
                                 "x2 bk64 s5": A(2, 64, 5), "x3 bk64 s5": A(3, 64, 5),
                                 "x4 bk64 s3": A(4, 64, 3)}, rng, reps=1)
    for model, cases in (("llama3-8b", ((6, 1024), (6, 4096), (2, 8192), (3, 8192))),
                         ("qwen3-30b-a3b", ((12, 1024), (12, 8192), (4, 4096)))):
        kb.use_model(model)
        for s, ctx in cases:
            w = s * kb.KH
            v = {"default": {}}
            for p, bk in ((132, 128), (132, 64), (264, 64), (396, 64)):
                x = min(32, ctx // 64, p // w)
                if x >= 2:
                    v[f"x{x} bk{bk} s5"] = A(x, bk, 5)
            case(model, s, ctx, v, rng, reps=1)
    kb.use_model("llama3-8b")
    for busy in (2, 4, 8):
        sparse(16, busy, 8192, rng)


def sparse(slots, busy, ctx, rng):
    c = kb.paged_case(rng, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy))
    c["q"] = jax.random.normal(jax.random.key(2), (slots, kb.N, kb.E), jnp.bfloat16)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    byts = 2 * busy * ctx * kb.KH * kb.E * 2 + 2 * busy * kb.N * kb.E * 2
    scale = kb.E ** -0.5
    f = jax.jit(functools.partial(rpa.ragged_paged_attention, sm_scale=scale, impl="pallas",
                                  busy_seqs=0))
    b = breakdown(f, args, byts)
    print(f"decode S={slots} L={ctx} {busy} busy  default(busy 0) {sum(b.values()):8.2f} us  "
          + "  ".join(f"{k}={v:.2f}" for k, v in sorted(b.items())), flush=True)
    k_d, v_d = kb.dense_kv(dict(c, bt=c["bt"][:busy]))
    q4 = c["q"][:busy].reshape(busy, 1, kb.N, kb.E)
    fc = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
        q4, k_d, v_d, scale=scale, implementation="cudnn"))
    b = breakdown(fc, (q4, k_d, v_d), byts)
    print(f"decode S={slots} L={ctx} {busy} busy  cudnn {sum(b.values()):8.2f} us", flush=True)



sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import rpa_old  # noqa: E402
except ImportError:
    rpa_old = None   # run1-run3 do not need it


def bucket_case(model, qlens, ctxs, rng):
    """A bucket of len(qlens) slots and as many tokens (padding tokens after the busy ones) at
    `model`'s heads: (case, kernel args, bytes, XLA reference, real tokens, busy slots)."""
    kb.use_model(model)
    slots = len(qlens)
    c = kb.paged_case(rng, qlens, ctxs)
    t = sum(qlens)
    if t < slots:
        c["q"] = jax.random.normal(jax.random.key(2), (slots, kb.N, kb.E), jnp.bfloat16)
    args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
    byts = sum(2 * L * kb.KH * kb.E * 2 + 2 * q * kb.N * kb.E * 2 for q, L in zip(qlens, ctxs))
    ref = jax.jit(functools.partial(rpa.xla_ragged_paged_attention, sm_scale=kb.E ** -0.5))(*args)
    return c, args, byts, ref, t, sum(1 for q in qlens if q)


def case2(model, qlens, ctxs, variants, rng, reps=2, cudnn=True):
    """Bucket of len(qlens) slots and as many tokens (padding tokens after the busy ones);
    variants name -> (module, options); cuDNN on the busy decodes."""
    c, args, byts, ref, t, busy = bucket_case(model, qlens, ctxs, rng)
    slots = len(qlens)
    scale = kb.E ** -0.5
    name = f"{model} S={slots} L={max(ctxs)}" + (f" {busy} busy" if busy < slots else "") + \
        (" chunk" if max(qlens) > 1 else "")
    kw_name = max(len(k) for k in variants)
    fs = {k: jax.jit(functools.partial(mod.ragged_paged_attention, sm_scale=scale,
                                       impl="pallas", **opts))
          for k, (mod, opts) in variants.items()}
    for _ in range(reps):
        for k, f in fs.items():
            try:
                err = kb.rel_err(f(*args)[:t], ref[:t])
                b = breakdown(f, args, byts)
                print(f"decode {name:36s} {k:12s} {sum(b.values()):8.2f} us  "
                      + "  ".join(f"{a}={v:.2f}" for a, v in sorted(b.items()))
                      + f"  err={err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"# {k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if cudnn and max(qlens) == 1:
        k_d, v_d = kb.dense_kv(dict(c, bt=c["bt"][:busy]))
        q4 = c["q"][:busy].reshape(busy, 1, kb.N, kb.E)
        fc = jax.jit(lambda q4, k_d, v_d: jax.nn.dot_product_attention(
            q4, k_d, v_d, scale=scale, implementation="cudnn"))
        for _ in range(reps):
            b = breakdown(fc, (q4, k_d, v_d), byts)
            print(f"decode {name:36s} {'cudnn':12s} {sum(b.values()):8.2f} us", flush=True)


def padded(variants, rng, llama_busies, qwen_buckets=((16, (2, 8)), (32, (4, 16, 24)))):
    """Padded 16-slot buckets at Llama-3.1-8B's heads and 16-/32-slot ones at Qwen3-30B-A3B's
    (busy decodes of 1K and 8K keys first, the rest padding), then a bucket of 11 slots holding
    a 6-token prompt chunk and 4 decodes, once each."""
    buckets = [("llama3-8b", 16, llama_busies)] + [
        ("qwen3-30b-a3b", s, b) for s, b in qwen_buckets]
    for model, slots, busies in buckets:
        for busy in busies:
            for ctx in (1024, 8192):
                case2(model, [1] * busy + [0] * (slots - busy),
                      [ctx] * busy + [0] * (slots - busy), variants, rng, reps=1)
    case2("llama3-8b", [6, 1, 1, 1, 1] + [0] * 6, [4000, 1000, 3000, 8000, 17] + [0] * 6,
          variants, rng, reps=1)


def run4(rng):
    """Session 13's split tilings (split_decode_tiling) against HEAD's kernel, cuDNN beside:
    (a) full buckets; (b) padded 16- and 32-slot buckets with busy_seqs 0 (the engine below
    its floor); (c) a padded bucket holding a prompt chunk (correctness)."""
    ab = {"old": (rpa_old, {}), "new": (rpa, {})}
    for model, cases in (("llama3-8b", ((1, 1024), (1, 8192), (4, 4096), (16, 1024), (6, 1024),
                                        (8, 4096), (12, 1024), (12, 4096))),
                         ("qwen3-30b-a3b", ((1, 1024), (1, 8192), (4, 4096), (16, 1024),
                                            (24, 1024), (24, 8192)))):
        for s, ctx in cases:
            case2(model, [1] * s, [ctx] * s, ab, rng)
    padded({"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}, rng,
           (1, 2, 4, 8, 12))


def run5(rng):
    """Why a padded bucket whose busy items leave one split each (12 busy of 16 slots at 8 kv
    heads: 96 items) runs slower in fill mode than the static unsplit tiling."""
    P = dict(num_splits=1, block_k=128, num_stages=5, prefetch_slots=False)
    F = dict(num_splits=16, block_k=128, num_stages=5, prefetch_slots=False, fill_splits=True)
    for model, slots, busy, kh in (("llama3-8b", 16, 12, 8), ("llama3-8b", 16, 10, 8),
                                   ("qwen3-30b-a3b", 32, 24, 4)):
        for ctx in (1024, 8192):
            v = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0)),
                 "piped x1": (rpa, P), "fill P=132": (rpa, F),
                 "fill P=96": (rpa, dict(F, fill_programs=busy * kh)),
                 "fill P=128": (rpa, dict(F, fill_programs=128)),
                 "fill x2": (rpa, dict(F, num_splits=2, fill_programs=2 * busy * kh)),
                 "split x2": (rpa, dict(P, num_splits=2))}
            case2(model, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
                  v, rng, reps=1)
        case2(model, [1] * busy, [8192] * busy, {"new": (rpa, {})}, rng, reps=1)


def run6(rng):
    """(a) fill mode's busy programs spread over its grid (then 132 programs of 128-key steps),
    against HEAD and against the same sequences in a full bucket (no idle programs); (b) run4
    again."""
    for model, slots, busy in (("llama3-8b", 16, 12), ("llama3-8b", 16, 10),
                               ("qwen3-30b-a3b", 32, 24)):
        for ctx in (1024, 8192):
            v = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}
            case2(model, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
                  v, rng, reps=1)
            case2(model, [1] * busy, [ctx] * busy, {"new": (rpa, {})}, rng, reps=1,
                  cudnn=False)   # the same sequences in a full bucket: no idle programs
    run4(rng)


def run7(rng):
    """Fill mode's grid: 132 programs of 128-key steps (one an SM) against 264 or 396 of 64-key
    steps (two or three an SM, 5 stages), on padded buckets (busy_seqs 0)."""
    F64 = dict(num_splits=32, block_k=64, num_stages=5, prefetch_slots=False, fill_splits=True)
    v = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0)),
         "fill64 P=264": (rpa, dict(F64, fill_programs=264)),
         "fill64 P=396": (rpa, dict(F64, fill_programs=396))}
    padded(v, rng, (2, 4, 8, 10, 12), qwen_buckets=((32, (4, 24)),))


def run8(rng):
    """The final code (fill mode: 264 programs of 64-key 5-stage steps) against HEAD, once
    each: padded buckets (busy_seqs 0), one holding a prompt chunk, and full buckets."""
    padded({"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}, rng,
           (1, 2, 4, 8, 10, 12))
    ab = {"old": (rpa_old, {}), "new": (rpa, {})}
    for model, cases in (("llama3-8b", ((1, 1024), (1, 8192), (4, 4096), (16, 1024), (32, 1024),
                                        (8, 4096), (12, 1024))),
                         ("qwen3-30b-a3b", ((1, 1024), (1, 8192), (4, 4096), (16, 1024),
                                            (32, 1024), (24, 1024)))):
        for s, ctx in cases:
            case2(model, [1] * s, [ctx] * s, ab, rng, reps=1)


if __name__ == "__main__":
    if rpa_old is None and sys.argv[1] not in ("run1", "run2", "run3"):
        sys.exit("write the old kernel beside this script first (see the docstring)")
    print(jax.devices(), flush=True)
    globals()[sys.argv[1]](np.random.default_rng(0))
