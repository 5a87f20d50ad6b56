"""A float32 engine's step program asks XLA for full-precision matmuls (issue 70): a GPU's
default f32 matmul is TF32, which flipped greedy near-ties against transformers. The CPU
computes f32 either way, so this reads the compiled program's dots instead."""

from __future__ import annotations

import re

import pytest

from jaxserve import LLM, SamplingParams


@pytest.mark.parametrize("dtype, want", [("float32", {"{highest,highest}"}), ("bfloat16", set())])
def test_step_program_dots_at_full_precision_in_float32(dtype, want, tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), dtype=dtype, warmup=False, max_num_seqs=2, max_model_len=64,
              num_kv_blocks=32)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    programs = list(llm.engine.runner._compiler.executables.values())
    assert programs
    for program in programs:
        text = program.as_text()
        dots = re.findall(r" dot\([^\n]*", text)
        assert dots
        assert set(re.findall(r"operand_precision=(\{[^}]*\})", "\n".join(dots))) == want
