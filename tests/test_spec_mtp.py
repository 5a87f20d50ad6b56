"""The MTP proposer on the tiny DeepSeek V3 checkpoint with its MTP layer (the golden
weights of tests/models/test_deepseek_golden.py): greedy outputs equal those without
speculation, batched and alone, and its drafts are verified and counted."""

import os
import shutil

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, spec_counts, token_ids
from tests.test_spec_decode import MAX_LEN, prompts

MTP = {"method": "mtp", "num_speculative_tokens": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("mtp") / "ckpt"
    shutil.copytree(os.path.join(GOLDEN_DIR, "ckpt", "deepseek_v3"), path)
    mtp = np.load(os.path.join(GOLDEN_DIR, "deepseek_v3_mtp.npz"))
    save_file({k[len("tensor:"):]: mtp[k] for k in mtp.files if k.startswith("tensor:")},
              str(path / "model-mtp.safetensors"))
    return loader.load_model(str(path), dtype="float32")


def test_mtp_drafts_change_no_greedy_output(model):
    plain = make_llm(model, max_len=MAX_LEN)
    spec = make_llm(model, MTP, max_len=MAX_LEN)
    want = token_ids(plain.generate(prompts(4), GREEDY, use_tqdm=False))
    assert token_ids(spec.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts(2)] == want[:2]
    c = spec_counts(spec)
    assert c["spec_decode_num_drafts_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0


def test_mtp_needs_mtp_layers_and_one_token(model):
    llama = loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", "llama"), dtype="float32")
    with pytest.raises(ValueError, match=r"'mtp' needs a model with MTP layers"):
        make_llm(llama, MTP, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'\] must be 1 with method 'mtp'"):
        make_llm(model, {"method": "mtp", "num_speculative_tokens": 2}, max_len=MAX_LEN)


def test_each_draft_is_the_mtp_layers_prediction_over_the_whole_sequence(model):
    """The proposer's incremental MTP (its own cache, the rejected positions left out) drafts
    what one pass of the MTP layer over the request's whole sequence predicts."""
    import jax

    from jaxserve.models import deepseek
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = model
    spec = make_llm(model, MTP, max_len=MAX_LEN)
    proposer, scheduler = spec.engine.core.proposer, spec.engine.scheduler
    seen = []
    observe = proposer.observe

    def recording(out, step, result):
        observe(out, step, result)
        for rid, drafts in proposer._drafts.items():
            if rid in scheduler.requests:
                seen.append((list(scheduler.requests[rid].all_token_ids), drafts[0]))

    proposer.observe = recording
    spec.generate(prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 8
    tables = scattered_block_tables(1, 16, 32, seed=1)
    forward = jax.jit(deepseek.forward, static_argnums=0)
    mtp = jax.jit(deepseek.mtp_forward, static_argnums=0)

    def zeros(specs):
        return [{n: jax.numpy.zeros((32, 4, *shape)) for n, shape in s.arrays} for s in specs]

    for tokens, draft in seen:
        n = len(tokens) - 1
        _, hidden, _ = forward(cfg, params, zeros(deepseek.cache_specs(cfg)),
                               build_step([Chunk(0, tokens[:-1], 0)], tables, 4, 64, 1))
        _, logits, _ = mtp(cfg, params, zeros(deepseek.mtp_cache_specs(cfg)),
                           build_step([Chunk(0, tokens[1:], 0)], tables, 4, 64, 1), hidden)
        assert int(np.argmax(np.asarray(logits[n - 1]))) == draft, (tokens, draft)
