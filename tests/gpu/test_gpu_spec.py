"""Speculative decoding on the GPU path (Pallas attention, the fused stack, verifying steps
compiled for the GPU) on the tiny llama checkpoint in float32: n-gram and draft-model greedy
outputs equal those without speculation, batched and alone, with drafts accepted; a stop
token inside a run of accepted drafts ends the output there (the draft model is the target
itself: every draft accepted)."""

from __future__ import annotations

import gc

import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

TOKENS = 24
K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def prompts():
    # repeated motifs: n-gram finds earlier windows to copy
    return [{"prompt_token_ids": ([5 + i, 17 + 3 * i, 40 + i] * (2 + i % 3)) + [7 + i]} for i in range(6)]


def engine(path, spec=None):
    llm = LLM(path, dtype="float32", max_num_seqs=8, max_model_len=256, num_kv_blocks=128, warmup=False,
              speculative_config=spec)
    assert llm.engine.runner.attention_impl == "pallas"
    return llm


def ids(llm, batch, params=GREEDY):
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_drafts_equals_without(method, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    plain = engine(path)
    want = ids(plain, prompts())
    del plain
    gc.collect()
    spec = engine(path, {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3} if method == "ngram" else
                  {"method": "draft_model", "model": path, "num_speculative_tokens": K})
    assert ids(spec, prompts()) == want
    assert [ids(spec, [p])[0] for p in prompts()[:2]] == want[:2]
    counts = {k: v for k, v in spec.get_metrics().items() if k.startswith("spec_decode")}
    assert counts["spec_decode_num_accepted_tokens_total"] > 0
    if method == "draft_model":          # the target drafting for itself: every draft accepted
        assert counts["spec_decode_num_accepted_tokens_total"] == counts["spec_decode_num_draft_tokens_total"]
        # a stop token inside the accepted runs: the output ends at its first place
        stops = [(i, j, w[j]) for i, w in enumerate(want) for j in range(1, K + 2) if w[j] not in w[:j]]
        assert stops
        for i, j, token in stops[:6]:
            params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, stop_token_ids=[token])
            out = spec.generate([prompts()[i]], params, use_tqdm=False)[0].outputs[0]
            assert list(out.token_ids) == want[i][:j + 1] and out.finish_reason == "stop", (i, j)
    assert spec.engine.scheduler.pool.num_used == 0
    del spec
    gc.collect()
