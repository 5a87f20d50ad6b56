"""Architectures jaxserve runs, keyed by the HF `architectures` name: the only way from a
config to its model family (loaders, dummy weights, sharding and the runner all ask here).

A family is a module with `cache_specs`, `param_shapes`, `forward`, `compute_logits` and
`make_kernels` (models/llama.py documents the interface), and optionally its own
`config_from_hf` / `load_hf`. Most architectures are configurations of the decoder in llama.py
(dense or MoE MLP, qkv bias, q/k norm, sliding window); DeepSeek V3 / V3.2 (MLA,
group-limited MoE, sparse attention) have their own module, deepseek.py.
"""

from __future__ import annotations

from types import ModuleType

from jaxserve.models import deepseek, llama, minimax_m2, qwen3_next

ARCHITECTURES: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": llama,
    "MixtralForCausalLM": llama,
    "Qwen3MoeForCausalLM": llama,
    # own module: MLA latent cache, group-limited MoE; config_from_hf / load_hf of their own
    "DeepseekV3ForCausalLM": deepseek,
    "DeepseekV32ForCausalLM": deepseek,
    # own module: full-width q/k norm, partial rotary, biased sigmoid routing (deepseek's)
    "MiniMaxM2ForCausalLM": minimax_m2,
}
# Hybrid gated-DeltaNet families: their own module, config class (`config_from_hf`) and
# loaders (`load_hf`, `dummy_params`), which hf_loader.py and dummy.py dispatch to.
ARCHITECTURES.update({
    "Qwen3NextForCausalLM": qwen3_next,
    "Qwen3_5MoeForCausalLM": qwen3_next,
    "Qwen3_5MoeForConditionalGeneration": qwen3_next,   # the text model; vision tower skipped
    "Qwen3_5ForCausalLM": qwen3_next,                   # dense Qwen3.5: a dense MLP in every layer
    "Qwen3_5ForConditionalGeneration": qwen3_next,
})


def get_model_module(architecture: str) -> ModuleType:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[architecture]


def param_shapes(cfg) -> dict:
    """Shape of every parameter of the config's architecture."""
    return get_model_module(cfg.architecture).param_shapes(cfg)
