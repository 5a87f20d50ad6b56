"""The EAGLE3 proposer with a random-weight HF-format head (tests/spec_helpers.py) on the
tiny Llama: greedy outputs equal those without speculation, batched and alone, with one
draft and chained (k = 3); its drafts are target ids through d2t and what the head predicts
over the whole sequence; a head right by construction has every chained draft accepted;
bad heads are refused; the head's cache is sized in the KV budget."""

import os

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from jaxserve.spec_decode import eagle3
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, spec_counts, token_ids, write_eagle3_head
from tests.test_spec_decode import MAX_LEN, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", "llama"), dtype="float32")


def eagle(path, k=1):
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k}


def test_eagle3_drafts_change_no_greedy_output(model, tmp_path):
    head = write_eagle3_head(tmp_path / "head", model[0], draft_vocab=64, aux_layers=(0, 1, 1))
    plain = make_llm(model, max_len=MAX_LEN)
    spec = make_llm(model, eagle(head), max_len=MAX_LEN)
    want = token_ids(plain.generate(prompts(4), GREEDY, use_tqdm=False))
    assert token_ids(spec.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts(2)] == want[:2]
    assert spec_counts(spec)["spec_decode_num_drafts_total"] > 0
    proposer = spec.engine.core.proposer
    allowed = set(np.asarray(proposer.params["draft_to_target"]).tolist())
    spec.generate(prompts(1), GREEDY, use_tqdm=False)
    assert proposer._drafts and all(d[0] in allowed for d in proposer._drafts.values())
    assert spec.engine.scheduler.pool.num_used == 0


def test_bad_heads_are_refused(model, tmp_path):
    assert eagle3.default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match=r"aux layer ids must be three layers of the target \(0 to 1\)"):
        make_llm(model, eagle(write_eagle3_head(tmp_path / "a", model[0], 64)), max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"must be an EAGLE3 head"):
        make_llm(model, eagle(os.path.join(GOLDEN_DIR, "ckpt", "llama")), max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'\] must be an integer from 1 to 8"):
        make_llm(model, eagle(str(tmp_path / "a"), k=9), max_len=MAX_LEN)


def test_each_draft_is_the_heads_prediction_over_the_whole_sequence(model, tmp_path):
    """The proposer's incremental head (its own K/V, rejected positions left out, the aux
    streams in the head's order) drafts what one pass over the whole sequence predicts."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = model
    head = write_eagle3_head(tmp_path / "head", cfg, draft_vocab=64, aux_layers=(1, 0, 1), seed=3)
    spec = make_llm(model, eagle(head), max_len=MAX_LEN)
    proposer, scheduler = spec.engine.core.proposer, spec.engine.scheduler
    seen, observe = [], proposer.observe

    def recording(out, step, result):
        observe(out, step, result)
        seen.extend((list(scheduler.requests[rid].all_token_ids), d[0])
                    for rid, d in proposer._drafts.items() if rid in scheduler.requests)

    proposer.observe = recording
    spec.generate(prompts(2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 8
    tables = scattered_block_tables(1, 16, 32, seed=1)

    def zeros(c):
        return [{n: jnp.zeros((32, 4, *shape)) for n, shape in s.arrays} for s in llama.cache_specs(c)]

    @jax.jit
    def reference(tokens_in, tokens_next):
        _, _, aux = llama.forward(cfg, params, zeros(cfg), tokens_in, "xla", (0, 1))
        streams = jnp.concatenate([aux[1], aux[0], aux[1]], -1)
        _, ids, _ = eagle3.head_forward(proposer.cfg, proposer.params, zeros(proposer.cfg)[0],
                                        tokens_next, proposer.embed, streams, llama.make_kernels(proposer.cfg))
        return ids

    for tokens, draft in seen:
        ids = reference(build_step([Chunk(0, tokens[:-1], 0)], tables, 4, 64, 1),
                        build_step([Chunk(0, tokens[1:], 0)], tables, 4, 64, 1))
        assert int(ids[len(tokens) - 2]) == draft, (tokens, draft)
