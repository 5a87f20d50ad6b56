"""On the CPU a step's cost follows its tokens and contexts, not the KV cache's size or
max_model_len (issue 39: the default engine took 2.5 s a token, its 32-block twin 0.3 s).

Counts work, not time: the compiled step program's cost analysis (XLA counts a loop's body
once, so the attention's walk over key steps costs the same whatever the block-table width)
and its HLO (no instruction copies a whole cache array)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from jaxserve import LLM
from jaxserve.worker import packing
from jaxserve.core.step_messages import SchedulerOutput

TINY = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama")


def step_program(num_kv_blocks: int, max_model_len: int, num_tokens: int, model: str = TINY):
    """The compiled lean step program of the `num_tokens` bucket (no warm-up) and its
    cache array's shape."""
    llm = LLM(model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, warmup=False)
    runner = llm.engine.runner
    empty = SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[],
                            num_tokens=num_tokens, preempted_ids=[], num_cached_tokens=0)
    x, _, variant = runner.prepare(empty)
    packed, layout = packing.pack(x)
    assert x.num_tokens == num_tokens
    return runner._compile(layout, variant, len(packed)), runner.kv_cache[0]["k"]


def cost(program) -> tuple[float, float]:
    c = program.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    return c["flops"], c["bytes accessed"]


def whole_cache_copies(program, cache) -> list[str]:
    """Instructions that copy an array of the cache's size (any shape: a reshape is free)."""
    return copies_of_size(program, cache.size)


def copies_of_size(program, size: int) -> list[str]:
    found = []
    for m in re.finditer(r"= f32\[([0-9,]+)\]\{[0-9,]*\} copy\(", program.as_text()):
        dims = [int(d) for d in m.group(1).split(",")]
        n = 1
        for d in dims:
            n *= d
        if n == size:
            found.append(m.group(0))
    return found


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_step_cost_does_not_grow_with_the_cache_or_max_model_len(num_tokens):
    # max_model_len 128 and 256: 8 and 16 blocks a table, both walked 8 blocks (128 keys,
    # the default keys_per_step) a loop step
    small, small_cache = step_program(32, 128, num_tokens)
    big_cache_prog, big_cache = step_program(2048, 128, num_tokens)
    long_prog, _ = step_program(32, 256, num_tokens)      # twice the block-table width
    for prog, cache in ((small, small_cache), (big_cache_prog, big_cache), (long_prog, small_cache)):
        assert whole_cache_copies(prog, cache) == []
    flops, bytes_ = cost(small)
    big_flops, big_bytes = cost(big_cache_prog)
    long_flops, long_bytes = cost(long_prog)
    assert big_flops == pytest.approx(flops, rel=0.01)
    assert long_flops == pytest.approx(flops, rel=0.01)
    assert long_bytes <= 1.05 * bytes_     # (fusion choices differ a little: 0.92x seen)
    # XLA counts an in-place write's operand as accessed, so each of the 2 * layers cache
    # arrays adds its size once for the one-token write (a dynamic-update-slice) and at most
    # three times for a scatter; a copied cache adds it 4-11 times (issue 39).
    cache_growth = 4 * (big_cache.nbytes - small_cache.nbytes)     # 2 layers, k and v
    times = 1.05 if num_tokens == 1 else 3.05
    assert big_bytes - bytes_ <= times * cache_growth


def test_the_lone_decode_writes_the_cache_in_place():
    """The one-token step's write is a dynamic-update-slice into the donated cache: its
    output shares the parameter's buffer (XLA's input_output_alias), nothing is copied."""
    prog, cache = step_program(256, 128, 1)
    text = prog.as_text()
    assert whole_cache_copies(prog, cache) == []
    header = text.splitlines()[0]          # HloModule ..., input_output_alias={ {0}: (15, ...
    assert len(re.findall(r"\((\d+), \{\}, (may|must)-alias\)", header)) == 4   # 2 layers' k, v


def test_a_tied_lm_head_reads_the_embedding_as_stored():
    """The LM head of tied embeddings contracts the [V, D] table on D where it lies: written
    as `h @ embed.T`, XLA CPU copied the transposed table every step (the default model's
    113 MB), reading it at a seventh of the bandwidth (issue 68)."""
    tied = os.path.join(os.path.dirname(__file__), "golden", "ckpt", "llama_tied")
    prog, _ = step_program(64, 128, 1, tied)
    vocab, hidden = 256, 64                  # the checkpoint's config.json
    assert copies_of_size(prog, vocab * hidden) == []
