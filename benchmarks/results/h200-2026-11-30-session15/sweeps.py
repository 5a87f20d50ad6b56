"""The fifteenth session's decode sweeps on the H200 (CUPTI time by kernel, inputs out of L2,
through session 13's `breakdown` and session 14's `bucket`):

    git show 9618b1c:pallas_kernels/ragged_paged_attention.py \
        > benchmarks/results/h200-2026-11-30-session15/rpa_old.py
    (and session 14's rpa_old.py and split_merge_old.py, as its sweeps.py says: it is loaded
    here for its helpers, and loads them)
    python3 benchmarks/results/h200-2026-11-30-session15/sweeps.py run2|run3|...|run6

"old" is the fourteenth session's final kernel (9618b1c; a copy, not kept), "new" the code of
the moment. Scratch variants of "new" are built here from the committed file by one textual
edit each (`variant`), so that nothing but the edit differs: they are probes, not kept code."""
import functools, importlib.util, os, sys
import jax, numpy as np
_here = os.path.dirname(os.path.abspath(__file__))
_results = os.path.dirname(_here)
_root = os.path.dirname(os.path.dirname(_results))


def _load(name, path, edit=None):
    """Module `name` from `path`, its source edited first by (old, new), or by each pair of a
    list of them, if given."""
    src = open(path).read()
    for old, new in ([edit] if isinstance(edit, tuple) else edit or []):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__file__ = path
    sys.modules[name] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


s14 = _load("sweeps14", os.path.join(_results, "h200-2026-11-30-session14", "sweeps.py"))
kb, bucket, engine_hint = s14.kb, s14.bucket, s14.engine_hint
from jaxserve.pallas_kernels import ragged_paged_attention as rpa   # noqa: E402
KERNEL = os.path.join(_root, "pallas_kernels", "ragged_paged_attention.py")
rpa_old = _load("rpa_old15", os.path.join(_here, "rpa_old.py"))
probe = _load("stream_probe15", os.path.join(_here, "stream_probe.py"))

# no mask at all: right only where every context is a whole number of key steps
rpa_nomask = _load("rpa_nomask15", KERNEL, ("        if masked:\n", "        if False:\n"))
# no slot lookup before the key loop (the carried slots are unused without prefetch_slots)
rpa_noslot = _load("rpa_noslot15", KERNEL, (
    "jnp.zeros((rows,), jnp.float32), slots(step_lo))",
    "jnp.zeros((rows,), jnp.float32),\n"
    "             slots(step_lo) if prefetch_slots else jnp.zeros((block_k,), jnp.int32))"))


# each tile's sequence is its index (right only for a bucket of one-token sequences): the
# search over the tile counts leaves the chain of loads before the first K/V copy
_DIRECT = ("            seq = jnp.sum(((start_all <= j) & (s_all <= num_seqs)).astype(jnp.int32)) - 1",
           "            seq = jnp.minimum(j, num_seqs)")
rpa_direct = _load("rpa_direct15", KERNEL, _DIRECT)
_src = open(KERNEL).read().replace("        if masked:\n", "        if False:\n")
with open(os.path.join(_here, "_nomask.tmp.py"), "w") as f:
    f.write(_src)
rpa_direct_nomask = _load("rpa_direct_nomask15", os.path.join(_here, "_nomask.tmp.py"), _DIRECT)
os.remove(os.path.join(_here, "_nomask.tmp.py"))


# the mask only on the window's and the causal edge's steps (a branch a step, not a compare
# and a select per score)
rpa_condmask = _load("rpa_condmask15", KERNEL, (
    """        if masked:
            vis = kpos[None, :] <= last_R[:, None]
            if sliding_window is not None:
                vis &= kpos[None, :] > window_R[:, None]
            s = jnp.where(vis, s, -jnp.inf)
""", """        def mask(s):
            vis = kpos[None, :] <= last_R[:, None]
            if sliding_window is not None:
                vis &= kpos[None, :] > window_R[:, None]
            return jnp.where(vis, s, -jnp.inf)
        if masked:
            s = jax.lax.cond((step < full_lo) | (step >= full_hi), mask, lambda s: s, s)
"""))
# no guard for rows that saw no key (right where every row sees a key in every step)
rpa_nosafe = _load("rpa_nosafe15", KERNEL, (
    "m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)", "m_safe = m_new"))


# scores kept unscaled until the exponent, so that the scale and the max's shift are one fma
# a score (as in the probe: 16 mul.f32 a thread and step fewer in Triton 3.9's PTX at 16 x 1K)
FMASCALE = [
    ("""        s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * score_scale   # [R, BK]
        if soft_cap is not None:
            s = (soft_cap * LOG2E) * jnp.tanh(s / soft_cap)
""", """        s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32)                  # [R, BK]
        scale = score_scale
        if soft_cap is not None:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (score_scale / soft_cap))
            scale = 1.0
"""),
    ("m_new = jnp.maximum(m_R, s.max(axis=1))", "m_new = jnp.maximum(m_R, s.max(axis=1) * scale)"),
    ("p = exp2(s - m_safe[:, None])", "p = exp2(s * scale - m_safe[:, None])")]
rpa_fmascale = _load("rpa_fmascale15", KERNEL, FMASCALE)


class ProbeAsKernel:
    """stream_probe's unmasked attention, called like the kernel (full even buckets only)."""
    @staticmethod
    def ragged_paged_attention(q, k, v, qsl, seq_lens, bt, *, sm_scale, impl, busy_seqs=0):
        return probe.probe(q, k, v, seq_lens, bt)


def twice(v):
    """The variants, then each again under the name + " again" (interleaved repetitions)."""
    return v | {k + " again": x for k, x in v.items()}


def full_buckets(ab, rng):
    """Full buckets of even decodes, each with the variants ab(slots, contexts, True) gives."""
    for model, s, ctx in (("llama3-8b", 16, 1024), ("llama3-8b", 16, 1000),
                          ("qwen3-30b-a3b", 24, 1024), ("qwen3-30b-a3b", 32, 1024),
                          ("llama3-8b", 32, 1024), ("llama3-8b", 4, 4096),
                          ("llama3-8b", 1, 8192), ("llama3-8b", 64, 1024),
                          ("qwen3-30b-a3b", 128, 1000)):
        kb.use_model(model)
        bucket(model, [1] * s, [ctx] * s, ab(s, [ctx] * s, True), rng, f"full, {s} x {ctx}")


def run2(rng):
    """The one-compare mask (new) against old, beside the same kernel unmasked, without the
    slot lookup before its loop, and (full even buckets) session 15's probe kernel."""
    def ab(slots, ctxs, even):
        h = {m: engine_hint(mod, slots, ctxs) for m, mod in (("old", rpa_old), ("new", rpa))}
        v = {"old": (rpa_old, dict(busy_seqs=h["old"])), "new": (rpa, dict(busy_seqs=h["new"])),
             "noslot": (rpa_noslot, dict(busy_seqs=h["new"]))}
        if all(c % 128 == 0 for c in ctxs):
            v["nomask"] = (rpa_nomask, dict(busy_seqs=h["new"]))
        if even and all(c % 128 == 0 for c in ctxs):
            v["probe"] = (ProbeAsKernel, {})
        v["new again"] = v["new"]
        v["old again"] = v["old"]
        return v
    full_buckets(ab, rng)
    kb.use_model("llama3-8b")
    for slots, busy, ctx in ((16, 12, 1024), (32, 2, 8192)):
        bucket("llama3-8b", [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
               ab(slots, [ctx] * busy, False), rng, f"{busy} busy x {ctx}")
    ctxs = [8192] + [1024] * 15
    bucket("llama3-8b", [1] * 16, ctxs, ab(16, ctxs, False), rng, "full, 8192 + 15 x 1024")
    chunk = {"old": (rpa_old, dict(busy_seqs=0)), "new": (rpa, dict(busy_seqs=0)),
             "old again": (rpa_old, dict(busy_seqs=0)), "new again": (rpa, dict(busy_seqs=0))}
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28, chunk,
           rng, "20-token chunk + 3 decodes")


def run3(rng):
    """Full buckets of one-token sequences, contexts whole key steps: what the mask and the
    tile search cost against the probe kernel (which has neither)."""
    for model, s, ctx in (("llama3-8b", 16, 1024), ("qwen3-30b-a3b", 24, 1024),
                          ("qwen3-30b-a3b", 32, 1024), ("llama3-8b", 32, 1024),
                          ("llama3-8b", 4, 4096), ("llama3-8b", 64, 1024)):
        kb.use_model(model)
        h = dict(busy_seqs=engine_hint(rpa, s, [ctx] * s))
        v = {"new": (rpa, h), "nomask": (rpa_nomask, h), "direct": (rpa_direct, h),
             "direct+nomask": (rpa_direct_nomask, h), "probe": (ProbeAsKernel, {})}
        bucket(model, [1] * s, [ctx] * s, twice(v), rng, f"full, {s} x {ctx}")


def run4(rng):
    """The mask only on edge steps (condmask) against every step's (new, old), and without
    the guard for rows that saw no key (nosafe; pure decode buckets only)."""
    def ab(slots, ctxs, decode):
        h = {m: engine_hint(mod, slots, ctxs) for m, mod in (("old", rpa_old), ("new", rpa))}
        v = {"old": (rpa_old, dict(busy_seqs=h["old"])), "new": (rpa, dict(busy_seqs=h["new"])),
             "condmask": (rpa_condmask, dict(busy_seqs=h["new"]))}
        if decode:
            v["nosafe"] = (rpa_nosafe, dict(busy_seqs=h["new"]))
        return twice(v)
    run4_buckets(ab, {"old": rpa_old, "new": rpa, "condmask": rpa_condmask}, rng)


def run4_buckets(ab, chunk_modules, rng):
    """Run 4's buckets: full ones of even decodes, 12 busy of 16, a skewed full one (variants
    from ab), then two holding a prompt chunk (each of chunk_modules, busy_seqs 0)."""
    full_buckets(ab, rng)
    kb.use_model("llama3-8b")
    bucket("llama3-8b", [1] * 12 + [0] * 4, [1024] * 12 + [0] * 4, ab(16, [1024] * 12, True),
           rng, "12 busy x 1024")
    ctxs = [8192] + [1024] * 15
    bucket("llama3-8b", [1] * 16, ctxs, ab(16, ctxs, True), rng, "full, 8192 + 15 x 1024")
    v = twice({name: (mod, dict(busy_seqs=0)) for name, mod in chunk_modules.items()})
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28, v, rng,
           "20-token chunk + 3 decodes")
    bucket("llama3-8b", [40] + [1] * 40, [1500] + [1000] * 40, v, rng, "40-token chunk + 40 decodes")


def run5(rng):
    """Padded buckets with fewer busy slots than their floor (the engine passes busy_seqs 0:
    fill_splits and a merge) against the floor's tiling (pipelined, unsplit), by context: is
    there a context below which the engine should pass the floor anyway?"""
    cases = [("llama3-8b", 16, b, c) for b in (8, 10, 12) for c in (512, 1024, 2048, 3072)]
    cases += [("llama3-8b", 32, b, c) for b in (8, 12) for c in (1024, 2048)]
    cases += [("qwen3-30b-a3b", 32, b, c) for b in (16, 20, 24) for c in (1024, 2048, 3072)]
    cases += [("qwen3-30b-a3b", 64, b, c) for b in (16, 24) for c in (1024, 2048)]
    for model, slots, busy, ctx in cases:
        kb.use_model(model)
        floor = rpa.tiling_busy_floor(slots, slots, kb.N, kb.KH, context=32768)
        bucket(model, [1] * busy + [0] * (slots - busy), [ctx] * busy + [0] * (slots - busy),
               {"fill": (rpa, dict(busy_seqs=0)), f"floor {floor}": (rpa, dict(busy_seqs=floor))},
               rng, f"{busy} busy x {ctx}")
    kb.use_model("llama3-8b")
    for busy in (10, 12):
        ctxs = [int(c) for c in rng.integers(500, 1500, busy)]
        bucket("llama3-8b", [1] * busy + [0] * (16 - busy), ctxs + [0] * (16 - busy),
               {"fill": (rpa, dict(busy_seqs=0)), "floor 13": (rpa, dict(busy_seqs=13))},
               rng, f"{busy} busy x 500-1500")


def run6(rng):
    """Prepared for the next session, not run in this one: scores scaled inside the exponent's
    fma (fmascale) against the committed kernel, on the buckets of run 4."""
    def ab(slots, ctxs, decode):
        h = dict(busy_seqs=engine_hint(rpa, slots, ctxs))
        return twice({"new": (rpa, h), "fmascale": (rpa_fmascale, h)})
    run4_buckets(ab, {"new": rpa, "fmascale": rpa_fmascale}, rng)


if __name__ == "__main__":
    print(jax.devices(), flush=True)
    globals()[sys.argv[1]](np.random.default_rng(0))
