"""The n-gram proposer (vLLM's "prompt lookup"): on the host, from the request's own tokens.

The longest suffix of prompt_lookup_max down to prompt_lookup_min tokens that occurred
earlier in the prompt + output proposes the tokens that followed its first occurrence, up to
num_speculative_tokens of them.

Vectorised over the sequence: the candidates are the earlier positions holding the last
token (one comparison over the sequence); each candidate's match is then extended backwards
for all candidates at once, at most prompt_lookup_max comparisons of the candidate array.
Each request's ids live in a growing numpy buffer, so a step converts only its new tokens.
"""

from __future__ import annotations

import numpy as np

from jaxserve.spec_decode.proposer import Proposer


def propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts (at most k) for one sequence of token ids."""
    n_tok = len(tokens)
    max_n = min(max_n, n_tok - 1)
    if k <= 0 or max_n < min_n:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])   # a match ending here, 1 token long
    if not len(ends):
        return []
    length = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for j in range(1, max_n):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[n_tok - 1 - j]
        length += alive
    best = length.max()
    if best < min_n:
        return []
    start = ends[np.argmax(length >= best)] + 1          # the first occurrence that long
    return tokens[start:start + k].tolist()


class NgramProposer(Proposer):
    method = "ngram"
    pipelines = True      # reads token ids only: drafts ahead of the device (drafting.py)

    def __init__(self, spec_config):
        self.min_n = spec_config.prompt_lookup_min
        self.max_n = spec_config.prompt_lookup_max
        self.k = spec_config.num_speculative_tokens
        self._ids: dict[str, tuple[np.ndarray, int]] = {}   # request -> (buffer, tokens in it)

    def _tokens(self, req) -> np.ndarray:
        """The request's prompt + output ids, appending only what is new since the last step."""
        buf, n = self._ids.get(req.request_id, (None, 0))
        total = req.num_tokens
        if buf is None or n > total or n < req.num_prompt_tokens:
            buf, n = np.empty(max(16, 2 * total), np.int64), 0
            buf[:req.num_prompt_tokens] = req.prompt_token_ids
            n = req.num_prompt_tokens
        if total > len(buf):
            buf = np.concatenate([buf[:n], np.empty(total, np.int64)])
        buf[n:total] = req.output_token_ids[n - req.num_prompt_tokens:]
        self._ids[req.request_id] = (buf, total)
        return buf[:total]

    def propose(self, requests, limits: list[int], tails=None) -> list[list[int]]:
        """Drafts per request (scheduler Requests in decode), each at most its limit, from
        its tokens followed by its tail (if any)."""
        out = []
        for i, (r, lim) in enumerate(zip(requests, limits)):
            tokens = self._tokens(r)
            if tails is not None and tails[i]:
                tokens = np.concatenate([tokens, np.asarray(tails[i], np.int64)])
            out.append(propose(tokens, self.min_n, self.max_n, lim))
        return out

    def retain(self, running_ids) -> None:
        for rid in [r for r in self._ids if r not in running_ids]:
            del self._ids[rid]
