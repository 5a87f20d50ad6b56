"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler that verifies
their drafts inside the target's step, and its configuration and metrics."""
