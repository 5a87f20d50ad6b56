"""Speculative decoding on DeepSeek V4: a verifying step writes every draft's rows, and a draft
that completes a compression window writes that window's entry; a rejected draft's rows and
entry are overwritten when the kept tokens reach them (no rollback: every V4 cache array is
paged, and a token reads only entries whose windows are complete at its position).
Greedy tokens equal transformers' with drafts right and wrong, batched and alone."""

from __future__ import annotations

from test_hybrid_speculation import NGRAM, Replay, counts, generate, make_llm
from test_new_families_engine import assert_all_free, golden


def test_right_and_wrong_drafts_keep_the_greedy_tokens_of_transformers(tiny_checkpoint):
    prompts, want = golden("deepseek_v4")
    llm = make_llm(tiny_checkpoint, "deepseek_v4", NGRAM)
    llm.engine.core.proposer = Replay(prompts, want, k=3, p=0.6)
    assert generate(llm, prompts, len(want[0])) == want
    assert [generate(llm, [p], len(w))[0] for p, w in zip(prompts, want)] == want
    c = counts(llm)
    assert c["rollbacks"] == 0 and 0 < c["accepted"] < c["drafted"]     # both ways exercised
    assert_all_free(llm)
