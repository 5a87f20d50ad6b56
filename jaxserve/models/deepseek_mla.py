"""DeepSeek V3 / V3.2's MLA sub-block through the fused kernels ("mla" in the kernel plan,
issue 71): the same maths as models/deepseek.py attention_block, in fewer launches.

    a = h @ w_in                            the fused input projection (one GEMM)
    mla_input_prep(a)                       q latent RMSNorm; kv latent RMSNorm + shared key
                                            rotary + paged write; V3.2's indexer key LayerNorm +
                                            rotary + paged write and head weights' scale
    b = q_lat @ w_q_lat (or wq_b)           the q projection (one GEMM; none without q_lora)
    mla_q_absorb(b)                         q_nope @ W_UK beside the roped q_rope; V3.2's roped
                                            indexer queries
    [V3.2: indexer scores, TopK]            as the unfused path (deepseek.select_positions)
    mla_attention_partials                  the attention kernel, its key splits unmerged
    mla_merge_uv                            the splits merged, W_UV applied, heads side by side
    @ wo                                    the o projection (one GEMM)

Against the unfused Pallas path this drops the projection's slice copies, the q latent's norm
fusion, the head weights' scale, the query's reshape / split / rotary / concatenation, the
indexer query's rotary and concatenation, the batched matmuls' transposes and the split merge
(the launches a layer: .scratch/fuse32_gpu.sh counts them on the GPU).

Taken (`takes`) for steps of at most policy.MLA_FUSED_MAX_TOKENS tokens whose weights the runner
fused (deepseek.fuse_projections: "w_in"), on one device (the kernels are unsharded; the plan
refuses "mla" under a mesh); other steps run deepseek.attention_block as before. This module
reads the config's fields and the projections' order (deepseek.input_projections) but imports
nothing from deepseek.py, which calls it.
"""

from __future__ import annotations

import jax

from jaxserve.core.step_input import StepInput
from jaxserve.models import layers
from jaxserve.pallas_kernels.mla_attention import mla_attention_partials
from jaxserve.pallas_kernels.mla_input_prep import mla_input_prep
from jaxserve.pallas_kernels.mla_output import mla_merge_uv
from jaxserve.pallas_kernels.mla_q_absorb import mla_q_absorb
from jaxserve.pallas_kernels.policy import mla_fused_takes

FUSED_INPUT = "w_in"          # deepseek.FUSED_INPUT (deepseek.py asserts they agree)
INDEX_EPS = 1e-6              # mla.layer_norm's default: the indexer key's LayerNorm


def takes(lp: dict, num_tokens: int) -> bool:
    """Whether this layer's step runs the fused kernels (the plan has "mla" on)."""
    return FUSED_INPUT in lp and mla_fused_takes(num_tokens)


def attention_block(cfg, lp: dict, cache: dict, h_TD: jax.Array, x: StepInput, rope, select,
                    eps: float):
    """MLA on normed input through the fused kernels: (new cache dict, output f[T, D]).
    cfg: a DeepseekConfig; rope: deepseek.Rope; select(q_idx_TIJ, w_TI, index_k) -> i32[T, k]
    (V3.2's scores and TopK on roped queries and scaled weights); eps: the latents' RMSNorm."""
    n, e, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    index = bool(cfg.index_topk)
    a_TM = layers.linear(h_TD, lp[FUSED_INPUT])
    q_width = cfg.q_lora_rank or n * (e + r)
    q_lat_TQ, latent, index_k, w_TI = mla_input_prep(
        a_TM, lp["kv_a_norm"], x.positions, x.slot_mapping, cache["latent"], rope.inv_freq,
        lp["q_a_norm"] if cfg.q_lora_rank else None,
        *((lp["k_idx_norm"], lp["k_idx_bias"], cache["index_k"]) if index else (None,) * 3),
        q_width=q_width, factor=rope.factor, eps=eps, index_eps=INDEX_EPS, impl="pallas")
    cache = dict(cache, latent=latent, **({"index_k": index_k} if index else {}))
    if cfg.q_lora_rank:
        b_TM = layers.linear(q_lat_TQ, lp["w_q_lat"] if "w_q_lat" in lp else lp["wq_b"])
    else:
        b_TM = a_TM                 # q is the input projection's first columns
    q_TNW, q_idx_TIJ = mla_q_absorb(b_TM, lp["w_uk"], x.positions, rope.inv_freq, num_heads=n,
                                    index_heads=cfg.index_n_heads if index else 0,
                                    factor=rope.factor, impl="pallas")
    selected_Tk = select(q_idx_TIJ, w_TI, index_k) if index else None
    o_part, lse = mla_attention_partials(q_TNW, latent, x.block_tables, x.token_seq_ids,
                                         x.positions, selected_Tk, sm_scale=rope.sm_scale,
                                         value_dim=cfg.kv_lora_rank)
    o_TM = mla_merge_uv(o_part, lse, lp["w_uv"], out_dtype=h_TD.dtype, impl="pallas")
    return cache, layers.linear(o_TM, lp["wo"])
