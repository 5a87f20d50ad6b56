"""DeepSeek V4's MTP layer (models/deepseek_v4_mtp.py) on the tiny V4 checkpoint with a random
MTP layer in DeepSeek's checkpoint names (mtp.0.*, tests/golden/make_golden_deepseek_v4.py
--mtp): its logits over a sequence equal the torch reference's (DeepSeek's MTPBlock maths around
transformers' V4 block); as the "mtp" proposer, greedy outputs equal those without speculation,
batched and alone, with chained drafts, drafts counted, every block free afterwards; each
draft is what the layer predicts over the whole sequence."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.models import deepseek_v4 as v4
from jaxserve.models import deepseek_v4_mtp as v4_mtp
from jaxserve.models import loader
from model_step_builder import Chunk, build_step, scattered_block_tables
from test_deepseek_v4_golden import ATOL, BLOCK_SIZE, GOLDEN_DIR, NUM_BLOCKS, S, STEP_T, empty_caches
from tests.spec_helpers import make_llm, record_drafts, spec_counts, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint with num_nextn_predict_layers 1 and the golden's mtp.0.* tensors beside it."""
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("v4mtp") / "ckpt"
    shutil.copytree(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v4"), path)
    with open(path / "config.json") as f:
        hf = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump({**hf, "num_nextn_predict_layers": 1}, f)
    golden = np.load(os.path.join(GOLDEN_DIR, "deepseek_v4_mtp.npz"))
    save_file({k[len("tensor:"):]: golden[k] for k in golden.files if k.startswith("tensor:")},
              str(path / "model-mtp.safetensors"))
    return loader.load_model(str(path), dtype="float32")


def _passes(cfg):
    """Jitted (target's streams over x, (MTP logits, its output streams) over x with hidden h),
    each from empty caches on 1-sequence steps."""
    @jax.jit
    def streams(params, x):
        with jax.default_matmul_precision("highest"):
            return v4.forward(cfg, params, empty_caches(cfg), x, "xla", (cfg.num_layers,))[2][0]

    @jax.jit
    def mtp(params, x, h):
        with jax.default_matmul_precision("highest"):
            caches = [{n: jnp.zeros((NUM_BLOCKS, spec.rows(n, BLOCK_SIZE), *shape)) for n, shape in spec.arrays}
                      for spec in v4_mtp.mtp_cache_specs(cfg)]
            return v4_mtp.mtp_forward(cfg, params, caches, x, h)[1:]

    tables = scattered_block_tables(1, 16, NUM_BLOCKS, seed=3)
    return streams, mtp, lambda tokens: build_step([Chunk(0, tokens, 0)], tables, BLOCK_SIZE, STEP_T, S)


def test_mtp_logits_match_the_torch_reference(model):
    cfg, params, _ = model
    golden = np.load(os.path.join(GOLDEN_DIR, "deepseek_v4_mtp.npz"))
    tokens = golden["prompt"].tolist()
    assert cfg.mtp_layer_types == (v4.SLIDING,) and len(params["mtp"]) == 1
    streams, mtp, step = _passes(cfg)
    # position i: token i + 1 with the target's streams at token i (the proposer's pairing)
    logits, _ = mtp(params, step(tokens[1:]), streams(params, step(tokens[:-1])))
    np.testing.assert_allclose(np.asarray(logits)[:len(tokens) - 1], golden["logits"], atol=ATOL, rtol=0)


PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 5, 9, 5], [17, 30, 17, 30, 17, 30, 4], [7, 7, 8])]


@pytest.fixture(scope="module")
def spec(model):
    return make_llm(model, {"method": "mtp", "num_speculative_tokens": 2}, max_len=32)


def test_chained_mtp_drafts_change_no_greedy_output(model, spec):
    """Two drafts a step: the first from the target's streams, the second chained on the
    layer's own output streams."""
    want = token_ids(make_llm(model, max_len=32).generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(spec.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS[:2]] == want[:2]
    c = spec_counts(spec)
    assert c["spec_decode_num_draft_tokens_total"] > c["spec_decode_num_drafts_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0


def test_each_mtp_chain_is_the_layers_continuation_over_the_whole_sequence(model, spec):
    """The proposer's incremental passes (its own cache, the target's streams from the steps)
    draft what the layer predicts over the request's whole sequence: draft 1 at the last token
    with the target's streams, draft 2 with draft 1 appended and the layer's own output
    streams at the position before."""
    cfg, params, _ = model
    streams, mtp, step = _passes(cfg)
    seen = record_drafts(spec, PROMPTS[:2], max_tokens=4)
    assert len(seen) >= 4
    for tokens, drafts in seen:
        n = len(tokens) - 1
        h = streams(params, step(tokens[:-1])).at[n:].set(0)
        inputs, want = list(tokens[1:]), []
        for _ in range(2):
            logits, out = mtp(params, step(inputs), h)
            last = len(inputs) - 1
            want.append(int(np.argmax(np.asarray(logits[last]))))
            inputs.append(want[-1])
            h = h.at[last + 1].set(out[last])
        assert drafts == want, (tokens, drafts, want)


def test_mtp_layer_types_come_from_compress_ratios_past_the_layers():
    from jaxserve.models.loaders.hf import read_hf_config
    hf = {k: v for k, v in read_hf_config(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v4")).items()
          if k != "layer_types"}
    cfg = v4.config_from_hf({**hf, "num_nextn_predict_layers": 1, "compress_ratios": [0, 4, 128, 4, 128]})
    assert cfg.layer_types == (v4.SLIDING, v4.CSA, v4.HCA, v4.CSA) and cfg.mtp_layer_types == (v4.HCA,)
    assert [len(s.arrays) for s in v4_mtp.mtp_cache_specs(cfg)] == [4]
    assert "wc_kv" in v4_mtp.mtp_param_shapes(cfg)[0] and "router_bias" in v4_mtp.mtp_param_shapes(cfg)[0]
    # no entry for it (transformers' layer_types, or the released 0): sliding
    assert v4.config_from_hf({**hf, "num_nextn_predict_layers": 1}).mtp_layer_types == (v4.SLIDING,)
