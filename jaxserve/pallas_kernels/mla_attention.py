"""MLA paged attention (absorbed): every token's heads over its sequence's paged latents,
dense (causal) or sparse over selected positions (DeepSeek V3.2's indexer), ragged batches.

Layouts (per layer):
    q_TNW          f[T, N, W]   [q_nope @ W_UK (C) | roped q_rope (R)] of each token and head
    latent_NPW     f[NB, P, W]  per slot [normed kv latent (C) | roped shared key (R)]; block 0
                                is the null block
    block_tables   i32[S, B]    physical block of each logical block of each sequence
    token_seq_ids  i32[T]       sequence of each token (padding tokens: any, output unused)
    positions      i32[T]       absolute position of each token: it sees positions 0..its own
    selected_Tk    i32[T, k]    optional: only these positions (-1: none), within 0..its own
    -> o_TNC       f[T, N, C]   softmax-weighted latents (W_UV is applied by the caller)

Why this shape: all N heads share one latent row per key (MQA with one W-wide "head" whose
first C columns are also the value), so a program takes one token and a tile of BH heads as
the rows of its dot products and reads each key's row once for those heads: scores
q_lat . lat + q_rope . rope over BK keys a step, then p @ lat into a [BH, C] accumulator with
an online softmax. The latent and rope parts are loaded as two column ranges of the same
slots, since W (576) is not a power of two and Triton's blocks must be. The token's keys come
either as positions 0..pos (dense: a loop of ceil((pos + 1) / BK) steps, so each decode row
and each prefill token walks only its own causal range) or as the k selected positions
(sparse: k / BK steps, whatever the context length), both gathered through the block table.
Prefill tokens do not share key loads across query tokens here (one program per token);
that is the thing to change first if prefill MLA is measured to matter.
Steps of few tokens split each token's key range (flash-decoding, key_splits): the splits'
normalised partials and log2-sum-exp2 are merged by pallas_kernels/split_merge.py. Without
splits one decode token at DeepSeek's 128 heads was 8 programs: 291 us over a 4K context,
against XLA's 32 (H100, BENCHMARKS.md).

Legend: T tokens, S sequences, N heads, C kv latent (value width), R rope dims, W = C + R,
NB cache blocks, P slots per block, B blocks per sequence, L = B * P context slots,
k selected positions per token, BH heads per program, BK keys per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels.dispatch import num_sms, resolve_impl, whole
from jaxserve.pallas_kernels.split_merge import merge_splits


def _selected_mask(selected_k, ctx_len: int):
    idx = jnp.where(selected_k >= 0, selected_k, ctx_len)
    return jnp.zeros((ctx_len,), bool).at[idx].set(True, mode="drop")


def ref_mla_attention(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, *,
                      sm_scale: float, value_dim: int, selected_Tk=None, token_chunk: int = 64):
    """Plain jnp, per token (decode rows, prefill chunks and mixed batches are one case): o
    f[T, N, C]. The reference of the kernel, and the model's "xla" path."""
    t, n, w = q_TNW.shape
    p = latent_NPW.shape[1]
    ctx_len = block_tables_SB.shape[1] * p
    slot_pos_L = jnp.arange(ctx_len, dtype=jnp.int32)
    if selected_Tk is None:
        selected_Tk = jnp.zeros((t, 0), jnp.int32)
    sparse = selected_Tk.shape[1] > 0

    def one_token(args):
        q_NW, seq, pos, sel_k = args
        lat_LW = latent_NPW[block_tables_SB[seq]].reshape(ctx_len, w).astype(jnp.float32)
        s_NL = jnp.einsum("nw,lw->nl", q_NW.astype(jnp.float32), lat_LW) * sm_scale
        visible_L = slot_pos_L <= pos
        if sparse:
            visible_L &= _selected_mask(sel_k, ctx_len)
        s_NL = jnp.where(visible_L[None, :], s_NL, -jnp.inf)
        o_NC = jax.nn.softmax(s_NL, axis=-1) @ lat_LW[:, :value_dim]
        return o_NC.astype(q_TNW.dtype)

    return jax.lax.map(one_token, (q_TNW, token_seq_ids_T, positions_T, selected_Tk),
                       batch_size=min(t, token_chunk))


def _validate(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, value_dim, selected_Tk):
    t, n, w = q_TNW.shape
    if latent_NPW.ndim != 3 or latent_NPW.shape[2] != w:
        raise ValueError(f"latent cache must be [NB, P, W={w}]; got {latent_NPW.shape}")
    if token_seq_ids_T.shape != (t,) or positions_T.shape != (t,):
        raise ValueError(f"token_seq_ids and positions must be [T={t}]; got "
                         f"{token_seq_ids_T.shape}, {positions_T.shape}")
    if block_tables_SB.ndim != 2:
        raise ValueError(f"block_tables must be [S, B]; got {block_tables_SB.shape}")
    if not 0 < value_dim < w:
        raise ValueError(f"value_dim must be in (0, W={w}); got {value_dim}")
    if selected_Tk is not None and (selected_Tk.ndim != 2 or selected_Tk.shape[0] != t):
        raise ValueError(f"selected_Tk must be [T={t}, k]; got {selected_Tk.shape}")


def _mla_kernel(q_ref, lat_ref, bt_ref, seq_ref, pos_ref, sel_ref, o_ref, *lse_ref, n, c, r, p,
                blocks_per_seq, block_h, block_k, sm_scale, num_sel, splits):
    """Program (token, head tile, split): with splits > 1 (lse_ref given) the split's share of
    the token's key steps, written as a normalised partial and its log2-sum-exp2."""
    tok, hb, x = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, pos = seq_ref[tok], pos_ref[tok]
    head_H = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)
    out_head_H = head_H                   # the output has room for the padded heads
    head_H = jnp.minimum(head_H, n - 1)
    cols_C = jnp.arange(c, dtype=jnp.int32)
    cols_R = c + jnp.arange(r, dtype=jnp.int32)
    q_lat = plgpu.load(q_ref.at[tok, head_H[:, None], cols_C[None, :]])            # [BH, C]
    q_rope = plgpu.load(q_ref.at[tok, head_H[:, None], cols_R[None, :]])           # [BH, R]
    kk = jnp.arange(block_k, dtype=jnp.int32)

    def body(step, carry):
        m, l, acc = carry
        if num_sel:        # sparse: the step's selected positions
            j = step * block_k + kk
            key_pos = plgpu.load(sel_ref.at[tok, jnp.minimum(j, num_sel - 1)], mask=j < num_sel, other=-1)
        else:              # dense: positions step*BK ...
            key_pos = step * block_k + kk
        valid = (key_pos >= 0) & (key_pos <= pos)
        key_pos = jnp.where(valid, key_pos, 0)
        page = plgpu.load(bt_ref.at[seq * blocks_per_seq + key_pos // p])
        slot = jnp.where(valid, page * p + key_pos % p, 0)
        lat = plgpu.load(lat_ref.at[slot[:, None], cols_C[None, :]])                # [BK, C]
        rope = plgpu.load(lat_ref.at[slot[:, None], cols_R[None, :]])               # [BK, R]
        s = (plgpu.dot(q_lat, lat, trans_b=True).astype(jnp.float32)
             + plgpu.dot(q_rope, rope, trans_b=True).astype(jnp.float32)) * sm_scale
        s = jnp.where(valid[None, :], s, -jnp.inf)                                  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        prob = jnp.exp(s - m_new[:, None])
        l = l * corr + jnp.sum(prob, axis=1)
        acc = acc * corr[:, None] + plgpu.dot(prob.astype(lat.dtype), lat).astype(jnp.float32)
        return m_new, l, acc

    # a finite floor for the running max: a step with no valid key then adds exp(-inf) = 0
    init = (jnp.full((block_h,), -1e30, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            jnp.zeros((block_h, c), jnp.float32))
    steps = pl.cdiv(num_sel, block_k) if num_sel else pos // block_k + 1
    per_split = pl.cdiv(steps, splits)
    first, last = x * per_split, jnp.minimum((x + 1) * per_split, steps)
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if not lse_ref:
        plgpu.store(o_ref.at[tok, out_head_H[:, None], cols_C[None, :]], o.astype(o_ref.dtype))
        return
    plgpu.store(o_ref.at[x, tok, out_head_H[:, None], cols_C[None, :]], o)
    lse = jnp.where(l > 0, m * LOG2E + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    plgpu.store(lse_ref[0].at[x, tok, out_head_H], lse)


def key_splits(num_tokens: int, num_heads: int, block_h: int) -> int:
    """Key-range splits a step of num_tokens tokens takes (flash-decoding): enough programs for
    about two per SM, up to 16 splits; one where the tokens fill the GPU already. Why: at one
    decode token DeepSeek's 128 heads are 8 programs, and a 4K context took 291 us against
    XLA's 32 (H100, BENCHMARKS.md)."""
    programs = num_tokens * pl.cdiv(num_heads, block_h)
    return max(1, min(MAX_SPLITS, (2 * num_sms()) // programs))


MAX_SPLITS = 16
LOG2E = 1.4426950408889634


def _pallas(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, selected_Tk, *,
            sm_scale, value_dim, block_h, block_k, num_warps, num_stages, interpret, splits,
            partials: bool = False):
    """The kernel's call: o f[T, N, C], or with `partials` the splits unmerged (one split
    too): (o f32[X, T, Np, C], lse f32[X, T, Np]), Np the heads padded to whole tiles."""
    t, n, w = q_TNW.shape
    nb, p, _ = latent_NPW.shape
    s, b = block_tables_SB.shape
    c, r = value_dim, w - value_dim
    num_sel = 0 if selected_Tk is None else selected_Tk.shape[1]
    if selected_Tk is None:
        selected_Tk = jnp.full((t, 1), -1, jnp.int32)        # unread: keeps one signature
    block_h = block_h or 16
    # heads padded to whole tiles in the output (sliced off after), so no store is masked
    n_pad = pl.cdiv(n, block_h) * block_h
    splits = key_splits(t, n, block_h) if splits is None else splits
    kernel = functools.partial(_mla_kernel, n=n, c=c, r=r, p=p, blocks_per_seq=b, block_h=block_h,
                               block_k=block_k, sm_scale=sm_scale, num_sel=num_sel, splits=splits)
    if splits == 1 and not partials:
        out_specs = whole(t, n_pad, c)
        out_shape = jax.ShapeDtypeStruct((t, n_pad, c), q_TNW.dtype)
    else:
        out_specs = [whole(splits, t, n_pad, c), whole(splits, t, n_pad)]
        out_shape = [jax.ShapeDtypeStruct((splits, t, n_pad, c), jnp.float32),
                     jax.ShapeDtypeStruct((splits, t, n_pad), jnp.float32)]
    name = ("mla_sparse_attention" if num_sel else "mla_attention") + (f"_x{splits}" if splits > 1 else "")
    out = pl.pallas_call(
        kernel, grid=(t, pl.cdiv(n, block_h), splits),
        in_specs=[whole(t, n, w), whole(nb * p, w), whole(s * b), whole(t), whole(t),
                  whole(*selected_Tk.shape)],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name,
    )(q_TNW, latent_NPW.reshape(nb * p, w), block_tables_SB.reshape(-1),
      token_seq_ids_T.astype(jnp.int32), positions_T.astype(jnp.int32),
      selected_Tk.astype(jnp.int32))
    if partials:
        return tuple(out)
    if splits > 1:
        o_part, lse = out
        kernel_merge = not interpret and c >= 16 and c & (c - 1) == 0   # (its tiles: 2^n >= 16)
        out = merge_splits(o_part, lse, out_dtype=q_TNW.dtype,
                           impl="pallas" if kernel_merge else "xla", interpret=interpret)
    return out[:, :n]


@functools.partial(jax.jit, static_argnames=("sm_scale", "value_dim", "impl", "block_h", "block_k",
                                             "num_warps", "num_stages", "interpret", "splits"))
def mla_attention(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, selected_Tk=None,
                  *, sm_scale: float, value_dim: int, impl: str = "auto", block_h: int | None = None,
                  block_k: int = 32, num_warps: int = 4, num_stages: int = 2,
                  interpret: bool | None = None, splits: int | None = None):
    """Absorbed MLA over the paged latent cache: o f[T, N, C] (see the module docstring).

    impl: "pallas" (interpreted on CPU), "xla" (ref_mla_attention) or "auto" (pallas on a GPU).
    block_h: heads per program (default 16: the [BH, C] f32 accumulator of C = 512 is then 64
    registers a thread at 4 warps; more heads a program would read each latent row for more
    heads at once, fewer programs re-reading it, but spill); block_k: keys per step (for the
    sparse form, of the selected positions); splits: key-range splits per token, merged after
    (default key_splits: more than one only for steps of few tokens)."""
    _validate(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, value_dim, selected_Tk)
    impl, on_gpu = resolve_impl(impl)
    if impl == "xla":
        return ref_mla_attention(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T,
                                 sm_scale=sm_scale, value_dim=value_dim, selected_Tk=selected_Tk)
    return _pallas(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, selected_Tk,
                   sm_scale=sm_scale, value_dim=value_dim, block_h=block_h, block_k=block_k,
                   num_warps=num_warps, num_stages=num_stages,
                   interpret=(not on_gpu) if interpret is None else interpret, splits=splits)


@functools.partial(jax.jit, static_argnames=("sm_scale", "value_dim", "block_h", "block_k",
                                             "num_warps", "num_stages", "interpret", "splits"))
def mla_attention_partials(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T,
                           selected_Tk=None, *, sm_scale: float, value_dim: int,
                           block_h: int | None = None, block_k: int = 32, num_warps: int = 4,
                           num_stages: int = 2, interpret: bool | None = None,
                           splits: int | None = None):
    """The Pallas kernel's key-range splits unmerged, for a caller that merges them itself
    (mla_output.mla_merge_uv: the merge folded into W_UV): (o f32[X, T, Np, C] normalised
    partials, lse f32[X, T, Np] their log2-sum-exp2, -inf where a split saw no key); X is
    key_splits' (or `splits`), one included; Np the heads padded to whole tiles of block_h."""
    _validate(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, value_dim, selected_Tk)
    on_gpu = resolve_impl("pallas")[1]
    return _pallas(q_TNW, latent_NPW, block_tables_SB, token_seq_ids_T, positions_T, selected_Tk,
                   sm_scale=sm_scale, value_dim=value_dim, block_h=block_h, block_k=block_k,
                   num_warps=num_warps, num_stages=num_stages,
                   interpret=(not on_gpu) if interpret is None else interpret, splits=splits,
                   partials=True)
