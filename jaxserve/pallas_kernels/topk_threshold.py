"""Top-k and top-p thresholds of vocab-sized rows, without sorting them.

Top-k sampling keeps the logits >= the k-th largest one; top-p (nucleus) sampling keeps the
most likely tokens until their probability reaches p. Both keep every logit >= a per-row
threshold, and finding that threshold is the only part that needs the whole row:

    kth_S = topk_threshold(x_SV, k_S)             # f32[S]; -inf where k <= 0 or k >= V
    cut_S = topp_threshold(x_SV, p_S, kth_S)      # f32[S]; -inf where p >= 1
    keep_SV = (x_SV >= kth_S[:, None]) & (x_SV >= cut_S[:, None])

topp_threshold's probabilities are those of the tokens >= `floor` (top-p over what top-k
kept): the cut is the smallest kept value v such that the tokens strictly above v hold less
than p of that mass, ties at v included (as a descending sort with a cumulative sum, which
is the reference).

Method (radix select, 4 bits a pass): map each f32 to an int32 key with the same order and
build the threshold's key from its most significant bits down. Each of 8 passes measures,
for 16 candidate keys at once (the bits found so far followed by each 4-bit digit), how much
of the row is >= each candidate: the count of tokens (top-k) or their unnormalised
probability exp(x - max) (top-p); the largest candidate with at least the target (k tokens,
or p times the kept mass) fixes the next 4 bits. A pass is one kernel over a grid of (row,
chunk of the row) programs (about 4 per SM in all) writing each chunk's 16 sums; the next
pass's programs add those up and pick the digit themselves, so a search is 8 kernels and one
small XLA op. No sort, no scatter, nothing of the row's size written.

Why: a full sort of each row costs several times a radix search (H200, 32 rows of 128,256:
top-k 100 us against a sort's 859; BENCHMARKS.md, "Kernels"). A top-p pass costs ~2.5x a top-k
one (exp and f32 sums over the 16 candidates), so from ~128 rows the pair takes about as long
as one sort, which serves both: the sampler sorts past 64 rows.

Layouts: x_SV f32[S, V] (bf16 is upcast), k_S i32[S], p_S f32[S], floor_S f32[S] -> f32[S].
Legend: S rows (sequences), V vocabulary, C chunks of a row (programs per row per pass),
BV elements of a chunk per inner step, D = 16 candidate digits per pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, num_sms, resolve_impl, whole

INT_MIN = -(2 ** 31)
BITS = 4                       # bits of the key fixed per pass
DIGITS = 1 << BITS             # candidates per pass (D)
PASSES = 32 // BITS

# ---------------------------------------------------------------------------------------------
# References (full sort)
# ---------------------------------------------------------------------------------------------


def ref_topk_threshold(x_SV, k_S):
    """k-th largest value per row by a full sort; -inf where k <= 0 or k >= V (keep all)."""
    v = x_SV.shape[-1]
    sorted_SV = -jnp.sort(-x_SV.astype(jnp.float32), axis=-1)
    kth = jnp.take_along_axis(sorted_SV, jnp.clip(k_S - 1, 0, v - 1)[:, None], axis=-1)[:, 0]
    return jnp.where((k_S <= 0) | (k_S >= v), -jnp.inf, kth)


def ref_topp_threshold(x_SV, p_S, floor_S):
    """Nucleus cut per row by a full sort: over the tokens >= floor, the smallest value whose
    predecessors (descending) hold less than p of their probability; -inf where p >= 1."""
    x_SV = x_SV.astype(jnp.float32)
    kept_SV = jnp.where(x_SV >= floor_S[:, None], x_SV, -jnp.inf)
    sorted_SV = -jnp.sort(-kept_SV, axis=-1)
    probs_SV = jax.nn.softmax(sorted_SV, axis=-1)
    mass_before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV
    cut = jnp.min(jnp.where(mass_before_SV < p_S[:, None], sorted_SV, jnp.inf), axis=-1)
    # NOTE: p = 1 keeps everything even where float rounding lets the cumsum reach 1
    return jnp.where(p_S >= 1.0, -jnp.inf, cut)


def xla_topk_threshold(x_SV, k_S, *, max_k: int):
    """Same as ref_topk_threshold via lax.top_k(max_k) (valid when every k <= max_k)."""
    v = x_SV.shape[-1]
    vals_SK = jax.lax.top_k(x_SV.astype(jnp.float32), min(max_k, v))[0]
    kth = jnp.take_along_axis(vals_SK, jnp.clip(k_S - 1, 0, vals_SK.shape[1] - 1)[:, None],
                              axis=-1)[:, 0]
    return jnp.where((k_S <= 0) | (k_S >= v), -jnp.inf, kth)


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def _ordered_key(x):
    """int32 with the order of the f32 values (negative floats: flip the magnitude bits)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _key_to_float(prefix_S):
    """The f32 whose ordered key is `prefix` (kept in "unsigned order": sign bit flipped)."""
    key = prefix_S ^ INT_MIN
    return jax.lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ 0x7FFFFFFF), jnp.float32)


# ---------------------------------------------------------------------------------------------
# Kernel: one pass, one (row, chunk) per program
# ---------------------------------------------------------------------------------------------


def _pass_kernel(x_ref, prev_ref, prefix_ref, target_ref, max_ref, out_ref, prefix_out_ref, *,
                 v, chunk, block_v, shift, weighted):
    row, c = pl.program_id(0), pl.program_id(1)
    d = jnp.arange(DIGITS, dtype=jnp.int32)
    prefix = prefix_ref[row]
    if prev_ref is not None:   # finish the last pass: add its chunks' sums, keep the best digit
        num_chunks = prev_ref.shape[1]
        cc = jnp.arange(pl.next_power_of_2(num_chunks), dtype=jnp.int32)
        prev = plgpu.load(prev_ref.at[row, jnp.minimum(cc, num_chunks - 1)[:, None], d[None, :]],
                          mask=(cc < num_chunks)[:, None], other=0)
        total = jnp.sum(prev, axis=0)
        digit = jnp.max(jnp.where(total >= target_ref[row], d, 0))
        prefix = prefix | (digit << (shift + BITS))

        @pl.when(c == 0)
        def _():
            prefix_out_ref[row] = prefix

    # candidate keys: the bits found so far, then each digit; compared as signed int32 keys
    cands = (prefix | (d << shift)) ^ INT_MIN
    lo = c * chunk
    hi = jnp.minimum(lo + chunk, v)
    if weighted:   # a row of only -inf has no probability anywhere; shifting by 0 keeps exp at 0
        row_max = max_ref[row]
        row_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)

    def step(i, acc):
        col = lo + i * block_v + jnp.arange(block_v, dtype=jnp.int32)
        live = col < hi
        x = plgpu.load(x_ref.at[row, col], mask=live, other=-jnp.inf).astype(jnp.float32)
        ge = (_ordered_key(x)[:, None] >= cands[None, :]) & live[:, None]      # [BV, D]
        if weighted:   # each thread keeps its own sums; one reduction after the loop
            return acc + jnp.where(ge, jnp.exp(x - row_max)[:, None], 0.0)
        return acc + jnp.sum(ge.astype(jnp.int32), axis=0)

    # per-thread [BV, D] sums were faster for top-p and slower for top-k (H200), so only top-p
    # keeps them
    acc = jnp.zeros((block_v, DIGITS) if weighted else (DIGITS,),
                    jnp.float32 if weighted else jnp.int32)
    acc = jax.lax.fori_loop(0, chunk // block_v, step, acc)
    if weighted:
        acc = jnp.sum(acc, axis=0)
    plgpu.store(out_ref.at[row, c, d], acc)


def _chunking(s: int, v: int, block_v: int, programs: int) -> tuple[int, int]:
    """(C chunks per row, chunk length, a multiple of BV): about `programs` programs in all."""
    steps = pl.cdiv(v, block_v)
    per_chunk = pl.cdiv(steps, max(1, min(steps, pl.cdiv(programs, s))))
    chunk = per_chunk * block_v
    return pl.cdiv(v, chunk), chunk


def _radix_select(x_SV, target_S, max_S, *, weighted: bool, block_v: int, num_warps: int,
                  programs: int, interpret: bool):
    """Largest key whose share of the row (count, or exp(x - max) mass when weighted) is >=
    target, as an f32; the caller guarantees the smallest key (0 in unsigned order) qualifies
    up to rounding (a digit of 0 is the fallback). Pass p's kernel also adds up pass p - 1's
    chunk sums and picks its digit (every program for its row; the first of the row stores
    the prefix), so a search is PASSES kernels and one small XLA op for the last digit."""
    s, v = x_SV.shape
    num_chunks, chunk = _chunking(s, v, block_v, programs)
    acc_dtype = jnp.float32 if weighted else jnp.int32
    d = jnp.arange(DIGITS, dtype=jnp.int32)
    prefix = jnp.zeros((s,), jnp.int32)
    part = None
    for p in range(PASSES):
        shift = 32 - BITS * (p + 1)
        kernel = functools.partial(_pass_kernel, v=v, chunk=chunk, block_v=block_v, shift=shift,
                                   weighted=weighted)
        rows = pl.BlockSpec((s,), lambda i, c: (0,))
        parts = pl.BlockSpec((s, num_chunks, DIGITS), lambda i, c: (0, 0, 0))
        out_shape = [jax.ShapeDtypeStruct((s, num_chunks, DIGITS), acc_dtype)]
        if part is None:     # the first pass: no sums to finish, the prefix stays 0
            args, in_specs = (x_SV, prefix, target_S, max_S), [whole(s, v)] + [rows] * 3
            out_specs = [parts]
            kernel = absent_refs(kernel, 1, 6)   # no last-pass sums, no prefix out
        else:
            args = (x_SV, part, prefix, target_S, max_S)
            in_specs, out_specs = [whole(s, v), parts] + [rows] * 3, [parts, rows]
            out_shape.append(jax.ShapeDtypeStruct((s,), jnp.int32))
        outs = pl.pallas_call(
            kernel, grid=(s, num_chunks), in_specs=in_specs, out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
            interpret=interpret,
            name=f"{'topp' if weighted else 'topk'}_threshold_pass",
        )(*args)
        part, prefix = outs if len(outs) == 2 else (outs[0], prefix)
    digit = jnp.max(jnp.where(part.sum(axis=1) >= target_S[:, None], d[None, :], 0), axis=1)
    return _key_to_float(prefix | digit)


# ---------------------------------------------------------------------------------------------
# Public wrappers
# ---------------------------------------------------------------------------------------------


def _check_rows(x_SV, name, a_S):
    if x_SV.ndim != 2 or a_S.shape != x_SV.shape[:1]:
        raise ValueError(f"x_SV must be [S, V] and {name} [S]; got {x_SV.shape} and {a_S.shape}")


def _impl(impl: str, allowed) -> tuple[str, bool]:
    """"auto" = the radix-select kernels on a GPU, the full sort elsewhere."""
    concrete, on_gpu = resolve_impl("pallas" if impl == "auto" else impl, allowed)
    if impl == "auto" and not on_gpu:
        concrete = "sort"
    return concrete, on_gpu


def _programs(programs: int | None) -> int:
    return programs or 4 * num_sms()


@functools.partial(jax.jit, static_argnames=("impl", "max_k", "block_v", "num_warps",
                                             "programs", "interpret"))
def topk_threshold(x_SV, k_S, *, impl: str = "auto", max_k: int = 2048, block_v: int = 2048,
                   num_warps: int = 8, programs: int | None = None,
                   interpret: bool | None = None):
    """k-th largest value of each row (f32[S]); -inf where k <= 0 or k >= V.

    impl: "pallas" (radix select; interpreted on CPU), "sort" (full sort, the reference),
    "xla" (lax.top_k(max_k): every k must be <= max_k) or "auto" ("pallas" on a GPU, "sort"
    elsewhere). programs: about how many programs a pass runs (default 4 per SM). Blocks of
    2,048 elements and 8 warps: the fastest of an H200 sweep from 4 rows up."""
    _check_rows(x_SV, "k_S", k_S)
    impl, on_gpu = _impl(impl, ("pallas", "xla", "sort"))
    if impl == "sort":
        return ref_topk_threshold(x_SV, k_S)
    if impl == "xla":
        return xla_topk_threshold(x_SV, k_S, max_k=max_k)
    v = x_SV.shape[1]
    k_S = k_S.astype(jnp.int32)
    kth = _radix_select(x_SV, k_S, jnp.zeros(k_S.shape, jnp.float32), weighted=False,
                        block_v=block_v, num_warps=num_warps, programs=_programs(programs),
                        interpret=(not on_gpu) if interpret is None else interpret)
    return jnp.where((k_S <= 0) | (k_S >= v), -jnp.inf, kth)


@functools.partial(jax.jit, static_argnames=("impl", "block_v", "num_warps", "programs",
                                             "interpret"))
def topp_threshold(x_SV, p_S, floor_S, *, impl: str = "auto", block_v: int = 512,
                   num_warps: int = 8, programs: int | None = None,
                   interpret: bool | None = None):
    """Nucleus cut of each row (f32[S]) over its tokens >= floor_S (pass -inf for the whole
    row): keep x >= cut. -inf where p >= 1. impl: "pallas", "sort" or "auto" (as
    topk_threshold). Blocks of 512 elements and 8 warps, with per-thread sums: the fastest of
    an H200 sweep from 32 rows up."""
    _check_rows(x_SV, "p_S", p_S)
    _check_rows(x_SV, "floor_S", floor_S)
    impl, on_gpu = _impl(impl, ("pallas", "sort"))
    if impl == "sort":
        return ref_topp_threshold(x_SV, p_S, floor_S)
    x_SV = x_SV.astype(jnp.float32)
    max_S = jnp.max(x_SV, axis=1)
    # the kept tokens' unnormalised mass: what a candidate's share is measured against
    shifted = jnp.where(max_S == -jnp.inf, 0.0, max_S)[:, None]
    kept_mass = jnp.sum(jnp.where(x_SV >= floor_S[:, None], jnp.exp(x_SV - shifted), 0.0),
                        axis=1)
    cut = _radix_select(x_SV, p_S.astype(jnp.float32) * kept_mass, max_S, weighted=True,
                        block_v=block_v, num_warps=num_warps, programs=_programs(programs),
                        interpret=(not on_gpu) if interpret is None else interpret)
    # NOTE: with p just below 1 the kernels' sums (in another order than kept_mass's) can all
    # fall short of the target: no digit qualifies and the key stays 0, a NaN. Keeping
    # everything >= floor is then the answer (a NaN-safe max: NaN >= floor is false).
    cut = jnp.where(cut >= floor_S, cut, floor_S)
    return jnp.where(p_S >= 1.0, -jnp.inf, cut)
