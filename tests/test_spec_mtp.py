"""The MTP proposer on the tiny DeepSeek V3 checkpoint with its MTP layer (the golden
weights of tests/models/test_deepseek_golden.py): greedy outputs equal those without
speculation, batched and alone, with one draft and chained (the one layer run k = 3 times);
its drafts are verified and counted, and are what the layer predicts over the whole
sequence; its cache is paid from the KV budget."""

import os
import shutil

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, record_drafts, spec_counts, token_ids
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


def test_mtp_needs_mtp_layers(model):
    llama = loader.load_model(os.path.join(GOLDEN_DIR, "ckpt", "llama"), dtype="float32")
    with pytest.raises(ValueError, match=r"'mtp' needs a model with MTP layers"):
        make_llm(llama, MTP, max_len=MAX_LEN)
    # Qwen3.5's MTP weights load (params["mtp"]), but no forward runs them yet.
    from types import SimpleNamespace

    from jaxserve.spec_decode.config import SpeculativeConfig
    from jaxserve.spec_decode.mtp import MtpProposer
    from jaxserve.models import registry
    with pytest.raises(ValueError, match=r"'mtp' is not built for Qwen3_5ForCausalLM yet"):
        MtpProposer(SpeculativeConfig("mtp", 3), registry.QWEN3_NEXT,
                    SimpleNamespace(architecture="Qwen3_5ForCausalLM"), {"mtp": {"fc": None}})


def test_each_draft_is_the_mtp_layers_prediction_over_the_whole_sequence(model):
    """The proposer's incremental MTP (its own cache, the rejected positions left out) drafts
    what one pass of the MTP layer over the request's whole sequence predicts."""
    import jax

    from jaxserve.models import deepseek
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = model
    spec = make_llm(model, MTP, max_len=MAX_LEN)
    seen = [(tokens, drafts[0]) for tokens, drafts in record_drafts(spec, prompts(2))]
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


MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


def test_chained_mtp_drafts_change_no_greedy_output(model):
    want = token_ids(make_llm(model, max_len=MAX_LEN).generate(prompts(4), GREEDY, use_tqdm=False))
    spec = make_llm(model, MTP3, max_len=MAX_LEN)
    assert token_ids(spec.generate(prompts(4), GREEDY, use_tqdm=False)) == want
    assert [token_ids(spec.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts(2)] == want[:2]
    c = spec_counts(spec)
    assert c["spec_decode_num_draft_tokens_total"] > c["spec_decode_num_drafts_total"] > 0
    assert spec.engine.scheduler.pool.num_used == 0
    # Pipelined: steps ran past drafts still on the device, and rejections voided them.
    assert spec.engine.scheduler.num_chunks_past_drafts > 0 and spec.engine.scheduler.num_void_chunks > 0


def test_each_mtp_chain_is_the_layers_own_continuation_over_the_whole_sequence(model):
    """Draft j + 1 is the MTP layer's prediction over the whole sequence with drafts 1..j
    appended, each position after the last token fed the layer's own output (before
    head_norm) at the position before."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import deepseek
    from tests.models.model_step_builder import Chunk, build_step, scattered_block_tables

    cfg, params, _ = model
    spec = make_llm(model, MTP3, max_len=MAX_LEN)
    proposer = spec.engine.core.proposer
    seen = record_drafts(spec, prompts(2))
    assert len(seen) >= 6
    tables = scattered_block_tables(1, 16, 32, seed=1)
    forward = jax.jit(deepseek.forward, static_argnums=0)
    mtp = jax.jit(deepseek.mtp_forward, static_argnums=0)

    def zeros(specs):
        return [{n: jnp.zeros((32, 4, *shape)) for n, shape in s.arrays} for s in specs]

    def step(tokens):
        return build_step([Chunk(0, tokens, 0)], tables, 4, 64, 1)

    for tokens, drafts in seen:
        n = len(tokens) - 1
        _, h, _ = forward(cfg, params, zeros(deepseek.cache_specs(cfg)), step(tokens[:-1]))
        h = h.at[n:].set(0)
        inputs, want = list(tokens[1:]), []
        for j in range(3):
            _, logits, out = mtp(cfg, params, zeros(deepseek.mtp_cache_specs(cfg)), step(inputs), h)
            last = len(inputs) - 1
            want.append(int(np.argmax(np.asarray(logits[last]))))
            inputs.append(want[-1])
            h = h.at[last + 1].set(out[last])
        assert drafts == want, (tokens, drafts, want)


def test_the_mtp_cache_is_paid_from_the_kv_budget(model):
    from jaxserve.core.kv_cache.manager import bytes_per_block
    from jaxserve.models import deepseek

    cfg = model[0]
    per_target = bytes_per_block(deepseek.cache_specs(cfg), 4, 4)
    per_mtp = bytes_per_block(deepseek.mtp_cache_specs(cfg), 4, 4)
    budget = 40 * (per_target + per_mtp)
    assert make_llm(model, cache_bytes=budget).engine.runner.num_blocks == budget // per_target > 40
    spec = make_llm(model, MTP3, cache_bytes=budget)
    assert spec.engine.runner.num_blocks == 40
    assert all(a.shape[0] == 40 for c in spec.engine.core.proposer.cache for a in c.values())


def test_an_mtp_layer_right_by_construction_has_every_chained_draft_accepted(model):
    """Target and MTP logits all 0 (final norm and head_norm 0: greedy picks token 0, and the
    layer drafts 0): every draft at every position is accepted."""
    import jax.numpy as jnp

    cfg, params, tok = model
    zero = lambda a: jnp.zeros_like(a)
    right = {**params, "final_norm": zero(params["final_norm"]),
             "mtp": [{**mp, "head_norm": zero(mp["head_norm"])} for mp in params["mtp"]]}
    spec = make_llm((cfg, right, tok), MTP3, max_len=MAX_LEN)
    outs = spec.generate(prompts(1), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
    assert token_ids(outs) == [[[0] * 10]]
    c = spec_counts(spec)
    assert (c["spec_decode_num_drafts_total"], c["spec_decode_num_draft_tokens_total"],
            c["spec_decode_num_accepted_tokens_total"]) == (2, 6, 6)
    assert [c[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(3)] == [2, 2, 2]


def test_after_warmup_mtp_compiles_nothing(model):
    """The MTP pass and its chain have one program per target bucket, compiled by warm-up
    (tests/test_spec_warmup.py has the other proposers)."""
    from tests.test_spec_warmup import compiles

    spec = make_llm(model, {"method": "mtp", "num_speculative_tokens": 2}, max_len=MAX_LEN,
                    max_num_seqs=4, max_tokens=16, warmup=True)
    spec.engine.wait_for_warmup()
    random = SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True)
    with compiles() as seen:
        spec.generate(prompts(4), [GREEDY, random, GREEDY, random], use_tqdm=False)
        spec.generate(prompts(1), GREEDY, use_tqdm=False)
    assert spec_counts(spec)["spec_decode_num_drafts_total"] > 0
    assert seen == []
