"""Speculative decoding: the Proposer contract (proposer.py) and its proposers (n-gram, draft
model, MTP, EAGLE3), which requests draft and how many (drafting.py), the configuration and
metrics. The rejection sampler that verifies drafts inside the target's step is sample/."""
