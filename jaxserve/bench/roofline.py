"""The memory roofline of a decode step: bytes it must read from HBM over the bandwidth.

A decode step reads every weight once (all parameters, as DESIGN.md §6 counts them: the
embedding table too, although only T of its rows are gathered, so the figure is a slight
over-estimate for tied/untied embeddings alike) and the KV cache of every sequence's context.
"""

from __future__ import annotations

import jax

# Device-to-device copy bandwidth measured on this workplace's H200 (bytes read + written);
# the vendor's 4.8 TB/s is not reached by any copy.
H200_HBM_BYTES_PER_S = 4.24e12


def param_bytes(params) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(params))


def kv_bytes_per_token(cfg, kv_dtype_itemsize: int) -> int:
    """K and V of one token over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype_itemsize


def decode_step_bytes(weight_bytes: int, kv_token_bytes: int, context_lens: list[int]) -> int:
    """Bytes one decode step must read: all weights plus each sequence's KV context."""
    return weight_bytes + kv_token_bytes * sum(context_lens)


def roofline_seconds(num_bytes: float, bandwidth: float = H200_HBM_BYTES_PER_S) -> float:
    return num_bytes / bandwidth
