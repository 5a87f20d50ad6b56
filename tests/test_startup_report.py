"""The start-up block an engine logs once built: max_model_len, the KV cache's blocks, tokens
and bytes, the concurrency at max_model_len, the CPU's cache budget, speculation's config."""

from __future__ import annotations

import logging

import pytest

from jaxserve.models import loader
from tests.spec_helpers import make_llm


@pytest.fixture(scope="module")
def model():
    return loader.load_model(None, dtype="float32")


def _block(caplog, build):
    # NOTE: on the jaxserve logger itself: configure_logging (run by other tests in this
    # process) stops it propagating to the root logger caplog listens on.
    logger = logging.getLogger("jaxserve")
    own = not logger.propagate
    if own:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="jaxserve"):
            llm = build()
    finally:
        if own:
            logger.removeHandler(caplog.handler)
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine built:")]
    assert len(blocks) == 1, [r.getMessage() for r in caplog.records]
    return llm, blocks[0]


def test_startup_block_with_speculation_on_cpu(caplog, model):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm, text = _block(caplog, lambda: make_llm(model, spec, max_len=128, block_size=4,
                                                cache_bytes=4 << 20))
    runner = llm.engine.runner
    tokens = (runner.num_blocks - 1) * 4
    assert (f"max_model_len: 128 tokens (the model's maximum: "
            f"{llm.engine.config.model.max_position_embeddings})") in text
    assert (f"KV cache: {runner.num_blocks} blocks of 4 tokens, {tokens} tokens, "
            f"{runner.num_blocks * runner.bytes_per_block / 2**20:.2f} MiB "
            f"({runner.num_blocks * runner.bytes_per_block} bytes) per device") in text
    assert f"maximum concurrency at max_model_len (128 tokens per request): {tokens / 128:.2f}x" in text
    assert "on the CPU --gpu-memory-utilization is not used; the budget is a fixed 4.00 MiB" in text
    assert "speculative decoding: on (method=ngram, num_speculative_tokens=3)" in text
    assert runner.num_blocks * runner.bytes_per_block <= 4 << 20


def test_startup_block_explicit_blocks_no_speculation(caplog, model):
    llm, text = _block(caplog, lambda: make_llm(model, max_len=64, block_size=4, num_kv_blocks=33))
    assert "KV cache: 33 blocks of 4 tokens, 128 tokens," in text
    assert "maximum concurrency at max_model_len (64 tokens per request): 2.00x" in text
    assert "num_kv_blocks=33 set explicitly" in text and "speculative decoding: off" in text
    per_block = llm.engine.runner.bytes_per_block
    assert f"({33 * per_block} bytes) per device" in text
