"""Everything MLA does with a layer's one input projection before its second, in one kernel
(DeepSeek V3 / V3.2, the fused "mla" path): the q latent's RMSNorm, the kv latent's RMSNorm
with the shared key's rotary and their paged write, V3.2's indexer key (LayerNorm, rotary,
paged write) and its head weights' scale.

    q_lat_TQ, latent', index_k', w_TI = mla_input_prep(
        a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H, q_norm_Q=None,
        index_norm_J=None, index_bias_J=None, index_cache_NPJ=None, *, q_width, factor=...)

a_TM is the fused input projection's output as it comes (models/deepseek.py input_projections,
w_in), read in place:
    [q part (q_width) | kv latent (C) | shared key (R) | indexer key (J) | head weights (I)]
per token t (slot s = slot_mapping[t]):
    q_lat[t]   = RMSNorm(a[t, :q_width]) * q_norm          (when q_norm_Q is given, else None:
                                                            q_lora_rank null, q is the q part)
    latent[s], index_k[s]                                   as mla_latent_write
    w[t]       = f32(a[t, head weights]) * I^-1/2           (V3.2, else None)

Why: the XLA path slices the projection into three to four copies, norms the q latent in a
fusion of its own and scales the head weights in another, around the latent-write kernel:
four to six launches a layer where this is one (issue 71). Rounding as the model's ops
(layers.rms_norm: f32, then the input dtype).

Layouts: a_TM f[T, M], M = q_width + C + R (+ J + I); kv_norm_C f[C], q_norm_Q f[Q],
positions_T / slot_mapping_T i32[T], latent_NPW f[NB, P, C + R], inv_freq_H f32[R/2];
index_norm_J / index_bias_J f[J], index_cache_NPJ f[NB, P, J]. The caches are updated in place
(input_output_aliases) when the caller donates them.

Legend: T tokens, Q q latent (q_width), C kv latent, R rope dims, H = R / 2, J indexer head dim,
I indexer heads, NB cache blocks, P block size; Qp, Cp, Hp, Jp, Ip: powers of two at least
those (masked tails).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.models import layers
from jaxserve.pallas_kernels.dispatch import absent_refs, per_token_call, resolve_impl, whole
from jaxserve.pallas_kernels.mla_latent_write import (ref_mla_latent_write, rms_normed, rotary,
                                                      write_index_key, write_latent)


def ref_mla_input_prep(a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H,
                       q_norm_Q=None, index_norm_J=None, index_bias_J=None, index_cache_NPJ=None,
                       *, q_width: int, factor: float = 1.0, eps: float = 1e-6,
                       index_eps: float = 1e-6):
    """The model's own ops: slices of a_TM, layers.rms_norm, ref_mla_latent_write, the scale."""
    w = kv_norm_C.shape[0] + 2 * inv_freq_H.shape[0]
    q = None if q_norm_Q is None else layers.rms_norm(a_TM[:, :q_width], q_norm_Q, eps)
    idx = heads = None
    if index_norm_J is not None:
        j0 = q_width + w
        j = index_norm_J.shape[0]
        idx, heads = a_TM[:, j0:j0 + j], a_TM[:, j0 + j:]
        heads = heads.astype(jnp.float32) * heads.shape[1] ** -0.5
    latent, index = ref_mla_latent_write(a_TM[:, q_width:q_width + w], kv_norm_C, positions_T,
                                         slot_mapping_T, latent_NPW, inv_freq_H, factor=factor,
                                         eps=eps, index_TJ=idx, index_norm_J=index_norm_J,
                                         index_bias_J=index_bias_J, index_cache_NPJ=index_cache_NPJ,
                                         index_eps=index_eps)
    return q, latent, index, heads


def _validate(a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H, q_norm_Q,
              index_norm_J, index_bias_J, index_cache_NPJ, q_width):
    t, m = a_TM.shape
    c, r = kv_norm_C.shape[0], 2 * inv_freq_H.shape[0]
    parts = (index_norm_J, index_bias_J, index_cache_NPJ)
    if any(p is None for p in parts) != all(p is None for p in parts):
        raise ValueError("index_norm_J, index_bias_J and index_cache_NPJ go together (V3.2's "
                         "indexer) or are all None")
    j = 0 if index_norm_J is None else index_norm_J.shape[0]
    if q_width < 0 or m < q_width + c + r + j + (1 if j else 0) or (not j and m != q_width + c + r):
        raise ValueError(f"a_TM must be [T, q_width + C + R (+ J + I)] = [T, {q_width} + {c} + {r}"
                         f"{f' + {j} + I' if j else ''}]; got {a_TM.shape}")
    if q_norm_Q is not None and q_norm_Q.shape != (q_width,):
        raise ValueError(f"q_norm_Q must be f[q_width={q_width}]; got {q_norm_Q.shape}")
    if positions_T.shape != (t,) or slot_mapping_T.shape != (t,):
        raise ValueError(f"positions_T and slot_mapping_T must be i32[T={t}]; got "
                         f"{positions_T.shape} and {slot_mapping_T.shape}")
    if latent_NPW.ndim != 3 or latent_NPW.shape[2] != c + r:
        raise ValueError(f"latent_NPW must be [NB, P, C + R = {c + r}]; got {latent_NPW.shape}")
    if j and (j < r or index_bias_J.shape != (j,)
              or index_cache_NPJ.shape != latent_NPW.shape[:2] + (j,)):
        raise ValueError(f"index_norm_J / index_bias_J must be f[J] with J >= R={r} and "
                         f"index_cache_NPJ [NB, P, J] = {latent_NPW.shape[:2] + (j,)}; got "
                         f"{index_bias_J.shape}, {index_cache_NPJ.shape}")


def _kernel(a_ref, kvn_ref, pos_ref, slot_ref, inv_ref, qn_ref, idxn_ref, idxb_ref, latent_in,
            index_in, latent_ref, index_ref, q_ref, w_ref, *, q_width, q_p, c, c_p, half, half_p,
            j, j_p, heads, heads_p, factor, eps, index_eps):
    del latent_in, index_in   # aliased to latent_ref / index_ref
    t = pl.program_id(0)
    slot = slot_ref[t]
    dtype = a_ref.dtype
    rot = rotary(pos_ref, inv_ref, t, half, half_p)
    write_latent(a_ref, q_width, kvn_ref, t, slot, rot, latent_ref, c=c, c_p=c_p, half=half,
                 factor=factor, eps=eps)
    if qn_ref is not None:
        normed, cols, ok = rms_normed(a_ref, t, 0, q_width, q_p, qn_ref, eps, dtype)
        plgpu.store(q_ref.at[t, cols], normed.astype(q_ref.dtype), mask=ok)
    if idxn_ref is None:
        return
    idx_off = q_width + c + 2 * half
    write_index_key(a_ref, idx_off, idxn_ref, idxb_ref, t, slot, rot, index_ref, j=j, j_p=j_p,
                    half=half, factor=factor, index_eps=index_eps)
    i = jnp.arange(heads_p, dtype=jnp.int32)
    w = plgpu.load(a_ref.at[t, idx_off + j + jnp.minimum(i, heads - 1)]).astype(jnp.float32)
    plgpu.store(w_ref.at[t, i], w * heads ** -0.5, mask=i < heads)


@functools.partial(jax.jit, static_argnames=("q_width", "factor", "eps", "index_eps", "impl",
                                             "num_warps", "interpret"))
def mla_input_prep(a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H,
                   q_norm_Q=None, index_norm_J=None, index_bias_J=None, index_cache_NPJ=None, *,
                   q_width: int, factor: float = 1.0, eps: float = 1e-6, index_eps: float = 1e-6,
                   impl: str = "auto", num_warps: int = 4, interpret: bool | None = None):
    """(q_lat f[T, Q] or None, latent cache, index cache or None, head weights f32[T, I] or
    None): see the module docstring. Donate the caches. impl: "pallas" (this kernel;
    interpreted on a CPU), "xla" (the reference) or "auto"."""
    _validate(a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW, inv_freq_H, q_norm_Q,
              index_norm_J, index_bias_J, index_cache_NPJ, q_width)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_mla_input_prep(a_TM, kv_norm_C, positions_T, slot_mapping_T, latent_NPW,
                                  inv_freq_H, q_norm_Q, index_norm_J, index_bias_J, index_cache_NPJ,
                                  q_width=q_width, factor=factor, eps=eps, index_eps=index_eps)
    t, m = a_TM.shape
    c, half = kv_norm_C.shape[0], inv_freq_H.shape[0]
    nb, p, w = latent_NPW.shape
    has_q, has_index = q_norm_Q is not None, index_norm_J is not None
    j = index_norm_J.shape[0] if has_index else 1
    heads = m - q_width - w - j if has_index else 1
    p2 = pl.next_power_of_2
    kernel = functools.partial(_kernel, q_width=q_width, q_p=p2(max(q_width, 1)), c=c, c_p=p2(c),
                               half=half, half_p=p2(half), j=j, j_p=p2(j), heads=heads,
                               heads_p=p2(heads), factor=float(factor), eps=float(eps),
                               index_eps=float(index_eps))
    ins = [a_TM, kv_norm_C, positions_T.astype(jnp.int32), slot_mapping_T.astype(jnp.int32),
           inv_freq_H.astype(jnp.float32)]
    specs = [whole(t, m), whole(c), whole(t), whole(t), whole(half)]
    if has_q:
        ins.append(q_norm_Q)
        specs.append(whole(q_width))
    if has_index:
        ins += [index_norm_J, index_bias_J]
        specs += [whole(j), whole(j)]
    ins.append(latent_NPW.reshape(nb * p, w))
    specs.append(whole(nb * p, w))
    aliases = {len(ins) - 1: 0}
    outs, out_specs = [jax.ShapeDtypeStruct((nb * p, w), latent_NPW.dtype)], [whole(nb * p, w)]
    if has_index:
        ins.append(index_cache_NPJ.reshape(nb * p, j))
        specs.append(whole(nb * p, j))
        aliases[len(ins) - 1] = 1
        outs.append(jax.ShapeDtypeStruct((nb * p, j), index_cache_NPJ.dtype))
        out_specs.append(whole(nb * p, j))
    if has_q:
        outs.append(jax.ShapeDtypeStruct((t, q_width), a_TM.dtype))
        out_specs.append(whole(t, q_width))
    if has_index:
        outs.append(jax.ShapeDtypeStruct((t, heads), jnp.float32))
        out_specs.append(whole(t, heads))
    # the refs this call leaves out (positions in _kernel's full list)
    absent = ([] if has_q else [5, 12]) + ([] if has_index else [6, 7, 9, 11, 13])
    if absent:
        kernel = absent_refs(kernel, *sorted(absent))
    out = per_token_call(kernel, t, ins, specs, outs, out_specs, aliases, num_warps=num_warps,
                         interpret=(not on_gpu) if interpret is None else interpret,
                         name="mla_input_prep" + ("_index" if has_index else ""))
    out = list(out)
    latent = out.pop(0).reshape(latent_NPW.shape)
    index = out.pop(0).reshape(index_cache_NPJ.shape) if has_index else None
    q = out.pop(0) if has_q else None
    heads_w = out.pop(0) if has_index else None
    return q, latent, index, heads_w
