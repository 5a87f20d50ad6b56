"""The routed experts of a few tokens in two kernels, with no sorting, gathering or tile list
around them (the MoE layer of a small decode step):

    out_TD = moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down)      f32[T, D]
    out[t] = sum_i weights[t, i] * down_e(silu(h[t] @ gate_e) * (h[t] @ up_e)),  e = experts[t, i]

Kernel 1 (program (r, j), r = t * k + i): the SwiGLU activations of row r, columns j*BF..,
from that row's expert's gate and up columns -> act f[T*k, F].
Kernel 2 (program (r, j)): columns j*BD.. of row r's down projection, act[r] @ down_e, rounded
to the input dtype (as the grouped path's down output is) -> y f[T*k, D]; the weighted sum
over each token's k rows in f32 is one small XLA fusion after it (no float atomics: the sum's
order is fixed, so a token's output does not depend on its batch).

Each program streams its expert's [BK, BF] weight tiles through a tensor-core dot, its one
input row as row 0 of the 16-row tile Triton's dot needs (zeros below, so the product's
column sums are that row's): the weights are read exactly as the grouped kernel reads them
(its 16-row tiles, BK = 128, 4 stages), so the pipelined loads keep as many bytes in flight,
with one program per (row, column block).
Why: the grouped path (models/moe.py expert_rows_sum) runs, besides its grouped matmuls, the
rows' grouping by expert, the gather of their inputs, each matmul's tile list, the SwiGLU and
the gather-back with the weighted sum; with expert arrays past the grouped kernel's int32
reach in chunks (DeepSeek-V3) each projection adds a rotation and a sum per chunk. At one
token that is 8 to 24 small launches a layer for a few MB of weights (issue 33). Each
(token, expert) row reads its own expert's weights: for T tokens that is up to T * k expert
reads where the grouped path reads each distinct expert once, so the models take this path
only for steps of at most a few tokens (policy.py MOE_DECODE_MAX_TOKENS).
(The first version summed matrix-vector products on the CUDA cores, one program per token
looping over its k experts in kernel 2: 126 us against the grouped path's 44 at
Qwen3-30B-A3B's experts, H100; BENCHMARKS.md.)

Weights: gate / up / down [X, D, F] / [X, D, F] / [X, F, D] ([in, out], the grouped path's
layout), or gate|up fused as one [X, D, 2F] (gate columns first; pass it as `gate` with
`up=None`); each may be a tuple of consecutive expert chunks (moe.split_expert_weights: the
kernels address one chunk at a time, within int32).
Block-scaled FP8 weights (grouped_matmul.BlockScaledFp8: e4m3 values [X, K, N] and one f32
scale per B x B block, [X, ceil(K/B), ceil(N/B)]; DeepSeek's checkpoints, B = 128), all three
of them or none, chunks too (BlockScaledFp8.split): the kernels read the FP8 bytes, widen
each [BK, BN] tile to the activations' dtype (exact for bf16), dot it with f32 accumulation
and multiply that K-step's partial product by its (expert, K block, column block) scale
before adding it up, as the grouped kernel does. BK, BF and BD then also divide B, so a tile
lies in one scale block: any tile of gate|up fused does too, the up half's first column F
being a multiple of BF (F need not be one of B: a block across the two halves is fine).
The reference dequantizes the weights to f32 first. Measured at DeepSeek-V3's experts, one
token: 212.4 us in FP8 against 165.6 us in bf16 (39 % against 100 % of HBM, H200; the
widening and scaling cost more than the halved bytes save: BENCHMARKS.md, issue 30's choice).

Legend: T tokens, k experts per token, R = T * k rows, X experts, D model dim, F expert MLP
dim, BK / BF / BD block sizes (powers of two >= 16 dividing their dims, and B for FP8), TM = 16
tile rows, B the FP8 scale block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import resolve_impl, whole
from jaxserve.pallas_kernels.grouped_matmul import BLOCK_M as TILE_M, BlockScaledFp8, dequantize

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _whole(w):
    """The weight as one array: chunks concatenated, block-scaled FP8 dequantized (to f32)."""
    if isinstance(w, (tuple, list)):
        return jnp.concatenate([_whole(c) for c in w])
    return dequantize(w) if isinstance(w, BlockScaledFp8) else w


def ref_moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down):
    """Plain jnp: every (token, expert) row through its expert, rounded as the grouped path
    rounds (projections and SwiGLU in the input dtype), weighted and summed in f32. FP8
    weights are dequantized to f32 first."""
    gate, down = _whole(gate), _whole(down)
    if up is None:
        gate, up = jnp.split(gate, 2, axis=-1)
    up = _whole(up)
    dtype = h_TD.dtype
    e_Tk = experts_Tk.astype(jnp.int32)
    hi = jax.lax.Precision.HIGHEST
    g_TkF = jnp.einsum("td,tkdf->tkf", h_TD, gate[e_Tk], precision=hi).astype(dtype)
    u_TkF = jnp.einsum("td,tkdf->tkf", h_TD, up[e_Tk], precision=hi).astype(dtype)
    act = (jax.nn.silu(g_TkF.astype(jnp.float32)) * u_TkF.astype(jnp.float32)).astype(dtype)
    y_TkD = jnp.einsum("tkf,tkfd->tkd", act, down[e_Tk], precision=hi).astype(dtype)
    return _weighted_sum(y_TkD, weights_Tk)


def _weighted_sum(y_TkD, weights_Tk):
    """f32[T, D]: each token's k expert outputs times their weights, summed in f32."""
    return jnp.sum(y_TkD.astype(jnp.float32) * weights_Tk.astype(jnp.float32)[:, :, None], axis=1)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _chunks(w) -> tuple:
    return tuple(w) if isinstance(w, (tuple, list)) else (w,)


def _fp8_block(gate) -> int:
    """The scale block B of block-scaled FP8 weights (problem() checked that all share it), or
    0 for weights in the activations' dtype."""
    first = _chunks(gate)[0]
    return first.block if isinstance(first, BlockScaledFp8) else 0


def _fp8_problem(h_TD, parts) -> str | None:
    if not all(isinstance(w, BlockScaledFp8) for w in parts):
        return "gate, up and down must all be block-scaled FP8 (BlockScaledFp8) or none"
    if h_TD.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"with FP8 weights h_TD must be bf16, f16 or f32; got {h_TD.dtype}"
    blocks = {w.block for w in parts}
    if len(blocks) != 1 or min(blocks) % 16:
        return f"the FP8 weights need one scale block, a multiple of 16; got {sorted(blocks)}"
    return next((w.problem() for w in parts if w.problem()), None)


def problem(h_TD, gate, up, down) -> str | None:
    """Why these operands cannot take the kernels (None if they can)."""
    parts = _chunks(gate) + (_chunks(up) if up is not None else ()) + _chunks(down)
    if any(isinstance(w, BlockScaledFp8) for w in parts):
        why = _fp8_problem(h_TD, parts)
        if why:
            return why
    elif any(w.dtype != h_TD.dtype for w in parts):
        return f"the weights must have h_TD's dtype {h_TD.dtype}"
    d = h_TD.shape[1]
    f = _chunks(down)[0].shape[1]
    if d % 16 or f % 16:
        return f"D and F must be multiples of 16; got D={d}, F={f}"
    if any(w.size > 2 ** 31 for w in parts):      # (offsets up to size - 1)
        return "a weight array past int32 offsets (split it: moe.split_expert_weights)"
    return None


def _validate(h_TD, weights_Tk, experts_Tk, gate, up, down):
    t, d = h_TD.shape
    if weights_Tk.shape != experts_Tk.shape or weights_Tk.ndim != 2 or weights_Tk.shape[0] != t:
        raise ValueError(f"weights_Tk and experts_Tk must both be [T={t}, k]; got "
                         f"{weights_Tk.shape} and {experts_Tk.shape}")
    x = sum(w.shape[0] for w in _chunks(down))
    f = _chunks(down)[0].shape[1]
    want_gate = (x, d, f if up is not None else 2 * f)
    for name, w, want in (("gate", gate, want_gate), ("up", up, (x, d, f)), ("down", down, (x, f, d))):
        if w is None:
            continue
        got = (sum(c.shape[0] for c in _chunks(w)),) + _chunks(w)[0].shape[1:]
        if got != want or len({c.shape[0] for c in _chunks(w)}) != 1:
            raise ValueError(f"{name} must be [X, ...] = {want} (or equal chunks of experts); got "
                             f"{[c.shape for c in _chunks(w)]}")
    why = problem(h_TD, gate, up, down)
    if why:
        raise ValueError(f"moe_decode: {why}; use the grouped path")


def _block(dim: int, preferred: int, fp8_block: int = 0) -> int:
    """The largest power of two up to `preferred` dividing `dim` (and the FP8 scale block, if
    any: a tile in one block; >= 16 as both are multiples of 16)."""
    b = min(preferred, fp8_block) if fp8_block else preferred
    while dim % b or (fp8_block and fp8_block % b):
        b //= 2
    return b


# ---------------------------------------------------------------------------------------------
# Kernel bodies
# ---------------------------------------------------------------------------------------------


def _chunk_sum(expert, per_chunk: int, refs, scale_refs, steps: int, tile_sum, out_shape):
    """sum over the weight chunks of fori_loop(steps, tile_sum(ref, scale ref, local expert)),
    where only the chunk holding `expert` runs its steps (the others run none): one chunk's
    reads. scale_refs: each chunk's FP8 scales, or () for weights in the activations' dtype."""
    total = jnp.zeros(out_shape, jnp.float32)
    for c, ref in enumerate(refs):
        local = jnp.clip(expert - c * per_chunk, 0, per_chunk - 1)
        n = jnp.where(expert // per_chunk == c, jnp.int32(steps), jnp.int32(0))
        scale_ref = scale_refs[c] if scale_refs else None
        total = total + jax.lax.fori_loop(jnp.int32(0), n,
                                          functools.partial(tile_sum, ref, scale_ref, local),
                                          jnp.zeros(out_shape, jnp.float32))
    return total


def _row_tile_dot(in_ref, row, ref, scale_ref, local, cols, block, step, acc, *, col0=None,
                  fp8_block=0):
    """acc + in[row, step's BK] (as row 0 of a TM-row tile, zeros below) @ ref[local, those
    rows, cols]; for FP8 weights (scale_ref; cols = col0 + arange) the tile is widened to in's
    dtype and the product times its block's scale, scales[local, BK block, column block]."""
    kk = step * block + jnp.arange(block, dtype=jnp.int32)
    first = (jnp.arange(TILE_M, dtype=jnp.int32) == 0)[:, None]
    x = plgpu.load(in_ref.at[jnp.full((TILE_M, 1), row, jnp.int32), kk[None, :]],
                   mask=first, other=0)                                             # [TM, BK]
    w = plgpu.load(ref.at[local, kk[:, None], cols[None, :]])                       # [BK, BN]
    if scale_ref is None:
        return acc + plgpu.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    # FP8: the tile lies in one scale block (BK and BN divide B, col0 a multiple of BN): one
    # scale for its product
    part = plgpu.dot(x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    return acc + part * scale_ref[local, step * block // fp8_block, col0 // fp8_block]


def _act_kernel(h_ref, e_ref, *refs, k, d, gate_chunk, up_chunk, n_gate, n_up, up_off, block_k,
                block_f, fp8_block):
    """Program (r, j): act[r, j*BF..] of row r = t * k + i. refs: gate chunks, up chunks, then
    (FP8) their scales in the same order, then act."""
    n = n_gate + n_up
    gate_refs, up_refs, act_ref = refs[:n_gate], refs[n_gate:n], refs[-1]
    scales = refs[n:2 * n] if fp8_block else ()
    gate_scales, up_scales = scales[:n_gate], scales[n_gate:]
    r, j = pl.program_id(0), pl.program_id(1)
    t = r // k
    expert = e_ref[t, r % k]
    col0 = j * block_f
    cols = col0 + jnp.arange(block_f, dtype=jnp.int32)
    up_col0 = up_off + col0 if fp8_block else None
    steps, shape = d // block_k, (TILE_M, block_f)
    dot = functools.partial(_row_tile_dot, h_ref, t, fp8_block=fp8_block)
    gate = _chunk_sum(expert, gate_chunk, gate_refs, gate_scales, steps,
                      lambda ref, scale, local, step, acc:
                      dot(ref, scale, local, cols, block_k, step, acc, col0=col0), shape)
    up = _chunk_sum(expert, up_chunk, up_refs or gate_refs, up_scales or gate_scales, steps,
                    lambda ref, scale, local, step, acc:
                    dot(ref, scale, local, up_off + cols, block_k, step, acc, col0=up_col0),
                    shape)
    dtype = act_ref.dtype       # (rows 1.. of the tiles are 0: their sum is row 0)
    g = jnp.sum(gate, axis=0).astype(dtype).astype(jnp.float32)
    u = jnp.sum(up, axis=0).astype(dtype).astype(jnp.float32)
    plgpu.store(act_ref.at[r, cols], (g / (1.0 + jnp.exp(-g)) * u).astype(dtype))


def _down_kernel(act_ref, e_ref, *refs, k, f, per_chunk, n_down, block_f, block_d, fp8_block):
    """Program (r, j): y[r, j*BD..] = (act[r] @ down_e)[those columns], e = row r's expert.
    refs: down chunks, then (FP8) their scales, then y."""
    down_refs, y_ref = refs[:n_down], refs[-1]
    scales = refs[n_down:2 * n_down] if fp8_block else ()
    r, j = pl.program_id(0), pl.program_id(1)
    col0 = j * block_d
    cols = col0 + jnp.arange(block_d, dtype=jnp.int32)
    dot = functools.partial(_row_tile_dot, act_ref, r, fp8_block=fp8_block)
    y = _chunk_sum(e_ref[r // k, r % k], per_chunk, down_refs, scales, f // block_f,
                   lambda ref, scale, local, step, acc:
                   dot(ref, scale, local, cols, block_f, step, acc, col0=col0),
                   (TILE_M, block_d))
    plgpu.store(y_ref.at[r, cols], jnp.sum(y, axis=0).astype(y_ref.dtype))


# ---------------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------------


def _values(chunks) -> tuple:
    """The kernels' weight operands: the arrays, or the FP8 values of BlockScaledFp8 chunks."""
    return tuple(w.values if isinstance(w, BlockScaledFp8) else w for w in chunks)


def _scales(chunks) -> tuple:
    """The FP8 chunks' scales as f32 [X, ceil(K/B), ceil(N/B)] (none for other weights)."""
    return tuple(w.scales.astype(jnp.float32) for w in chunks if isinstance(w, BlockScaledFp8))


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "block_k", "block_f", "block_d", "num_warps",
                                             "num_stages", "interpret"))
def moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down, *, impl: str = "auto",
               block_k: int = 128, block_f: int = 64, block_d: int = 128, num_warps: int = 4,
               num_stages: int = 4, interpret: bool | None = None):
    """f32[T, D]: the routed experts' weighted sum for each token (module docstring).
    impl: "pallas" (the two kernels; interpreted on a CPU), "xla" (the reference) or "auto".
    block_k / block_f / block_d: preferred block sizes (the largest power of two up to each
    that divides its dim, and the FP8 scale block if any, is used); the defaults tile the
    weights as the grouped kernel does (kernel 1's gate and up tiles together are its 128
    columns of gate|up). gate / up / down may be BlockScaledFp8 (all three, or chunks of it)."""
    _validate(h_TD, weights_Tk, experts_Tk, gate, up, down)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down)
    interpret = (not on_gpu) if interpret is None else interpret
    t, d = h_TD.shape
    k = weights_Tk.shape[1]
    r = t * k
    gates, ups, downs = _chunks(gate), (_chunks(up) if up is not None else ()), _chunks(down)
    f = downs[0].shape[1]
    fp8 = _fp8_block(gate)
    bk, bf, bd = _block(d, block_k, fp8), _block(f, block_f, fp8), _block(d, block_d, fp8)
    experts_Tk = experts_Tk.astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    tag = "_fp8" if fp8 else ""
    gate_ups = gates + ups
    act = pl.pallas_call(
        functools.partial(_act_kernel, k=k, d=d, gate_chunk=gates[0].shape[0],
                          up_chunk=(ups or gates)[0].shape[0], n_gate=len(gates), n_up=len(ups),
                          up_off=0 if ups else f, block_k=bk, block_f=bf, fp8_block=fp8),
        grid=(r, f // bf),
        in_specs=[whole(t, d), whole(t, k)] + [whole(*w.shape) for w in gate_ups]
        + [whole(*w.scales.shape) for w in gate_ups if fp8],
        out_specs=whole(r, f),
        out_shape=jax.ShapeDtypeStruct((r, f), h_TD.dtype),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_act{tag}_bk{bk}_bf{bf}",
    )(h_TD, experts_Tk, *_values(gate_ups), *_scales(gate_ups))
    y_RD = pl.pallas_call(
        functools.partial(_down_kernel, k=k, f=f, per_chunk=downs[0].shape[0], n_down=len(downs),
                          block_f=bf, block_d=bd, fp8_block=fp8),
        grid=(r, d // bd),
        in_specs=[whole(r, f), whole(t, k)] + [whole(*w.shape) for w in downs]
        + [whole(*w.scales.shape) for w in downs if fp8],
        out_specs=whole(r, d),
        out_shape=jax.ShapeDtypeStruct((r, d), h_TD.dtype),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_down{tag}_bf{bf}_bd{bd}",
    )(act, experts_Tk, *_values(downs), *_scales(downs))
    return _weighted_sum(y_RD.reshape(t, k, d), weights_Tk)
