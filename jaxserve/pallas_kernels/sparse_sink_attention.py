"""DeepSeek V4's attention of each token over gathered K=V rows with a per-head sink, in one
kernel:

    o_THE = sparse_sink_attention(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW,
                                  comp_slots_TK, comp_ok_TK, sinks_H, sm_scale=...)
    o[t, h] = sum_l p[t, h, l] * row_l,  p = softmax over {sm_scale * q[t, h] . row_l} and the
              sink logit sinks[h] (the sink's share is dropped: it only enlarges the denominator)

where the rows l of token t are the window's (kv rows at win_slots[t, :], where win_ok) and
the compressed entries chosen for it (comp rows at comp_slots[t, :], where comp_ok); keys and
values are the same rows (V4's shared K=V head). The model builds the slots in XLA (the
window's last W positions through the block table; CSA's top-k entries or HCA's visible ones:
models/deepseek_v4_attention.py), a few integer ops.

Program (t, h-block): the token's q rows of BH heads against chunks of BL gathered rows, the
window's chunks then the entries', with an online softmax (running max, denominator and
accumulator in f32); the sink joins at the end. Why: in XLA the step gathers a [T, W + k, E]
copy of the rows, then two products and a mask, each a kernel of its own, a layer.

Layouts: q_THE f[T, H, E]; kv_NPE f[NB, P, E], comp_NPE f[NB, R, E] (R entry rows a block;
None: sliding layers); slots i32 (rows of the flattened arrays), ok bool; sinks_H f32[H] -> f32[T, H, E]. Legend: T tokens, H heads, E head dim,
NB blocks, P block size, W window rows, K entries per token; BH heads and BL rows per program
step, Ep = E rounded up to a power of two >= 16 (masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import checked_block, resolve_impl, whole

_NEG = -1e30     # the running max's start: finite, so a chunk of masked rows gives no NaN


def ref_sparse_sink_attention(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW, comp_slots_TK,
                              comp_ok_TK, sinks_H, *, sm_scale: float):
    """Plain jnp: gather the rows, mask, softmax with the sink, weighted sum. f32[T, H, E]."""
    def rows(cache, slots):
        n, r, e = cache.shape
        return cache.reshape(n * r, e)[slots]
    keys, oks = [rows(kv_NPE, win_slots_TW)], [win_ok_TW]
    if comp_NPE is not None:
        keys.append(rows(comp_NPE, comp_slots_TK))
        oks.append(comp_ok_TK)
    k_TLE = jnp.concatenate(keys, axis=1).astype(jnp.float32)
    ok_TL = jnp.concatenate(oks, axis=1)
    s = jnp.einsum("the,tle->thl", q_THE.astype(jnp.float32), k_TLE) * sm_scale
    s = jnp.where(ok_TL[:, None, :], s, -jnp.inf)
    sink = sinks_H.astype(jnp.float32)[None, :, None]
    top = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
    p = jnp.exp(s - top)
    return jnp.einsum("thl,tle->the", p / (jnp.sum(p, -1, keepdims=True) + jnp.exp(sink - top)), k_TLE)


def _validate(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW, comp_slots_TK, comp_ok_TK, sinks_H):
    t, h, e = q_THE.shape
    if kv_NPE.ndim != 3 or kv_NPE.shape[2] != e:
        raise ValueError(f"kv_NPE must be [NB, P, E={e}]; got {kv_NPE.shape}")
    if comp_NPE is not None and (comp_NPE.ndim != 3 or comp_NPE.shape[2] != e):
        raise ValueError(f"comp_NPE must be [NB, R, E={e}]; got {comp_NPE.shape}")
    if win_slots_TW.shape[0] != t or win_ok_TW.shape != win_slots_TW.shape:
        raise ValueError(f"win_slots_TW / win_ok_TW must be [T={t}, W] alike; got "
                         f"{win_slots_TW.shape} and {win_ok_TW.shape}")
    if comp_NPE is not None and (comp_slots_TK.shape[0] != t or comp_ok_TK.shape != comp_slots_TK.shape):
        raise ValueError(f"comp_slots_TK / comp_ok_TK must be [T={t}, K] alike; got "
                         f"{comp_slots_TK.shape} and {comp_ok_TK.shape}")
    if sinks_H.shape != (h,):
        raise ValueError(f"sinks_H must be f32[H={h}]; got {sinks_H.shape}")


def _kernel(q_ref, kv_ref, comp_ref, ws_ref, wok_ref, cs_ref, cok_ref, clen_ref, sink_ref, o_ref, *, heads,
            bh, e, e_p, bl, lengths, sm_scale):
    t, hb = pl.program_id(0), pl.program_id(1)
    h = hb * bh + jnp.arange(bh, dtype=jnp.int32)
    h_ok = h < heads
    h_safe = jnp.minimum(h, heads - 1)
    d = jnp.arange(e_p, dtype=jnp.int32)
    d_ok = d < e
    d_safe = jnp.minimum(d, e - 1)
    q = plgpu.load(q_ref.at[t, h_safe[:, None], d_safe[None, :]])
    q = jnp.where(h_ok[:, None] & d_ok[None, :], q, jnp.zeros_like(q)).astype(jnp.float32)

    def source(rows_ref, slots_ref, ok_ref, n, steps, carry):
        def chunk(c, carry):
            m, l, acc = carry
            idx = c * bl + jnp.arange(bl, dtype=jnp.int32)
            inside = idx < n
            idx_safe = jnp.minimum(idx, n - 1)
            slots = plgpu.load(slots_ref.at[t, idx_safe])
            ok = inside & (plgpu.load(ok_ref.at[t, idx_safe]) != 0)
            k = plgpu.load(rows_ref.at[slots[:, None], d_safe[None, :]]).astype(jnp.float32)
            # masked rows zeroed: their p is 0, but 0 * a non-finite row would be NaN
            k = jnp.where(ok[:, None] & d_ok[None, :], k, 0.0)                        # [BL, Ep]
            s = plgpu.dot(q, k, trans_b=True, precision=jax.lax.Precision.HIGHEST) * sm_scale
            s = jnp.where(ok[None, :], s, -jnp.inf)                                   # [BH, BL]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp(s - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[:, None] + plgpu.dot(p, k, precision=jax.lax.Precision.HIGHEST)
            return m_new, l * alpha + jnp.sum(p, axis=1), acc
        return jax.lax.fori_loop(0, steps, chunk, carry)

    carry = (jnp.full((bh,), _NEG, jnp.float32), jnp.zeros((bh,), jnp.float32),
             jnp.zeros((bh, e_p), jnp.float32))
    carry = source(kv_ref, ws_ref, wok_ref, lengths[0], pl.cdiv(lengths[0], bl), carry)
    if comp_ref is not None:    # only the chunks up to the token's last visitable row
        visit = jnp.clip(plgpu.load(clen_ref.at[t]), 0, lengths[1])
        carry = source(comp_ref, cs_ref, cok_ref, lengths[1], (visit + bl - 1) // bl, carry)
    m, l, acc = carry
    sink = plgpu.load(sink_ref.at[h_safe]).astype(jnp.float32)
    top = jnp.maximum(m, sink)
    out = acc * (jnp.exp(m - top) / (l * jnp.exp(m - top) + jnp.exp(sink - top)))[:, None]
    # unclamped indices: the padding heads' and columns' lanes are masked, and clamped ones
    # would alias the last real head's (interpret mode writes masked lanes' old values back)
    plgpu.store(o_ref.at[t, h[:, None], d[None, :]], out, mask=h_ok[:, None] & d_ok[None, :])


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "heads_per_program",
                                             "rows_per_step", "num_warps", "interpret"))
def sparse_sink_attention(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW, comp_slots_TK,
                          comp_ok_TK, sinks_H, comp_len_T=None, *, sm_scale: float, impl: str = "auto",
                          heads_per_program: int = 16, rows_per_step: int = 32,
                          num_warps: int = 4, interpret: bool | None = None):
    """f32[T, H, E]: see the module docstring. impl "pallas" (this kernel; interpreted on a
    CPU), "xla" (the reference) or "auto". heads_per_program (BH) and rows_per_step (BL):
    powers of two >= 16. comp_NPE None: the window only (comp_slots / comp_ok unused).
    comp_len_T (optional i32[T]): rows past it are all masked for that token, so the kernel
    does not visit their chunks (HCA's visible entries are a prefix: its decode reads its
    context's entries, not the block table's); the reference ignores it."""
    _validate(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW, comp_slots_TK, comp_ok_TK, sinks_H)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_sparse_sink_attention(q_THE, kv_NPE, comp_NPE, win_slots_TW, win_ok_TW,
                                         comp_slots_TK, comp_ok_TK, sinks_H, sm_scale=sm_scale)
    bh = checked_block(heads_per_program, "heads_per_program")
    bl = checked_block(rows_per_step, "rows_per_step")
    t, h, e = q_THE.shape
    nb, p, _ = kv_NPE.shape
    w = win_slots_TW.shape[1]
    has_comp = comp_NPE is not None
    k = comp_slots_TK.shape[1] if has_comp else 0
    kernel = functools.partial(_kernel, heads=h, bh=bh, e=e, e_p=max(16, pl.next_power_of_2(e)),
                               bl=bl, lengths=(w, k), sm_scale=float(sm_scale))
    args = [q_THE, kv_NPE.reshape(nb * p, e)]
    specs = [whole(t, h, e), whole(nb * p, e)]
    if has_comp:
        rows = comp_NPE.shape[0] * comp_NPE.shape[1]
        args.append(comp_NPE.reshape(rows, e))
        specs.append(whole(rows, e))
    args += [win_slots_TW.astype(jnp.int32), win_ok_TW.astype(jnp.int32)]
    specs += [whole(t, w), whole(t, w)]
    if has_comp:
        clen = jnp.full((t,), k, jnp.int32) if comp_len_T is None else comp_len_T.astype(jnp.int32)
        args += [comp_slots_TK.astype(jnp.int32), comp_ok_TK.astype(jnp.int32), clen]
        specs += [whole(t, k), whole(t, k), whole(t)]
    args.append(sinks_H.astype(jnp.float32))
    specs.append(whole(h))
    if not has_comp:       # the kernel's comp_ref, cs_ref, cok_ref, clen_ref are absent
        inner = kernel

        def kernel(q_ref, kv_ref, ws_ref, wok_ref, sink_ref, o_ref):
            inner(q_ref, kv_ref, None, ws_ref, wok_ref, None, None, None, sink_ref, o_ref)
    return pl.pallas_call(
        kernel,
        grid=(t, pl.cdiv(h, bh)),
        in_specs=specs,
        out_specs=whole(t, h, e),
        out_shape=jax.ShapeDtypeStruct((t, h, e), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=(not on_gpu) if interpret is None else interpret,
        name="sparse_sink_attention",
    )(*args)
