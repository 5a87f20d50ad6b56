"""The sixteenth session's decode sweeps on the H200 (CUPTI time by kernel, inputs out of L2,
through session 14's `bucket` on session 15's buckets):

    (session 13's, 14's and 15's rpa_old.py / split_merge_old.py in place, as their
    sweeps.py say: session 15's is loaded here for its buckets and variants, and loads them;
    and this folder's split_merge_old.py: `git show 807eda9:pallas_kernels/split_merge.py`)
    python3 benchmarks/results/h200-2026-11-30-session16/sweeps.py cpu_check|run1|stress|run2|run3|run4

The patched copies (rpa_fused.py, split_merge_live.py) are written here from the diffs on
first import (`git` and `patch` needed).

"new" is the code of the moment. The variants are scratch edits of the committed kernel made
here by textual replacement (session 15's `_load`), so that nothing but the edit differs:
probes, not kept code."""
import importlib.util, os, sys
import jax, numpy as np
_here = os.path.dirname(os.path.abspath(__file__))
_results = os.path.dirname(_here)


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


s15 = _module("sweeps15", os.path.join(_results, "h200-2026-11-30-session15", "sweeps.py"))
_load, KERNEL, rpa, engine_hint = s15._load, s15.KERNEL, s15.rpa, s15.engine_hint
FMASCALE = s15.FMASCALE     # session 15's edit: the scale inside the exponent's fma
# masked="keys": a tile of one token's rows (every row's last visible key is the tile's end,
# its window start the token's): the mask is a bias vector over the step's keys, added to
# every row (one add a score instead of a compare and a select)
KEYS_MASK = ("""        if masked:
            vis = kpos[None, :] <= last_R[:, None]""", """        if masked == "keys":
            vis_k = kpos < kv_end
            if sliding_window is not None:
                vis_k &= kpos > first_pos - sliding_window
            s = s + jnp.where(vis_k, 0.0, -jnp.inf)[None, :]
        elif masked:
            vis = kpos[None, :] <= last_R[:, None]""")
ONE_LOOP = "        acc, m_R, l_R, _ = jax.lax.fori_loop(step_lo, step_hi, masked_body, carry)\n"
# kbias: every tile's loop takes the key-vector mask (right only where every tile holds one
# token: decode buckets without a chunk)
KBIAS_LOOP = (ONE_LOOP, "        acc, m_R, l_R, _ = jax.lax.fori_loop(step_lo, step_hi, "
              "functools.partial(body, masked='keys'), carry)\n")
# twoloops: one-token tiles take the key-vector loop, others the per-score one (a branch once
# a program, outside the loops: right for every batch)
TWO_LOOPS = (ONE_LOOP, """        def loop(masked):
            return lambda c: jax.lax.fori_loop(step_lo, step_hi,
                                               functools.partial(body, masked=masked), c)
        acc, m_R, l_R, _ = jax.lax.cond(first_pos == last_pos, loop("keys"), loop(True), carry)
""")
rpa_fmascale = _load("rpa_fmascale16", KERNEL, FMASCALE)
rpa_kbias = _load("rpa_kbias16", KERNEL, [KEYS_MASK, KBIAS_LOOP])
rpa_kbias_fma = _load("rpa_kbias_fma16", KERNEL, FMASCALE + [KEYS_MASK, KBIAS_LOOP])
rpa_twoloops = _load("rpa_twoloops16", KERNEL, [KEYS_MASK, TWO_LOOPS])
rpa_twoloops_fma = _load("rpa_twoloops_fma16", KERNEL, FMASCALE + [KEYS_MASK, TWO_LOOPS])
def _patched(name, source, diff):
    """`name` beside this file: `diff` applied to pallas_kernels/`source` as it was at 807eda9
    (the committed code when the variant ran), written once."""
    import subprocess
    path = os.path.join(_here, name)
    if not os.path.exists(path):
        base = subprocess.run(["git", "show", f"807eda9:pallas_kernels/{source}"],
                              capture_output=True, text=True, check=True, cwd=_here).stdout
        with open(path + ".base", "w") as f:
            f.write(base)
        subprocess.run(["patch", "-s", "-o", path, path + ".base", os.path.join(_here, diff)],
                       check=True)
        os.remove(path + ".base")
    return path


# the committed kernel of the moment with the split merge inside it (fused_merge, default on
# in this copy; fused_merge=False is the committed code path): run 2 and stress ran this file
# as the kernel itself (then at pallas_kernels/), not kept
rpa_fused = _load("rpa_fused16", _patched("rpa_fused.py", "ragged_paged_attention.py",
                                          "fused_merge.diff"))


def run1(rng):
    """fmascale, the key-vector mask (kbias: decode-only buckets; twoloops: every bucket, a
    branch per program) and both together, against the committed kernel, on session 15's run
    4 buckets and two larger ones."""
    def ab(slots, ctxs, decode):
        h = dict(busy_seqs=engine_hint(rpa, slots, ctxs))
        v = {"new": (rpa, h), "fmascale": (rpa_fmascale, h)}
        if decode:
            v |= {"kbias": (rpa_kbias, h), "kbias+fma": (rpa_kbias_fma, h)}
        return s15.twice(v | {"twoloops": (rpa_twoloops, h),
                              "twoloops+fma": (rpa_twoloops_fma, h)})
    s15.run4_buckets(ab, {"new": rpa, "fmascale": rpa_fmascale, "twoloops": rpa_twoloops,
                          "twoloops+fma": rpa_twoloops_fma}, rng)
    for model, s, ctx in (("llama3-8b", 128, 1024), ("llama3-8b", 32, 8192)):
        s15.kb.use_model(model)
        s15.bucket(model, [1] * s, [ctx] * s, ab(s, [ctx] * s, True), rng, f"full, {s} x {ctx}")


def run2(rng):
    """The merge inside the kernel (fused_merge, the default being tried) against the merge
    kernel (fused_merge=False), on every kind of split grid: padded buckets (fill_splits),
    full buckets split by their size, a skewed one, buckets holding a prompt chunk; and full
    buckets of one unsplit wave (16 x 1K, Qwen's 24 and 32 x 1K) against fill_splits over
    them, now that a split costs no second kernel. Each call zeroes its own counts ("other":
    that memset, where it runs as a kernel)."""
    kb, bucket = s15.kb, s15.bucket

    def ab(slots, ctxs, *, tuned=None):
        h = dict(busy_seqs=engine_hint(rpa, slots, ctxs))
        v = {"sep": (rpa_fused, dict(h, fused_merge=False)), "fused": (rpa_fused, h)}
        if tuned:
            v |= {"fill sep": (rpa_fused, dict(tuned, fused_merge=False)),
                  "fill fused": (rpa_fused, tuned)}
        return s15.twice(v)

    pad = [("llama3-8b", 16, b, c) for b, c in ((2, 8192), (8, 8192), (12, 1024), (8, 1024),
                                                (4, 2048))]
    pad += [("qwen3-30b-a3b", 32, b, c) for b, c in ((16, 1024), (16, 2048), (24, 1024))]
    pad += [("qwen3-30b-a3b", 64, b, c) for b, c in ((16, 2048), (24, 1024))]
    pad += [("llama3-8b", 32, b, c) for b, c in ((2, 8192), (12, 1024))]
    for model, slots, busy, ctx in pad:
        kb.use_model(model)
        ctxs = [ctx] * busy + [0] * (slots - busy)
        bucket(model, [1] * busy + [0] * (slots - busy), ctxs, ab(slots, ctxs[:busy]), rng,
               f"{busy} busy x {ctx}")
    for model, s, ctx in (("llama3-8b", 1, 1024), ("llama3-8b", 1, 8192),
                          ("llama3-8b", 4, 4096), ("qwen3-30b-a3b", 1, 8192),
                          ("qwen3-30b-a3b", 4, 4096)):
        kb.use_model(model)
        bucket(model, [1] * s, [ctx] * s, ab(s, [ctx] * s), rng, f"full, {s} x {ctx}")
    fill = dict(num_splits=32, block_k=64, num_stages=5, prefetch_slots=False, fill_splits=True)
    for model, s, ctx in (("llama3-8b", 16, 1024), ("qwen3-30b-a3b", 24, 1024),
                          ("qwen3-30b-a3b", 32, 1024), ("llama3-8b", 12, 1024),
                          ("llama3-8b", 16, 4096)):
        kb.use_model(model)
        bucket(model, [1] * s, [ctx] * s, ab(s, [ctx] * s, tuned=fill), rng,
               f"full, {s} x {ctx}")
    kb.use_model("llama3-8b")
    ctxs = [8192] + [1024] * 15
    bucket("llama3-8b", [1] * 16, ctxs, ab(16, ctxs), rng, "full, 8192 + 15 x 1024")
    v = s15.twice({"sep": (rpa_fused, dict(busy_seqs=0, fused_merge=False)),
                   "fused": (rpa_fused, dict(busy_seqs=0))})
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28, v, rng,
           "20-token chunk + 3 decodes")
    bucket("llama3-8b", [6, 1, 1, 1, 1] + [0] * 6, [300, 1000, 2000, 700, 4000] + [0] * 6, v,
           rng, "6-token chunk + 4 of 11")


# runs 3-4: the committed merge kernel ("old": 807eda9's; the attention kernel calling it, at
# run time the committed one too) against the merge of live counts a chunk of splits at a time
# (live_merge.diff, then in pallas_kernels/split_merge.py; not kept), at each chunk size
_load("split_merge_old16", os.path.join(_here, "split_merge_old.py"))
_MERGE_IMPORT = "from jaxserve.pallas_kernels.split_merge import merge_splits"
rpa_oldmerge = _load("rpa_oldmerge16", KERNEL, (_MERGE_IMPORT,
                                                "from split_merge_old16 import merge_splits"))
_LIVE = _patched("split_merge_live.py", "split_merge.py", "live_merge.diff")
_load("split_merge_live16", _LIVE)
_MERGE_CALL = 'merge_splits(*outs, out_dtype=q_TNE.dtype, impl="pallas", interpret=interpret)'
rpa_chunk = {c: _load(f"rpa_chunk{c}_16", KERNEL, [
    (_MERGE_IMPORT, "from split_merge_live16 import merge_splits"),
    (_MERGE_CALL, _MERGE_CALL.replace("interpret=interpret)",
                                      f"interpret=interpret, live_chunk={c})"))])
    for c in (1, 2, 4, 8)}


def run3(rng):
    """The merge of fill grids (live counts) a chunk of splits at a time up to the live
    (chunks of 1, 2, 4, 8) against the X-wide tile before ("old"), on padded buckets, a
    skewed one and buckets holding a chunk (all fill_splits in the engine)."""
    kb, bucket = s15.kb, s15.bucket

    def ab(slots, ctxs):
        h = dict(busy_seqs=engine_hint(rpa, slots, ctxs))
        return s15.twice({"old": (rpa_oldmerge, h)}
                         | {f"c{c}": (rpa_chunk[c], h) for c in (1, 2, 4, 8)})

    pad = [("llama3-8b", 16, b, c) for b, c in ((2, 8192), (8, 8192), (12, 1024), (8, 1024),
                                                (4, 2048), (1, 1024))]
    pad += [("qwen3-30b-a3b", 32, b, c) for b, c in ((16, 1024), (16, 2048), (24, 1024))]
    pad += [("qwen3-30b-a3b", 64, b, c) for b, c in ((16, 2048), (24, 1024), (4, 8192))]
    pad += [("llama3-8b", 32, b, c) for b, c in ((2, 8192), (12, 1024), (24, 2048))]
    for model, slots, busy, ctx in pad:
        kb.use_model(model)
        ctxs = [ctx] * busy + [0] * (slots - busy)
        bucket(model, [1] * busy + [0] * (slots - busy), ctxs, ab(slots, ctxs[:busy]), rng,
               f"{busy} busy x {ctx}")
    kb.use_model("llama3-8b")
    for ctxs in ([8192] + [1024] * 15, [16384] + [1024] * 7 + [0] * 8):
        busy = sum(1 for c in ctxs if c)
        bucket("llama3-8b", [1] * busy + [0] * (16 - busy), ctxs, ab(16, ctxs[:busy]), rng,
               f"{busy} busy, {ctxs[0]} + {busy - 1} x 1024")
    v = ab(32, [2000, 8000, 1000, 500])
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28, v, rng,
           "20-token chunk + 3 decodes")
    bucket("llama3-8b", [6, 1, 1, 1, 1] + [0] * 6, [300, 1000, 2000, 700, 4000] + [0] * 6,
           ab(11, [300, 1000, 2000, 700, 4000]), rng, "6-token chunk + 4 of 11")


# the live loop pipelined by Triton (its loads a stage or two ahead): a copy of the merge with
# `stages` stages for live merges, and the attention kernel calling it with live_chunk `chunk`
def rpa_piped(chunk, stages):
    _load(f"split_merge_s{stages}_16", _LIVE, ("num_warps=2 if xp * block_r * block_e <= 4096 "
                                                "else 4, num_stages=1)",
                                                "num_warps=2 if xp * block_r * block_e <= 4096 "
                                                f"else 4, num_stages=1 if live is None else {stages})"))
    return _load(f"rpa_c{chunk}s{stages}_16", KERNEL, [
        (_MERGE_IMPORT, f"from split_merge_s{stages}_16 import merge_splits"),
        (_MERGE_CALL, _MERGE_CALL.replace("interpret=interpret)",
                                          f"interpret=interpret, live_chunk={chunk})"))])


def run4(rng):
    """Run 3's buckets: the live loop with 2 or 3 stages against the X-wide tile (old)."""
    variants = {"old": rpa_oldmerge, "c4s3": rpa_piped(4, 3), "c8s2": rpa_piped(8, 2),
                "c8s3": rpa_piped(8, 3), "c2s3": rpa_piped(2, 3)}
    kb, bucket = s15.kb, s15.bucket

    def ab(slots, ctxs):
        h = dict(busy_seqs=engine_hint(rpa, slots, ctxs))
        return s15.twice({k: (m, h) for k, m in variants.items()})

    for model, slots, busy, ctx in (
            ("llama3-8b", 16, 2, 8192), ("llama3-8b", 16, 8, 8192), ("llama3-8b", 16, 12, 1024),
            ("llama3-8b", 16, 1, 1024), ("qwen3-30b-a3b", 32, 16, 2048),
            ("qwen3-30b-a3b", 64, 16, 2048), ("qwen3-30b-a3b", 64, 4, 8192),
            ("llama3-8b", 32, 2, 8192), ("llama3-8b", 32, 12, 1024)):
        kb.use_model(model)
        ctxs = [ctx] * busy + [0] * (slots - busy)
        bucket(model, [1] * busy + [0] * (slots - busy), ctxs, ab(slots, ctxs[:busy]), rng,
               f"{busy} busy x {ctx}")
    kb.use_model("llama3-8b")
    ctxs = [16384] + [1024] * 7 + [0] * 8
    bucket("llama3-8b", [1] * 8 + [0] * 8, ctxs, ab(16, ctxs[:8]), rng, "8 busy, 16384 + 7 x 1024")
    bucket("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28,
           ab(32, [2000, 8000, 1000, 500]), rng, "20-token chunk + 3 decodes")


def stress(rng):
    """Races: each bucket's fused call 300 times against the merge kernel's result (the same
    partials, so the two differ only by rounding: a split merged before it was written, or
    read stale, shows as an error far over it); also the counts left (all zero) when
    threaded through the calls."""
    import jax.numpy as jnp
    s13 = s15.s14.s13
    for model, qlens, ctxs in (
            ("llama3-8b", [1] * 12 + [0] * 4, [1024] * 12 + [0] * 4),
            ("llama3-8b", [1] * 16, [8192] + [1000] * 15),
            ("llama3-8b", [1] * 4, [4096, 4000, 3001, 4096]),
            ("qwen3-30b-a3b", [1] * 16 + [0] * 16, [2048] * 16 + [0] * 16),
            ("llama3-8b", [20, 1, 1, 1] + [0] * 28, [2000, 8000, 1000, 500] + [0] * 28)):
        c, args, byts, ref, t, busy = s13.bucket_case(model, qlens, ctxs, rng)
        hint = engine_hint(rpa, len(qlens), [L for q, L in zip(qlens, ctxs) if q])
        scale = s15.kb.E ** -0.5
        sep = jax.jit(lambda *a: rpa_fused.ragged_paged_attention(
            *a, sm_scale=scale, impl="pallas", busy_seqs=hint, fused_merge=False))(*args)
        size = rpa_fused.split_counts_size(len(qlens), len(qlens), s15.kb.KH)

        @jax.jit
        def many(counts, *a):
            def one(counts, _):
                o, counts = rpa_fused.ragged_paged_attention(*a, sm_scale=scale, impl="pallas",
                                                       busy_seqs=hint, split_counts=counts)
                return counts, jnp.max(jnp.abs(o.astype(jnp.float32) - sep.astype(jnp.float32)))
            return jax.lax.scan(one, counts, None, length=300)
        counts, diffs = many(jnp.zeros((size,), jnp.int32), *args)
        diffs = np.asarray(diffs)
        print(f"stress {model} {len(qlens)} slots, {busy} busy: max |fused - sep| over 300 calls "
              f"{diffs.max():.2e} (median {np.median(diffs):.2e}), calls over 1e-2: "
              f"{int((diffs > 1e-2).sum())}, counts left non-zero: "
              f"{int(np.count_nonzero(np.asarray(counts)))}", flush=True)


def cpu_check():
    """Each variant against the XLA reference in interpret mode: decode, a chunk among
    decodes, a window and a soft cap (kbias only on decode tiles)."""
    import jax.numpy as jnp
    kb = s15.kb
    kb.use_model("llama3-8b")
    rng = np.random.default_rng(1)
    mods = {"fmascale": rpa_fmascale, "kbias": rpa_kbias, "kbias+fma": rpa_kbias_fma,
            "twoloops": rpa_twoloops, "twoloops+fma": rpa_twoloops_fma}
    for qlens, ctxs in (([1, 1, 1, 0], [300, 77, 129, 0]), ([5, 1, 1, 0], [200, 64, 1, 0])):
        c = kb.paged_case(rng, qlens, ctxs)
        args = (c["q"], c["k"], c["v"], c["qsl"], c["seq_lens"], c["bt"])
        for kw in (dict(), dict(sliding_window=50), dict(soft_cap=30.0)):
            ref = rpa.ref_ragged_paged_attention(*args, sm_scale=kb.E ** -0.5, **kw)
            for name, mod in mods.items():
                if name.startswith("kbias") and max(qlens) > 1:
                    continue
                out = mod.ragged_paged_attention(*args, sm_scale=kb.E ** -0.5, impl="triton",
                                                 interpret=True, **kw)
                t = int(sum(qlens))
                err = kb.rel_err(out[:t], ref[:t])
                assert err < 1e-2 and not jnp.any(out[t:]), (name, qlens, kw, err)
                print(f"{name:14s} {str(qlens):14s} {str(kw):24s} err={err:.1e}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "cpu_check":
        cpu_check()
    else:
        print(jax.devices(), flush=True)
        globals()[sys.argv[1]](np.random.default_rng(0))
