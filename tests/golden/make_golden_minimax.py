"""A tiny MiniMax-M2 checkpoint and its golden, made with transformers' own classes.

Run where torch + transformers exist (not in the test environment):

    /work/ref311/bin/python tests/golden/make_golden_minimax.py

Same layout as make_golden.py (whose helpers it reuses): `ckpt/minimax_m2/` in the Hub's
tensor layout (block_sparse_moe.experts.{j}.w1/w2/w3, block_sparse_moe.e_score_correction_bias),
`minimax_m2.npz` with every prefill position's logits and 16 greedy decode steps.
MiniMax specifics made non-trivial on purpose: a non-zero `e_score_correction_bias` (it
changes the expert choice but not the weights), partial rotary (rotary_dim 16 of head_dim
32, a head dim the fused Pallas kernel takes), a rope theta other than the default, full-width q/k norm weights away from 1, and a
config.json in the published checkpoints' style (top-level `rotary_dim` and `rope_theta`,
no `rope_parameters`), read back by transformers before the goldens are recorded.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import transformers as tf

from make_golden import CKPT_DIR, HERE, PROMPT_LENS, SEED, _greedy_goldens, _randomize

NAME = "minimax_m2"
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters=dict(rope_type="default", rope_theta=50000.0, partial_rotary_factor=0.5))
ROTARY_DIM = 16


def _published_style_config(path: str) -> None:
    """Rewrite config.json as MiniMax's own checkpoints write it: rope_theta and rotary_dim at
    the top level (transformers turns rotary_dim into partial_rotary_factor on load)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rotary_dim"] = ROTARY_DIM
    cfg.update(scoring_func="sigmoid", use_routing_bias=True)
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def main() -> None:
    os.makedirs(CKPT_DIR, exist_ok=True)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + sum(map(ord, NAME)))
    model = tf.MiniMaxM2ForCausalLM(tf.MiniMaxM2Config(**CONFIG)).eval()
    _randomize(model, gen)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):   # a buffer: _randomize skips it
                mod.e_score_correction_bias.copy_(0.3 * torch.randn(mod.e_score_correction_bias.shape,
                                                                    generator=gen))
    out = os.path.join(CKPT_DIR, NAME)
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    _published_style_config(out)
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    rope = model.config.rope_parameters
    assert abs(rope["partial_rotary_factor"] - ROTARY_DIM / CONFIG["head_dim"]) < 1e-9, rope
    assert rope["rope_theta"] == CONFIG["rope_parameters"]["rope_theta"], rope
    assert float(model.model.layers[0].mlp.e_score_correction_bias.abs().max()) > 0.1
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    goldens = _greedy_goldens(model, prompts)
    np.savez_compressed(os.path.join(HERE, f"{NAME}.npz"), **goldens)
    print(f"{NAME}: min top-2 margin {goldens['min_top2_margin']:.4f}, greedy {goldens['greedy_0'][:6].tolist()}...")


if __name__ == "__main__":
    main()
