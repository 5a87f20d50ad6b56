"""models/llama.py with attention_impl="pallas": the Pallas attention kernel (interpret mode)
inside the real model step gives the transformers golden logits, like the XLA path."""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.models.loader import load_model
from jaxserve.pallas_kernels.policy import KernelPlan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))
from model_step_builder import Chunk, build_step, empty_kv_cache, scattered_block_tables  # noqa: E402

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "golden")
BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_SEQ, STEP_T, S = 8, 32, 6, 24, 4


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _step(cfg, params, kv_cache, x, impl, fuse=False):
    kernels = llama.make_kernels(cfg, impl, kernel_plan=KernelPlan.for_model(
        cfg, "llama", {"norm", "rope"} if fuse else ()))
    kv_cache, hidden_TD, _ = llama.forward(cfg, params, kv_cache, x, kernels)
    return kv_cache, llama.compute_logits(cfg, params, hidden_TD)


@pytest.mark.parametrize("name", ["mistral"])     # sliding window + GQA
def test_pallas_attention_in_model_matches_golden(name, tiny_checkpoint):
    golden = np.load(os.path.join(GOLDEN_DIR, f"{name}.npz"))
    cfg, params, _ = load_model(tiny_checkpoint(name))
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(3)]
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=1)
    kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
    # mixed step: whole short prompts + the head of the long one; then its tail + 2 decodes
    first = [Chunk(0, prompts[0], 0), Chunk(1, prompts[1], 0), Chunk(2, prompts[2][:12], 0)]
    x = build_step(first, tables, BLOCK_SIZE, STEP_T, S)
    kv, logits = _step(cfg, params, kv, x, "pallas")
    for i in range(2):
        got = np.asarray(logits)[int(x.query_start_loc[i]):int(x.query_start_loc[i + 1])]
        np.testing.assert_allclose(got, golden[f"prefill_logits_{i}"], atol=1e-4, rtol=0)
    nxt = [int(np.argmax(golden[f"prefill_logits_{i}"][-1])) for i in range(2)]
    second = [Chunk(2, prompts[2][12:], 12), Chunk(0, [nxt[0]], len(prompts[0])),
              Chunk(1, [nxt[1]], len(prompts[1]))]
    x = build_step(second, tables, BLOCK_SIZE, STEP_T, S)
    kv, logits = _step(cfg, params, kv, x, "pallas")
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[:len(prompts[2]) - 12], golden["prefill_logits_2"][12:],
                               atol=1e-4, rtol=0)
    for i in range(2):
        np.testing.assert_allclose(logits[int(x.logits_indices[i + 1])],
                                   golden[f"decode_logits_{i}"][0], atol=1e-4, rtol=0)


def test_auto_is_xla_on_cpu_and_bad_impl_is_refused(tiny_checkpoint):
    from jaxserve.models.attention import AttentionBackend

    cfg, _, _ = load_model(tiny_checkpoint("llama"))
    backend = lambda impl: AttentionBackend(cfg, impl, context=64, itemsize=4)  # noqa: E731
    assert backend("auto").impl == "xla" and llama.make_kernels(cfg, "auto").impl == "xla"
    assert backend("pallas").impl == "pallas"
    with pytest.raises(ValueError, match="attention_impl"):
        backend("cudnn")


def test_fused_kernels_in_model_match_xla_path():
    """Head dim 32 with q/k norms: with both fused kernels the Pallas step uses all three kernels
    (attention, add+RMSNorm, QK-norm+RoPE+KV write) and must give the XLA step's logits and cache."""
    from jaxserve.models.loader import load_dummy

    cfg, params = load_dummy({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64,
                              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
                              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False},
                             seed=3)
    fused = llama.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(cfg, "llama", {"norm", "rope"}))
    assert (fused.add_norm.__name__, fused.rope_write.__name__) == ("fused_add_norm", "fused_rope_write")
    rng = np.random.default_rng(0)
    tables = scattered_block_tables(3, BLOCKS_PER_SEQ, NUM_BLOCKS, seed=2)
    chunks = [Chunk(0, rng.integers(0, 128, 5).tolist(), 0), Chunk(1, rng.integers(0, 128, 9).tolist(), 0),
              Chunk(2, rng.integers(0, 128, 3).tolist(), 0)]
    x = build_step(chunks, tables, BLOCK_SIZE, STEP_T, S)
    outs = {}
    for impl in ("xla", "pallas"):
        kv = empty_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE)
        outs[impl] = jax.device_get(_step(cfg, params, kv, x, impl, impl == "pallas"))
    (kv_x, logits_x), (kv_p, logits_p) = outs["xla"], outs["pallas"]
    real = int(x.query_start_loc[3])
    np.testing.assert_allclose(logits_p[:real], logits_x[:real], atol=1e-4, rtol=1e-4)
    for layer_x, layer_p in zip(kv_x, kv_p):
        for name in ("k", "v"):                                     # block 0 takes padding writes
            np.testing.assert_allclose(layer_p[name][1:], layer_x[name][1:], atol=1e-5)


def test_fused_kernels_chosen_one_by_one():
    """Each fused kernel can be switched on alone (EngineConfig.fused_kernels: how the H200 runs
    time them in the step)."""
    from jaxserve.models.loader import load_dummy

    cfg, _ = load_dummy({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                         "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 64,
                         "rms_norm_eps": 1e-6}, seed=0)
    def names(k):
        return tuple(getattr(f, "func", f).__name__ for f in (k.add_norm, k.rope_write))

    assert names(llama.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(cfg, "llama", {"norm"}))) == ("fused_add_norm", "qk_norm_rope_write")
    assert names(llama.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(cfg, "llama", {"rope"}))) == ("add_norm", "fused_rope_write")
    assert names(llama.make_kernels(cfg, "pallas")) == ("add_norm", "qk_norm_rope_write")
    with pytest.raises(ValueError, match="fused_kernels"):
        llama.make_kernels(cfg, "pallas", kernel_plan=KernelPlan.for_model(cfg, "llama", {"norms"}))
