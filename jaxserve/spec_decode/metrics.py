"""Acceptance counters of speculative decoding, from each finished step (vLLM's names)."""

from __future__ import annotations


def record(metrics, scheduled, result) -> None:
    """Count a step's verified drafts: a request with k drafts that kept a tokens accepted
    a - 1 of them, those at positions 0 .. a - 2."""
    for sched, tokens in zip(scheduled.scheduled, result.sampled_token_ids):
        k = len(sched.spec_token_ids)
        if not k or not tokens:
            continue
        accepted = len(tokens) - 1
        metrics.inc("spec_decode_num_drafts")
        metrics.inc("spec_decode_num_draft_tokens", k)
        metrics.inc("spec_decode_num_accepted_tokens", accepted)
        for pos in range(accepted):
            metrics.inc_labeled("spec_decode_num_accepted_tokens_per_pos", pos)
