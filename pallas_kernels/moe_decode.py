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
only for steps of at most a few tokens (models/moe.py FUSED_MAX_TOKENS).
(The first version summed matrix-vector products on the CUDA cores, one program per token
looping over its k experts in kernel 2: 126 us against the grouped path's 44 at
Qwen3-30B-A3B's experts, H100; BENCHMARKS.md.)

Weights: gate / up / down [X, D, F] / [X, D, F] / [X, F, D] ([in, out], the grouped path's
layout), or gate|up fused as one [X, D, 2F] (gate columns first; pass it as `gate` with
`up=None`); each may be a tuple of consecutive expert chunks (moe.split_expert_weights: the
kernels address one chunk at a time, within int32). Block-scaled FP8 weights are not taken
here (the grouped path reads them).

Legend: T tokens, k experts per token, R = T * k rows, X experts, D model dim, F expert MLP
dim, BK / BF / BD block sizes (powers of two >= 16 dividing their dims), TM = 16 tile rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import resolve_impl, whole
from jaxserve.pallas_kernels.grouped_matmul import BLOCK_M as TILE_M, BlockScaledFp8

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _whole(w):
    return jnp.concatenate(w) if isinstance(w, (tuple, list)) else w


def ref_moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down):
    """Plain jnp: every (token, expert) row through its expert, rounded as the grouped path
    rounds (projections and SwiGLU in the input dtype), weighted and summed in f32."""
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


def problem(h_TD, gate, up, down) -> str | None:
    """Why these operands cannot take the kernels (None if they can)."""
    parts = _chunks(gate) + (_chunks(up) if up is not None else ()) + _chunks(down)
    if any(isinstance(w, BlockScaledFp8) for w in parts):
        return "block-scaled FP8 weights (the grouped path reads them)"
    if any(w.dtype != h_TD.dtype for w in parts):
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


def _block(dim: int, preferred: int) -> int:
    b = preferred
    while dim % b:
        b //= 2
    return b


# ---------------------------------------------------------------------------------------------
# Kernel bodies
# ---------------------------------------------------------------------------------------------


def _chunk_sum(expert, per_chunk: int, refs, steps: int, tile_sum, out_shape):
    """sum over the weight chunks of fori_loop(steps, tile_sum(ref, local expert)), where only
    the chunk holding `expert` runs its steps (the others run none): one chunk's reads."""
    total = jnp.zeros(out_shape, jnp.float32)
    for c, ref in enumerate(refs):
        local = jnp.clip(expert - c * per_chunk, 0, per_chunk - 1)
        n = jnp.where(expert // per_chunk == c, jnp.int32(steps), jnp.int32(0))
        total = total + jax.lax.fori_loop(jnp.int32(0), n, functools.partial(tile_sum, ref, local),
                                          jnp.zeros(out_shape, jnp.float32))
    return total


def _row_tile_dot(in_ref, row, ref, local, cols, block, step, acc):
    """acc + in[row, step's BK] (as row 0 of a TM-row tile, zeros below) @ ref[local, those
    rows, cols]."""
    kk = step * block + jnp.arange(block, dtype=jnp.int32)
    first = (jnp.arange(TILE_M, dtype=jnp.int32) == 0)[:, None]
    x = plgpu.load(in_ref.at[jnp.full((TILE_M, 1), row, jnp.int32), kk[None, :]],
                   mask=first, other=0)                                             # [TM, BK]
    w = plgpu.load(ref.at[local, kk[:, None], cols[None, :]])                       # [BK, BN]
    return acc + plgpu.dot(x, w, precision=jax.lax.Precision.HIGHEST)


def _act_kernel(h_ref, e_ref, *refs, k, d, gate_chunk, up_chunk, n_gate, n_up, up_off, block_k,
                block_f):
    """Program (r, j): act[r, j*BF..] of row r = t * k + i."""
    gate_refs, up_refs, act_ref = refs[:n_gate], refs[n_gate:n_gate + n_up], refs[-1]
    r, j = pl.program_id(0), pl.program_id(1)
    t = r // k
    expert = e_ref[t, r % k]
    cols = j * block_f + jnp.arange(block_f, dtype=jnp.int32)
    steps, shape = d // block_k, (TILE_M, block_f)
    dot = functools.partial(_row_tile_dot, h_ref, t)
    gate = _chunk_sum(expert, gate_chunk, gate_refs, steps,
                      lambda ref, local, step, acc: dot(ref, local, cols, block_k, step, acc), shape)
    up = _chunk_sum(expert, up_chunk, up_refs or gate_refs, steps,
                    lambda ref, local, step, acc: dot(ref, local, up_off + cols, block_k, step, acc),
                    shape)
    dtype = act_ref.dtype       # (rows 1.. of the tiles are 0: their sum is row 0)
    g = jnp.sum(gate, axis=0).astype(dtype).astype(jnp.float32)
    u = jnp.sum(up, axis=0).astype(dtype).astype(jnp.float32)
    plgpu.store(act_ref.at[r, cols], (g / (1.0 + jnp.exp(-g)) * u).astype(dtype))


def _down_kernel(act_ref, e_ref, *refs, k, f, per_chunk, block_f, block_d):
    """Program (r, j): y[r, j*BD..] = (act[r] @ down_e)[those columns], e = row r's expert."""
    down_refs, y_ref = refs[:-1], refs[-1]
    r, j = pl.program_id(0), pl.program_id(1)
    cols = j * block_d + jnp.arange(block_d, dtype=jnp.int32)
    dot = functools.partial(_row_tile_dot, act_ref, r)
    y = _chunk_sum(e_ref[r // k, r % k], per_chunk, down_refs, f // block_f,
                   lambda ref, local, step, acc: dot(ref, local, cols, block_f, step, acc),
                   (TILE_M, block_d))
    plgpu.store(y_ref.at[r, cols], jnp.sum(y, axis=0).astype(y_ref.dtype))


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
    that divides its dim is used); the defaults tile the weights as the grouped kernel does
    (kernel 1's gate and up tiles together are its 128 columns of gate|up)."""
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
    bk, bf, bd = _block(d, block_k), _block(f, block_f), _block(d, block_d)
    experts_Tk = experts_Tk.astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    act = pl.pallas_call(
        functools.partial(_act_kernel, k=k, d=d, gate_chunk=gates[0].shape[0],
                          up_chunk=(ups or gates)[0].shape[0], n_gate=len(gates), n_up=len(ups),
                          up_off=0 if ups else f, block_k=bk, block_f=bf),
        grid=(r, f // bf),
        in_specs=[whole(t, d), whole(t, k)] + [whole(*w.shape) for w in gates + ups],
        out_specs=whole(r, f),
        out_shape=jax.ShapeDtypeStruct((r, f), h_TD.dtype),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_act_bk{bk}_bf{bf}",
    )(h_TD, experts_Tk, *gates, *ups)
    y_RD = pl.pallas_call(
        functools.partial(_down_kernel, k=k, f=f, per_chunk=downs[0].shape[0], block_f=bf,
                          block_d=bd),
        grid=(r, d // bd),
        in_specs=[whole(r, f), whole(t, k)] + [whole(*w.shape) for w in downs],
        out_specs=whole(r, d),
        out_shape=jax.ShapeDtypeStruct((r, d), h_TD.dtype),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_down_bf{bf}_bd{bd}",
    )(act, experts_Tk, *downs)
    return _weighted_sum(y_RD.reshape(t, k, d), weights_Tk)
