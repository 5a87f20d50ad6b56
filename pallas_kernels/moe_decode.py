"""The routed experts of a few tokens in two kernels, with no sorting, gathering or combining
around them (the MoE layer of a small decode step):

    out_TD = moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down)      f32[T, D]
    out[t] = sum_i weights[t, i] * down_e(silu(h[t] @ gate_e) * (h[t] @ up_e)),  e = experts[t, i]

Kernel 1 (program (r, j), r = t * k + i): the SwiGLU activations of row r, columns j*BF..,
from that row's expert's gate and up columns -> act f[T*k, F].
Kernel 2 (program (t, j)): output columns j*BD.. of token t: each of its k rows' activations
times its expert's down rows, rounded to the input dtype (as the grouped path's down output
is), weighted and summed in f32 -> out f32[T, D].

Why: the grouped path (models/moe.py expert_rows_sum) runs, besides its three grouped matmuls,
the rows' sort by expert (a few fusions), the gather of their inputs, the SwiGLU and the
gather-back with the weighted sum; with expert arrays past the grouped kernel's int32 reach
in chunks (DeepSeek-V3) each projection adds a rotation and a sum per chunk. At one token
that is 8 to 24 small launches a layer for a few MB of weights (issue 33). Here the work per
row is a matrix-vector product, so neither kernel needs Triton's dot (M >= 16): a [BK, BF]
weight tile times the input's BK values, summed over BK. Each (token, expert) row reads its
own expert's weights: for T tokens that is up to T * k expert reads where the grouped path
reads each distinct expert once, so the models take this path only for steps of at most a
few tokens (models/moe.py FUSED_MAX_TOKENS).

Weights: gate / up / down [X, D, F] / [X, D, F] / [X, F, D] ([in, out], the grouped path's
layout), or gate|up fused as one [X, D, 2F] (gate columns first; pass it as `gate` with
`up=None`); each may be a tuple of consecutive expert chunks (moe.split_expert_weights: the
kernels address one chunk at a time, within int32). Block-scaled FP8 weights are not taken
here (the grouped path reads them).

Legend: T tokens, k experts per token, X experts, D model dim, F expert MLP dim, BK / BF / BD
block sizes (powers of two >= 16 dividing their dims).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import resolve_impl, whole
from jaxserve.pallas_kernels.grouped_matmul import BlockScaledFp8

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


def _act_kernel(h_ref, e_ref, *refs, k, d, gate_chunk, up_chunk, n_gate, n_up, up_off, block_k,
                block_f):
    """Program (r, j): act[r, j*BF..] of row r = t * k + i."""
    gate_refs, up_refs, act_ref = refs[:n_gate], refs[n_gate:n_gate + n_up], refs[-1]
    r, j = pl.program_id(0), pl.program_id(1)
    t = r // k
    expert = e_ref[t, r % k]
    cols = j * block_f + jnp.arange(block_f, dtype=jnp.int32)
    kk_K = jnp.arange(block_k, dtype=jnp.int32)

    def tile_sum(col_off, ref, local, step, acc):
        kk = step * block_k + kk_K
        x = plgpu.load(h_ref.at[t, kk]).astype(jnp.float32)                        # [BK]
        w = plgpu.load(ref.at[local, kk[:, None], col_off + cols[None, :]])         # [BK, BF]
        return acc + jnp.sum(x[:, None] * w.astype(jnp.float32), axis=0)

    steps = d // block_k
    gate = _chunk_sum(expert, gate_chunk, gate_refs, steps, functools.partial(tile_sum, 0), (block_f,))
    up = _chunk_sum(expert, up_chunk, up_refs or gate_refs, steps,
                    functools.partial(tile_sum, up_off), (block_f,))
    dtype = act_ref.dtype
    g = gate.astype(dtype).astype(jnp.float32)
    act = g / (1.0 + jnp.exp(-g)) * up.astype(dtype).astype(jnp.float32)
    plgpu.store(act_ref.at[r, cols], act.astype(dtype))


def _down_kernel(act_ref, w_ref, e_ref, *refs, k, f, per_chunk, block_f, block_d):
    """Program (t, j): out[t, j*BD..] = sum_i weights[t, i] * (act[t*k+i] @ down_e)[those]."""
    down_refs, out_ref = refs[:-1], refs[-1]
    t, j = pl.program_id(0), pl.program_id(1)
    cols = j * block_d + jnp.arange(block_d, dtype=jnp.int32)
    ff_F = jnp.arange(block_f, dtype=jnp.int32)
    dtype = act_ref.dtype
    out = jnp.zeros((block_d,), jnp.float32)
    for i in range(k):
        row = t * k + i

        def tile_sum(ref, local, step, acc, row=row):
            ff = step * block_f + ff_F
            a = plgpu.load(act_ref.at[row, ff]).astype(jnp.float32)                 # [BF]
            w = plgpu.load(ref.at[local, ff[:, None], cols[None, :]])               # [BF, BD]
            return acc + jnp.sum(a[:, None] * w.astype(jnp.float32), axis=0)

        y = _chunk_sum(e_ref[t, i], per_chunk, down_refs, f // block_f, tile_sum, (block_d,))
        out = out + w_ref[t, i].astype(jnp.float32) * y.astype(dtype).astype(jnp.float32)
    plgpu.store(out_ref.at[t, cols], out)


# ---------------------------------------------------------------------------------------------
# Public wrapper
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("impl", "block_k", "block_f", "block_d", "num_warps",
                                             "interpret"))
def moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down, *, impl: str = "auto",
               block_k: int = 128, block_f: int = 64, block_d: int = 64, num_warps: int = 4,
               interpret: bool | None = None):
    """f32[T, D]: the routed experts' weighted sum for each token (module docstring).
    impl: "pallas" (the two kernels; interpreted on a CPU), "xla" (the reference) or "auto".
    block_k / block_f / block_d: preferred block sizes (the largest power of two up to each
    that divides its dim is used)."""
    _validate(h_TD, weights_Tk, experts_Tk, gate, up, down)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_moe_decode(h_TD, weights_Tk, experts_Tk, gate, up, down)
    interpret = (not on_gpu) if interpret is None else interpret
    t, d = h_TD.shape
    k = weights_Tk.shape[1]
    gates, ups, downs = _chunks(gate), (_chunks(up) if up is not None else ()), _chunks(down)
    f = downs[0].shape[1]
    bk, bf, bd = _block(d, block_k), _block(f, block_f), _block(d, block_d)
    experts_Tk = experts_Tk.astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    weight_specs = [whole(*w.shape) for w in gates + ups]
    act = pl.pallas_call(
        functools.partial(_act_kernel, k=k, d=d, gate_chunk=gates[0].shape[0],
                          up_chunk=(ups or gates)[0].shape[0], n_gate=len(gates), n_up=len(ups),
                          up_off=0 if ups else f, block_k=bk, block_f=bf),
        grid=(t * k, f // bf),
        in_specs=[whole(t, d), whole(t, k)] + weight_specs,
        out_specs=whole(t * k, f),
        out_shape=jax.ShapeDtypeStruct((t * k, f), h_TD.dtype),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_act_bk{bk}_bf{bf}",
    )(h_TD, experts_Tk, *gates, *ups)
    return pl.pallas_call(
        functools.partial(_down_kernel, k=k, f=f, per_chunk=downs[0].shape[0], block_f=bf,
                          block_d=bd),
        grid=(t, d // bd),
        in_specs=[whole(t * k, f), whole(t, k), whole(t, k)] + [whole(*w.shape) for w in downs],
        out_specs=whole(t, d),
        out_shape=jax.ShapeDtypeStruct((t, d), jnp.float32),
        compiler_params=params, interpret=interpret,
        name=f"moe_decode_down_bf{bf}_bd{bd}",
    )(act, weights_Tk.astype(jnp.float32), experts_Tk, *downs)
