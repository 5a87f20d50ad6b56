"""The memory roofline of a decode step: bytes it must read from HBM over the bandwidth.

A decode step reads every weight once and the KV cache of every sequence's context. An untied
embedding table counts only the T rows a step gathers (`decode_weight_bytes`; DESIGN.md §6
counts the whole table, which at Qwen3-30B-A3B's 622 MB table is 9 % of the bytes a token
touches, and 29 % of an 8-layer cut's); a tied one is read whole as the LM head.
Of a mixture of experts' routed experts it reads only those the batch's tokens chose: counted
as the expected number of distinct experts a uniform top-k router reaches,
X * (1 - (1 - k/X)^B) of X for B tokens.
"""

from __future__ import annotations

import jax

# Device-to-device copy bandwidth measured on this workplace's machines (bytes read + written);
# no copy reaches the vendors' 4.8 (H200) and 3.35 TB/s (H100).
H200_HBM_BYTES_PER_S = 4.24e12
H100_HBM_BYTES_PER_S = 3.0e12


def device_hbm_bytes_per_s() -> float:
    """The measured copy rate of the first device's kind (the H200's for any other kind)."""
    kind = jax.devices()[0].device_kind
    return H100_HBM_BYTES_PER_S if "H100" in kind else H200_HBM_BYTES_PER_S


def param_bytes(params) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(params))


def expected_experts(tokens: int, num_experts: int, k: int) -> float:
    """Distinct experts B tokens reach when each picks k of X uniformly."""
    return num_experts * (1 - (1 - k / num_experts) ** tokens)


def touched_param_bytes(params, num_experts: int, k: int, tokens: int) -> float:
    """param_bytes with routed-expert arrays (leading dim X, whole or as chunks of experts)
    counted at the fraction of experts `tokens` tokens reach."""
    if not num_experts or not k:
        return param_bytes(params)
    share = expected_experts(tokens, num_experts, k) / num_experts

    def walk(node) -> float:
        if isinstance(node, dict):
            return sum(walk(v) for v in node.values())
        if isinstance(node, (list, tuple)):
            if node and all(getattr(a, "ndim", 0) == 3 for a in node) and \
                    sum(a.shape[0] for a in node) == num_experts:     # expert chunks
                return share * param_bytes(list(node))
            return sum(walk(v) for v in node)
        if getattr(node, "ndim", 0) == 3 and node.shape[0] == num_experts:
            return share * param_bytes(node)
        return param_bytes(node) if hasattr(node, "dtype") else 0

    return walk(params)


def decode_weight_bytes(params, num_experts: int, k: int, tokens: int) -> float:
    """touched_param_bytes, with an untied embedding table (params "embed" beside "lm_head")
    counted at the `tokens` rows a step gathers."""
    total = touched_param_bytes(params, num_experts, k, tokens)
    embed = params.get("embed") if isinstance(params, dict) else None
    if embed is not None and "lm_head" in params:
        total -= param_bytes(embed) * (1 - min(tokens, embed.shape[0]) / embed.shape[0])
    return total


def kv_bytes_per_token(cfg, kv_dtype_itemsize: int) -> int:
    """K and V of one token over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype_itemsize


def decode_step_bytes(weight_bytes: int, kv_token_bytes: int, context_lens: list[int]) -> int:
    """Bytes one decode step must read: all weights plus each sequence's KV context."""
    return weight_bytes + kv_token_bytes * sum(context_lens)


def roofline_seconds(num_bytes: float, bandwidth: float = H200_HBM_BYTES_PER_S) -> float:
    return num_bytes / bandwidth
