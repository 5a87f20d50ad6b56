"""Architectures jaxserve runs, keyed by the HF `architectures` name: the only way from a
config to its model family (loaders, dummy weights, sharding and the runner all ask here).

A family is a `ModelFamily` object (models/interface.py: the contract; models/families.py:
the four) over a module of pure functions. Most architectures are configurations of the
decoder in llama.py (dense or MoE MLP, qkv bias, q/k norm, sliding window); DeepSeek V3 /
V3.2 (MLA, group-limited MoE, sparse attention) have their own module, deepseek.py.
"""

from __future__ import annotations

from jaxserve.models.families import DEEPSEEK, DEEPSEEK_V4, LLAMA, MINIMAX_M2, QWEN3_NEXT
from jaxserve.models.interface import ModelFamily

ARCHITECTURES: dict[str, ModelFamily] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "MixtralForCausalLM": LLAMA,
    "Qwen3MoeForCausalLM": LLAMA,
    # own module: MLA latent cache, group-limited MoE; config_from_hf / load_hf of their own
    "DeepseekV3ForCausalLM": DEEPSEEK,
    "DeepseekV32ForCausalLM": DEEPSEEK,
    # own module: sliding / compressed sparse / heavily compressed attention, mHC, hash MoE
    "DeepseekV4ForCausalLM": DEEPSEEK_V4,
    # own module: full-width q/k norm, partial rotary, biased sigmoid routing (deepseek's)
    "MiniMaxM2ForCausalLM": MINIMAX_M2,
}
# Hybrid gated-DeltaNet families: their own module, config class and loaders.
ARCHITECTURES.update({
    "Qwen3NextForCausalLM": QWEN3_NEXT,
    "Qwen3_5MoeForCausalLM": QWEN3_NEXT,
    "Qwen3_5MoeForConditionalGeneration": QWEN3_NEXT,   # the text model; vision tower skipped
    "Qwen3_5ForCausalLM": QWEN3_NEXT,                   # dense Qwen3.5: a dense MLP in every layer
    "Qwen3_5ForConditionalGeneration": QWEN3_NEXT,
})


def get_family(architecture: str) -> ModelFamily:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[architecture]

