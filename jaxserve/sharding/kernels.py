"""Running the Pallas kernels under tensor parallelism: one shard_map over the `model` axis.

A pallas_call is opaque to jit's partitioner, so on head-sharded inputs it would be run on
gathered (replicated) arrays. Kernels whose work splits by heads or channels instead run per
shard inside `jax.shard_map`: each rank runs the unchanged kernel on its own heads, the
step's metadata replicated. Kernels over replicated activations (fused add+RMSNorm, the
indexer's top-k, the sampler's thresholds) run through `replicated` so every rank computes
the same whole result, explicitly, whatever sharding the partitioner picked for the input.

The call sites read the ambient mesh (the one the caller set with `jax.set_mesh` or, in the
runner's step, `use_abstract_mesh`) through `jax.sharding.get_abstract_mesh()`; with no
mesh, or a `model` axis of size 1, each kernel is called as it is.

Wrapped: paged attention (models/attention.py), MLA (models/deepseek.py), the fused q/k-norm
+ RoPE + KV-write kernels (models/llama.py; MiniMax-M2's full-width norm with a psum of the
sums of squares, models/minimax_m2.py), the gated DeltaNet kernels (models/qwen3_next.py),
and, replicated, fused add+RMSNorm, TopK and the sampler's threshold kernels. Not here: the
MoE router / grouped matmul (models/moe.py owns expert dispatch under a mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.sharding.mesh import MODEL_AXIS


def model_axis_size() -> int:
    """The ambient mesh's `model` axis size (1 with no mesh or no such axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL_AXIS]


def per_model_shard(fn, in_specs, out_specs):
    """fn, run per `model` shard of the ambient mesh when that axis has size > 1, else fn.

    in_specs / out_specs: PartitionSpecs (pytrees of them) naming MODEL_AXIS where an array
    is split; anything else is replicated. check_vma is off: a Pallas kernel's output has no
    varying-axes annotation the checker could verify."""
    if model_axis_size() == 1:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def check_divides(what: str, **sizes: int) -> int:
    """The `model` axis size, after checking it divides every named size (a ValueError names them)."""
    tp = model_axis_size()
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        listed = " and ".join(f"{name} ({size})" for name, size in bad.items())
        raise ValueError(f"tensor_parallel_size {tp} must divide the {listed} to run {what} "
                         f"per model shard")
    return tp


# Specs: T tokens, N heads (query, kv or value heads), E head dim, P tokens per block, C channels.
HEADS_TNE = P(None, MODEL_AXIS, None)           # q / k / v [T, N, E], DeltaNet v / o [T, H, V]
CACHE_NPKE = P(None, None, MODEL_AXIS, None)    # paged K / V caches [blocks, P, K, E]
COLUMNS_TC = P(None, MODEL_AXIS)                # [T, C] split by columns (heads, channels)
VECTOR_C = P(MODEL_AXIS)                        # [C] per-head weights / norms
STATE_SHVK = P(None, MODEL_AXIS, None, None)    # DeltaNet state [slots, H, V, K]
REPLICATED = P()


def replicated(fn, num_args: int, num_outs: int | None = None):
    """fn on replicated inputs and outputs under a `model` axis: every rank runs the kernel on
    whole arrays (an input split by the partitioner is gathered first). num_outs: None for a
    single array output, else the length of its output tuple."""
    outs = REPLICATED if num_outs is None else (REPLICATED,) * num_outs
    return per_model_shard(fn, (REPLICATED,) * num_args, outs)


def paged_attention(kernel, q_TNE, k_cache, v_cache, *metadata):
    """kernel(q, k_cache, v_cache, *metadata) -> o [T, N, E], per head shard under TP."""
    if model_axis_size() == 1:
        return kernel(q_TNE, k_cache, v_cache, *metadata)
    check_divides("the attention kernel", **{"query heads": q_TNE.shape[1], "kv heads": k_cache.shape[2]})
    wrapped = per_model_shard(
        kernel, (HEADS_TNE, CACHE_NPKE, CACHE_NPKE) + (REPLICATED,) * len(metadata), HEADS_TNE)
    return wrapped(q_TNE, k_cache, v_cache, *metadata)


def mla_attention(kernel, q_TNW, latent_NPW, *metadata):
    """kernel(q, latent, *metadata) -> o [T, N, C]: MLA per head shard; the latent cache (one
    row per token, read by every head) and the metadata (selected positions too) replicated."""
    if model_axis_size() == 1:
        return kernel(q_TNW, latent_NPW, *metadata)
    check_divides("the MLA kernel", heads=q_TNW.shape[1])
    wrapped = per_model_shard(kernel, (HEADS_TNE,) + (REPLICATED,) * (1 + len(metadata)), HEADS_TNE)
    return wrapped(q_TNW, latent_NPW, *metadata)


def qk_norm_rope_kv_write(kernel, q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache,
                          inv_freq, q_norm, k_norm, *, norm_spec=REPLICATED):
    """kernel(...) -> (q', k_cache, v_cache) per head shard: q by query heads, k / v and the
    caches by kv heads, positions / slots / inv_freq replicated; q_norm / k_norm (None: no
    norm) per `norm_spec` (REPLICATED for per-head-dim weights f[E], VECTOR_C for weights
    spanning the heads)."""
    if model_axis_size() == 1:
        return kernel(q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache, inv_freq, q_norm, k_norm)
    check_divides("the fused q/k-norm + RoPE + KV-write kernel",
                  **{"query heads": q_TNE.shape[1], "kv heads": k_TKE.shape[1]})
    heads = (HEADS_TNE, HEADS_TNE, HEADS_TNE, REPLICATED, REPLICATED, CACHE_NPKE, CACHE_NPKE, REPLICATED)
    args = (q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache, inv_freq)
    if q_norm is None:
        wrapped = per_model_shard(lambda *a: kernel(*a, None, None), heads, (HEADS_TNE, CACHE_NPKE, CACHE_NPKE))
        return wrapped(*args)
    wrapped = per_model_shard(kernel, heads + (norm_spec, norm_spec), (HEADS_TNE, CACHE_NPKE, CACHE_NPKE))
    return wrapped(*args, q_norm, k_norm)


def gated_delta(fn, conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, ssm_SHVK, *metadata):
    """fn(conv, a, b, a_log, dt_bias, ssm, *metadata) -> (o [T, H, V], ssm): the gated DeltaNet
    kernels per value-head shard. The conv output's channels are split in contiguous blocks
    (each rank's block its own key heads' q | k and their value heads' v: the grouped layout,
    qwen3_next_loader.group_conv_channels); gates, A_log, dt_bias and the state by value head."""
    if model_axis_size() == 1:
        return fn(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, ssm_SHVK, *metadata)
    check_divides("the gated DeltaNet kernels", **{"value heads": a_TH.shape[1],
                                                   "conv channels": conv_TC.shape[1]})
    wrapped = per_model_shard(
        fn, (COLUMNS_TC, COLUMNS_TC, COLUMNS_TC, VECTOR_C, VECTOR_C, STATE_SHVK)
        + (REPLICATED,) * len(metadata), (HEADS_TNE, STATE_SHVK))
    return wrapped(conv_TC, a_TH, b_TH, a_log_H, dt_bias_H, ssm_SHVK, *metadata)


def full_qk_norm_rope_kv_write(kernel, q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache,
                               inv_freq, q_norm, k_norm):
    """MiniMax-M2's fused kernel (pallas_kernels/full_qk_norm_rope_kv_write.py) per head shard.
    Its q / k norms run over the WHOLE row (all heads), split across ranks here: each rank sums
    the squares of its own heads, one psum over `model` (of f32[T, 2]: q's and k's together)
    gives the whole rows' sums, which the kernel takes with the whole widths. The norm weights
    f[N*E] / f[K*E] are split with their heads."""
    if model_axis_size() == 1:
        return kernel(q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache, inv_freq, q_norm, k_norm)
    check_divides("the fused full-width q/k-norm + RoPE + KV-write kernel",
                  **{"query heads": q_TNE.shape[1], "kv heads": k_TKE.shape[1]})
    widths = (q_TNE.shape[1] * q_TNE.shape[2], k_TKE.shape[1] * k_TKE.shape[2])

    def per_shard(q, k, *rest):
        squares = lambda a: jnp.sum(jnp.square(a.astype(jnp.float32)), axis=(1, 2))  # noqa: E731
        sumsq_T2 = jax.lax.psum(jnp.stack([squares(q), squares(k)], axis=-1), MODEL_AXIS)
        return kernel(q, k, *rest, sumsq_T2, widths=widths)

    wrapped = per_model_shard(
        per_shard, (HEADS_TNE, HEADS_TNE, HEADS_TNE, REPLICATED, REPLICATED, CACHE_NPKE, CACHE_NPKE,
                    REPLICATED, VECTOR_C, VECTOR_C), (HEADS_TNE, CACHE_NPKE, CACHE_NPKE))
    return wrapped(q_TNE, k_TKE, v_TKE, positions, slots, k_cache, v_cache, inv_freq, q_norm, k_norm)
