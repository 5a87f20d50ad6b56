"""DeepSeek V4's MTP layer (models/deepseek_v4_mtp.py) on the tiny V4 checkpoint with a random
MTP layer in DeepSeek's checkpoint names (mtp.0.*, tests/golden/make_golden_deepseek_v4.py
--mtp): its logits over a sequence equal the torch reference's (DeepSeek's MTPBlock maths around
transformers' V4 block); as the "mtp" proposer, greedy outputs equal those without speculation,
batched and alone, with chained drafts, drafts counted, every block free afterwards."""

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
from tests.spec_helpers import make_llm, spec_counts, token_ids

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


def test_mtp_logits_match_the_torch_reference(model):
    cfg, params, _ = model
    golden = np.load(os.path.join(GOLDEN_DIR, "deepseek_v4_mtp.npz"))
    tokens = golden["prompt"].tolist()
    assert cfg.mtp_layer_types == (v4.SLIDING,) and len(params["mtp"]) == 1
    tables = scattered_block_tables(1, 16, NUM_BLOCKS, seed=3)

    @jax.jit
    def run(params, x_main, x_mtp):
        with jax.default_matmul_precision("highest"):
            _, _, (streams,) = v4.forward(cfg, params, empty_caches(cfg), x_main, "xla", (cfg.num_layers,))
            mtp_caches = [{n: jnp.zeros((NUM_BLOCKS, spec.rows(n, BLOCK_SIZE), *shape))
                           for n, shape in spec.arrays} for spec in v4_mtp.mtp_cache_specs(cfg)]
            return v4_mtp.mtp_forward(cfg, params, mtp_caches, x_mtp, streams)[1]

    # position i: token i + 1 with the target's streams at token i (the proposer's pairing)
    logits = run(params, build_step([Chunk(0, tokens[:-1], 0)], tables, BLOCK_SIZE, STEP_T, S),
                 build_step([Chunk(0, tokens[1:], 0)], tables, BLOCK_SIZE, STEP_T, S))
    np.testing.assert_allclose(np.asarray(logits)[:len(tokens) - 1], golden["logits"], atol=ATOL, rtol=0)


def test_chained_mtp_drafts_change_no_greedy_output(model):
    """Two drafts a step: the first from the target's streams, the second chained on the
    layer's own output streams."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 5, 9, 5], [17, 30, 17, 30, 17, 30, 4], [7, 7, 8])]
    want = token_ids(make_llm(model, max_len=32).generate(prompts, GREEDY, use_tqdm=False))
    spec = make_llm(model, {"method": "mtp", "num_speculative_tokens": 2}, max_len=32)
    assert token_ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts[:2]] == want[:2]
    c = spec_counts(spec)
    assert c["spec_decode_num_draft_tokens_total"] > c["spec_decode_num_drafts_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0
