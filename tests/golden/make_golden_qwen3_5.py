"""Tiny random-weight Qwen3-Next and Qwen3.5-MoE checkpoints and their transformers goldens.

    /work/ref311/bin/python tests/golden/make_golden_qwen3_5.py [--only qwen3_next qwen3_5_moe]

Like make_golden.py (whose goldens helper it reuses): a fixed seed, transformers' own classes,
save_pretrained into ckpt/<name>/ (bf16 on disk), loaded back in f32, goldens in <name>.npz:
every prefill position's logits + 16 greedy decode steps. The prompts are longer (up to 40
tokens) so that 16-token prefill chunks carry the linear layers' state across chunks.

Random weights move the gates and decays away from their initial values: A_log spread over
log(0.05..2), dt_bias and the zero-centred norms random around their defaults, the conv
kernel large enough that q/k/v are not near zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402

HERE = make_golden.HERE
CKPT_DIR = make_golden.CKPT_DIR
PROMPT_LENS = (5, 17, 40)
SEED = 4321

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
               linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=24,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

SPECS = {
    # dense MLP in layer 2 (mlp_only_layers) to cover Qwen3-Next's mixed MLPs
    "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM,
                   dict(intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                             partial_rotary_factor=0.25))),
    "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM,
                    dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True))),
    # the dense text model: same layers, a dense MLP everywhere (no MoE keys), tied embeddings
    "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM,
                dict(intermediate_size=48, tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                          partial_rotary_factor=0.25, mrope_section=[1, 1, 0]))),
}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            rnd = lambda scale: scale * torch.randn(p.shape, generator=gen)  # noqa: E731
            if name.endswith("A_log"):
                p.copy_(torch.log(0.05 + 1.95 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(rnd(0.5))
            elif name.endswith("linear_attn.norm.weight"):      # gated RMSNorm: w * x
                p.copy_(1.0 + rnd(0.2))
            elif "norm" in name:                                # zero-centred: (1 + w) * x
                p.copy_(rnd(0.2))
            elif "conv1d" in name:
                p.copy_(rnd(0.4))
            else:
                p.copy_(rnd(0.08))


def build(name: str, gen: torch.Generator) -> str:
    cfg_cls, model_cls, extra = SPECS[name]
    kwargs = dict(_COMMON, **extra)
    if "intermediate_size" in extra and name != "qwen3_next":
        kwargs = {k: v for k, v in kwargs.items() if k not in _MOE_KEYS}
    config = cfg_cls(**kwargs)
    model = model_cls(config).eval()
    randomize(model, gen)
    out = os.path.join(CKPT_DIR, name)
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=list(SPECS))
    args = ap.parse_args()
    torch.manual_seed(SEED)
    for name in args.only:
        gen = torch.Generator().manual_seed(SEED + sum(map(ord, name)))
        path = build(name, gen)
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
        prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
                   for n in PROMPT_LENS]
        goldens = make_golden._greedy_goldens(model, prompts)
        np.savez_compressed(os.path.join(HERE, f"{name}.npz"), **goldens)
        print(f"{name}: min top-2 margin {goldens['min_top2_margin']:.4f}, "
              f"greedy {goldens['greedy_0'][:6].tolist()}...")


if __name__ == "__main__":
    main()
