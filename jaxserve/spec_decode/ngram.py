"""The n-gram proposer (vLLM's "prompt lookup"): on the host, from the request's own tokens.

The longest suffix of prompt_lookup_max down to prompt_lookup_min tokens that occurred
earlier in the prompt + output proposes the tokens that followed its first occurrence, up to
num_speculative_tokens of them. Each length is one vectorised numpy comparison of every
window against the suffix.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts (at most k) for one sequence of token ids."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        # Windows starting at 0 .. n_tok - n - 1: each is followed by at least one token.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = hits[0] + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, spec_config):
        self.min_n = spec_config.prompt_lookup_min
        self.max_n = spec_config.prompt_lookup_max
        self.k = spec_config.num_speculative_tokens

    def propose(self, requests, limits: list[int]) -> list[list[int]]:
        """Drafts per request (scheduler Requests in decode), each at most its limit."""
        return [propose(np.asarray(r.all_token_ids, np.int64), self.min_n, self.max_n, min(self.k, lim))
                for r, lim in zip(requests, limits)]

    def retain(self, alive_ids) -> None:
        """Nothing is kept per request."""
