"""A linear layer with its neighbours fused in: an RMSNorm before it, a bias, a SiLU gate or a
residual add after it. For small-batch decode, where a step is bound by how many kernels it
launches, not by bytes (issue 33: the default model's 30 layers ran 17 kernels each); with it a
dense layer is five kernels plus attention.

    y = [RMSNorm(x) * norm_w] @ W  [+ bias]                  the matmul's output rounded to x's dtype
    out = y                                                  plain
        | silu(y[:, :F]) * y[:, F:]       (gated: W = [W_gate | W_up], out f[T, F])
        | residual + y                    (residual)

With `normed_out` (and a norm) it also returns the normalised rows, RMSNorm(x) * norm_K in x's
dtype (as models/layers.py rms_norm rounds them), written by the programs of the first column
block in a second pass over their rows: the fused stack's MoE layer reads them into its experts
(models/moe.py residual_moe) from the router projection, with no norm kernel of its own.

Rounding follows the model's XLA ops one by one (models/llama.py: `layers.rms_norm` in f32 to
the input dtype, the matmul's output to the input dtype, each elementwise op to it again), so in
f32 the two agree to the order of the sums; in bf16 to an ulp here and there (XLA's own
sigmoid, and its fusions, which may keep f32 between ops). `out_dtype=float32` (the LM head) keeps the f32
accumulator instead, as `jnp.dot(..., preferred_element_type=f32)` does.

Layouts: x_TK f[T, K]; w f[K, N] (activations multiply on the left, as the models store
weights) or, with `w_layout="NK"`, f[N, K] (a tied embedding used as the LM head, read without
a transpose); norm_K f[K]; bias_N f[N]; residual_TN f[T, N].

Legend: T rows (tokens), K contraction dim, N output columns (2F when gated), F the gated
output width, BM / BN / BK a program's rows / output columns / K step.

GPU kernel (Triton lowering of pallas_call): program (i, j) owns rows i*BM.. and output columns
j*BN.. (and F + j*BN.. when gated) and streams those weight columns BK rows at a time. A norm
costs no second pass: its per-row scale commutes with the product, so x is multiplied by the
norm weight as it streams, its squares summed alongside, and the scale applied at the end (so
in bf16 the normalised x is rounded before its row scale, not after: an ulp apart at most).
Each weight element is read once per row tile; at decode (one row tile) that is the matmul's
traffic floor, spread over N / BN programs.

One row over [N, K] weights of up to ONE_ROW_MAX_ELEMENTS (the fused stack's decode step:
`one_row`) skips the tensor cores: a dot needs 16 output columns a program, which left the
default model's 576-wide o and down projections 36 programs for 132 SMs, each waiting on a
chain of loads. There each program takes 4 weight rows whole, multiplies them by the row in
f32 and sums along K: four times the programs, each with all its loads in flight at once
(`one_row_tiling`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import absent_refs, checked_block, num_sms, resolve_impl, whole

HIGHEST = jax.lax.Precision.HIGHEST
SMALL_WEIGHT_ELEMENTS = 1 << 22   # decode_warps
# one_row: up to Qwen3-30B-A3B's q|k|v (10.5M) and o (8.4M), where the one-row program took
# 9.2 and 7.8 us against the dot program's 29.7 and 23.4 (H100, `kernels.py --only linear
# --model qwen3-30b-a3b --sweep`, BENCHMARKS.md); heads (tens of millions and up) unmeasured
ONE_ROW_MAX_ELEMENTS = 1 << 24

# ---------------------------------------------------------------------------------------------
# Reference: the model's XLA ops, in its order
# ---------------------------------------------------------------------------------------------


def ref_fused_linear(x_TK, w, *, norm_K=None, eps: float = 1e-6, bias_N=None, residual_TN=None,
                     gated: bool = False, w_layout: str = "KN", out_dtype=None,
                     normed_out: bool = False):
    if norm_K is not None:
        h = x_TK.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
        x_TK = (h * norm_K.astype(jnp.float32)).astype(x_TK.dtype)
    if normed_out:
        return ref_fused_linear(x_TK, w, bias_N=bias_N, residual_TN=residual_TN, gated=gated,
                                w_layout=w_layout, out_dtype=out_dtype), x_TK
    w_KN = w.T if w_layout == "NK" else w
    if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
        return jnp.dot(x_TK, w_KN, preferred_element_type=jnp.float32)
    y = x_TK @ w_KN
    if bias_N is not None:
        y = y + bias_N
    if gated:
        gate, up = jnp.split(y, 2, axis=-1)
        return jax.nn.silu(gate) * up
    if residual_TN is not None:
        return y + residual_TN
    return y


# ---------------------------------------------------------------------------------------------
# Validation and tiling
# ---------------------------------------------------------------------------------------------


def _problem(x_TK, w, norm_K, bias_N, residual_TN, gated, w_layout, out_dtype) -> str | None:
    """Why the Pallas kernel cannot take these operands (None if it can)."""
    if x_TK.ndim != 2 or w.ndim != 2:
        return f"x_TK and w must be matrices; got {x_TK.shape} and {w.shape}"
    if w_layout not in ("KN", "NK"):
        return f"w_layout must be 'KN' or 'NK'; got {w_layout!r}"
    k, n = w.shape if w_layout == "KN" else w.shape[::-1]
    if x_TK.shape[1] != k:
        return f"x_TK must be [T, K={k}]; got {x_TK.shape}"
    if x_TK.dtype != w.dtype or x_TK.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"x_TK and w must share one dtype of bf16, f16, f32; got {x_TK.dtype}, {w.dtype}"
    n_out = n // 2 if gated else n
    if k % 16 or n_out % 16 or (gated and n % 2):
        return f"K and the output width must be multiples of 16; got K={k}, N={n}"
    if norm_K is not None and norm_K.shape != (k,):
        return f"norm_K must be f[K={k}]; got {norm_K.shape}"
    if bias_N is not None and bias_N.shape != (n,):
        return f"bias_N must be f[N={n}]; got {bias_N.shape}"
    if residual_TN is not None and (residual_TN.shape != (x_TK.shape[0], n) or gated):
        return f"residual_TN must be f[T, N={n}] (and not gated); got {residual_TN.shape}"
    if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32 and x_TK.dtype != jnp.float32:
        if gated or bias_N is not None or residual_TN is not None:
            return "out_dtype=float32 (the f32 accumulator) takes no bias, gate or residual"
    return None


def dot_tiling(t: int, k: int, n_out: int, w_layout: str) -> tuple[int, int, int]:
    """(BM, BN, BK). BM: Triton's smallest dot M (16) for decode, up to 64 rows for prefill.
    BN: the widest of 128..16 dividing the output that still gives every SM a program; fewer
    programs than SMs would leave HBM bandwidth unused at decode. BK: below."""
    bm = 16 if t <= 16 else 32 if t <= 32 else 64
    row_tiles = pl.cdiv(t, bm)
    bn = 16
    for cand in (128, 64, 32):
        if n_out % cand == 0 and row_tiles * (n_out // cand) >= num_sms():
            bn = cand
            break
    # few, large K steps: at decode each step's loads wait on HBM latency, not bandwidth
    # (H200: 24 steps of 64 made the down projection 8.8 us; BENCHMARKS.md); BK need not divide
    # K (the tail is masked). Shared memory bounds it: 3 stages of x and weight tiles.
    bk = 128 if w_layout == "NK" else (256 if bn <= 32 else 64)
    if bm == 64 and bn > 32:
        # [N, K] too: 64 x 128 x tiles beside gate|up's 2 x 128 x 128 weight tiles asked the
        # H100 for 353 KB of shared memory in f32 (227 KB there)
        bk = 64
    return bm, bn, min(bk, pl.next_power_of_2(k))


def one_row(t: int, weight_elements: int, w_layout: str) -> bool:
    """Whether a step takes the one-row (no tensor-core) program: one row times [N, K]
    weights of up to ONE_ROW_MAX_ELEMENTS (see the module docstring)."""
    return t == 1 and w_layout == "NK" and weight_elements <= ONE_ROW_MAX_ELEMENTS


def one_row_tiling(k: int) -> tuple[int, int]:
    """(BN, BK) of the one-row program: 4 weight rows a program, the whole (padded) K in one
    step up to 2048 (all of a program's loads in flight at once). Measured (H100, CUPTI,
    BENCHMARKS.md, issue 33's "one-row program"): at the default model's shapes BN 4 with the
    whole K and 4 warps was the fastest of BN 4-16, BK 512-2048, 2 or 4 warps for all four
    projections (q|k|v 2.8 us, o 1.8, gate|up 4.2, down 3.2). (The output width is a
    multiple of 16: `_problem`.)"""
    return 4, min(2048, pl.next_power_of_2(k))


def decode_warps(t: int, weight_elements: int, single: bool = False) -> int:
    """Warps a program: 4 for the one-row program (`single`; see one_row_tiling), 2 for the
    dot program's one row times a small weight (up to 4M elements), else 4. The dot
    program's one-row steps are latency-bound: at the default model's shapes 2 warps took
    q|k|v 5.3 us against 6.6 and gate|up 6.7 against 8.7, o 3.1 either way (H100,
    `benchmarks/kernels.py --only linear --sweep`, BENCHMARKS.md); 8 warps were slower
    everywhere. The LM head (28M) was not swept: it keeps 4."""
    if single:
        return 4
    return 2 if t == 1 and weight_elements <= SMALL_WEIGHT_ELEMENTS else 4


# ---------------------------------------------------------------------------------------------
# Kernel body: program (i, j) = rows i*BM.. x output columns j*BN..
# ---------------------------------------------------------------------------------------------


def _kernel(
    # inputs
    x_ref, norm_ref, w_ref, bias_ref, res_ref,
    # outputs
    o_ref, normed_ref,
    *, t, k, n_out, bm, bn, bk, eps, gated, w_nk, round_out, dot=True):
    i, j = pl.program_id(0), pl.program_id(1)
    rows_R = i * bm + jnp.arange(bm, dtype=jnp.int32)
    # rows past T: any value will do (never stored), so clamp the loads instead of masking
    xrows_R1 = jnp.minimum(rows_R, t - 1)[:, None]
    kk_K = jnp.arange(bk, dtype=jnp.int32)
    cols_N = j * bn + jnp.arange(bn, dtype=jnp.int32)
    # NOTE: int32 bounds (see grouped_matmul: the GPU's verifier); the last step may run past
    # K (BK need not divide it): those loads are masked to 0
    steps = jnp.int32(pl.cdiv(k, bk))
    dtype = x_ref.dtype

    def weights(kk, cols):
        if w_nk:   # [N, K]: BN rows of BK contiguous elements
            return plgpu.load(w_ref.at[cols[:, None], kk[None, :]], mask=(kk < k)[None, :], other=0)
        return plgpu.load(w_ref.at[kk[:, None], cols[None, :]], mask=(kk < k)[:, None], other=0)

    def matmul(x, w):
        if not dot:    # one row (bm 1) times [BN, BK]: products in f32, summed along K
            return jnp.sum(w.astype(jnp.float32) * x.astype(jnp.float32), axis=1)[None, :]
        return plgpu.dot(x, w, trans_b=w_nk, precision=HIGHEST)

    # RMSNorm(x) * w @ W = inv_rms[row] * ((x * w) @ W): the row's scale waits for the end, so
    # its sum of squares is taken in the same pass over x as the product
    def body(s, carry):
        ss_R, accs = carry
        kk = s * bk + kk_K
        x = plgpu.load(x_ref.at[xrows_R1, kk[None, :]], mask=(kk < k)[None, :], other=0)
        if norm_ref is not None:
            xf = x.astype(jnp.float32)
            ss_R = ss_R + jnp.sum(xf * xf, axis=1)
            nw = plgpu.load(norm_ref.at[kk], mask=kk < k, other=0).astype(jnp.float32)
            x = (xf * nw[None, :]).astype(dtype)
        out = (accs[0] + matmul(x, weights(kk, cols_N)),)
        if gated:
            out += (accs[1] + matmul(x, weights(kk, cols_N + n_out)),)
        return ss_R, out

    zeros = jnp.zeros((bm, bn), jnp.float32)
    ss_R, accs = jax.lax.fori_loop(jnp.int32(0), steps, body, (
        jnp.zeros((bm,), jnp.float32), (zeros, zeros) if gated else (zeros,)))
    if norm_ref is not None:
        inv_R1 = jax.lax.rsqrt(ss_R / k + eps)[:, None]
        accs = tuple(a * inv_R1 for a in accs)

    def rounded(v):   # one op of the XLA path: f32 math, rounded to the model's dtype
        return v.astype(dtype).astype(jnp.float32)

    if not round_out:
        y = accs[0]
    else:
        y = rounded(accs[0])
        if bias_ref is not None:
            y = rounded(y + plgpu.load(bias_ref.at[cols_N]).astype(jnp.float32)[None, :])
        if gated:
            up = rounded(accs[1])
            if bias_ref is not None:
                up = rounded(up + plgpu.load(bias_ref.at[cols_N + n_out]).astype(jnp.float32)[None, :])
            y = rounded(rounded(y * rounded(jax.nn.sigmoid(y))) * up)
        if res_ref is not None:
            y = y + plgpu.load(res_ref.at[xrows_R1, cols_N[None, :]]).astype(jnp.float32)
    plgpu.store(o_ref.at[rows_R[:, None], cols_N[None, :]], y.astype(o_ref.dtype),
                mask=(rows_R < t)[:, None])
    if normed_ref is not None:
        @pl.when(j == 0)
        def _():   # a second pass over x (in cache by now), rounded as layers.rms_norm
            def store_normed(s, carry):
                kk = s * bk + kk_K
                x = plgpu.load(x_ref.at[xrows_R1, kk[None, :]], mask=(kk < k)[None, :], other=0)
                nw = plgpu.load(norm_ref.at[kk], mask=kk < k, other=0).astype(jnp.float32)
                h = x.astype(jnp.float32) * inv_R1 * nw[None, :]
                plgpu.store(normed_ref.at[rows_R[:, None], kk[None, :]], h.astype(dtype),
                            mask=(rows_R < t)[:, None] & (kk < k)[None, :])
                return carry
            jax.lax.fori_loop(jnp.int32(0), steps, store_normed, jnp.int32(0))


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearTiling:
    """A caller's tiling of the kernel; None fields are chosen by the rules (one_row,
    one_row_tiling or dot_tiling, decode_warps)."""
    one_row_program: bool | None = None   # the one-row program (one row, [N, K]) or the dot one
    block_n: int | None = None            # output columns a program (the one-row program: rows of w)
    block_k: int | None = None            # K a step (need not divide K: the last step is masked)
    num_warps: int | None = None
    num_stages: int = 3


@functools.partial(jax.jit, static_argnames=("eps", "gated", "w_layout", "out_dtype", "normed_out",
                                             "impl", "tiling", "interpret"))
def fused_linear(x_TK, w, *, norm_K=None, eps: float = 1e-6, bias_N=None, residual_TN=None,
                 gated: bool = False, w_layout: str = "KN", out_dtype=None,
                 normed_out: bool = False, impl: str = "auto",
                 tiling: LinearTiling = LinearTiling(), interpret: bool | None = None):
    """[RMSNorm(x) * norm_K] @ w [+ bias_N], then silu-gated (`gated`) or plus `residual_TN`:
    see the module docstring. impl "pallas" (Triton; interpreted on CPU), "xla", or "auto"
    (pallas on a GPU when the shapes suit the kernel). tiling: the program (one-row or dot) and
    its blocks, each None field by the rules (`one_row`'s choice, ...). normed_out: return
    (output, RMSNorm(x) * norm_K) (module docstring)."""
    if normed_out and norm_K is None:
        raise ValueError("fused_linear: normed_out needs norm_K")
    problem = _problem(x_TK, w, norm_K, bias_N, residual_TN, gated, w_layout, out_dtype)
    if problem and (impl != "auto" or x_TK.ndim != 2 or w.ndim != 2):
        raise ValueError(f"fused_linear: {problem}")
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla" or problem:
        return ref_fused_linear(x_TK, w, norm_K=norm_K, eps=eps, bias_N=bias_N,
                                residual_TN=residual_TN, gated=gated, w_layout=w_layout,
                                out_dtype=out_dtype, normed_out=normed_out)
    t, k = x_TK.shape
    n = w.shape[1] if w_layout == "KN" else w.shape[0]
    n_out = n // 2 if gated else n
    single = one_row(t, k * n, w_layout) if tiling.one_row_program is None else tiling.one_row_program
    if single and (t != 1 or w_layout != "NK"):
        raise ValueError(f"fused_linear: the one-row program takes one row and [N, K] weights; "
                         f"got T={t}, w_layout={w_layout!r}")
    if single:
        (bn, bk), bm = one_row_tiling(k), 1
    else:
        bm, bn, bk = dot_tiling(t, k, n_out, w_layout)
    num_warps = tiling.num_warps or decode_warps(t, k * n, single)
    if tiling.block_n is not None:   # the one-row program (no dot) takes any power of two
        bn = checked_block(tiling.block_n, "block_n", n_out, "N", least=1 if single else 16)
    if tiling.block_k is not None:   # need not divide K: the last step's loads are masked
        bk = checked_block(tiling.block_k, "block_k")
    f32_out = out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32
    out_dt = jnp.float32 if f32_out else x_TK.dtype
    present = [a is not None for a in (norm_K, bias_N, residual_TN)]
    kernel = functools.partial(_kernel, t=t, k=k, n_out=n_out, bm=bm, bn=bn, bk=bk, eps=float(eps),
                               gated=gated, w_nk=w_layout == "NK", round_out=out_dt == x_TK.dtype,
                               dot=not single)
    absent = [pos for pos, ok in zip((1, 3, 4, 6), present + [normed_out]) if not ok]
    ins = [a for a in (x_TK, norm_K, w, bias_N, residual_TN) if a is not None]
    out_shape = jax.ShapeDtypeStruct((t, n_out), out_dt)
    normed_shape = jax.ShapeDtypeStruct((t, k), x_TK.dtype)
    return pl.pallas_call(
        absent_refs(kernel, *absent),
        grid=(pl.cdiv(t, bm), n_out // bn),
        in_specs=[whole(*a.shape) for a in ins],
        out_specs=(whole(t, n_out), whole(t, k)) if normed_out else whole(t, n_out),
        out_shape=(out_shape, normed_shape) if normed_out else out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=tiling.num_stages),
        interpret=(not on_gpu) if interpret is None else interpret,
        name=f"fused_linear{'_norm' * present[0]}{'_gated' * gated}{'_res' * present[2]}"
             f"{'_normed' * normed_out}_bm{bm}_bn{bn}_bk{bk}",
    )(*ins)

