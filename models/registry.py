"""Architectures jaxserve runs, keyed by the HF `architectures` name.

Every supported architecture is a configuration of the decoder in llama.py (dense or MoE MLP,
qkv bias, q/k norm, sliding window), so the registry maps names to that module.
"""

from __future__ import annotations

from types import ModuleType

from jaxserve.models import llama
from jaxserve.models import qwen3_next

ARCHITECTURES: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "Qwen3ForCausalLM": llama,
    "MixtralForCausalLM": llama,
    "Qwen3MoeForCausalLM": llama,
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
