"""Every architecture through the offline API: LLM(<tiny HF dir>) batches the three golden
prompts together and its greedy tokens equal transformers' (17 tokens each)."""

import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
ARCHS = ["llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("name", ARCHS)
def test_llm_greedy_equals_transformers(name, tiny_checkpoint):
    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    llm = LLM(tiny_checkpoint(name), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, block_size=4, warmup=False)
    prompts = [{"prompt_token_ids": golden[f"prompt_{i}"].tolist()} for i in range(3)]
    n = len(golden["greedy_0"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == golden[f"greedy_{i}"].tolist(), f"prompt {i}"
    assert llm.engine.scheduler.pool.num_used == 0
