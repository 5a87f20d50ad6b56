"""Regenerate the multi-LoRA goldens (tests/test_lora_*.py compare against them).

Needs torch + transformers + peft, which the test environment does not have; run it where
they exist:

    /work/ref311/bin/python tests/golden/make_golden_lora.py

Base model: the tiny random llama checkpoint of make_golden.py (`ckpt/llama`, f32). Two PEFT
adapters with random weights (PEFT starts B at zero, which would change nothing), saved with
peft's own `save_pretrained` under `lora/<name>/` (adapter_config.json +
adapter_model.safetensors):
- "sql": rank 8, lora_alpha 16, q/v/o projections;
- "chat": rank 16, rsLoRA (alpha / sqrt(r)), lora_alpha 8, k and gate/up/down, with
  down_proj at rank 4 (`rank_pattern`: a per-module rank).
`lora/goldens.json` holds, per prompt, the greedy ids of the base model and of each adapter
(GREEDY_STEPS tokens, EOS not stopping them), and the versions used.
"""

from __future__ import annotations

import json
import os
import shutil

import peft
import torch
import transformers as tf

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join(HERE, "ckpt", "llama")
OUT = os.path.join(HERE, "lora")
PROMPT_LENS = (5, 11, 20)
GREEDY_STEPS = 12
SEED = 4321

ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "chat": dict(r=16, lora_alpha=8, use_rslora=True,
                 target_modules=["k_proj", "gate_proj", "up_proj", "down_proj"],
                 rank_pattern={"down_proj": 4}),
}


def _base():
    return tf.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32,
                                                   attn_implementation="eager").eval()


def _greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(GREEDY_STEPS):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def main() -> None:
    gen = torch.Generator().manual_seed(SEED)
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    base = _base()
    vocab = base.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    result = {"versions": {"torch": torch.__version__, "transformers": tf.__version__,
                           "peft": peft.__version__},
              "base_model": "ckpt/llama", "prompts": prompts, "greedy_steps": GREEDY_STEPS,
              "greedy": {"base": [_greedy(base, p) for p in prompts]}}
    for name, options in ADAPTERS.items():
        model = peft.get_peft_model(_base(), peft.LoraConfig(task_type="CAUSAL_LM", **options))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        model.eval()
        path = os.path.join(OUT, name)
        model.save_pretrained(path)
        os.remove(os.path.join(path, "README.md"))     # peft's model card: not needed here
        conf_path = os.path.join(path, "adapter_config.json")
        conf = json.load(open(conf_path))
        conf["base_model_name_or_path"] = "tests/golden/ckpt/llama"    # not this machine's path
        json.dump(conf, open(conf_path, "w"), indent=2, sort_keys=True)
        # (read back as saved, so the goldens describe the files)
        loaded = peft.PeftModel.from_pretrained(_base(), path).eval()
        result["greedy"][name] = [_greedy(loaded, p) for p in prompts]
    for name, ids in result["greedy"].items():
        if name != "base":
            differ = sum(a != b for a, b in zip(ids, result["greedy"]["base"]))
            print(f"{name}: {differ}/{len(prompts)} prompts differ from the base model")
    with open(os.path.join(OUT, "goldens.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["greedy"]))


if __name__ == "__main__":
    main()
