"""Logical axes of the families whose parameters are not llama's: DeepSeek V3 / V3.2 (MLA, the
V3.2 indexer, shared experts) and Qwen3-Next / Qwen3.5 (gated attention, gated DeltaNet, a
gated shared expert), plus the names of every cache array. sharding/rules.py maps the logical
names to mesh axes; this file only says what each dimension *is*.

Why each choice (TP = the `model` axis):
- MLA: q_b_proj (wq_b / wq) columns, the per-head halves of kv_b_proj (w_uk, w_uv) and o_proj
  rows (wo) split by head: each rank attends with its own heads, one all-reduce after wo.
  The latent cache holds ONE compressed row (latent | rope key) per token that every head
  reads, so it has no head axis to split: it is replicated over `model` (as are wkv_a and
  kv_a_norm, which make it; each rank computes the small [D, C+R] projection itself), and
  wq_a / q_a_norm (the q latent, also read by every head and by the indexer).
- V3.2 indexer: its top-k needs, for every cached position, the sum over ALL indexer heads;
  split heads would all-reduce f32[T, context] scores per layer, far more traffic than its
  small weights cost whole, so wq_idx, wk_idx, w_idx and the index-key cache stay replicated.
- Gated DeltaNet: value heads split (w_z, w_b, w_a columns, dt_bias, a_log, w_out rows, the
  recurrent state's H axis). The conv channels (w_qkv columns, conv_w rows, the conv state)
  split in contiguous blocks, the same blocks in all three, so the depthwise conv and its
  state update stay local. HF's channel order q | k | v would make those blocks parts of
  heads (XLA then reshards the conv output before the delta rule), so on a mesh the loaders
  reorder them per key head (w_qkv_grouped / conv_w_grouped: [q_j | k_j | v of its value
  heads] for each key head j; qwen3_next_loader.group_conv_channels) whenever the key heads
  divide the `model` axis: each rank's block is then its own heads, and nothing moves.
- Router weights and DeepSeek's e_score_correction_bias: replicated (every rank scores every
  expert); experts over `expert`, their F over `model`; shared experts and dense MLPs like a
  dense MLP; Qwen's shared-expert gate [D, 1] replicated.
"""

from __future__ import annotations

_MLA = {
    "wq_a": ("embed", "lora"), "q_a_norm": ("lora",), "wq_b": ("lora", "heads"),
    "wkv_a": ("embed", "lora"), "kv_a_norm": ("lora",),
    "w_uk": ("heads", "head_dim", "lora"), "w_uv": ("heads", "lora", "head_dim"),
    # replicated indexer (see above)
    "wq_idx": ("lora", "head_dim"), "wk_idx": ("embed", "head_dim"),
    "k_idx_norm": ("head_dim",), "k_idx_bias": ("head_dim",), "w_idx": ("embed", "head_dim"),
}
_SHARED_EXPERT = {"ws_gate": ("embed", "mlp"), "ws_up": ("embed", "mlp"), "ws_down": ("mlp", "embed")}
_DEEPSEEK = {
    **_MLA, **_SHARED_EXPERT, "router_bias": ("router",),
    # MTP (params["mtp"][m]): its decoder layer as above, and
    "enorm": ("embed",), "hnorm": ("embed",), "eh_proj": ("embed", "embed"),
    "head_norm": ("embed",), "head": ("embed", "vocab"),
}
_QWEN3_NEXT = {
    **_SHARED_EXPERT, "w_shared_gate": ("embed", "one"),
    # full attention: wq's columns are per head [E query | E gate], so "heads" splits both
    "wq": ("embed", "heads"),
    # gated DeltaNet
    "w_qkv": ("embed", "conv_channels"), "conv_w": ("conv_channels", "conv_width"),
    "w_qkv_grouped": ("embed", "conv_channels"), "conv_w_grouped": ("conv_channels", "conv_width"),
    "w_z": ("embed", "v_heads"), "w_b": ("embed", "v_heads"), "w_a": ("embed", "v_heads"),
    "dt_bias": ("v_heads",), "a_log": ("v_heads",), "gdn_norm": ("head_dim",),
    "w_out": ("v_heads", "embed"),
    # MTP (params["mtp"]): fc, its norms, then full-attention layers as above
    "fc": ("embed", "embed"), "pre_fc_norm_embedding": ("embed",), "pre_fc_norm_hidden": ("embed",),
    "norm": ("embed",),
}

# by the family's module (models/registry.py maps each architecture to one)
FAMILY_AXES: dict[str, dict] = {
    # MiniMax-M2 normalises q / k over the whole projection, so its norm weights span the heads
    "minimax_m2": {"q_norm": ("heads",), "k_norm": ("kv_heads",), "router_bias": ("router",)},
    "deepseek": _DEEPSEEK,
    "qwen3_next": _QWEN3_NEXT,
}


def family(architecture: str) -> str:
    """The family module's short name ("llama", "deepseek", ...) of an architecture."""
    from jaxserve.models.registry import get_family

    return get_family(architecture).name


# Cache array name -> logical axes of [num_blocks, P, ...] (paged) or [num_slots, ...] (state).
CACHE_AXES = {
    "k": ("kv_blocks", "block_tokens", "kv_heads", "head_dim"),
    "v": ("kv_blocks", "block_tokens", "kv_heads", "head_dim"),
    "latent": ("kv_blocks", "block_tokens", "lora"),          # MLA: replicated (see above)
    "index_k": ("kv_blocks", "block_tokens", "head_dim"),     # V3.2 indexer: replicated
    "conv": ("state_slots", "conv_channels", "conv_width"),           # split like w_qkv's columns
    "ssm": ("state_slots", "v_heads", "head_dim", "head_dim"),  # [H, B, A]: by value head
}


def divisible_dims(cfg) -> list[tuple[str, int, str]] | None:
    """(config field, size, logical axis) of each dimension this family splits, or None for
    llama's families (rules.check_divisible's own list)."""
    name = family(cfg.architecture)
    if name == "deepseek":
        dims = [("num_attention_heads", cfg.num_heads, "heads")]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers + cfg.num_mtp_layers)):
            dims.append(("intermediate_size", cfg.intermediate_size, "mlp"))
        if cfg.num_experts:
            dims += [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                     ("n_routed_experts", cfg.num_experts, "experts")]
        return dims
    if name == "qwen3_next":
        dims = []
        if "full_attention" in cfg.layer_types:
            dims += [("num_attention_heads", cfg.num_heads, "heads"),
                     ("num_key_value_heads", cfg.num_kv_heads, "kv_heads")]
        if "linear_attention" in cfg.layer_types:
            dims += [("linear_num_value_heads", cfg.linear_num_value_heads, "v_heads"),
                     ("conv channels (2 * linear_num_key_heads * linear_key_head_dim + "
                      "linear_num_value_heads * linear_value_head_dim)", cfg.conv_dim, "conv_channels")]
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            dims.append(("intermediate_size", cfg.intermediate_size, "mlp"))
        if cfg.num_experts:
            dims += [("moe_intermediate_size", cfg.moe_intermediate_size, "mlp"),
                     ("num_experts", cfg.num_experts, "experts")]
            if cfg.shared_expert_intermediate_size:
                dims.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, "mlp"))
        return dims
    return None
