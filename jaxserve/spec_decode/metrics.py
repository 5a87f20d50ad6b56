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


def mean_acceptance_length(before: dict, after: dict) -> float | None:
    """Tokens kept per verifying request-step between two get_metrics() dicts (1 + accepted
    drafts per draft; None when nothing was drafted)."""
    drafts = after["spec_decode_num_drafts_total"] - before["spec_decode_num_drafts_total"]
    accepted = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
    return 1 + accepted / drafts if drafts else None
