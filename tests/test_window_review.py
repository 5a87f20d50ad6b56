"""Review of DeepSeek V4's sliding-window cache group (kv_cache/window_group.py): what the
first tests did not pin. A DeepSeek V4 checkpoint as a draft model (speculative method
"draft_model") is refused by what it keeps, a sliding-window cache group, not "per-request
state" (it has none)."""

import os

import pytest

from jaxserve import LLM

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def test_a_v4_draft_model_is_refused_for_its_window_group():
    path = os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v4")
    with pytest.raises(ValueError, match=r"speculative_config\['model'\].*sliding-window") as error:
        LLM(path, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
            block_size=4, num_kv_blocks=32, warmup=False,
            speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    assert "per-request state" not in str(error.value)
