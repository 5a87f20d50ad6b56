"""Architectures jaxserve runs, keyed by the HF `architectures` name.

Most architectures are configurations of the decoder in llama.py (dense or MoE MLP, qkv
bias, q/k norm, sliding window); DeepSeek V3 / V3.2 (MLA, group-limited MoE, sparse
attention) have their own module, deepseek.py, with its own config_from_hf and load_hf.
"""

from __future__ import annotations

from types import ModuleType

from jaxserve.models import deepseek, llama

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
}


def get_model_module(architecture: str) -> ModuleType:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[architecture]
