"""Building blocks shared by the model families: RMSNorm, rotary embeddings, the paged
KV-cache write and the plain-XLA paged attention (the reference the Pallas kernel matches).

Legend: T tokens, S sequences, D model dim, N query heads, K kv heads, G = N // K,
E head dim, P tokens per block, B blocks per sequence, L = B * P context slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


# XLA's GPU simplifier rewrites a dot with a one-row input into multiply + reduce when both
# operands together hold fewer than 10M elements (gpu_algebraic_simplifier.cc). On the H200
# that came out as two fusions that write and re-read the whole product: Qwen3-30B-A3B's
# o-projection (a 16.8 MB weight) took 28.2 us at one token, 6.0 us on two rows (BENCHMARKS.md).
STRENGTH_REDUCED_DOT_ELEMENTS = 10_000_000
# Below this many weight elements the rewrite costs at most a few microseconds, less than
# the padding below would add.
SMALL_WEIGHT_ELEMENTS = 1_000_000


def linear(x_TD: jax.Array, w_DF: jax.Array) -> jax.Array:
    """x_TD @ w_DF, kept a matrix product when T = 1: a one-row input of a mid-sized weight is
    padded to two rows (then XLA hands the dot to cuBLAS or its GEMM emitter) and the extra
    row dropped; the barrier keeps XLA from moving that slice back into the dot.
    NOTE: the test uses the whole weight's size; under tensor parallelism XLA decides on each
    device's shard, so a weight over 10M elements whose shards are under it still gets the
    slow rewrite (speed only; results are the same either way)."""
    t, d = x_TD.shape
    if t == 1 and SMALL_WEIGHT_ELEMENTS <= w_DF.size < STRENGTH_REDUCED_DOT_ELEMENTS - d:
        y_2F = jax.lax.optimization_barrier(jnp.pad(x_TD, ((0, 1), (0, 0))) @ w_DF)
        return y_2F[:1]
    return x_TD @ w_DF


def lm_head(h_SD: jax.Array, params: dict, tied: bool) -> jax.Array:
    """f32 logits of the LM head: `lm_head` f[D, V], or a tied `embed` f[V, D] contracted on
    its D axis as it is stored. NOTE: not `h @ embed.T`: XLA CPU copied the transposed table
    (113 MB for the default model) inside the dot's fusion every step, reading it at ~1/7 of
    the bandwidth of this form (BENCHMARKS.md, CPU)."""
    if tied:
        return jax.lax.dot_general(h_SD, params["embed"], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return jnp.dot(h_SD, params["lm_head"], preferred_element_type=jnp.float32)


def project(h_TD: jax.Array, lp: dict, name: str) -> jax.Array:
    """h_TD @ lp[name], or through its [out, in] copy lp[name + "_t"] (llama.transpose_for_fused_stack)."""
    if name + "_t" in lp:
        return h_TD @ lp[name + "_t"].T
    return linear(h_TD, lp[name])


def gate_up(lp: dict, project: Callable):
    """(gate, up) activations of an MLP layer, fused (w_gate_up, by a family's fuse_projections) or not;
    `project(w)` applies the layer's input to a weight (a matmul, or a grouped one for MoE)."""
    if "w_gate_up" in lp:
        return jnp.split(project(lp["w_gate_up"]), 2, axis=-1)
    return project(lp["w_gate"]), project(lp["w_up"])


def fuse_in_place(lp: dict, fused: str, names) -> None:
    """lp[fused] = the concatenation of lp[names] along the output (last) axis, the parts
    popped (so each is freed as soon as the caller drops the old layer dict), when all of them
    are there: the families' fuse_projections (one matmul where several read the same input)."""
    names = list(names)
    if len(names) > 1 and all(n in lp for n in names):
        lp[fused] = jnp.concatenate([lp.pop(n) for n in names], axis=-1)


def rms_norm(x_TD: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32, returned in the input dtype (as HF does)."""
    x = x_TD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * w_D.astype(jnp.float32)).astype(x_TD.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> jax.Array:
    """Inverse frequencies f32[E/2], with HF's `llama3` and `linear` scaling rules."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = jnp.where(wavelen > old_len / low, inv / factor, inv)
        return jnp.where((wavelen >= old_len / high) & (wavelen <= old_len / low), mid, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: linear, llama3")


def apply_rope(x_TNE: jax.Array, positions_T: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in HF's "rotate half" layout (first half / second half pairs)."""
    angles = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, E/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x = x_TNE.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_TNE.dtype)


def write_kv(k_cache_NPKE, v_cache_NPKE, k_TKE, v_TKE, slot_mapping_T):
    """Scatter this step's keys and values into their cache slots, in place once donated.

    Indexed by (block, offset), not by slot into a reshaped [N*P, K, E] cache: on XLA:CPU
    the reshaped form of a one-token write became a dynamic-update-slice that copied the
    whole cache four times per layer (1456-block cache: 12.6 GB accessed per decode step,
    jax 0.11.2); this form, behind the barrier, is updated in place (tests/test_cpu_step_cost.py
    checks the compiled step)."""
    p = k_cache_NPKE.shape[1]
    block_T, offset_T = slot_mapping_T // p, slot_mapping_T % p
    k_cache = k_cache_NPKE.at[block_T, offset_T].set(k_TKE.astype(k_cache_NPKE.dtype))
    v_cache = v_cache_NPKE.at[block_T, offset_T].set(v_TKE.astype(v_cache_NPKE.dtype))
    # The written cache has two readers, the attention and the step's output: without the
    # barrier XLA:CPU may fuse the write into the attention's gather as well, and copy the
    # cache to give the fused copy its own operand (seen on the tiny test model).
    return jax.lax.optimization_barrier((k_cache, v_cache))


def qk_norm_rope_write(q_TNE, k_TKE, v_TKE, positions_T, slot_mapping_T, k_cache_NPKE, v_cache_NPKE,
                       inv_freq, q_norm_E=None, k_norm_E=None, *, eps: float):
    """Per-head q/k RMSNorm (Qwen3; skipped when the norms are None), RoPE, and the cache write:
    returns (q', k_cache, v_cache). pallas_kernels/qk_norm_rope_kv_write.py fuses the same."""
    if q_norm_E is not None:
        q_TNE = rms_norm(q_TNE, q_norm_E, eps)
        k_TKE = rms_norm(k_TKE, k_norm_E, eps)
    q_TNE = apply_rope(q_TNE, positions_T, inv_freq)
    k_TKE = apply_rope(k_TKE, positions_T, inv_freq)
    k_cache, v_cache = write_kv(k_cache_NPKE, v_cache_NPKE, k_TKE, v_TKE, slot_mapping_T)
    return q_TNE, k_cache, v_cache


def paged_attention_xla(q_TNE, k_cache_NPKE, v_cache_NPKE, block_tables_SB, token_seq_ids_T,
                        positions_T, *, sm_scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None, token_chunk: int = 64,
                        keys_per_step: int = 128) -> jax.Array:
    """Causal attention of every token over its own sequence's paged context.

    Token t of sequence s sees the cached keys at positions 0..positions[t] (this step's keys
    must already be written), restricted to the last `sliding_window` positions if set.
    Works per token, so decode rows, prefill chunks and mixed batches are all the same case.

    The keys are walked `keys_per_step` at a time (whole blocks) with an online softmax, up to
    the step's furthest position only: a loop with a dynamic trip count, so the work follows
    the step's contexts, not max_model_len (the block-table width), while the shapes, and so
    the compiled programs, stay the same. Why: gathering all B * P slots per token made a
    one-token decode of the default model read 2048 keys per layer at any context.
    Memory is bounded by processing `token_chunk` tokens at a time (each chunk walks up to its
    own furthest position).
    """
    t = q_TNE.shape[0]
    if t <= token_chunk:
        return _attend_chunk(q_TNE, k_cache_NPKE, v_cache_NPKE, block_tables_SB, token_seq_ids_T,
                             positions_T, sm_scale, sliding_window, soft_cap, keys_per_step)
    chunks = -(-t // token_chunk)
    pad = chunks * token_chunk - t

    def split(x_T):   # padding tokens: sequence 0, position 0 (outputs dropped below)
        return jnp.pad(x_T, [(0, pad)] + [(0, 0)] * (x_T.ndim - 1)).reshape(
            chunks, token_chunk, *x_T.shape[1:])

    def one_chunk(args):
        return _attend_chunk(*args[:1], k_cache_NPKE, v_cache_NPKE, block_tables_SB, *args[1:],
                             sm_scale, sliding_window, soft_cap, keys_per_step)

    out = jax.lax.map(one_chunk, (split(q_TNE), split(token_seq_ids_T), split(positions_T)))
    return out.reshape(chunks * token_chunk, *q_TNE.shape[1:])[:t]


def _attend_chunk(q_TNE, k_cache_NPKE, v_cache_NPKE, block_tables_SB, token_seq_ids_T,
                  positions_T, sm_scale, sliding_window, soft_cap, keys_per_step):
    """paged_attention_xla for one chunk of tokens: the online-softmax loop over key steps."""
    t, n, e = q_TNE.shape
    _, p, kh, _ = k_cache_NPKE.shape
    g = n // kh
    b = block_tables_SB.shape[1]
    c = max(1, min(keys_per_step // p, b))          # blocks a step
    num_steps = -(-b // c)
    tables_TB = block_tables_SB[token_seq_ids_T]     # [T, B]: small (ids, not keys)
    tables_TB = jnp.pad(tables_TB, ((0, 0), (0, num_steps * c - b)))   # null block: never seen
    q_TKGE = q_TNE.reshape(t, kh, g, e).astype(jnp.float32)
    pos_T = positions_T.astype(jnp.int32)
    first = 0
    if sliding_window is not None:    # steps wholly before every token's window are skipped
        first = jnp.maximum(jnp.min(pos_T) - sliding_window + 1, 0) // (c * p)
    last = jnp.max(pos_T) // (c * p) + 1

    def body(j, carry):
        m_TKG, l_TKG, acc_TKGE = carry
        blocks_TC = jax.lax.dynamic_slice_in_dim(tables_TB, j * c, c, axis=1)
        k_TLKE = k_cache_NPKE[blocks_TC].reshape(t, c * p, kh, e).astype(jnp.float32)
        v_TLKE = v_cache_NPKE[blocks_TC].reshape(t, c * p, kh, e).astype(jnp.float32)
        s_TKGL = jnp.einsum("tkge,tlke->tkgl", q_TKGE, k_TLKE) * sm_scale
        if soft_cap is not None:
            s_TKGL = soft_cap * jnp.tanh(s_TKGL / soft_cap)
        key_pos_L = j * c * p + jnp.arange(c * p, dtype=jnp.int32)
        visible_TL = key_pos_L[None, :] <= pos_T[:, None]
        if sliding_window is not None:
            visible_TL &= key_pos_L[None, :] > pos_T[:, None] - sliding_window
        s_TKGL = jnp.where(visible_TL[:, None, None, :], s_TKGL, -jnp.inf)
        m_new = jnp.maximum(m_TKG, s_TKGL.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # nothing seen yet: no NaN
        alpha = jnp.exp(m_TKG - m_safe)
        w_TKGL = jnp.exp(s_TKGL - m_safe[..., None])
        acc_TKGE = acc_TKGE * alpha[..., None] + jnp.einsum("tkgl,tlke->tkge", w_TKGL, v_TLKE)
        return m_new, l_TKG * alpha + w_TKGL.sum(axis=-1), acc_TKGE

    init = (jnp.full((t, kh, g), -jnp.inf, jnp.float32), jnp.zeros((t, kh, g), jnp.float32),
            jnp.zeros((t, kh, g, e), jnp.float32))
    _, l_TKG, acc_TKGE = jax.lax.fori_loop(first, last, body, init)
    return (acc_TKGE / l_TKG[..., None]).reshape(t, n, e).astype(q_TNE.dtype)
