"""A stop token, EOS or max_tokens landing inside a run of kept tokens (issue 70): on an
accepted draft (n-gram, a draft model, EAGLE3) or inside a multi-step decode step, without
ignore_eos. The output ends exactly at the stop (the tokens after it, kept by the step, are
dropped), equals greedy decoding without speculation cut there, and says why it ended.

The n-gram prompts are a prompt followed by 40 of its own greedy tokens: the continuation is
the rest of that greedy output, whose runs and cycles the n-gram drafts then predict. The
draft model is the target itself: every draft is accepted, so each step keeps k + 1 tokens.
EAGLE3 drafts for a target made to count (x -> x + 1) with a head made to count too."""

import dataclasses
import os

import pytest

from jaxserve import SamplingParams
from jaxserve.models import loader
from tests.conftest import GOLDEN_DIR
from tests.spec_helpers import make_llm, spec_counts, token_ids, write_eagle3_head
from tests.test_spec_decode import prompts
from test_multi_step import _spy

LLAMA = os.path.join(GOLDEN_DIR, "ckpt", "llama")
MAX_LEN = 96
TOKENS = 10
K = 3


@pytest.fixture(scope="module")
def model():
    return loader.load_model(LLAMA, dtype="float32")


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model, max_len=MAX_LEN)


def greedy(max_tokens=TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def outputs(llm, batch, params):
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def ngram_prompts(plain):
    """Each prompt with 40 of its own greedy tokens after it."""
    base = prompts(6)
    lead = token_ids(plain.generate(base, greedy(40, ignore_eos=True), use_tqdm=False))
    return [{"prompt_token_ids": p["prompt_token_ids"] + g[0]} for p, g in zip(base, lead)]


def first_stops(ref, lo=1, hi=K + 2):
    """(prompt index, position, token): tokens at their first place in an output, from `lo` to
    `hi` (inside the first verifying steps' runs)."""
    return [(i, j, r[j]) for i, r in enumerate(ref) for j in range(lo, min(hi, len(r)))
            if r[j] not in r[:j]]


def check_stops(spec, ref, batch):
    """EOS (the engine's is ref's first token placed past the first), stop_token_ids and
    max_tokens inside the runs: each output is ref cut after the stop."""
    eos = spec.engine.inputs.eos_token_ids
    for out, r in zip(outputs(spec, batch, greedy()), ref):
        cut = next((j for j, t in enumerate(r) if t in eos), None)
        want = r if cut is None else r[:cut + 1]
        assert list(out.token_ids) == want
        assert out.finish_reason == ("length" if cut is None else "stop") and out.stop_reason is None
    stops = first_stops(ref)
    assert len(stops) >= 4
    for i, j, token in stops:
        out = outputs(spec, [batch[i]], greedy(ignore_eos=True, stop_token_ids=[token]))[0]
        assert list(out.token_ids) == ref[i][:j + 1], (i, j, token)
        assert (out.finish_reason, out.stop_reason) == ("stop", token)
    for m in range(1, K + 4):
        outs = outputs(spec, batch, greedy(m, ignore_eos=True))
        assert [list(o.token_ids) for o in outs] == [r[:m] for r in ref]
        assert all(o.finish_reason == "length" for o in outs)
    assert spec.engine.scheduler.pool.num_used == 0


def with_eos(model, ref):
    """The model with its EOS set to a token that first appears inside ref's runs."""
    cfg, params, tok = model
    _, _, eos = first_stops(ref, lo=2)[0]
    return dataclasses.replace(cfg, eos_token_ids=(eos,)), params, tok


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stops_on_accepted_drafts(model, plain, ngram_prompts, method):
    batch = ngram_prompts if method == "ngram" else prompts(6)
    ref = token_ids(plain.generate(batch, greedy(ignore_eos=True), use_tqdm=False))
    ref = [r[0] for r in ref]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3} if method == "ngram" else {
        "method": "draft_model", "model": LLAMA, "num_speculative_tokens": K}
    llm = make_llm(with_eos(model, ref), spec, max_len=MAX_LEN)
    check_stops(llm, ref, batch)
    c = spec_counts(llm)
    assert c["spec_decode_num_accepted_tokens_total"] > 0
    if method == "draft_model":      # the target drafting for itself: every draft accepted
        assert c["spec_decode_num_accepted_tokens_total"] == c["spec_decode_num_draft_tokens_total"] > 0


def test_stops_inside_multi_step_decode(model, plain):
    ref = [r[0] for r in token_ids(plain.generate(prompts(6), greedy(ignore_eos=True), use_tqdm=False))]
    llm = make_llm(with_eos(model, ref), max_len=MAX_LEN, num_scheduler_steps=4)
    seen = _spy(llm.engine)
    check_stops(llm, ref, prompts(6))
    assert 4 in seen                                 # it did run several steps at once


def counting_target(model):
    """The tiny llama made to count: its layers add nothing (wo, w_down zero), so the last
    hidden state is the token's embedding, and its LM head's column j is the embedding of
    j - 1: the greedy token after x is x + 1 (random embeddings of width 64 are near enough
    orthogonal)."""
    import jax.numpy as jnp

    cfg, params, tok = model
    layers = [{**lp, "wo": jnp.zeros_like(lp["wo"]), "w_down": jnp.zeros_like(lp["w_down"])}
              for lp in params["layers"]]
    return cfg, {**params, "layers": layers, "lm_head": jnp.roll(params["embed"], 1, axis=0).T}, tok


def counting_head(path, model) -> str:
    """An EAGLE3 head right for the counting target: fc passes the first aux stream (the
    token's embedding) through, its layer adds nothing, its LM head's row j is the embedding
    of j - 2 (at position t it predicts token t + 2) and d2t is the identity."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    cfg, params, _ = model
    head = write_eagle3_head(path, cfg, draft_vocab=cfg.vocab_size, aux_layers=(0, 1, 1))
    file = os.path.join(head, "model.safetensors")
    t = load_file(file)
    d = cfg.hidden_size
    t["fc.weight"] = np.concatenate([np.eye(d), np.zeros((d, 2 * d))], 1).astype(np.float32)
    t["midlayer.self_attn.o_proj.weight"] *= 0
    t["midlayer.mlp.down_proj.weight"] *= 0
    t["norm.weight"] = np.ones(d, np.float32)
    t["lm_head.weight"] = np.roll(np.asarray(params["embed"]), 2, axis=0).astype(np.float32)
    t["d2t"] = np.zeros(cfg.vocab_size, np.int64)
    save_file(t, file)
    return head


def test_stops_on_accepted_eagle3_drafts(model, tmp_path):
    """EAGLE3 (one draft a step: this head's chained drafts would be wrong) on the counting
    target, every draft accepted: a stop on the draft drops the bonus token kept with it."""
    target = counting_target(model)
    batch = [{"prompt_token_ids": [5, 9, 30 + 40 * i]} for i in range(4)]
    plain = make_llm(target, max_len=MAX_LEN)
    ref = [r[0] for r in token_ids(plain.generate(batch, greedy(ignore_eos=True), use_tqdm=False))]
    assert ref[0] == list(range(31, 31 + TOKENS))
    head = counting_head(tmp_path / "head", target)
    llm = make_llm(with_eos(target, ref), {"method": "eagle3", "model": head, "num_speculative_tokens": 1},
                   max_len=MAX_LEN)
    check_stops(llm, ref, batch)
    c = spec_counts(llm)
    assert c["spec_decode_num_accepted_tokens_total"] == c["spec_decode_num_draft_tokens_total"] > 0
