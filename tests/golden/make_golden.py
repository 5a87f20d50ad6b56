"""Regenerate the golden fixtures that the model tests compare against.

Needs torch + transformers (+ gguf for the default model), which the test environment does
not have; run it where they exist, e.g.

    /tmp/ref311/bin/python tests/golden/make_golden.py            # tiny checkpoints + goldens
    /tmp/ref311/bin/python tests/golden/make_golden.py --smollm2  # also the default GGUF model

Tiny checkpoints: one per supported architecture, built with transformers' own classes from a
fixed seed, written in the Hub's tensor layout (config.json + model.safetensors) under
`ckpt/<name>/`, then loaded back with `from_pretrained` so that the goldens describe the
files exactly as transformers reads them. `<name>.npz` holds, for a few prompts of different
lengths: every prefill position's logits, then 16 greedy decode steps' logits and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers as tf

HERE = os.path.dirname(os.path.abspath(__file__))
CKPT_DIR = os.path.join(HERE, "ckpt")
PROMPT_LENS = (3, 9, 20)     # ragged; longer than Mistral's sliding window and llama3's old length
DECODE_STEPS = 16
SEED = 1234

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)

# name -> (config class, model class, config kwargs, on-disk dtype, write a v4-style config.json)
SPECS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=False), "float32", False),
    "llama_tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True), "bfloat16", False),
    "llama3_rope": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)), "bfloat16", True),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=8, head_dim=16), "bfloat16",
                False),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=False), "float32", False),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=24, tie_word_embeddings=True),
              "bfloat16", False),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                              intermediate_size=48), "bfloat16", False),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(num_experts=4, norm_topk_prob=False,
                                                                  head_dim=16, **_MOE), "bfloat16", False),
}


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights large enough that logits are well separated (HF's init gives near-ties)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))


def _build_checkpoint(name: str, gen: torch.Generator) -> str:
    cfg_cls, model_cls, extra, disk_dtype, v4_config = SPECS[name]
    kwargs = dict(_SMALL)
    kwargs.update(extra)
    config = cfg_cls(**kwargs)
    model = model_cls(config).eval()
    _randomize(model, gen)
    out = os.path.join(CKPT_DIR, name)
    shutil.rmtree(out, ignore_errors=True)
    model.to(getattr(torch, disk_dtype)).save_pretrained(out)   # Hub tensor names (w1/w2/w3, ...)
    if v4_config:
        # Most Hub checkpoints predate transformers 5: rope_theta and rope_scaling at top level.
        path = os.path.join(out, "config.json")
        cfg = json.load(open(path))
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        json.dump(cfg, open(path, "w"), indent=2, sort_keys=True)
    return out


def _greedy_goldens(model, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    margins = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            res = model(ids, use_cache=True)
        prefill = res.logits[0].float().numpy()
        past = res.past_key_values
        tokens = [int(prefill[-1].argmax())]
        step_logits = []
        for _ in range(DECODE_STEPS):
            with torch.no_grad():
                res = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            row = res.logits[0, -1].float().numpy()
            step_logits.append(row)
            tokens.append(int(row.argmax()))
        for row in [prefill[-1]] + step_logits:
            top2 = np.sort(row)[-2:]
            margins.append(top2[1] - top2[0])
        out[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        out[f"prefill_logits_{i}"] = prefill.astype(np.float32)
        out[f"decode_logits_{i}"] = np.stack(step_logits).astype(np.float32)
        out[f"greedy_{i}"] = np.asarray(tokens, np.int32)
    out["min_top2_margin"] = np.float32(min(margins))
    return out


def make_tiny(names: list[str]) -> None:
    os.makedirs(CKPT_DIR, exist_ok=True)
    for name in names:
        gen = torch.Generator().manual_seed(SEED + sum(map(ord, name)))
        path = _build_checkpoint(name, gen)
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
        vocab = model.config.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        goldens = _greedy_goldens(model, prompts)
        np.savez_compressed(os.path.join(HERE, f"{name}.npz"), **goldens)
        print(f"{name}: min top-2 margin {goldens['min_top2_margin']:.4f}, "
              f"greedy {goldens['greedy_0'][:6].tolist()}...")


SMOLLM2_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nnewlines",
    "Numbers 1234567 and 3.14159",
    "Unicode: café, naïve, 日本語, emoji 🤗",
    "<|im_start|>user\nhi<|im_end|>",
]
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
]


def make_smollm2(gguf_path: str, new_tokens: int = 24) -> None:
    folder, fname = os.path.split(gguf_path)
    tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    golden = {"gguf_file": fname, "new_tokens": new_tokens,
              "tokenization": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)}
                               for t in SMOLLM2_TEXTS],
              "chat_text": chat, "prompts": []}
    for text in SMOLLM2_PROMPTS + [chat]:
        ids = tok.encode(text, add_special_tokens=False)
        seq, margins, top5 = list(ids), [], None
        past = None
        feed = torch.tensor([ids])
        for step in range(new_tokens):
            with torch.no_grad():
                res = model(feed, past_key_values=past, use_cache=True)
            past = res.past_key_values
            row = res.logits[0, -1].float()
            if step == 0:
                vals, idx = torch.topk(row, 5)
                top5 = {"ids": idx.tolist(), "logits": vals.tolist()}
            two = torch.topk(row, 2).values
            margins.append(float(two[0] - two[1]))
            seq.append(int(row.argmax()))
            feed = torch.tensor([[seq[-1]]])
        golden["prompts"].append({"text": text, "prompt_token_ids": ids, "greedy": seq[len(ids):],
                                  "first_top5": top5, "min_top2_margin": min(margins),
                                  "greedy_text": tok.decode(seq[len(ids):])})
        print(repr(text[:40]), "->", repr(golden["prompts"][-1]["greedy_text"]),
              f"margin {min(margins):.4f}")
    with open(os.path.join(HERE, "smollm2_greedy.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=list(SPECS), help="tiny checkpoints to rebuild")
    ap.add_argument("--smollm2", action="store_true", help="also record the default GGUF model")
    ap.add_argument("--gguf", default=os.path.expanduser(
        "~/.cache/jaxserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    torch.manual_seed(SEED)
    make_tiny(args.only)
    if args.smollm2:
        make_smollm2(args.gguf)


if __name__ == "__main__":
    main()
