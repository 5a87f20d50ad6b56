"""Load a GGUF file: model config from metadata, dequantized weights, tokenizer metadata.

Dequantization is the `gguf` package's (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the
rest it knows). llama.cpp stores the Q and K projections of llama-family models with rows
permuted for its interleaved rotary layout; we undo that so the weights match HF's layout.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import registry

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "minimax-m2": "MiniMaxM2ForCausalLM",   # llama.cpp keeps HF's q/k layout (NEOX rotary) here
}

# Per-layer GGUF tensor suffix -> (our name, transpose to [in, out]).
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_q_norm.weight": ("q_norm", False),
    "attn_k_norm.weight": ("k_norm", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
    "ffn_gate_inp.weight": ("router", True),
    "ffn_gate_exps.weight": ("w_gate", "experts"),
    "ffn_up_exps.weight": ("w_up", "experts"),
    "ffn_down_exps.weight": ("w_down", "experts"),
    "exp_probs_b.bias": ("router_bias", False),       # e_score_correction_bias (MiniMax-M2)
}


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_metadata(reader) -> dict[str, Any]:
    return {k: _field(reader, k) for k in reader.fields if not k.startswith("GGUF.")}


def gguf_to_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """Translate GGUF metadata into a HF config.json-like dict."""
    arch = meta["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    hf = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length", 0),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length") or hidden // heads,
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if g("expert_count"):
        hf.update(num_experts=g("expert_count"), num_experts_per_tok=g("expert_used_count"),
                  moe_intermediate_size=g("expert_feed_forward_length"), norm_topk_prob=True)
    if arch == "minimax-m2":    # experts in every layer; partial rotary; sigmoid unless said
        gating = g("expert_gating_func", 2)                   # gguf.ExpertGatingFuncType.SIGMOID
        hf.update(num_local_experts=g("expert_count"), intermediate_size=g("expert_feed_forward_length"),
                  rotary_dim=g("rope.dimension_count"), scoring_func="sigmoid" if gating == 2 else "softmax")
    if g("attention.sliding_window"):
        hf["sliding_window"] = g("attention.sliding_window")
    return hf


def _unpermute_rows(w_out_in: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave of Q/K (HF "rotate half" layout back)."""
    rows = w_out_in.shape[0]
    return (w_out_in.reshape(n_head, rows // n_head // 2, 2, *w_out_in.shape[1:])
            .swapaxes(1, 2).reshape(w_out_in.shape))


def open_gguf(path: str):
    """gguf's reader of `path`; ValueError naming the file when it is not a GGUF file (the
    reader's own message, 'GGUF magic invalid', does not say which file)."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def load_gguf(path: str, dtype=np.float32) -> tuple[ModelConfig, dict, dict[str, Any]]:
    """Returns (config, params as numpy arrays, metadata for the tokenizer)."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = open_gguf(path)
    meta = read_metadata(reader)
    hf = gguf_to_hf_config(meta)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    hf["tie_word_embeddings"] = not has_output
    cfg = registry.get_family(hf["architectures"][0]).config_from_gguf(hf)
    permute_qk = meta["general.architecture"] in ("llama", "mistral")

    params: dict[str, Any] = {"layers": [dict() for _ in range(cfg.num_layers)]}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        name = t.name
        if name == "token_embd.weight":
            params["embed"] = w.astype(dtype)
        elif name == "output_norm.weight":
            params["final_norm"] = w.astype(dtype)
        elif name == "output.weight":
            params["lm_head"] = np.ascontiguousarray(w.T).astype(dtype)
        elif name.startswith("blk."):
            _, idx, suffix = name.split(".", 2)
            if suffix not in _LAYER_TENSORS:
                continue  # e.g. rope_freqs: recomputed from the config
            ours, how = _LAYER_TENSORS[suffix]
            if permute_qk and suffix == "attn_q.weight":
                w = _unpermute_rows(w, cfg.num_heads)
            elif permute_qk and suffix == "attn_k.weight":
                w = _unpermute_rows(w, cfg.num_kv_heads)
            if how == "experts":      # stored [X, out, in] -> [X, in, out]
                w = np.swapaxes(w, 1, 2)
            elif how:
                w = w.T
            params["layers"][int(idx)][ours] = np.ascontiguousarray(w).astype(dtype)
    return cfg, params, meta
