"""The fourteenth session's decode sweeps on the H200 (CUPTI time by kernel, inputs out of L2,
through session 13's `breakdown`):

    git show d18907e:pallas_kernels/ragged_paged_attention.py | \
        sed 's/from jaxserve.pallas_kernels.split_merge import/from split_merge_old import/' \
        > benchmarks/results/h200-2026-11-30-session14/rpa_old.py
    git show d18907e:pallas_kernels/split_merge.py \
        > benchmarks/results/h200-2026-11-30-session14/split_merge_old.py
    python3 benchmarks/results/h200-2026-11-30-session14/sweeps.py run1|...

"old" is the thirteenth session's final kernel and merge (d18907e; copies of committed code,
not kept), "new" the code of the moment (README.md says which). cuDNN reads the busy
sequences' K/V gathered dense, padded to the longest with key_value_seq_lengths where the
contexts differ (`cudnn+len`), as jax.nn.dot_product_attention needs for a ragged batch."""
import functools, importlib.util, os, sys
import jax, jax.numpy as jnp, numpy as np
_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)      # split_merge_old, for rpa_old


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rpa_old = _load("rpa_old14", os.path.join(_here, "rpa_old.py"))
s13 = _load("sweeps13", os.path.join(os.path.dirname(_here), "h200-2026-11-30-session13",
                                     "sweeps.py"))
breakdown, kb = s13.breakdown, s13.kb
from jaxserve.pallas_kernels import ragged_paged_attention as rpa   # noqa: E402


def bucket(model, qlens, ctxs, variants, rng, label=""):
    """One padded or full decode bucket (slots = len(qlens)): each variant (module, options)
    and cuDNN on the busy decodes, with their lengths when they differ."""
    c, args, byts, ref, t, busy = s13.bucket_case(model, qlens, ctxs, rng)
    scale = kb.E ** -0.5
    name = f"{model} S={len(qlens)} {label}"
    for k, (mod, opts) in variants.items():
        f = jax.jit(functools.partial(mod.ragged_paged_attention, sm_scale=scale,
                                      impl="pallas", **opts))
        try:
            err = kb.rel_err(f(*args)[:t], ref[:t])
            b = breakdown(f, args, byts)
            tot = sum(b.values())
            print(f"{name:44s} {k:10s} {tot:8.2f} us  {byts / tot / 4.24e4:5.1f}%  "
                  + "  ".join(f"{a}={v:.2f}" for a, v in sorted(b.items()))
                  + f"  err={err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"# {k}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    k_d, v_d = kb.dense_kv(dict(c, bt=c["bt"][:busy]))
    q4 = c["q"][:busy].reshape(busy, 1, kb.N, kb.E)
    lens = jnp.asarray([L for q, L in zip(qlens, ctxs) if q], jnp.int32)
    ragged = len(set(lens.tolist())) > 1
    fc = jax.jit(lambda q4, k_d, v_d, lens: jax.nn.dot_product_attention(
        q4, k_d, v_d, scale=scale, implementation="cudnn",
        key_value_seq_lengths=lens if ragged else None))
    b = breakdown(fc, (q4, k_d, v_d, lens), byts)
    tot = sum(b.values())
    print(f"{name:44s} {'cudnn+len' if ragged else 'cudnn':10s} {tot:8.2f} us  "
          f"{byts / tot / 4.24e4:5.1f}%", flush=True)


def FILL(x=32):
    return dict(num_splits=x, block_k=64, num_stages=5, prefetch_slots=False, fill_splits=True)


def padded_even(variants, rng):
    """Padded buckets of even contexts (busy decodes first, the rest padding)."""
    for model, slots, busy, ctx in (("llama3-8b", 16, 2, 8192), ("llama3-8b", 16, 12, 1024),
                                    ("llama3-8b", 16, 8, 8192), ("qwen3-30b-a3b", 32, 24, 1024),
                                    ("qwen3-30b-a3b", 32, 4, 8192)):
        bucket(model, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
               variants, rng, f"{busy} busy x {ctx}")


def run1(rng):
    """(a) padded buckets of equal contexts, old against new (the split counts are the same:
    a check that nothing else moved); (b) padded buckets of mixed contexts (one long among
    short ones), old (every busy item split alike) against new (splits by key steps); (c) full
    buckets of mixed and of equal contexts: the default tiling (unsplit, or split by the grid's
    size) against fill_splits forced, to see what fill mode would cost and gain there."""
    pad = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}
    padded_even(pad, rng)
    mixes = (("llama3-8b", 16, [32768] + [1024] * 3), ("llama3-8b", 16, [8192] + [512] * 3),
             ("llama3-8b", 16, [16384] + [1024] * 7), ("llama3-8b", 16, [32768] + [2048] * 11),
             ("llama3-8b", 16, [4096, 2048, 1024, 512, 256, 128, 3000, 700]),
             ("qwen3-30b-a3b", 32, [32768] + [1024] * 15))
    for model, slots, ctxs in mixes:
        busy = len(ctxs)
        bucket(model, [1] * busy + [0] * (slots - busy), ctxs + [0] * (slots - busy), pad, rng,
               f"{busy} busy, {max(ctxs)} + {len(ctxs) - 1} short")
    full = {"default": (rpa, {}), "fill": (rpa, FILL())}
    for model, ctxs in (("llama3-8b", [32768] + [1024] * 15), ("llama3-8b", [8192] + [1024] * 15),
                        ("llama3-8b", [1024] * 16), ("llama3-8b", [4096] * 16),
                        ("llama3-8b", [1024] * 12), ("llama3-8b", [8192] * 4),
                        ("llama3-8b", [16384] + [1024] * 31), ("llama3-8b", [1024] * 32),
                        ("qwen3-30b-a3b", [32768] + [1024] * 31),
                        ("qwen3-30b-a3b", [1024] * 32)):
        bucket(model, [1] * len(ctxs), ctxs, full, rng,
               f"full, {max(ctxs)} + {len(ctxs) - 1}" if len(set(ctxs)) > 1
               else f"full, {len(ctxs)} x {ctxs[0]}")


def run2(rng):
    """(a) run1's padded buckets of equal contexts again (new: one sequence search less); (b)
    full buckets of 128 items (16 slots at 8 kv heads, 32 at 4) as their contexts spread
    further from even: default against fill_splits; (c) 32 slots at 8 kv heads (256 items):
    fill grids of 396 and 528 programs against the default."""
    pad = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}
    padded_even(pad, rng)
    full = {"default": (rpa, {}), "fill": (rpa, FILL())}
    for model, s in (("llama3-8b", 16), ("qwen3-30b-a3b", 32)):
        for mean in (1024, 4096):
            spreads = [(f"one {r}x", [mean] * (s - 1) + [int(mean * r)]) for r in (1.25, 1.5, 2, 3)]
            spreads += [(f"spread {w}", [int(mean * (1 - w + 2 * w * i / (s - 1))) // 16 * 16
                                         for i in range(s)]) for w in (0.25, 0.5)]
            for label, ctxs in spreads:
                bucket(model, [1] * s, ctxs, full, rng,
                       f"full {mean} {label} max/mean {max(ctxs) / np.mean(ctxs):.2f}")
    big = {"default": (rpa, {}), "fill P=396": (rpa, dict(FILL(), fill_programs=396)),
           "fill P=528": (rpa, dict(FILL(), fill_programs=528))}
    for ctxs in ([16384] + [1024] * 31, [4096] + [1024] * 31, [1024] * 32, [4096] * 32,
                 [int(1024 * (0.5 + i / 31)) // 16 * 16 for i in range(32)]):
        bucket("llama3-8b", [1] * 32, ctxs, big, rng,
               f"full 32, max/mean {max(ctxs) / np.mean(ctxs):.2f} max {max(ctxs)}")


def run3(rng):
    """Grids of 133-264 programs (32 slots at 8 kv heads, 64 at 4): (a) padded (busy count not
    said): the default (unsplit 128-key 2-stage) against fill grids of 396 and 528 programs,
    even and skewed contexts; (b) full buckets whose contexts grow skewed: the default
    (pipelined 64-key, the busy count said) against the same fill grids."""
    fills = {"fill P=396": (rpa, dict(FILL(), fill_programs=396)),
             "fill P=528": (rpa, dict(FILL(), fill_programs=528))}
    pad = {"default": (rpa, dict(busy_seqs=0))} | fills
    for model, slots, busies in (("llama3-8b", 32, (2, 4, 8, 12)),
                                 ("qwen3-30b-a3b", 64, (4, 16, 24))):
        for busy in busies:
            for ctx in (1024, 8192):
                bucket(model, [1] * busy + [0] * (slots - busy),
                       [ctx] * busy + [0] * (slots - busy), pad, rng, f"{busy} busy x {ctx}")
        for ctxs in ([16384] + [1024] * 7, [4096] + [1024] * 11):
            busy = len(ctxs)
            bucket(model, [1] * busy + [0] * (slots - busy), ctxs + [0] * (slots - busy), pad,
                   rng, f"{busy} busy, {max(ctxs)} + {busy - 1} short")
    full = {"default": (rpa, {})} | fills
    for model, s in (("llama3-8b", 32), ("qwen3-30b-a3b", 64)):
        for mean in (1024, 4096):
            for r in (2, 3):
                ctxs = [mean] * (s - 1) + [int(mean * r)]
                bucket(model, [1] * s, ctxs, full, rng,
                       f"full {mean} one {r}x max/mean {max(ctxs) / np.mean(ctxs):.2f}")


def engine_hint(mod, slots, ctxs, context=32768):
    """busy_seqs as the engine (runner.busy_floor) passes it to kernel module `mod` for a
    bucket of `slots` one-token slots holding decodes of `ctxs` keys (old: no skew rule)."""
    shape = (slots, slots, kb.N, kb.KH)
    floor = mod.tiling_busy_floor(*shape, context=context)
    if not floor or len(ctxs) < floor:
        return 0
    if hasattr(mod, "skewed_contexts") and mod.skewed_contexts(ctxs):
        unsaid = mod.special_decode_tiling(*shape, 0, context=context)
        if unsaid and unsaid.fill_splits:
            return 0
    return floor


def run4(rng):
    """The final code against old as the engine calls them (busy_seqs as runner.busy_floor
    gives it): padded 32-slot buckets (now fill_splits over 396 programs), one holding a
    prompt chunk, 16-slot ones of even contexts (unchanged but for the split counts' cost), and
    full buckets of skewed contexts (now fill_splits, the engine not saying the busy count)."""
    for model, slots, busy, ctx in (("llama3-8b", 32, 2, 8192), ("llama3-8b", 32, 8, 1024),
                                    ("llama3-8b", 32, 12, 8192), ("llama3-8b", 16, 12, 1024),
                                    ("llama3-8b", 16, 4, 8192), ("qwen3-30b-a3b", 64, 16, 4096),
                                    ("qwen3-30b-a3b", 32, 24, 1024)):
        kb.use_model(model)
        ab = {m: (mod, dict(busy_seqs=engine_hint(mod, slots, [ctx] * busy)))
              for m, mod in (("old", rpa_old), ("new", rpa))}
        bucket(model, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
               ab, rng, f"{busy} busy x {ctx}")
    kb.use_model("llama3-8b")
    chunk = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0))}
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28, chunk,
           rng, "20-token chunk + 3 decodes")
    for model, ctxs in (("llama3-8b", [8192] + [1024] * 15), ("llama3-8b", [2048] + [1024] * 15),
                        ("llama3-8b", [1024] * 16), ("llama3-8b", [16384] + [1024] * 31),
                        ("llama3-8b", [2048] + [1024] * 31),
                        ("qwen3-30b-a3b", [8192] + [1024] * 31),
                        ("qwen3-30b-a3b", [16384] + [2048] * 63)):
        kb.use_model(model)
        s = len(ctxs)
        ab = {m: (mod, dict(busy_seqs=engine_hint(mod, s, ctxs)))
              for m, mod in (("old", rpa_old), ("new", rpa))}
        bucket(model, [1] * s, ctxs, ab, rng,
               f"full, {max(ctxs)} + {s - 1} x {min(ctxs)}" if len(set(ctxs)) > 1
               else f"full, {s} x {ctxs[0]}")


def run8(rng):
    """A lead for later: full buckets past two programs an SM (64 slots at 8 kv heads, 128 at
    4: 512 items), one long context among short ones and even ones, the default against
    fill_splits forced over 660 and 792 programs (not dispatched by the engine)."""
    big = {"default": (rpa, {}), "fill P=660": (rpa, dict(FILL(), fill_programs=660)),
           "fill P=792": (rpa, dict(FILL(), fill_programs=792))}
    for model, s in (("llama3-8b", 64), ("qwen3-30b-a3b", 128)):
        for ctxs in ([16384] + [1024] * (s - 1), [4096] + [1024] * (s - 1), [1024] * s):
            bucket(model, [1] * s, ctxs, big, rng,
                   f"full {s}, max/mean {max(ctxs) / np.mean(ctxs):.2f} max {max(ctxs)}")


if __name__ == "__main__":
    print(jax.devices(), flush=True)
    globals()[sys.argv[1]](np.random.default_rng(0))
