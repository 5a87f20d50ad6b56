"""Architectures jaxserve runs, keyed by the HF `architectures` name.

Every supported architecture is a configuration of the decoder in llama.py (dense or MoE MLP,
qkv bias, q/k norm, sliding window), so the registry maps names to that module.
"""

from __future__ import annotations

from types import ModuleType

from jaxserve.models import llama

ARCHITECTURES: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": llama,
    "MixtralForCausalLM": llama,
    "Qwen3MoeForCausalLM": llama,
}


def get_model_module(architecture: str) -> ModuleType:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[architecture]
